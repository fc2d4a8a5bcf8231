"""FLITE core: the latent parametrisation on a tiny CNN and a tiny random Llama.

Numeric checks of what the federated protocol relies on: z = 0 is the backbone exactly,
averaging latents is averaging weights, the structured and dense forms are one linear
map, the factors are bit-identical in another process, only the latents train, and the
fingerprint tells incompatible parties apart.
"""

from __future__ import annotations

import copy
import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from clients.flite import (
    FliteConfig,
    FliteConv,
    FliteLinear,
    FliteNorm,
    LayerSpec,
    apply_flite,
    factor_checksum,
    fingerprint,
    flite_layers,
    generate_raw_factors,
    get_latents,
    latents_by_layer,
    layer_seed,
    layout,
    merge_and_unload,
    num_latents,
    plan,
    set_latents,
    split_budget,
    trainable_parameters,
)

from clients.models.heads import orthogonal_head_

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------
# Tiny models
# --------------------------------------------------------------------------------------


class TinyCNN(nn.Module):
    """Conv (bias) -> BN -> ReLU -> depthwise conv (groups=8) -> BN -> ReLU ->
    1x1 conv -> GroupNorm -> ReLU -> global pool -> Linear head ``fc``."""

    def __init__(self, width: int = 8, classes: int = 5):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.dw = nn.Conv2d(width, width, 3, padding=1, groups=width, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.pw = nn.Conv2d(width, 2 * width, 1, bias=False)
        self.gn = nn.GroupNorm(4, 2 * width)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.dw(x)))
        x = F.relu(self.gn(self.pw(x)))
        return self.fc(x.mean(dim=(2, 3)))


def tiny_cnn(width: int = 8, seed: int = 0) -> TinyCNN:
    torch.manual_seed(seed)
    model = TinyCNN(width)
    with torch.no_grad():  # "pretrained": non-trivial norm statistics and affine parameters
        for bn in (model.bn1, model.bn2):
            bn.running_mean.uniform_(-0.2, 0.2)
            bn.running_var.uniform_(0.5, 1.5)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.1, 0.1)
    return model.eval()


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=128,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def images(n: int = 4, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, 8, 8, generator=torch.Generator().manual_seed(seed))


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(seed))


def cnn_config(**overrides) -> FliteConfig:
    values = dict(seed=12345, rank=8, latent_budget=40, norm_latents=3, split="uniform")
    values.update(overrides)
    return FliteConfig(**values)


def random_latents(model, seed: int, std: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=num_latents(model)) * std).astype(np.float32)


# --------------------------------------------------------------------------------------
# Layout and injection
# --------------------------------------------------------------------------------------


def test_cnn_layout_budget_and_wrappers():
    model = apply_flite(tiny_cnn(), cnn_config())
    names = [name for name, _ in layout(model)]
    # named_modules order; the head ``fc`` is excluded (freeze_head), norms are included.
    assert names == ["conv1", "bn1", "dw", "bn2", "pw", "gn"]
    assert num_latents(model) == 40  # the budget exactly: 3 norms x 3, the rest split
    assert [k for _, k in layout(model)] == [11, 3, 10, 3, 10, 3]
    assert isinstance(model.conv1, FliteConv) and isinstance(model.bn1, FliteNorm)
    assert isinstance(model.gn, FliteNorm) and isinstance(model.fc, nn.Linear)
    # Grouped (depthwise) conv: the weight's own shape (out, in/groups * kh * kw).
    assert model.dw.flite_spec.matrix_shape == (8, 1 * 3 * 3)
    assert model.bn1.flite_spec.matrix_shape == (2, 8)  # [weight; bias]
    # Attribute passthrough and the frozen pretrained weight.
    assert model.conv1.out_channels == 8 and model.conv1.weight is model.conv1.base_layer.weight
    with pytest.raises(ValueError, match="already"):
        apply_flite(model, cnn_config())


def test_split_budget_is_exact_and_respects_caps():
    assert split_budget(10, [1, 1, 1], [100, 100, 100]) == [4, 3, 3]
    assert split_budget(12, [1, 4, 1], [100, 100, 100]) == [2, 8, 2]
    assert split_budget(20, [1, 1, 1], [2, 100, 100]) == [2, 9, 9]  # cap hit, rest re-shared
    assert split_budget(4, [10, 1, 1], [3, 5, 5]) == [2, 1, 1]  # floor of 1 binds, not the cap
    rng = np.random.default_rng(0)
    for _ in range(300):  # always exact, always within [1, cap]
        n = int(rng.integers(1, 12))
        weights = list(rng.uniform(0.01, 100.0, n))
        caps = [int(c) for c in rng.integers(1, 50, n)]
        total = int(rng.integers(n, sum(caps) + 1))
        alloc = split_budget(total, weights, caps)
        assert sum(alloc) == total and all(1 <= a <= c for a, c in zip(alloc, caps))
    with pytest.raises(ValueError, match="cannot give each"):
        split_budget(2, [1, 1, 1], [5, 5, 5])
    with pytest.raises(ValueError, match="exceeds"):
        split_budget(20, [1, 1], [5, 5])


def test_default_vision_budget_is_1280_latents():
    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.convs = nn.ModuleList(nn.Conv2d(16, 16, 3) for _ in range(20))
            self.norms = nn.ModuleList(nn.BatchNorm2d(16) for _ in range(20))
            self.classifier = nn.Linear(16, 10)

    specs = plan(Wide(), FliteConfig())
    assert sum(s.latents for s in specs) == 1280
    assert {s.latents for s in specs if s.kind == "norm"} == {12}
    assert {s.latents for s in specs if s.kind == "conv"} == {52}  # (1280 - 20 x 12) / 20
    assert all(s.rank == 64 for s in specs if s.kind == "conv")
    uniform = plan(Wide(), FliteConfig(split="uniform", norm_latents=4))
    assert {s.latents for s in uniform if s.kind == "conv"} == {60}
    no_norms = plan(Wide(), FliteConfig(include_norms=False))
    assert sum(s.latents for s in no_norms) == 1280 and {s.latents for s in no_norms} == {64}


def test_sqrt_split_follows_layer_size():
    class Uneven(nn.Module):
        def __init__(self):
            super().__init__()
            self.small = nn.Linear(10, 10)  # 100 parameters
            self.big = nn.Linear(100, 100)  # 10,000 parameters: sqrt ratio 10
            self.head = nn.Linear(100, 3)

    specs = plan(Uneven(), FliteConfig(include_norms=False, latent_budget=110))
    assert [(s.name, s.latents) for s in specs] == [("small", 10), ("big", 100)]
    capped = plan(Uneven(), FliteConfig(include_norms=False, latent_budget=10_050))
    assert [s.latents for s in capped] == [100, 9_950]  # "small" is full: never more than its size
    by_size = plan(Uneven(), FliteConfig(include_norms=False, latent_budget=202, split="size"))
    assert [s.latents for s in by_size] == [2, 200]  # 100 : 10,000


def test_late_split_puts_the_last_layers_first():
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(10, 10) for _ in range(4))  # equal sizes
            self.head = nn.Linear(10, 3)

    specs = plan(Stack(), FliteConfig(include_norms=False, latent_budget=100, split="late"))
    assert [s.latents for s in specs] == [10, 20, 30, 40]  # position 1..4
    assert [s.latents for s in plan(Stack(), FliteConfig(include_norms=False, latent_budget=100))] == [25] * 4
    with pytest.raises(ValueError, match="split must be one of"):
        FliteConfig(split="deep").validate()


def test_llama_all_projections_and_norms():
    model = apply_flite(tiny_llama(), FliteConfig(seed=7, rank=8, latent_budget=200))
    names = [name for name, _ in layout(model)]
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert f"model.layers.1.self_attn.{proj}" in names or f"model.layers.1.mlp.{proj}" in names
    assert "model.norm" in names and "lm_head" not in names  # the LM head stays frozen
    assert sum(isinstance(m, FliteLinear) for m in flite_layers(model)) == 14
    assert sum(isinstance(m, FliteNorm) for m in flite_layers(model)) == 5
    assert num_latents(model) == 200
    only_qv = apply_flite(tiny_llama(), FliteConfig(target_modules=["q_proj", "v_proj"], include_norms=False, latents=6))
    assert [n.rsplit(".", 1)[-1] for n, _ in layout(only_qv)] == ["q_proj", "v_proj"] * 2


# --------------------------------------------------------------------------------------
# z = 0 is the backbone; structured == dense; averaging identity; scaling
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("threshold", [0, 8192])  # all structured / the default mix
def test_zero_latents_reproduce_cnn_exactly(threshold):
    base = tiny_cnn()
    x = images()
    with torch.no_grad():
        expected = base(x)
        model = apply_flite(copy.deepcopy(base), cnn_config(structured_threshold=threshold))
        assert torch.equal(model(x), expected)
    assert np.all(get_latents(model) == 0)


@pytest.mark.parametrize("threshold", [0, 8192])
def test_zero_latents_reproduce_llama_exactly(threshold):
    base = tiny_llama()
    ids = tokens()
    with torch.no_grad():
        expected = base(ids).logits
        model = apply_flite(copy.deepcopy(base), FliteConfig(seed=3, rank=8, latent_budget=200,
                                                             structured_threshold=threshold))
        assert torch.equal(model(ids).logits, expected)


def _pair(build, **cfg):
    """The same backbone with every layer structured, and with every layer dense."""
    structured = apply_flite(build(), FliteConfig(**cfg, structured_threshold=0))
    dense = apply_flite(build(), FliteConfig(**cfg, structured_threshold=10**9))
    assert all(layer.flite_structured for layer in flite_layers(structured))
    assert not any(layer.flite_structured for layer in flite_layers(dense))
    return structured, dense


@pytest.mark.parametrize("which", ["cnn", "llama"])
def test_structured_and_dense_forms_give_the_same_delta(which):
    if which == "cnn":
        structured, dense = _pair(tiny_cnn, seed=99, rank=8, latent_budget=40, norm_latents=3)
        x = images()
    else:
        structured, dense = _pair(tiny_llama, seed=99, rank=8, latent_budget=200)
        x = tokens()
    z = random_latents(structured, seed=5, std=0.3)
    set_latents(structured, z)
    set_latents(dense, z)
    for s_layer, d_layer in zip(flite_layers(structured), flite_layers(dense)):
        ds, dd = s_layer.delta_matrix().detach(), d_layer.delta_matrix().detach()
        assert ds.abs().max() > 0
        torch.testing.assert_close(ds, dd, rtol=1e-5, atol=1e-6 * float(ds.abs().max()))
        # The dense U is exactly the structured map, materialised.
        torch.testing.assert_close(s_layer.dense_map(), d_layer.flite_U, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        out_s = structured(x) if which == "cnn" else structured(x).logits
        out_d = dense(x) if which == "cnn" else dense(x).logits
    torch.testing.assert_close(out_s, out_d, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("threshold", [0, 10**9])
def test_averaging_identity(threshold):
    """mean_k θ(z_k) == θ(mean_k z_k): the server may average latents instead of weights."""
    model = apply_flite(tiny_cnn(), cnn_config(structured_threshold=threshold))
    zs = [random_latents(model, seed=s, std=0.5) for s in range(8)]
    weights = []
    for z in zs:
        set_latents(model, z)
        with torch.no_grad():
            weights.append([p.double() for layer in flite_layers(model) for p in layer.effective_parameters().values()])
    set_latents(model, np.mean(np.stack(zs), axis=0))
    with torch.no_grad():
        from_mean = [p.double() for layer in flite_layers(model) for p in layer.effective_parameters().values()]
    for i, target in enumerate(from_mean):
        mean_of_weights = torch.stack([w[i] for w in weights]).mean(0)
        rel = float(torch.linalg.vector_norm(mean_of_weights - target) / torch.linalg.vector_norm(target))
        assert rel <= 1e-6, (i, rel)
    # The deltas alone, the strictest form of the identity.
    for layer in flite_layers(model):
        deltas = []
        for z in zs:
            set_latents(model, z)
            deltas.append(layer.delta_matrix().detach().double())
        set_latents(model, np.mean(np.stack(zs), axis=0))
        target = layer.delta_matrix().detach().double()
        rel = float(torch.linalg.vector_norm(torch.stack(deltas).mean(0) - target) / torch.linalg.vector_norm(target))
        assert rel <= 1e-6, (layer.flite_spec.name, rel)


@pytest.mark.parametrize("mode", ["weight", "unit"])
def test_latent_directions_are_orthonormal_and_scaled(mode):
    """Gram(directions) = c² I with c = scale · ρ · sqrt(m·n/k): unit-RMS latents move a
    layer by scale · ρ in RMS, ρ the RMS of its pretrained parameters (mode "weight")."""
    scale = 0.05
    model = apply_flite(tiny_cnn(), cnn_config(scale=scale, norm_scale=0.2, scale_mode=mode, structured_threshold=0))
    for layer in flite_layers(model):
        spec = layer.flite_spec
        U = layer.dense_map().double()
        params = [getattr(layer.base_layer, n).detach().double() for n in spec.param_names]
        rho = float(torch.sqrt(sum((p**2).sum() for p in params) / spec.numel)) if mode == "weight" else 1.0
        s = 0.2 if spec.kind == "norm" else scale
        c = s * rho * (spec.numel / spec.latents) ** 0.5
        assert layer.flite_coeff == pytest.approx(c, rel=1e-12)
        torch.testing.assert_close(U.T @ U, c**2 * torch.eye(spec.latents, dtype=torch.float64), rtol=0, atol=1e-4 * c**2)
        z = np.random.default_rng(0).choice([-1.0, 1.0], size=spec.latents).astype(np.float32)  # unit RMS
        with torch.no_grad():
            layer.flite_z.copy_(torch.from_numpy(z))
            rms = float(layer.delta_matrix().double().pow(2).mean().sqrt())
        assert rms == pytest.approx(s * rho, rel=1e-4)


# --------------------------------------------------------------------------------------
# Reproducibility of the factors
# --------------------------------------------------------------------------------------


def test_layer_seed_and_raw_factors_are_pinned():
    """Golden values: a change here silently breaks compatibility between clients."""
    expected = int.from_bytes(hashlib.sha256(b"\x00" * 8 + b"\x00" + b"a").digest()[:8], "little")
    assert layer_seed(0, "a") == expected == 2480952642325816695
    assert layer_seed(0, "a") != layer_seed(1, "a") != layer_seed(0, "b")
    spec = LayerSpec("conv1", "conv", (4, 6), 3, 5, ("weight",))
    raw = generate_raw_factors(123, spec)
    assert raw.digest() == "f80a09a029c0184bc5fe0f6e42b6af79bc11bd99756012678eefcfc139d97b7a"
    assert raw.A.dtype == raw.B.dtype == raw.V.dtype == torch.float32
    assert raw.A.shape == (4, 5) and raw.B.shape == (5, 6) and raw.V.shape == (3, 5)
    # Independent of the global RNG.
    torch.manual_seed(999)
    assert generate_raw_factors(123, spec).digest() == raw.digest()


_CHILD = textwrap.dedent(
    """
    import hashlib, json, sys
    import torch
    torch.manual_seed(4242)  # a different global RNG state must not matter
    sys.path.insert(0, {repo!r})
    sys.path.insert(0, {tests!r})
    from test_flite_core import cnn_config, tiny_cnn
    from clients.flite import apply_flite, factor_checksum, flite_layers

    config = cnn_config()
    model = tiny_cnn()
    out = {{"raw_plain": factor_checksum(config, model)}}
    apply_flite(model, config)
    out["raw_applied"] = factor_checksum(config, model)
    h = hashlib.sha256()
    for layer in flite_layers(model):
        for name, buf in sorted(layer.named_buffers()):
            if name.startswith("flite_"):
                h.update(buf.numpy().tobytes())
    out["derived"] = h.hexdigest()
    print(json.dumps(out))
    """
)


def _derived_checksum(model) -> str:
    h = hashlib.sha256()
    for layer in flite_layers(model):
        for name, buf in sorted(layer.named_buffers()):
            if name.startswith("flite_"):
                h.update(buf.numpy().tobytes())
    return h.hexdigest()


def test_factors_are_bit_identical_in_another_process():
    script = _CHILD.format(repo=str(REPO), tests=str(REPO / "tests"))
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
        env={"PYTHONHASHSEED": "123", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    child = json.loads(result.stdout.strip().splitlines()[-1])
    config = cnn_config()
    model = tiny_cnn()
    assert child["raw_plain"] == factor_checksum(config, model)
    apply_flite(model, config)
    assert child["raw_applied"] == child["raw_plain"] == factor_checksum(config, model)
    assert child["derived"] == _derived_checksum(model)  # normalised factors too, on this machine


# --------------------------------------------------------------------------------------
# Training: only the latents, and they learn
# --------------------------------------------------------------------------------------


def test_gradients_reach_the_latents_and_nothing_else_is_trainable():
    cnn = apply_flite(tiny_cnn(), cnn_config(structured_threshold=0))
    llama = apply_flite(tiny_llama(), FliteConfig(seed=1, rank=8, latent_budget=200))
    cases = [
        (cnn, lambda m: F.cross_entropy(m(images(8)), torch.arange(8) % 5)),
        (llama, lambda m: m(tokens(), labels=tokens()).loss),
    ]
    for model, loss_fn in cases:
        trainable = [name for name, p in model.named_parameters() if p.requires_grad]
        assert trainable and all(name.endswith("flite_z") for name in trainable)
        assert [p for p in model.parameters() if p.requires_grad] == trainable_parameters(model)
        loss_fn(model).backward()
        for layer in flite_layers(model):
            assert layer.flite_z.grad is not None and float(layer.flite_z.grad.abs().sum()) > 0, layer.flite_spec.name
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
        assert not any(name.startswith("flite") or ".flite_" in name for name in model.state_dict()
                       if not name.endswith("flite_z"))  # factors are never saved


def test_training_only_latents_reduces_the_loss():
    torch.manual_seed(0)
    model = tiny_cnn(width=8)
    orthogonal_head_(model.fc, seed=3, gain=4.0)
    apply_flite(model, cnn_config(latent_budget=60, scale=0.5))
    x = torch.randn(32, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 5, (32,), generator=torch.Generator().manual_seed(1))
    head_before = model.fc.weight.clone()
    optimiser = torch.optim.Adam(trainable_parameters(model), lr=0.05)
    losses = []
    for _ in range(40):
        optimiser.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    assert torch.equal(model.fc.weight, head_before)  # the frozen head never moved


def test_bn_running_statistics_still_update_in_train_mode():
    model = apply_flite(tiny_cnn(), cnn_config())
    before = model.bn1.running_mean.clone()
    model.train()
    model(images(8))
    assert not torch.equal(model.bn1.running_mean, before)


# --------------------------------------------------------------------------------------
# Latent I/O
# --------------------------------------------------------------------------------------


def test_get_set_latents_round_trip_and_errors():
    model = apply_flite(tiny_cnn(), cnn_config())
    z = random_latents(model, seed=3)
    set_latents(model, z)
    got = get_latents(model)
    assert got.dtype == np.float32 and np.array_equal(got, z)
    per_layer = latents_by_layer(model)
    assert list(per_layer) == [name for name, _ in layout(model)]
    set_latents(model, np.zeros(40, dtype=np.float32))
    set_latents(model, per_layer)  # the mapping form
    assert np.array_equal(get_latents(model), z)
    set_latents(model, torch.from_numpy(z))  # tensors too
    with pytest.raises(ValueError, match="expected a latent vector of 40 values .* got 39"):
        set_latents(model, z[:-1])
    with pytest.raises(ValueError, match="NaN or Inf"):
        set_latents(model, np.full(40, np.nan, dtype=np.float32))
    with pytest.raises(ValueError, match="1-D"):
        set_latents(model, z.reshape(4, 10))
    with pytest.raises(ValueError, match="missing"):
        set_latents(model, {"conv1": per_layer["conv1"]})
    bad = dict(per_layer, conv1=per_layer["conv1"][:-1])
    with pytest.raises(ValueError, match="layer 'conv1' expects 11 latents, got 10"):
        set_latents(model, bad)
    assert np.array_equal(get_latents(model), z)  # failed loads change nothing
    with pytest.raises(ValueError, match="apply_flite"):
        get_latents(tiny_cnn())


def test_merge_and_unload_bakes_the_latents_in():
    model = apply_flite(tiny_cnn(), cnn_config())
    set_latents(model, random_latents(model, seed=8, std=0.5))
    x = images()
    with torch.no_grad():
        expected = model(x)
        merged = merge_and_unload(model)
        assert not flite_layers(merged) and isinstance(merged.conv1, nn.Conv2d)
        torch.testing.assert_close(merged(x), expected, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------
# Fingerprint
# --------------------------------------------------------------------------------------


def test_fingerprint_identifies_seed_layout_and_backbone():
    config = cnn_config()
    reference = fingerprint(config, apply_flite(tiny_cnn(), config))
    assert len(reference) == 16 and int(reference, 16) >= 0
    # Same everything on another copy (other weights values: not covered), and from a plain
    # backbone on the meta device, as a server without weights would compute it.
    assert fingerprint(config, apply_flite(tiny_cnn(seed=5), config)) == reference
    with torch.device("meta"):
        meta_model = TinyCNN()
    assert fingerprint(config, meta_model) == reference
    # structured vs dense is an implementation detail, not a compatibility question.
    dense = cnn_config(structured_threshold=10**9)
    assert fingerprint(dense, apply_flite(tiny_cnn(), dense)) == reference
    variants = {
        "seed": (cnn_config(seed=12346), tiny_cnn()),
        "layout (budget)": (cnn_config(latent_budget=41), tiny_cnn()),
        "layout (norms)": (cnn_config(include_norms=False), tiny_cnn()),
        "rank": (cnn_config(rank=9), tiny_cnn()),
        "scale": (cnn_config(scale=2.0), tiny_cnn()),
        "backbone (width)": (cnn_config(), tiny_cnn(width=12)),
    }
    prints = {name: fingerprint(cfg, apply_flite(model, cfg)) for name, (cfg, model) in variants.items()}
    assert reference not in prints.values()
    assert len(set(prints.values())) == len(prints)
    # A different head (number of classes) is a different backbone structure.
    other_head = tiny_cnn()
    other_head.fc = nn.Linear(16, 7)
    assert fingerprint(config, apply_flite(other_head, config)) != reference
    with pytest.raises(ValueError, match="different FliteConfig"):
        fingerprint(cnn_config(seed=1), apply_flite(tiny_cnn(), config))


def test_fingerprint_on_llama_matches_between_plain_and_applied():
    config = FliteConfig(seed=11, rank=8, latent_budget=200)
    plain = fingerprint(config, tiny_llama())
    assert fingerprint(config, apply_flite(tiny_llama(seed=2), config)) == plain


# --------------------------------------------------------------------------------------
# Frozen orthogonal head and config validation
# --------------------------------------------------------------------------------------


def test_orthogonal_head_is_orthonormal_frozen_and_seeded():
    head = nn.Linear(16, 5)
    state = torch.random.get_rng_state()
    orthogonal_head_(head, seed=7)
    assert torch.equal(torch.random.get_rng_state(), state)  # global RNG untouched
    w = head.weight.detach().double()
    torch.testing.assert_close(w @ w.T, torch.eye(5, dtype=torch.float64), rtol=0, atol=1e-6)
    assert torch.equal(head.bias, torch.zeros(5))
    assert not head.weight.requires_grad and not head.bias.requires_grad
    assert torch.equal(orthogonal_head_(nn.Linear(16, 5), seed=7).weight, head.weight)
    assert not torch.equal(orthogonal_head_(nn.Linear(16, 5), seed=8).weight, head.weight)
    scaled = orthogonal_head_(nn.Linear(16, 5), seed=7, gain=3.0)
    torch.testing.assert_close(scaled.weight, 3.0 * head.weight)


def test_failed_apply_leaves_the_model_untouched():
    with torch.device("meta"):
        model = TinyCNN()
    with pytest.raises(ValueError, match="meta device"):
        apply_flite(model, cnn_config())
    assert not flite_layers(model) and not hasattr(model, "flite_config")
    assert all(p.requires_grad for p in model.parameters())


def test_unfrozen_head_gets_latents():
    model = apply_flite(tiny_cnn(), cnn_config(freeze_head=False))
    assert "fc" in [name for name, _ in layout(model)] and isinstance(model.fc, FliteLinear)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(seed=-1), "seed"),
        (dict(seed=2**64), "seed"),
        (dict(rank=0), "rank"),
        (dict(split="log"), "split"),
        (dict(scale=0.0), "scale"),
        (dict(scale_mode="std"), "scale_mode"),
        (dict(target_modules="("), "regular expression"),
        (dict(latents=0), "latents"),
    ],
)
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FliteConfig(**kwargs)


def test_config_round_trips_through_a_dict_and_budget_errors_are_clear():
    config = cnn_config(target_modules=["conv1"])
    assert FliteConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="unknown FliteConfig keys"):
        FliteConfig.from_dict({"sede": 1})
    with pytest.raises(ValueError, match="leaves"):
        plan(tiny_cnn(), cnn_config(latent_budget=9))  # 3 norms x 3 latents eat it all
    with pytest.raises(ValueError, match="no layer"):
        plan(tiny_cnn(), cnn_config(target_modules=["nothing"], include_norms=False))


DERIVE = """
import hashlib, sys
import torch
torch.set_num_threads(int(sys.argv[1]))
from fedapps.config import compose
from fedapps.flite import prepare
model, _, _ = prepare(compose(["model=tiny-cnn", "algorithm.flite.structured_threshold=100000000"],
                              task="cifar10", algorithm="flite"))
digest = hashlib.sha256()
for name, buf in sorted(model.named_buffers()):
    if "flite_" in name:
        digest.update(name.encode() + buf.contiguous().numpy().tobytes())
print(digest.hexdigest())
"""


def test_derived_factors_are_bit_identical_across_thread_counts():
    """Clients on machines with other thread counts derive the same bits: every dense map
    (4.6M entries on the tiny CNN; before they were formed on one thread, 1 and 2 threads
    gave different last bits) and every basis."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    digests = {threads: subprocess.run([sys.executable, "-c", DERIVE, str(threads)], cwd=root, check=True,
                                       capture_output=True, text=True).stdout.strip().splitlines()[-1]
               for threads in (1, 2)}
    assert len(digests[1]) == 64 and digests[1] == digests[2]
