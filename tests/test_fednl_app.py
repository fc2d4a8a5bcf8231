"""FedNL as a Flower pair: θ payloads, per-node LoRA, the model it builds, the NIAH task,
the streaming diagnostics, and tiny-model simulations in both payload modes."""

import copy

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict

from clients.fednl import (
    FedNLConfig,
    FedNLStreamer,
    KVCacheStreamer,
    add_delta_memory,
    is_memory_param,
    is_qkv_lora_param,
    memory_attentions,
    meta_rule_names,
    relative_ce,
    stream_logits,
    streamed_nll,
)
from clients.fednl.diagnostics import PeakMemory, binned_nll
from clients.models import build_model
from clients.tasks import make_task
from clients.tasks.niah import DEPTHS, LETTERS
from fedapps import fednl
from fedapps.config import ConfigError, compose, to_yaml
from fedapps.outputs import mean_train_loss, read_metrics
from fedapps.session import session
from strategies import codec
from strategies.screening import CONFIG_RECORD
from strategies.fednl import FedNL, check_theta, gate_alpha

torch.set_num_threads(1)

# tiny-llama: 2 layers, hidden 64, 4 heads of 16, 2 KV heads; LoRA r=8 on q, k, v
LAYERS, HIDDEN, HEADS, KV_DIM, R = 2, 64, 4, 32, 8
MEMORY_HEADS = 2  # algorithm.memory.memory_heads=kv (the default): one memory and one β per KV head
GATE_THETA = LAYERS * (1 + MEMORY_HEADS * HIDDEN + MEMORY_HEADS)  # gate logit + β weight and bias, per layer
LORA_THETA = LAYERS * (R * HIDDEN + HIDDEN * R + 2 * (R * HIDDEN + KV_DIM * R))  # q, k, v: A and B


def answer(msg, ctx):
    """inprocess.answer, imported when called: a subprocess imports this module as tests.test_fednl_app."""
    from inprocess import answer as reply

    return reply(msg, ctx)


def fednl_cfg(*overrides, mode="meta-rules", **groups):
    return compose([f"algorithm.mode={mode}", *overrides], preset="test", algorithm="fednl", **groups)


def context(node_id: int, partition_id: int) -> Context:
    return Context(run_id=1, node_id=node_id, node_config={"partition-id": partition_id, "num-partitions": 2},
                   state=RecordDict(), run_config={})


def message(cfg, arrays, phase: str, server_round: int, node_id: int) -> Message:
    content = RecordDict({
        "arrays": arrays,
        "config": ConfigRecord({"server-round": server_round}),
        CONFIG_RECORD: ConfigRecord({"yaml": to_yaml(cfg)}),
    })
    return Message(content, dst_node_id=node_id, message_type=phase)


def strategy_for(cfg):
    return fednl.plan_server(cfg, on_round_end=None, config_yaml=to_yaml(cfg)).strategy


# --------------------------------------------------------------------------- the payload θ
@pytest.mark.parametrize("mode", ["meta-rules", "gate"])
def test_the_uplink_payload_holds_exactly_the_configured_theta(mode):
    cfg = fednl_cfg("train.local_steps=1", "algorithm.eval_local=false", mode=mode)
    model, _, extra = fednl.prepare(cfg)
    names = extra["names"]
    assert names == meta_rule_names(model, mode)
    assert all(is_memory_param(n) or (mode == "meta-rules" and is_qkv_lora_param(n)) for n in names)
    assert not any("base_layer" in n or "embed" in n or "mlp" in n for n in names)  # no backbone
    lora = [n for n, _ in model.named_parameters() if is_qkv_lora_param(n)]
    assert extra["local_names"] == ([] if mode == "meta-rules" else lora)  # gate mode: LoRA stays local
    assert sorted(extra["local_init"]) == sorted(extra["local_names"])

    strategy = strategy_for(cfg)
    node = context(11, 0)
    out = answer(message(cfg, strategy.downlink_arrays(), "train", 1, 11), node)
    sent = codec.decode(out.content["arrays"])
    assert sorted(sent) == sorted(names)
    values = GATE_THETA + (LORA_THETA if mode == "meta-rules" else 0)
    assert sum(v.size for v in sent.values()) == values
    assert codec.payload_bytes(out.content["arrays"]) == 4 * values
    # nothing else of the model state (no memory S: it is activation state, not a tensor of the model)
    assert not any(name for name, _ in model.named_buffers() if "fednl" in name)
    # the strategy accepts it as a valid reply
    tensors, num_examples = strategy.validate_reply(out)
    assert num_examples > 0 and set(tensors) == set(strategy.uplink_keys)


def test_gate_mode_keeps_each_nodes_lora_on_the_node():
    cfg = fednl_cfg("train.local_steps=2", "algorithm.eval_local=false", mode="gate")
    strategy = strategy_for(cfg)
    a, b = context(1, 0), context(2, 1)
    answer(message(cfg, strategy.downlink_arrays(), "train", 1, 1), a)
    assert fednl.LOCAL_LORA in a.state.array_records
    lora_a = codec.decode(a.state.array_records[fednl.LOCAL_LORA])

    s = session(cfg, b, fednl.prepare)  # the process's shared model, now holding node a's LoRA
    fednl.restore_local(s, b)  # node b has none yet: the shared seeded init
    init = {k: v.numpy() for k, v in s.extra["local_init"].items()}
    params = dict(s.model.named_parameters())
    assert all(np.array_equal(params[k].detach().numpy(), v) for k, v in init.items())
    assert any(not np.array_equal(lora_a[k], init[k]) for k in init)  # a's LoRA did train

    answer(message(cfg, strategy.downlink_arrays(), "train", 1, 2), b)
    answer(message(cfg, strategy.downlink_arrays(), "evaluate", 1, 1), a)  # a evaluates its own LoRA
    params = dict(s.model.named_parameters())
    assert all(np.array_equal(params[k].detach().numpy(), v) for k, v in lora_a.items())


def test_strategy_refuses_anything_but_theta():
    gate = {"model.layers.0.self_attn.fednl_gate": np.zeros(1, np.float32)}
    lora = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight": np.zeros((8, 64), np.float32)}
    check_theta(list(gate), "gate")
    check_theta(list(gate | lora), "meta-rules")
    with pytest.raises(ValueError, match="neither LoRA"):
        check_theta([*gate, "model.layers.0.mlp.up_proj.weight"], "meta-rules")
    with pytest.raises(ValueError, match="keeps LoRA on the clients"):
        check_theta(list(gate | lora), "gate")
    with pytest.raises(ValueError, match="sends LoRA"):
        check_theta(list(gate), "meta-rules")
    with pytest.raises(ValueError, match="no memory gate"):
        check_theta(list(lora), "meta-rules")
    with pytest.raises(ValueError, match="mode"):
        FedNL(mode="everything", initial_state=gate, config_yaml="", num_clients=1)
    state = {"m.layers.1.self_attn.fednl_gate": np.zeros(1, np.float32),
             "m.layers.0.self_attn.fednl_gate": np.full(3, -4.0, np.float32)}
    assert gate_alpha(state) == pytest.approx([1 / (1 + np.exp(4.0)), 0.5])


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["algorithm.mode=lora"], "algorithm.mode"),
        (["algorithm.lora.target_modules=[q_proj,o_proj]"], "o_proj"),
        (["algorithm.lora.send=b"], "send"),
        (["algorithm.memory.gate=vector"], "invalid algorithm.memory"),
        (["algorithm.memory.chunk_size=0"], "chunk_size"),
        (["algorithm.memory.window=16", "algorithm.memory.sink=-1"], "sink"),
    ],
)
def test_bad_fednl_settings_fail_clearly(overrides, match):
    # the memory's settings already fail when the configuration is composed (ConfigError), the rest in prepare
    with pytest.raises((fednl.FedNLSetupError, ConfigError), match=match):
        fednl.prepare(compose(overrides, preset="test", algorithm="fednl"))


def test_paper_presets_carry_the_papers_hyperparameters():
    mmlu = compose(preset="fednl-mmlu-paper")
    assert (mmlu.algorithm.name, mmlu.task.name, mmlu.algorithm.lora.r, mmlu.algorithm.lora.alpha) == ("fednl", "mmlu", 32, 64)
    assert mmlu.train.lr == pytest.approx(5e-5) and mmlu.num_clients == 5
    niah = compose(preset="fednl-niah-paper")
    assert (niah.task.name, niah.algorithm.lora.r, niah.algorithm.lora.alpha, niah.rounds) == ("niah", 16, 32, 2)
    assert niah.train.lr == pytest.approx(3e-4) and niah.num_clients == 7
    assert compose(preset="fednl-niah-paper", algorithm="fedala").algorithm.name == "fedala"


# --------------------------------------------------------------------------- the model the pair builds
def test_alpha_to_zero_with_lora_at_init_gives_the_frozen_backbone():
    cfg = fednl_cfg("algorithm.memory.gate_init_logit=-100")
    backbone, tokenizer = build_model(cfg)
    model, _, _ = fednl.prepare(cfg)
    ids = torch.randint(0, len(tokenizer), (2, 45), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids, attention_mask=mask).logits,
                              backbone(input_ids=ids, attention_mask=mask).logits, atol=1e-6, rtol=0)
        for attn in memory_attentions(model):
            attn.fednl_gate.fill_(0.0)  # alpha = 0.5: the memory now changes the output
        assert not torch.allclose(model(input_ids=ids).logits, backbone(input_ids=ids).logits, atol=1e-3)


def test_gemma3_backbones_get_the_memory_too():
    """Gemma3: q_norm/k_norm before RoPE, local sliding-window layers beside global ones."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, vocab_size=256, intermediate_size=128, max_position_embeddings=4096,
                              sliding_window=32, layer_types=["sliding_attention", "full_attention"],
                              query_pre_attn_scalar=16)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    backbone = Gemma3ForCausalLM(config).eval()
    ids = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        silent = add_delta_memory(copy.deepcopy(backbone), FedNLConfig(gate_init_logit=float("-inf")))
        assert torch.equal(silent(ids).logits, backbone(ids).logits)
        for window in (None, 24):
            live = add_delta_memory(copy.deepcopy(backbone), FedNLConfig(gate_init_logit=0.0, window=window,
                                                                         chunk_size=16))
            assert (stream_logits(live, ids, block=32) - live(ids).logits).abs().max() <= 1e-4


@pytest.fixture(scope="module")
def live_model():
    """The pair's model (window 24, chunk 16) with alpha = 0.5, random beta and LoRA B."""
    cfg = fednl_cfg("algorithm.memory.window=24", "algorithm.memory.chunk_size=16",
                    "algorithm.memory.gate_init_logit=0.0")
    model, tokenizer, extra = fednl.prepare(cfg)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "fednl_beta.weight" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model, tokenizer, extra


@pytest.mark.parametrize("length", [67, 131])
def test_chunked_training_form_and_recurrent_stream_agree(live_model, length):
    model, tokenizer, _ = live_model
    ids = torch.randint(0, len(tokenizer), (2, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        chunked = model(input_ids=ids).logits  # chunked WY/UT delta rule over the whole sequence
    recurrent = stream_logits(model, ids, block=20, form="recurrent")  # token by token, blocks of 20
    assert (recurrent - chunked).abs().max().item() <= 1e-4


def test_gradients_reach_every_theta_tensor_through_the_memory(live_model):
    model, tokenizer, extra = live_model
    ids = torch.randint(0, len(tokenizer), (2, 50), generator=torch.Generator().manual_seed(1))
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    params = dict(model.named_parameters())
    for name in extra["names"]:
        grad = params[name].grad
        assert grad is not None and torch.isfinite(grad).all(), name
        assert grad.abs().sum() > 0, name
    assert all(p.grad is None for n, p in params.items() if n not in extra["names"])
    model.zero_grad(set_to_none=True)


def stream_peaks(hidden: int = 512) -> dict:
    """Peak-RSS growth from 1K to 4K streamed tokens: FedNL's recurrent form (least of up to five
    tries: RSS noise only adds bytes) and a KV-cache backbone. Run in a fresh process by the test."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         vocab_size=256, intermediate_size=512, max_position_embeddings=16384)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    backbone = LlamaForCausalLM(config).eval()
    model = add_delta_memory(copy.deepcopy(backbone), FedNLConfig(window=128, gate_init_logit=0.0))
    ids = torch.randint(0, 256, (1, 4096), generator=torch.Generator().manual_seed(0))
    streamed_nll(FedNLStreamer(model, block=128), ids[:, :512])  # warm up allocator and kernels

    def growth(streamer):
        samples = {}
        with PeakMemory() as peak:
            streamed_nll(streamer, ids, on_block=lambda n: samples.setdefault(n, peak.sample()))
        return samples[4096] - samples[1024]

    kv_growth = 2 * 2 * hidden * 4 * (4096 - 1024)  # layers x (K, V) x channels x fp32 bytes x tokens
    fednl = []
    for _ in range(5):
        fednl.append(growth(FedNLStreamer(model, block=128)))
        if fednl[-1] <= 0.15 * kv_growth:
            break
    return {"fednl": fednl, "kv": growth(KVCacheStreamer(backbone, block=128)), "kv_expected": kv_growth}


def test_recurrent_stream_peak_memory_does_not_grow_with_context():
    """Measured in a fresh process: the peak RSS of a long pytest process moves with whatever
    earlier tests' threads (Ray, gRPC, simulations) still allocate."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    code = "import json; from tests.test_fednl_app import stream_peaks; print(json.dumps(stream_peaks()))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["kv"] >= 0.8 * result["kv_expected"], result  # the measurement sees the KV cache grow
    assert min(result["fednl"]) <= 0.15 * result["kv_expected"], result  # the recurrent form's peak does not


# --------------------------------------------------------------------------- NIAH as a federated task
@pytest.fixture(scope="module")
def niah_cfg():
    return compose(["task.train_per_template=3", "task.test_per_template=4", "task.train_lengths=[640]",
                    "task.test_lengths=[640,768]", "eval.batch_size=2"], preset="test", task="niah",
                   algorithm="fednl")


def test_niah_natural_split_gives_each_of_seven_clients_one_template(niah_cfg):
    _, tokenizer = build_model(niah_cfg)
    tasks = [make_task(niah_cfg, pid, 7, tokenizer) for pid in range(7)]
    assert [t.templates for t in tasks] == [[name] for name in niah_cfg.task.templates]
    assert all(t.num_train == 3 and t.num_test == 4 for t in tasks)
    two = [make_task(niah_cfg, pid, 2, tokenizer) for pid in range(2)]
    assert sorted(sum((t.templates for t in two), [])) == sorted(niah_cfg.task.templates)


def test_niah_examples_have_needles_at_their_depths_and_one_right_choice(niah_cfg):
    _, tokenizer = build_model(niah_cfg)
    task = make_task(niah_cfg, 0, 7, tokenizer)
    for index in [*task.train_idx, *task.test_idx]:
        ex = task.example(index)
        assert ex["num_tokens"] <= ex["length_tokens"] and ex["target_depths"] == DEPTHS
        assert max(abs(d - t) for d, t in zip(ex["needle_depths"], DEPTHS)) < 0.06
        assert [c == ex["answer"] for c in ex["choices"]].count(True) == 1
        assert ex["choices"][LETTERS.index(ex["answer_letter"])] == ex["answer"]
        for needle, (start, end) in zip(ex["needles"], ex["needle_positions"]):
            assert ex["prompt"][start:end] == needle
    batch = task.collate(task.test_idx)
    assert batch["length"].tolist() == [640, 768, 640, 768]  # balanced over the test lengths
    last_tokens = batch["input_ids"][torch.arange(4), batch["last"]]
    assert tokenizer.decode(last_tokens[:1]).endswith(":")  # the prompt ends with "Answer:"
    assert all(0 <= a < 4 for a in batch["answer"].tolist())


def test_niah_splits_are_reproducible_and_disjoint(niah_cfg):
    _, tokenizer = build_model(niah_cfg)
    first, again = make_task(niah_cfg, 3, 7, tokenizer), make_task(niah_cfg, 3, 7, tokenizer)
    prompts = [first.example(i)["prompt"] for i in [*first.train_idx, *first.test_idx]]
    assert prompts == [again.example(i)["prompt"] for i in [*again.train_idx, *again.test_idx]]
    assert len(set(prompts)) == len(prompts)  # no test haystack is a training one
    other_seed = compose(["seed=7", "task.train_per_template=3", "task.test_per_template=4",
                          "task.train_lengths=[640]", "task.test_lengths=[640,768]"], preset="test", task="niah")
    changed = make_task(other_seed, 3, 7, tokenizer)
    assert changed.example(changed.train_idx[0])["prompt"] != prompts[0]


def test_niah_evaluation_reports_accuracy_per_length(niah_cfg):
    model, tokenizer, _ = fednl.prepare(niah_cfg)
    task = make_task(niah_cfg, 0, 7, tokenizer)
    metrics = task.evaluate(model, 2, 0)
    assert metrics["num-examples"] == 4
    assert set(metrics) == {"accuracy", "loss", "num-examples", "accuracy-640", "accuracy-768"}
    loss = task.loss(model, task.collate(task.train_idx[:2]))
    assert torch.isfinite(loss) and loss.requires_grad


def test_bad_niah_settings_fail_clearly(niah_cfg):
    from clients.tasks import TaskError

    _, tokenizer = build_model(niah_cfg)
    for override, match in (("task.templates=[passkey,haystack]", "templates"), ("task.test_lengths=[]", "test_lengths"),
                            ("task.train_per_template=0", "train_per_template"),
                            ("task.train_lengths=[200]", "train_lengths: length_tokens=200 is too short")):
        cfg = compose([override], preset="test", task="niah")
        with pytest.raises(TaskError, match=match):
            make_task(cfg, 0, 1, tokenizer)


# --------------------------------------------------------------------------- streaming diagnostics
def test_kv_cache_stream_scores_like_one_forward_and_bins_are_relative():
    cfg = fednl_cfg()
    backbone, tokenizer = build_model(cfg)
    ids = torch.randint(0, len(tokenizer), (1, 150), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = backbone(input_ids=ids).logits
    expected = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="none")
    streamer = KVCacheStreamer(backbone, block=40)
    nll = streamed_nll(streamer, ids)
    assert nll.shape == (1, 149) and (nll[0] - expected).abs().max() <= 1e-4
    assert streamer.state_bytes() == 2 * 2 * 2 * 16 * 150 * 4  # layers x (K, V) x kv heads x d x tokens x 4 B

    flat = torch.cat([torch.full((10,), 2.0), torch.full((10,), 1.0), torch.full((5,), 9.0)])
    assert binned_nll(flat, 10) == [2.0, 1.0]  # the partial bin is dropped
    assert relative_ce(flat, 10) == [1.0, 0.5]
    with pytest.raises(ValueError, match="no complete bin"):
        relative_ce(flat, 1024)


# --------------------------------------------------------------------------- whole runs (inprocess.run)
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["meta-rules", "gate"])
def test_fednl_simulation_learns_in_both_payload_modes(mode, outputs):
    from inprocess import run as simulate  # run_server in this process (#40: no Ray start)

    summary = simulate(fednl_cfg(mode=mode))
    rounds = read_metrics(summary["run_dir"])
    assert [r["round"] for r in rounds] == [0, 1, 2, 3] and summary["refused_replies"] == 0
    assert mean_train_loss(rounds[3]) < mean_train_loss(rounds[1])
    assert rounds[3]["eval"]["perplexity"] < rounds[0]["eval"]["perplexity"]
    values = GATE_THETA + (LORA_THETA if mode == "meta-rules" else 0)
    assert {c["uplink_payload_bytes"] for r in rounds[1:] for c in r["clients"]} == {4 * values}
    assert all(len(r["gate_alpha"]) == LAYERS for r in rounds[1:])
    assert all("train_local-perplexity" in c for r in rounds[1:] for c in r["clients"])  # aggregation drop
    assert summary["payload_mode"] == mode and summary["final_state"].endswith("fednl_theta.safetensors")
    model, _ = fednl.load_final(fednl_cfg(mode=mode), summary["final_state"])
    assert gate_alpha({n: p.detach().numpy() for n, p in model.named_parameters() if "fednl_gate" in n}) == \
        pytest.approx(summary["final_gate_alpha"])
    if mode == "meta-rules":  # (in mode 'gate' each client keeps its own LoRA: no single final model)
        from fedapps.final import load_run
        from fedapps.method import FinalStateError

        final = load_run(summary["run_dir"])
        assert final.evaluate()["aggregate"]["perplexity"] == pytest.approx(summary["final_metric"], rel=1e-6)
        with pytest.raises(FinalStateError, match="delta-rule memory is part of no Hugging Face architecture"):
            final.export(outputs / "merged")


@pytest.mark.slow
def test_fednl_on_niah_runs_and_reports_accuracy_per_length(outputs):
    from inprocess import run as simulate  # run_server in this process (#40: no Ray start)

    cfg = compose(["rounds=1", "train.local_steps=2", "train.batch_size=2", "task.train_per_template=2",
                   "task.test_per_template=2", "task.train_lengths=[640]", "task.test_lengths=[640,768]",
                   "eval.batch_size=2", "algorithm.memory.window=128"], preset="test", task="niah", algorithm="fednl")
    summary = simulate(cfg)  # 2 clients: the seven templates grouped round-robin
    final = read_metrics(summary["run_dir"])[-1]
    assert summary["refused_replies"] == 0
    assert {"accuracy", "accuracy-640", "accuracy-768"} <= set(final["eval"])
    assert all(0.0 <= c["eval_accuracy"] <= 1.0 for c in final["clients"])


def test_the_memory_ablation_is_the_backbone_bit_for_bit_and_trains_everything_but_the_gate():
    """algorithm.ablate_memory: α = 0 exactly and frozen (the memory path adds nothing), the rest of θ as
    in FedNL: the model's output is the backbone's (+ its zero-initialised LoRA), bit for bit."""
    from clients.train import local_train

    cfg = fednl_cfg("algorithm.ablate_memory=true", "train.local_steps=2")
    model, tok, extra = fednl.prepare(cfg)
    backbone, _ = build_model(cfg)
    ids = torch.arange(1, 33)[None]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, backbone(ids).logits)
    assert fednl.gate_metrics(model)["gate-alpha-max"] == 0.0
    gates = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("fednl_gate")}
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    assert gates and all(not p.requires_grad for n, p in model.named_parameters() if n in gates)
    assert not set(gates) & set(extra["names"])  # fixed on every side: not federated
    local_train(model, make_task(cfg, 0, 2, tok), cfg.train, seed=0)
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], v) for n, v in gates.items())
    assert any(not torch.equal(params[n], v) for n, v in lora.items())


def test_the_ablation_is_blind_to_the_memorys_settings():
    """The ablated model computes and trains the same whatever the memory's settings (bench.fednl's
    retrieval tuning carried the ablation's runs over when FedNL's memory moved to fewer layers)."""
    from clients.train import local_train

    memory = ("algorithm.memory.key_centering=true", "algorithm.memory.qk_activation=identity",
              "algorithm.memory.gate_init_logit=-2.0", "algorithm.lr.gate=0.1", "algorithm.memory.layers=[1]")
    models, logits = [], []
    for extra in ((), memory):
        cfg = fednl_cfg("algorithm.ablate_memory=true", "algorithm.memory.window=8", "train.local_steps=2", *extra)
        model, tok, _ = fednl.prepare(cfg)
        local_train(model, make_task(cfg, 0, 2, tok), cfg.train, seed=0)
        with torch.no_grad():
            logits.append(model(torch.arange(1, 33)[None]).logits)
        models.append({n: p for n, p in model.named_parameters() if "lora_" in n})
    assert torch.equal(logits[0], logits[1])
    assert models[0].keys() == models[1].keys() and all(torch.equal(models[0][n], models[1][n]) for n in models[0])


def test_eval_local_last_scores_the_local_model_in_the_last_round_only():
    """algorithm.eval_local=last: the aggregation drop's local score costs one evaluation a run, not one a
    round (bench.fednl's retrieval comparison); any other value than true / false / last is refused."""
    from flwr.app import ArrayRecord

    from fedapps.method import ClientCall

    cfg = fednl_cfg("rounds=3", "algorithm.eval_local=last")
    rounds = [ClientCall(message(cfg, ArrayRecord(), "train", r, 11), context(11, 0), cfg, None).scores_local
              for r in (1, 2, 3)]
    assert rounds == [False, False, True]
    every = fednl_cfg("rounds=3", "algorithm.eval_local=true")
    assert ClientCall(message(every, ArrayRecord(), "train", 1, 11), context(11, 0), every, None).scores_local
    with pytest.raises(ConfigError, match="eval_local must be true, false or last"):
        fednl_cfg("algorithm.eval_local=sometimes")


def test_the_ablations_replies_pass_the_server_and_keep_the_memory_off():
    """A federated round of the ablation: the client's reply (θ without the fixed gates) is accepted
    by the server's checks (the gates' -100 logit was refused before, beyond ±30: every reply), and
    the model rebuilt from the run's final θ still has α = 0."""
    cfg = fednl_cfg("algorithm.ablate_memory=true", "train.local_steps=1", "algorithm.eval_local=false")
    strategy = strategy_for(cfg)
    assert not any(k.endswith("fednl_gate") for k in strategy.global_state)
    out = answer(message(cfg, strategy.downlink_arrays(), "train", 1, 11), context(11, 0))
    sent = codec.decode(out.content["arrays"])
    assert sum(v.size for v in sent.values()) == GATE_THETA - LAYERS + LORA_THETA  # θ less one logit a layer
    tensors, num_examples = strategy.validate_reply(out)
    assert num_examples > 0 and set(tensors) == set(strategy.uplink_keys)
    strategy.check_values(tensors)  # within every bound
    model, _, _ = fednl.prepare(cfg)
    fednl.load_theta(model, out.content["arrays"])
    assert fednl.gate_metrics(model)["gate-alpha-max"] == 0.0


def test_separate_learning_rates_for_the_gate_beta_and_lora():
    from clients.train import parameter_groups

    cfg = fednl_cfg("algorithm.lr.gate=0.05", "algorithm.lr.beta=0.01")
    from fedapps.method import learning_rates

    rates = learning_rates(cfg, fednl.LR_PATTERNS)
    assert rates == {"fednl_gate": 0.05, "fednl_beta": 0.01}
    model, _, _ = fednl.prepare(cfg)
    groups = {g["lr"]: g["params"] for g in parameter_groups(model, float(cfg.train.lr), rates)}
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(groups) == sorted([0.05, 0.01, float(cfg.train.lr)])
    assert all(names[id(p)].endswith("fednl_gate") for p in groups[0.05])
    assert all("fednl_beta" in names[id(p)] for p in groups[0.01])
    assert all("lora_" in names[id(p)] for p in groups[float(cfg.train.lr)])
    # one learning rate: one group, in the parameters' own order (the optimiser as before)
    (single,) = parameter_groups(model, 1e-3)
    assert [id(p) for p in single["params"]] == [id(p) for p in model.parameters() if p.requires_grad]
    from fedapps.config import ConfigError, finalize

    with pytest.raises(ConfigError, match=r"algorithm.lr.gate must be null \(= train.lr\) or a number > 0"):
        finalize(fednl_cfg("algorithm.lr.gate=-1"))
