"""FedAvg-LoRA warm-started from the knowledge pool (``algorithm.lora.init=pool``, issue #43: is
SmartFed's gain knowledge reuse or the expert mixture?). The LoRA starts from the best rank-r fit of
the pool's mean ΔW per matrix, at FedAvg-LoRA's own bytes."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from clients.adapters import AdapterError, best_rank_fit
from clients.pool import Pool
from fedapps.config import ConfigError, compose


def test_the_fit_is_the_truncated_svd_and_exact_below_its_rank():
    gen = torch.Generator().manual_seed(0)
    delta = torch.randn(20, 12, generator=gen)
    A, B = best_rank_fit(delta, 3, scaling=2.0)
    assert A.shape == (3, 12) and B.shape == (20, 3)
    U, S, Vh = torch.linalg.svd(delta, full_matrices=False)
    torch.testing.assert_close(2.0 * B @ A, U[:, :3] @ torch.diag(S[:3]) @ Vh[:3], atol=1e-5, rtol=1e-5)
    low = torch.randn(20, 2, generator=gen) @ torch.randn(2, 12, generator=gen)  # rank 2 fits in rank 4 exactly
    A, B = best_rank_fit(low, 4, scaling=0.5)
    torch.testing.assert_close(0.5 * B @ A, low, atol=1e-4, rtol=1e-4)


def pool_for(cfg, folder):
    """A pool of two adapters (random non-zero factors) trained on this run's own tiny Llama."""
    from clients.models import build_model

    base, _ = build_model(cfg)
    pool = Pool(folder, backbone=base)
    for seed, (name, targets) in enumerate((("plays", ["q_proj", "v_proj"]), ("sonnets", ["q_proj", "down_proj"]))):
        torch.manual_seed(seed)
        model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
        for pname, param in model.named_parameters():
            if "lora_" in pname:
                torch.nn.init.normal_(param, std=0.2)
        model.save_pretrained(folder.parent / name)
        pool.add(folder.parent / name, {"source_run": f"runs/{name}", "task": name})
    return pool, base


def test_fedavg_lora_starts_from_the_pools_mean_update_at_its_own_rank(tmp_path):
    from clients.pool import backbone_fingerprint
    from fedapps.baselines import prepare

    cfg = compose([f"algorithm.pool={tmp_path / 'pool'}", "algorithm.lora.init=pool"], preset="test",
                  algorithm="fedavg-lora")
    pool, base = pool_for(cfg, tmp_path / "pool")
    model, _, extra = prepare(cfg)
    experts = pool.load_experts(backbone_fingerprint(base))
    q0, v0, d0, k0 = (f"model.layers.0.{m}" for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj",
                                                        "self_attn.k_proj"))
    modules = dict(model.named_modules())
    for name, adapters in ((q0, 2), (v0, 1), (d0, 1)):
        layer = modules[f"base_model.model.{name}"]
        mean = torch.from_numpy(experts[name].delta_weight()) / adapters  # q_proj: both adapters, averaged
        got = layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
        U, S, Vh = torch.linalg.svd(mean, full_matrices=False)
        r = int(cfg.algorithm.lora.r)
        torch.testing.assert_close(got, U[:, :r] @ torch.diag(S[:r]) @ Vh[:r], atol=1e-5, rtol=1e-4)
        assert got.norm() > 0
    assert float(modules[f"base_model.model.{k0}"].lora_B["default"].weight.detach().abs().sum()) == 0  # not pooled: PEFT's init
    # the federated tensors (what the server's initial global is read from) carry the warm start
    assert len(extra["names"]) == len([n for n, _ in model.named_parameters() if "lora_" in n])
    cold, _, _ = prepare(compose([], preset="test", algorithm="fedavg-lora"))
    ids = torch.arange(12)[None]
    assert not torch.allclose(model(ids).logits, cold(ids).logits)


def test_a_missing_pool_and_bad_settings_are_refused_clearly(tmp_path):
    from fedapps.baselines import prepare

    cfg = compose([f"algorithm.pool={tmp_path / 'nothing'}", "algorithm.lora.init=pool"], preset="test",
                  algorithm="fedavg-lora")
    with pytest.raises(AdapterError, match="algorithm.lora.init=pool: no knowledge pool at .*postcard pool build"):
        prepare(cfg)
    with pytest.raises(ConfigError, match="algorithm.lora.init must be random or pool, got 'svd'"):
        compose(["algorithm.lora.init=svd"], preset="test", algorithm="fedavg-lora")
    with pytest.raises(ConfigError, match="algorithm.lora.init=pool starts from a knowledge pool of causal-LM"):
        compose(["model=tiny-cnn", "algorithm.lora.init=pool"], task="fmnist", algorithm="fedavg-lora")
    assert compose([], algorithm="fedprox").algorithm.lora.init == "random"  # the LoRA baselines share it
