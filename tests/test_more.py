"""MoRE: rank-1 experts reproduce PEFT's LoRA, top-K routing, gradients, state exchange."""

import copy

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from transformers import LlamaConfig, LlamaForCausalLM

from clients.smartfed.more import (
    ExpertSet,
    MoREConfig,
    MoRELinear,
    active_state,
    apply_more,
    importance_state,
    MixtureError,
    load_mixture,
    to_layout_ids,
    more_modules,
    split_adapter,
)
from clients.pool import backbone_fingerprint
from strategies import sparse
from strategies.expert_state import ExpertState, aggregate

torch.set_num_threads(1)
Q0 = "model.layers.0.self_attn.q_proj"
V1 = "model.layers.1.self_attn.v_proj"


@pytest.fixture(scope="module")
def backbone():
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, vocab_size=128
    )
    return LlamaForCausalLM(config).eval()


def lora(backbone, name, seed, **kwargs):
    """A PEFT LoRA with random non-zero B, and its experts read via get_peft_model_state_dict."""
    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(backbone), LoraConfig(**kwargs)).eval()
    for pname, p in model.named_parameters():
        if "lora_B" in pname:
            torch.nn.init.normal_(p, std=0.5)
    tensors = {k: v.detach().numpy() for k, v in get_peft_model_state_dict(model).items()}
    return model, split_adapter(name, tensors, model.peft_config["default"].to_dict())


@pytest.fixture(scope="module")
def pooled(backbone):
    """Two adapters on q/v (ranks 4 and 2); per matrix their experts concatenated a then b."""
    peft_a, experts_a = lora(backbone, "a", 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    peft_b, experts_b = lora(backbone, "b", 2, r=2, lora_alpha=2, target_modules=["q_proj", "v_proj"])
    experts = {m: ExpertSet.concat([experts_a[m], experts_b[m]]) for m in experts_a}
    return {"a": peft_a, "b": peft_b, "experts": experts}


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))


def more_model(backbone, experts, **config):
    return apply_more(copy.deepcopy(backbone), experts, MoREConfig(**config))


def test_experts_of_one_adapter_reproduce_peft_merged_lora(backbone, pooled, tokens):
    # Merged PEFT output for adapter a (rank 4) and b (rank 2).
    with torch.no_grad():
        want_a = copy.deepcopy(pooled["a"]).merge_and_unload()(tokens).logits
        want_b = copy.deepcopy(pooled["b"]).merge_and_unload()(tokens).logits
        base = backbone(tokens).logits
    assert (want_a - base).abs().max() > 1e-2  # the adapter does something

    only_a = {m: list(range(4)) for m in pooled["experts"]}
    model = more_model(backbone, pooled["experts"], top_k=4, gate_mode="ones", active=only_a).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, want_a, atol=1e-5, rtol=0)

    only_b = {m: [4, 5] for m in pooled["experts"]}
    model = more_model(backbone, pooled["experts"], top_k=8, gate_mode="ones", active=only_b).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, want_b, atol=1e-5, rtol=0)

    # Default softmax gates: a uniform router with K = r gives every expert gate 1.
    model = more_model(backbone, pooled["experts"], top_k=4, router_std=0.0, active=only_a).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, want_a, atol=1e-5, rtol=0)


def test_top_k_keeps_exactly_k_experts_per_token(backbone, pooled):
    x = torch.randn(3, 5, 32)
    experts = pooled["experts"][Q0]
    for gate_mode in ("softmax", "softmax-raw", "ones"):
        for k in (1, 2, 3, 6, 10):
            layer = MoRELinear(
                torch.nn.Linear(32, 32, bias=False), experts.A, experts.B, k, torch.randn(6, 32), gate_mode=gate_mode
            )
            g = layer.gates(x)
            assert g.shape == (15, 6)
            assert ((g != 0).sum(-1) == min(k, 6)).all()
            if gate_mode == "softmax":
                torch.testing.assert_close(g.sum(-1), torch.full((15,), float(min(k, 6))))
            if gate_mode == "softmax-raw":
                probs = torch.softmax(x.reshape(-1, 32) @ layer.router.t(), -1)
                torch.testing.assert_close(g[g != 0], probs[g != 0])
    # Routing is over the active experts only.
    layer.set_active([1, 4, 5])
    g = layer.gates(x)
    assert g.shape == (15, 3) and ((g != 0).sum(-1) == 3).all()


def _backward(model, tokens):
    model.train()
    out = model(tokens, labels=tokens)
    out.loss.backward()


def test_gradients_reach_only_active_experts_and_routers(backbone, pooled, tokens):
    active = {m: [0, 2, 5] for m in pooled["experts"]}
    model = more_model(backbone, pooled["experts"], top_k=2, router_std=0.5, active=active)
    _backward(model, tokens)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.rsplit(".", 1)[-1] in ("expert_A", "expert_B", "router") for n in trainable)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, name
    for layer in more_modules(model).values():
        inactive = [1, 3, 4]
        for grad in (layer.expert_A.grad, layer.router.grad):
            assert grad[inactive].abs().sum() == 0
            assert grad[[0, 2, 5]].abs().sum() > 0
        assert layer.expert_B.grad[:, inactive].abs().sum() == 0
        assert layer.expert_B.grad[:, [0, 2, 5]].abs().sum() > 0


def test_router_only_mode_trains_no_expert(backbone, pooled, tokens):
    model = more_model(backbone, pooled["experts"], top_k=2, mode="router-only", router_std=0.5)
    _backward(model, tokens)
    for layer in more_modules(model).values():
        assert not layer.expert_A.requires_grad and layer.expert_A.grad is None and layer.expert_B.grad is None
        assert layer.router.grad.abs().sum() > 0
    state = active_state(model)
    assert not any(k.endswith(("/A", "/B")) for k in state)
    assert set(active_state(model, include_frozen=True)) > set(state)


def test_importance_is_gate_mass_times_output_norm(backbone, pooled, tokens):
    model = more_model(backbone, pooled["experts"], top_k=2, router_std=0.5, active={Q0: [1, 3, 4]})
    layer = more_modules(model)[Q0]
    captured = {}
    layer.register_forward_hook(lambda mod, inp, out: captured.setdefault("x", inp[0].detach()))
    model.eval()
    with torch.no_grad():
        model(tokens)
    assert torch.isnan(layer.importance).all()  # eval forwards do not measure
    model.train()
    with torch.no_grad():
        model(tokens)
    x = captured["x"].reshape(-1, 32)
    idx = layer.active_idx
    z = (x @ layer.expert_A[idx].t()) * layer.gates(x)
    want = z.abs().mean(0) * layer.expert_B[:, idx].norm(dim=0)
    torch.testing.assert_close(layer.importance[idx], want)
    assert torch.isnan(layer.importance[[0, 2, 5]]).all()
    reported = importance_state(model)[f"{Q0}/importance"]
    assert reported[0].tolist() == [1, 3, 4]
    np.testing.assert_allclose(reported[1], want.detach().numpy(), rtol=1e-6)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_sensitivity_importance_is_the_loss_change_of_removing_each_expert_to_first_order(
        backbone, pooled, tokens, checkpointed):
    """importance=sensitivity: |dL/dα_i| for α_i scaling expert i's output, measured by the layer
    from the gradient at its output; the same derivative through the experts' own parameters,
    Σ_o B[o,i]·∂L/∂B[o,i], must agree — with activation checkpointing too (the replay in
    backward measures nothing twice). Eval forwards measure nothing."""
    model = more_model(backbone, pooled["experts"], top_k=2, router_std=0.5, importance="sensitivity",
                       active={Q0: [1, 3, 4]})
    if checkpointed:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    layer = more_modules(model)[Q0]
    with torch.no_grad():
        model(tokens)
    assert torch.isnan(layer.importance).all()
    model(tokens, labels=tokens).loss.backward()
    idx = layer.active_idx
    want = (layer.expert_B.detach()[:, idx] * layer.expert_B.grad[:, idx]).sum(0).abs()
    assert float(want.min()) > 0
    torch.testing.assert_close(layer.importance[idx], want, rtol=1e-4, atol=1e-9)
    assert torch.isnan(layer.importance[[0, 2, 5]]).all() and layer.importance_steps[idx].tolist() == [1, 1, 1]


def test_an_unknown_importance_mode_is_refused():
    with pytest.raises(ValueError, match="importance must be one of"):
        MoREConfig(importance="gain")


def test_active_state_round_trip_through_the_wire(backbone, pooled, tokens):
    """Server state -> downlink -> client without the pool -> local step -> sparse update -> FedAvg."""
    experts = pooled["experts"]
    layout = sparse.ExpertLayout(
        {m: sparse.MatrixLayout(e.d_in, e.d_out, e.ids) for m, e in experts.items()}, train_experts=True
    )
    state = ExpertState.initial(layout, {m: (e.A, e.B) for m, e in experts.items()}, router_seed=0, router_std=0.3)
    active = {Q0: [0, 4], V1: [1, 2, 3], "model.layers.0.self_attn.v_proj": [5], "model.layers.1.self_attn.q_proj": [0]}
    downlink = sparse.encode(state.gather(active))

    # Reference: the full model from the pool with the same routers and active sets.
    reference = more_model(backbone, experts, top_k=2, router_std=0.3, active=active).eval()
    # Client: the plain backbone; its MoRE layers hold just the experts of the downlink.
    client = copy.deepcopy(backbone)
    ids = load_mixture(client, sparse.to_tensors(sparse.decode(downlink, layout, kind="state")), MoREConfig(top_k=2))
    assert {m: v.tolist() for m, v in ids.items()} == active
    assert backbone_fingerprint(client) == backbone_fingerprint(backbone)  # MoRE keeps base names
    client.eval()
    with torch.no_grad():
        torch.testing.assert_close(client(tokens).logits, reference(tokens).logits, atol=1e-6, rtol=0)

    before = active_state(client)
    optimizer = torch.optim.SGD([p for p in client.parameters() if p.requires_grad], lr=0.1)
    _backward(client, tokens)
    optimizer.step()
    after = to_layout_ids(active_state(client), ids)
    update = to_layout_ids(sparse.delta(active_state(client), before) | importance_state(client), ids)
    record = sparse.encode(update)
    parts = sparse.decode(record, layout, active=active, budget=7)
    new_state, importance = aggregate(state, [(parts, 12)])

    # One client: the server's experts now equal the client's.
    for key, value in after.items():
        matrix, field = key.rsplit("/", 1)
        if field == "ids":
            continue
        np.testing.assert_allclose(getattr(new_state, field)[matrix][after[f"{matrix}/ids"]], value, atol=1e-6)
    measured = importance[Q0][active[Q0]]
    assert np.isfinite(measured).all() and np.isnan(np.delete(importance[Q0], active[Q0])).all()


def test_load_mixture_validates(backbone, pooled):
    model = more_model(backbone, pooled["experts"], top_k=2)
    state = active_state(model, include_frozen=True)
    client = copy.deepcopy(backbone)
    with pytest.raises(MixtureError, match="lacks"):
        load_mixture(client, {k: v for k, v in state.items() if k != f"{Q0}/A"}, MoREConfig(top_k=2))
    with pytest.raises(MixtureError, match="does not fit"):
        load_mixture(client, dict(state, **{"model.layers.0.mlp.nope/ids": np.array([0]),
                                            "model.layers.0.mlp.nope/router": np.zeros((1, 32), np.float32),
                                            "model.layers.0.mlp.nope/A": np.zeros((1, 32), np.float32),
                                            "model.layers.0.mlp.nope/B": np.zeros((1, 32), np.float32)}),
                     MoREConfig(top_k=2))
    with pytest.raises(MixtureError, match="invalid expert ids"):
        load_mixture(client, dict(state, **{f"{Q0}/ids": np.array([0.5] * state[f"{Q0}/ids"].size)}), MoREConfig(top_k=2))
    bad = dict(state, **{f"{Q0}/router": np.zeros((state[f"{Q0}/ids"].size, 7), np.float32)})
    with pytest.raises(MixtureError, match="shape"):
        load_mixture(client, bad, MoREConfig(top_k=2))
    with pytest.raises(ValueError, match=r"in \[0, 6\)"):
        more_modules(model)[Q0].set_active([0, 6])


def test_apply_more_refuses_mismatches(backbone, pooled):
    experts = pooled["experts"]
    with pytest.raises(ValueError, match="no module"):
        more_model(backbone, {"model.layers.7.self_attn.q_proj": experts[Q0]})
    wrong = ExpertSet(("x:0",), np.zeros((1, 16), np.float32), np.zeros((32, 1), np.float32))
    with pytest.raises(ValueError, match="another backbone"):
        more_model(backbone, {Q0: wrong})
    with pytest.raises(TypeError, match="nn.Linear"):
        more_model(backbone, {"model.layers.0.self_attn": experts[Q0]})
    with pytest.raises(ValueError, match="gate_mode"):
        MoREConfig(gate_mode="sigmoid")
