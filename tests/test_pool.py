"""Knowledge pool: adding PEFT adapters, provenance, splitting, refusing foreign adapters."""

import copy
import json

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from clients.pool import (
    ExpertSet,
    Pool,
    PoolError,
    backbone_fingerprint,
    backbone_signature,
    split_adapter,
)

torch.set_num_threads(1)
Q0 = "model.layers.0.self_attn.q_proj"


def tiny_config(hidden=32):
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=128,
    )


def save_adapter(base, folder, seed, **lora):
    """A PEFT LoRA adapter with random (non-zero) A and B, saved with save_pretrained."""
    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(**lora))
    for name, p in model.named_parameters():
        if "lora_" in name:
            torch.nn.init.normal_(p, std=0.3)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def backbone():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config()).eval()


@pytest.fixture(scope="module")
def adapters(backbone, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    a = save_adapter(backbone, root / "math", 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    b = save_adapter(backbone, root / "code", 2, r=2, lora_alpha=4, use_rslora=True, target_modules=["q_proj", "k_proj"])
    return {"math": (root / "math", a), "code": (root / "code", b)}


def test_fingerprint_is_stable_across_wrappers_and_configs(backbone, adapters):
    fp = backbone_fingerprint(backbone)
    assert fp == backbone_fingerprint(backbone.config)  # meta-device instantiation
    assert fp == backbone_fingerprint(adapters["math"][1])  # PEFT-wrapped (base_layer names)
    assert fp == backbone_fingerprint(backbone_signature(backbone))
    assert fp != backbone_fingerprint(tiny_config(hidden=48))
    sig = backbone_signature(backbone)
    assert sig["hidden_size"] == 32 and sig["num_hidden_layers"] == 2 and sig["vocab_size"] == 128
    assert sig["shapes"][f"{Q0}.weight"] == [32, 32]


def test_add_list_and_split(backbone, adapters, tmp_path):
    pool = Pool(tmp_path / "pool", backbone=backbone)
    assert pool.add(adapters["math"][0], {"source_run": "runs/fedavg-math", "task": "mmlu-stem"}) == "math"
    pool.add(adapters["code"][0], {"source_run": "runs/fedavg-code", "task": "shakespeare", "note": "kept"})

    reopened = Pool(tmp_path / "pool")  # no backbone needed once created
    records = reopened.list()
    assert [r["name"] for r in records] == ["code", "math"]
    math = records[1]
    assert math["rank"] == 4 and math["alpha"] == 8.0 and math["task"] == "mmlu-stem"
    assert math["target_modules"] == ["q_proj", "v_proj"]
    assert math["backbone_fingerprint"] == backbone_fingerprint(backbone)
    assert math["num_experts"] == 4 * 4 and "created" in math
    assert records[0]["note"] == "kept"
    on_disk = json.loads((tmp_path / "pool" / "math" / "provenance.json").read_text())
    assert on_disk == math
    assert (tmp_path / "pool" / "math" / "adapter_model.safetensors").is_file()

    # q_proj is targeted by both adapters: 2 (code) + 4 (math) experts, in name order.
    q = reopened.experts_for(Q0)
    assert q.ids == ("code:0", "code:1", "math:0", "math:1", "math:2", "math:3")
    assert q.source(3) == ("math", 1)
    assert reopened.experts_for("model.layers.1.self_attn.k_proj").ids == ("code:0", "code:1")
    with pytest.raises(KeyError, match="no pooled adapter"):
        reopened.experts_for("model.layers.0.mlp.up_proj")

    # Each adapter's experts sum to PEFT's own delta weight (scale incl. rsLoRA).
    for name, idx in (("code", slice(0, 2)), ("math", slice(2, 6))):
        peft_layer = adapters[name][1].get_submodule(f"base_model.model.{Q0}")
        want = peft_layer.get_delta_weight("default").detach().numpy()
        part = ExpertSet(q.ids[idx], q.A[idx], q.B[:, idx])
        np.testing.assert_allclose(part.delta_weight(), want, rtol=1e-5, atol=1e-6)

    everything = reopened.load_experts(backbone_fingerprint(backbone))
    assert sorted(everything) == reopened.targets()
    assert len(everything) == 6  # q, k, v of 2 layers
    with pytest.raises(PoolError, match="not for the requested"):
        reopened.load_experts("0" * 16)


def test_weights_sha256_names_the_pool_a_comparison_ran_on(backbone, adapters, tmp_path):
    """bench/smartfed_protocol.py records it at tuning and refuses another pool at evaluation."""
    pool = Pool(tmp_path / "pool", backbone=backbone)
    for name in ("math", "code"):
        pool.add(adapters[name][0], {"source_run": f"runs/{name}", "task": "mmlu-stem"})
    both, math = pool.weights_sha256(), pool.weights_sha256(["math"])
    assert both == Pool(tmp_path / "pool").weights_sha256(["code", "math"]) and math != both
    weights = tmp_path / "pool" / "math" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\x01")  # one byte of one weight differs: another pool
    assert pool.weights_sha256(["math"]) != math


def test_foreign_adapter_is_refused(backbone, adapters, tmp_path):
    pool = Pool(tmp_path / "pool", backbone=backbone)
    foreign = LlamaForCausalLM(tiny_config(hidden=48))
    save_adapter(foreign, tmp_path / "foreign", 3, r=2, lora_alpha=2, target_modules=["q_proj"])
    with pytest.raises(PoolError, match=r"shape \(48, 48\).*different backbone"):
        pool.add(tmp_path / "foreign", {"source_run": "elsewhere", "task": "x"})
    assert len(pool) == 0 and not (tmp_path / "pool" / "foreign").exists()
    with pytest.raises(PoolError, match="built for backbone"):
        Pool(tmp_path / "pool", backbone=foreign)


def test_add_refuses_bad_requests(backbone, adapters, tmp_path):
    pool = Pool(tmp_path / "pool", backbone=backbone)
    math_dir = adapters["math"][0]
    with pytest.raises(PoolError, match="lacks"):
        pool.add(math_dir, {"task": "t"})
    with pytest.raises(PoolError, match="rank"):
        pool.add(math_dir, {"source_run": "r", "task": "t", "rank": 8})
    with pytest.raises(PoolError, match="name"):
        pool.add(math_dir, {"source_run": "r", "task": "t"}, name="a:b")
    with pytest.raises(PoolError, match="adapter_model.safetensors"):
        pool.add(tmp_path, {"source_run": "r", "task": "t"})
    pool.add(math_dir, {"source_run": "r", "task": "t"})
    with pytest.raises(PoolError, match="already"):
        pool.add(math_dir, {"source_run": "r", "task": "t"})
    with pytest.raises(PoolError, match="not a knowledge pool"):
        Pool(tmp_path / "nowhere")


def test_split_refuses_what_is_not_a_sum_of_rank1_terms():
    tensors = {f"base_model.model.{Q0}.lora_A.weight": np.ones((2, 4)), f"base_model.model.{Q0}.lora_B.weight": np.ones((3, 2))}
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4}
    assert split_adapter("x", tensors, config)[Q0].B[0, 0] == 2.0  # scale alpha / r
    with pytest.raises(PoolError, match="DoRA"):
        split_adapter("x", tensors, dict(config, use_dora=True))
    with pytest.raises(PoolError, match="only LoRA"):
        split_adapter("x", tensors, dict(config, peft_type="IA3"))
    with pytest.raises(PoolError, match="not a LoRA A/B weight"):
        split_adapter("x", dict(tensors, **{"base_model.model.lm_head.weight": np.ones((2, 2))}), config)
    with pytest.raises(PoolError, match="rank 2 but its config says r=4"):
        split_adapter("x", tensors, dict(config, r=4))
    patterned = split_adapter("x", tensors, dict(config, alpha_pattern={"q_proj": 8}))
    assert patterned[Q0].B[0, 0] == 4.0


def test_cli_lists_the_pool(backbone, adapters, tmp_path, capsys):
    from postcard import pool as pool_command  # `postcard pool`: the pool's one command line

    Pool(tmp_path / "pool", backbone=backbone).add(adapters["math"][0], {"task": "t", "source_run": "r"})
    assert pool_command.main(["list", "--pool", str(tmp_path / "pool"), "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[-1])["name"] == "math"
    assert pool_command.main(["list", "--pool", str(tmp_path / "missing")]) == 2


def test_pool_build_shows_no_run_simulation_banner_and_no_colour_codes_when_piped(capsys, monkeypatch):
    """#60: `postcard pool build` (and so `make demo`) printed Flower's "DEPRECATED FEATURE: run_simulation"
    banner, and colour codes into a log file. What its simulations log: the banner dropped (nothing else),
    Flower's levels and the lines Ray relays from the clients uncoloured when the output is not a terminal."""
    import logging
    import sys

    from flwr.common.logger import FLOWER_LOGGER, ConsoleHandler, console_handler, log, warn_deprecated_feature

    from postcard.pool import _not_the_run_simulation_banner, simulation_output

    monkeypatch.setattr(console_handler, "stream", sys.stderr)  # Flower's console: here, captured (not a terminal)
    message = ("The `run_simulation` function is deprecated and will be removed in a future version of Flower. "
               "Please use `flwr run` in the CLI instead to run your simulation.")  # as run_simulation says it
    with simulation_output():
        warn_deprecated_feature(message)
        warn_deprecated_feature("something else")
        log(logging.WARNING, "a warning of the run")
        print("\x1b[2m\x1b[36m(ClientAppActor pid=7)\x1b[0m \x1b[92mINFO \x1b[0m:      local training: step 1/4")
    out, err = capsys.readouterr()
    assert "run_simulation" not in out + err
    assert "DEPRECATED FEATURE: something else" in err and "WARNING :   a warning of the run" in err
    assert "(ClientAppActor pid=7) INFO :      local training: step 1/4" in out
    assert "\x1b[" not in out + err
    # as it was after it
    assert [h.colored for h in FLOWER_LOGGER.handlers if isinstance(h, ConsoleHandler)] == [True]
    assert _not_the_run_simulation_banner not in FLOWER_LOGGER.filters


@pytest.mark.slow
def test_pool_build_piped_to_a_file_has_no_banner_and_no_colour(tmp_path):
    """The whole path, as `make demo > log` runs it: one source, the tiny model, one round of one step."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-m", "postcard.pool", "build", "--sources", "shakespeare-histories",
                           "--pool", str(tmp_path / "pool"), "preset=test", "rounds=1", "train.local_steps=1",
                           "eval.max_batches=1", f"output_dir={tmp_path / 'runs'}"],
                          cwd=root, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "pool build done: 1 adapter(s) added" in proc.stdout
    assert "DEPRECATED FEATURE" not in output and "run_simulation" not in output
    assert "\x1b[" not in output
