"""SmartFed wired into Flower: strategy, client mixture, pool CLI, and tiny simulations.

Fast tests check the strategy on a synthetic layout (validation, sparse aggregation,
EEQA re-allocation), the client's mixture round trip, and the pool commands' refusals.
The slow ones (marked) build a tiny knowledge pool from two short federated LoRA runs on
the tiny Llama, then run SmartFed on Shakespeare plays that are not in the pool.
"""

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ConfigRecord, Message, MetricRecord, RecordDict

from clients.smartfed.more import MoREConfig, active_state, importance_state, more_modules
from clients.pool import Pool
from postcard import pool as pool_cli
from fedapps.config import compose
from fedapps.outputs import mean_train_loss, read_metrics
from strategies import codec, sparse
from strategies.eeqa import EEQA
from strategies.expert_state import ExpertState
from strategies.smartfed import BACKBONE_KEY, SmartFedStrategy, prior_importance

torch.set_num_threads(1)

Q, V = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"


# ---------------------------------------------------------------------------- strategy
def synthetic_state(mode="experts+router"):
    rng = np.random.default_rng(0)
    layout = sparse.ExpertLayout(
        {Q: sparse.MatrixLayout(4, 4, [f"a:{i}" for i in range(6)]), V: sparse.MatrixLayout(4, 2, [f"a:{i}" for i in range(4)])},
        train_experts=mode == "experts+router",
    )
    experts = {
        m: (rng.standard_normal((ml.num_experts, ml.d_in)), rng.standard_normal((ml.d_out, ml.num_experts)))
        for m, ml in layout.matrices.items()
    }
    # make Q's experts 4 and 5 clearly the largest pooled updates
    experts[Q][1][:, 4:] *= 10
    return ExpertState.initial(layout, experts, router_seed=0, router_std=0.1)


def make_strategy(mode="experts+router", budget=4, **kw):
    state = synthetic_state(mode)
    records = []
    eeqa = EEQA(state.layout.num_experts, budget, min_per_matrix=1)
    strategy = SmartFedStrategy(
        state=state, eeqa=eeqa, backbone_fingerprint="f" * 16, config_yaml="a: 1\n", num_clients=2,
        on_round_end=records.append, **kw,
    )
    return strategy, records


def reply(node_id, arrays, num_examples=10):
    request = Message(RecordDict({}), dst_node_id=node_id, message_type="train")
    content = RecordDict({"metrics": MetricRecord({"num-examples": num_examples, "loss": 1.0})})
    if arrays is not None:
        content["arrays"] = arrays
    return Message(content, reply_to=request)


def update_for(strategy, scale=0.5, importance=1.0, **replace):
    """A well-formed update: every active expert moved by `scale`, importance reported."""
    tensors = {}
    for m, ids in strategy.allocation.active.items():
        ml = strategy.expert_layout[m]
        k = len(ids)
        tensors[f"{m}/ids"] = np.asarray(ids, np.float32)
        tensors[f"{m}/router"] = np.full((k, ml.d_in), scale, np.float32)
        if strategy.expert_layout.train_experts:
            tensors[f"{m}/A"] = np.full((k, ml.d_in), scale, np.float32)
            tensors[f"{m}/B"] = np.full((k, ml.d_out), scale, np.float32)
        tensors[f"{m}/importance"] = sparse.importance_report(ids, np.full(k, importance))
    tensors.update(replace)
    return tensors


def test_first_allocation_activates_the_largest_pooled_experts_within_the_budget():
    strategy, _ = make_strategy(budget=4)
    active = strategy.allocation.active
    assert strategy.allocation.total == 4 and sum(len(v) for v in active.values()) == 4
    assert strategy.allocation.quotas == {Q: 2, V: 2}  # shared by expert counts 6:4, largest remainder
    prior = prior_importance(strategy.state)
    assert list(active[Q]) == [4, 5]  # the experts with the largest pooled update, not the first ones
    assert set(active[V]) == set(np.argsort(-prior[V])[:2])


def test_downlink_carries_only_the_active_experts_and_the_backbone_fingerprint():
    strategy, _ = make_strategy(budget=4)
    parts = sparse.decode(strategy.downlink_arrays(), strategy.expert_layout, kind="state")
    assert {m: p.ids.tolist() for m, p in parts.items()} == {m: list(v) for m, v in strategy.allocation.active.items()}
    np.testing.assert_array_equal(parts[Q].A, strategy.state.A[Q][parts[Q].ids])
    config = ConfigRecord()
    strategy._tag(config)
    assert config[BACKBONE_KEY] == "f" * 16


def test_sparse_aggregation_moves_only_updated_experts_and_reallocates():
    from strategies.robust import Robustness

    strategy, records = make_strategy(budget=4, robustness=Robustness.off())  # robust=off: the exact weighted mean
    before = strategy.state.copy()
    sent = {m: list(v) for m, v in strategy.allocation.active.items()}
    a = codec.encode(update_for(strategy, scale=1.0))
    b = codec.encode(update_for(strategy, scale=4.0))
    arrays, _ = strategy.aggregate_train(1, [reply(1, a, 10), reply(2, b, 30)])
    assert arrays is not None
    for m, ids in sent.items():
        np.testing.assert_allclose(strategy.state.A[m][ids], before.A[m][ids] + 3.25, rtol=1e-6)
        others = np.setdiff1d(np.arange(strategy.expert_layout[m].num_experts), ids)
        np.testing.assert_array_equal(strategy.state.A[m][others], before.A[m][others])
    # the global state the runner saves follows the expert state
    np.testing.assert_array_equal(strategy.global_state[f"{Q}/A"], strategy.state.A[Q])
    record = strategy.round_record()
    assert record["smartfed"]["experts_updated"] == 4 and record["smartfed"]["active_experts"] == 4
    assert record["clients"]["1"]["uplink_experts"] == 4
    assert record["clients"]["1"]["uplink_payload_bytes"] == codec.payload_bytes(a)
    assert strategy.eeqa.rounds == 2  # the first allocation and this round's


def test_a_resumed_strategy_continues_with_the_same_experts_quotas_and_eeqa_memory(tmp_path):
    """state_dict -> checkpoint.npz -> a fresh strategy: the next round sees what the old one would."""
    from fedapps import checkpoint as ckpt
    from fedapps.config import compose

    strategy, _ = make_strategy(budget=4)
    strategy.aggregate_train(1, [reply(1, codec.encode(update_for(strategy, 1.0, importance=0.5)), 10),
                                 reply(2, codec.encode(update_for(strategy, 2.0, importance=3.0)), 30)])
    arrays, meta = strategy.state_dict()
    ckpt.save(tmp_path, server_round=1, cfg=compose(preset="test", algorithm="smartfed"), arrays=arrays, meta=meta)
    saved = ckpt.load(tmp_path)
    resumed, _ = make_strategy(budget=4)
    resumed.load_state_dict(saved.arrays, saved.meta)
    assert resumed.active_sets() == strategy.active_sets()
    assert resumed.allocation.quotas == strategy.allocation.quotas
    assert resumed.eeqa.state_dict() == strategy.eeqa.state_dict()
    for m in strategy.expert_layout:
        np.testing.assert_array_equal(resumed.state.A[m], strategy.state.A[m])
        np.testing.assert_array_equal(resumed.state.router[m], strategy.state.router[m])
    np.testing.assert_array_equal(codec.decode(resumed.downlink_arrays())[f"{Q}/A"],
                                  codec.decode(strategy.downlink_arrays())[f"{Q}/A"])
    other, _ = make_strategy(budget=4)
    other.backbone_fingerprint = "e" * 16
    with pytest.raises(ValueError, match="backbone fingerprint"):
        other.load_state_dict(saved.arrays, saved.meta)


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda s, u: u.update({f"{Q}/ids": np.array([99] + list(u[f"{Q}/ids"][1:]), np.float32)}), "unknown expert id"),
        (lambda s, u: u.update({f"{Q}/A": np.ones((len(u[f"{Q}/ids"]), 5), np.float32)}), "has shape"),
        (lambda s, u: u.update({f"{Q}/B": np.full((len(u[f"{Q}/ids"]), 4), np.nan, np.float32)}), "NaN or Inf"),
        (lambda s, u: u.update({"model.layers.9.mlp.up_proj/ids": np.zeros(1, np.float32)}), "unknown matrix"),
        (lambda s, u: u.update({f"{Q}/ids": np.arange(6, dtype=np.float32), f"{Q}/router": np.zeros((6, 4), np.float32),
                                f"{Q}/A": np.zeros((6, 4), np.float32), f"{Q}/B": np.zeros((6, 4), np.float32)}),
         "budget overrun"),
    ],
)
def test_bad_payloads_are_refused_with_a_reason_and_leave_the_state(change, reason):
    strategy, _ = make_strategy(budget=4)
    before = strategy.state.copy()
    good = update_for(strategy)
    bad = dict(good)
    change(strategy, bad)
    # NaN cannot pass the codec's encoder: build such a record by hand
    record = codec.encode({k: np.nan_to_num(v) for k, v in bad.items()})
    for key, value in bad.items():
        if np.isnan(value).any():
            record[key] = Array(dtype="float32", shape=value.shape, stype=codec.FP32,
                                data=np.ascontiguousarray(value, "<f4").tobytes())
    strategy.aggregate_train(1, [reply(1, record)])
    refused = strategy.round_record()["refused"]
    assert len(refused) == 1 and reason in refused[0]["reason"], refused
    for m in strategy.expert_layout:
        np.testing.assert_array_equal(strategy.state.A[m], before.A[m])
        np.testing.assert_array_equal(strategy.state.router[m], before.router[m])


def test_router_only_replies_may_not_carry_expert_updates():
    strategy, _ = make_strategy("router-only", budget=4)
    assert all(k.endswith("/router") for k in strategy.uplink_keys)
    good = update_for(strategy)
    bad = dict(good, **{f"{Q}/A": np.zeros((len(good[f"{Q}/ids"]), 4), np.float32)})
    strategy.aggregate_train(1, [reply(1, codec.encode(bad)), reply(2, codec.encode(good))])
    assert ["router-only" in r["reason"] for r in strategy.round_record()["refused"]] == [True]
    assert strategy.round_record()["clients"]["2"]["uplink_experts"] == 4


def test_unmeasured_weight_lets_trained_experts_stay_active():
    neutral = EEQA({"a": 4}, budget=2)  # w = 1: never-measured experts count as the mean
    neutral.step()
    assert neutral.step({"a": np.array([3.0, 1.0, np.nan, np.nan])}).active["a"].tolist() == [0, 2]
    sticky = EEQA({"a": 4}, budget=2, unmeasured_weight=0.25)  # they count as 0.25 x the mean
    sticky.step()
    alloc = sticky.step({"a": np.array([3.0, 1.0, np.nan, np.nan])})
    assert alloc.active["a"].tolist() == [0, 1] and alloc.importance["a"].tolist() == [3.0, 1.0, 0.5, 0.5]
    with pytest.raises(ValueError, match="unmeasured_weight"):
        EEQA({"a": 4}, budget=2, unmeasured_weight=0)


# ---------------------------------------------------------------------------- client side
@pytest.fixture(scope="module")
def tiny():
    from clients.models.llm import load_causal_lm

    cfg = compose(algorithm="smartfed", preset="test")
    model, tok = load_causal_lm(cfg.model, seed=int(cfg.seed))
    return cfg, model, tok


def test_client_mixture_holds_only_the_downlink_experts_and_replies_in_layout_ids(tiny):
    from clients.smartfed.more import load_mixture, to_layout_ids

    cfg, model, _ = tiny
    model = copy.deepcopy(model)
    rng = np.random.default_rng(1)
    q, v = "model.layers.1.self_attn.q_proj", "model.layers.0.self_attn.v_proj"
    downlink = {
        f"{q}/ids": np.array([3, 17], np.float32), f"{q}/router": rng.normal(size=(2, 64)).astype(np.float32),
        f"{q}/A": rng.normal(size=(2, 64)).astype(np.float32), f"{q}/B": rng.normal(size=(2, 64)).astype(np.float32),
        f"{v}/ids": np.array([5], np.float32), f"{v}/router": np.zeros((1, 64), np.float32),
        f"{v}/A": rng.normal(size=(1, 64)).astype(np.float32), f"{v}/B": rng.normal(size=(1, 32)).astype(np.float32),
    }
    ids = load_mixture(model, downlink, MoREConfig(top_k=2))
    layers = more_modules(model)
    assert sorted(layers) == sorted([q, v]) and layers[q].num_experts == 2  # not the whole pool
    state = active_state(model)
    np.testing.assert_array_equal(state[f"{q}/A"], downlink[f"{q}/A"])
    np.testing.assert_array_equal(state[f"{q}/router"], downlink[f"{q}/router"])
    tokens = torch.randint(0, 1000, (2, 8))
    model(input_ids=tokens).logits.sum().backward()  # a training forward measures importance
    update = to_layout_ids({f"{q}/ids": np.array([1]), f"{q}/router": np.ones((1, 64), np.float32)}
                           | importance_state(model), ids)
    assert update[f"{q}/ids"].tolist() == [17]
    assert update[f"{q}/importance"][0].tolist() == [3, 17] and update[f"{v}/importance"][0].tolist() == [5]
    # a new downlink replaces the layers (and a smaller one removes the others)
    load_mixture(model, {k: val for k, val in downlink.items() if k.startswith(v)}, MoREConfig(top_k=2))
    assert list(more_modules(model)) == [v]


def test_missing_or_empty_pool_names_the_build_command(tiny, tmp_path):
    from clients.pool import PoolError
    from fedapps.smartfed import plan_server

    cfg, model, _ = tiny
    for overrides in ([f"algorithm.pool={tmp_path / 'nowhere'}"], [f"algorithm.pool={tmp_path / 'empty'}"]):
        if "empty" in overrides[0]:
            Pool(tmp_path / "empty", backbone=model)
        with pytest.raises(PoolError, match="postcard pool build"):
            plan_server(compose(overrides, algorithm="smartfed", preset="test"), on_round_end=None, config_yaml="")


def test_a_run_without_its_pool_is_refused_before_it_is_submitted(tiny, tmp_path, capsys):
    """#60: SmartFed without a pool was refused by its server, 36 s after `postcard` submitted it. The server's
    check (require_pool) is made before submitting, by finalize (`postcard`, postcard.app_run): one line naming
    the fix, exit 2, no run folder. Composing a config to look at it (compose, `postcard --cfg job`) is not
    refused, and a wrong setting is named before the pool."""
    from inprocess import fake_pool

    from clients.pool import PoolError
    from fedapps.config import ConfigError, finalize
    from fedapps.smartfed import plan_server
    from postcard import app_run

    cfg, model, _ = tiny
    nowhere = tmp_path / "nowhere"
    composed = compose([f"algorithm.pool={nowhere}"], algorithm="smartfed", preset="test")  # to look at: composes
    with pytest.raises(ConfigError) as err:
        finalize(composed)
    message = str(err.value)
    assert message == (f"no knowledge pool at {nowhere}: fill it first with `postcard pool build --pool {nowhere} "
                       f"model=tiny-llama seed=42` (or `postcard pool add RUN_DIR --pool {nowhere}` for a LoRA run of "
                       "this model), or point algorithm.pool=DIR at an existing pool")
    with pytest.raises(PoolError) as server:  # the server's own check: the same function, the same line
        plan_server(composed, on_round_end=None, config_yaml="")
    assert str(server.value) == message
    runs = tmp_path / "runs"
    status = app_run.main([str(app_run.ROOT), "--run-config", f"algorithm='smartfed' preset='test' "
                           f"output-dir='{runs}' overrides='algorithm.pool={nowhere}'"])
    assert status == 2 and capsys.readouterr().err == f"postcard.app_run: {message}\n"
    assert not runs.exists()
    # a setting's own error first; then an empty pool, a pool.json that does not read, an adapter it lacks
    with pytest.raises(ConfigError, match="top_k must be >= 1"):
        compose([f"algorithm.pool={nowhere}", "algorithm.top_k=0"], algorithm="smartfed", preset="test", ready=True)
    Pool(tmp_path / "empty", backbone=model)
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "pool.json").write_text("{")
    pool = fake_pool(tmp_path / "fake", model)
    for overrides, reason in (([f"algorithm.pool={tmp_path / 'empty'}"], "holds no adapter: fill it with `postcard pool"
                                                                         " build --pool"),
                              ([f"algorithm.pool={tmp_path / 'garbled'}"], "pool.json does not read"),
                              ([f"algorithm.pool={pool}", "algorithm.adapters=[other]"], "algorithm.adapters names "
                                                                                         "['other'], which the pool")):
        with pytest.raises(ConfigError, match=reason.replace("[", r"\[").replace("(", r"\(")) as err:
            compose(overrides, algorithm="smartfed", preset="test", ready=True)
        assert "\n" not in str(err.value)
    assert finalize(compose([f"algorithm.pool={pool}"], algorithm="smartfed", preset="test")).algorithm.pool == pool


def _fake_lora_run(folder, cfg, model):
    """A run folder as a LoRA run leaves it: config.yaml, summary.json, adapter/."""
    from clients.adapters import apply_lora
    from fedapps.config import to_yaml

    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(to_yaml(cfg))
    (folder / "summary.json").write_text(json.dumps({"metric": "perplexity", "initial_metric": 9.0, "final_metric": 8.0}))
    peft_model = apply_lora(copy.deepcopy(model), cfg.algorithm.lora, seed=0)
    peft_model.save_pretrained(str(folder / "adapter"))


def test_pool_add_and_list_and_foreign_backbone_refusal(tiny, tmp_path, capsys):
    from clients.models.llm import load_causal_lm

    cfg, model, _ = tiny
    lora = compose(["algorithm.lora.target_modules=[q_proj,v_proj]"], preset="test")
    _fake_lora_run(tmp_path / "run-a", lora, model)
    pool = tmp_path / "pool"
    assert pool_cli.main(["add", str(tmp_path / "run-a"), "--pool", str(pool), "--name", "run-a"]) == 0
    record = Pool(pool).provenance("run-a")
    assert record["source_run"] == str(tmp_path / "run-a") and record["task"] == "shakespeare"
    assert record["backbone"] == {"model": "tiny-llama", "path": None, "seed": int(cfg.seed)}
    assert record["final_metric"] == 8.0 and record["num_experts"] == 2 * 2 * 8

    other = compose(["algorithm.lora.target_modules=[q_proj,v_proj]", "model.random_init.hidden_size=32"], preset="test")
    other_model, _ = load_causal_lm(other.model, seed=int(other.seed))
    _fake_lora_run(tmp_path / "run-b", other, other_model)
    capsys.readouterr()
    assert pool_cli.main(["add", str(tmp_path / "run-b"), "--pool", str(pool)]) == 2
    assert "another backbone" in capsys.readouterr().err
    # the same shapes but another random init (seed) is refused too
    _fake_lora_run(tmp_path / "run-c", compose(["algorithm.lora.target_modules=[q_proj,v_proj]", "seed=7"],
                                               preset="test"), model)
    assert pool_cli.main(["add", str(tmp_path / "run-c"), "--pool", str(pool)]) == 2
    assert "seed" in capsys.readouterr().err

    assert pool_cli.main(["list", "--pool", str(pool)]) == 0
    out = capsys.readouterr().out
    assert "run-a" in out and "32 rank-1 experts" in out
    assert pool_cli.main(["list", "--pool", str(tmp_path / "nothing")]) == 2
    assert "postcard pool build" in capsys.readouterr().err


# ---------------------------------------------------------------------------- simulations
SOURCES = ["shakespeare-histories", "shakespeare-comedies"]  # conftest.SMARTFED_SOURCES (the demo's)


@pytest.fixture
def tiny_pool(tiny_llama_pool):
    """Two short federated LoRA runs on the tiny Llama (other plays than the target task's), built by
    `postcard pool build` once per session (tests/conftest.py; test_demo reads a copy of it too)."""
    return tiny_llama_pool


@pytest.mark.slow
def test_pool_build_creates_adapters_with_provenance(tiny_pool):
    pool_path, added, root = tiny_pool
    assert added == SOURCES
    pool = Pool(pool_path)
    assert pool.names() == sorted(SOURCES)
    for record in pool.list():
        assert record["source"] in SOURCES and record["task"] == "shakespeare"
        assert record["algorithm"] == "fedavg-lora" and record["rank"] == 8
        assert (root / "runs").resolve() in Path(record["source_run"]).parents
        assert (Path(record["source_run"]) / "adapter").is_dir()
        assert record["backbone"]["model"] == "tiny-llama" and record["backbone_fingerprint"] == pool.fingerprint
        assert set(record["data"]["plays"]).isdisjoint(compose(preset="test").task.plays)
    # building again skips what is there
    assert pool_cli.build(SOURCES, ["preset=test", "rounds=1", f"output_dir={root / 'runs'}"], pool=pool_path) == []


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["experts+router", "router-only"])
def test_smartfed_learns_over_three_rounds(tiny_pool, mode, outputs):
    from clients.models.llm import load_causal_lm
    from clients.tasks import make_task
    from clients.train import evaluate
    from inprocess import run as simulate  # run_server in this process (#40: no Ray start)
    from fedapps.smartfed import load_run_mixture

    pool_path, _, _ = tiny_pool
    overrides = [f"algorithm.pool={pool_path}", f"algorithm.mode={mode}"]
    if mode == "router-only":
        # Routers only re-weight frozen experts: a small effect per round, which EEQA moving
        # experts between matrices would blur. Pin the quotas (2 per matrix, top-2, so the
        # routers set every gate) and keep measured experts: only the routers change the model.
        overrides += ["train.lr=3e-2", "algorithm.budget_per_matrix=2", "algorithm.min_per_matrix=2",
                      "algorithm.max_per_matrix=2", "algorithm.unmeasured_weight=0.1"]
    cfg = compose(overrides, algorithm="smartfed", preset="test")
    summary = simulate(cfg)
    rounds = read_metrics(summary["run_dir"])
    assert [r["round"] for r in rounds] == [0, 1, 2, 3]
    assert summary["refused_replies"] == 0
    held_out = [r["eval"]["loss"] for r in rounds]
    if mode == "experts+router":
        assert mean_train_loss(rounds[3]) < mean_train_loss(rounds[1])
        assert held_out[3] < held_out[0]
    else:
        # the held-out loss falls every round; training losses of different rounds come from
        # different batches, whose spread is larger than what routers gain in a round
        assert held_out[0] > held_out[1] > held_out[2] > held_out[3]

    budget = summary["smartfed"]["budget"]
    for r in rounds[1:]:
        assert r["smartfed"]["active_experts"] == budget
        for c in r["clients"]:
            assert 0 < c["uplink_experts"] <= budget
    # per expert at most: id + importance (12 bytes), router row, and A row + B column unless
    # router-only (d_in, d_out <= 128 on the tiny Llama); fedavg-lora sends 65,536 bytes
    per_expert = 12 + 4 * (3 * 128 if mode == "experts+router" else 128)
    assert summary["uplink_bytes_per_client_round"] <= budget * per_expert < 65536
    if mode == "experts+router":
        # the saved mixture reproduces the final evaluation
        model, tok = load_causal_lm(cfg.model, seed=int(cfg.seed))
        load_run_mixture(model, summary["run_dir"], cfg)
        metrics = evaluate(model, make_task(cfg, 0, 2, tok), cfg.eval)
        assert metrics["perplexity"] == pytest.approx(summary["final_client_metrics"]["0"], rel=1e-4)
        from fedapps.final import load_run

        final = load_run(summary["run_dir"])  # the same, as one call, over every client's split
        assert final.evaluate()["aggregate"]["perplexity"] == pytest.approx(summary["final_metric"], rel=1e-4)


def test_experts_and_routers_get_learning_rates_of_their_own(tiny):
    from clients.smartfed.more import load_mixture
    from clients.train import parameter_groups
    from fedapps.method import learning_rates
    from fedapps.smartfed import LR_PATTERNS

    _, model, _ = tiny
    model = copy.deepcopy(model)
    q = "model.layers.1.self_attn.q_proj"
    rng = np.random.default_rng(1)
    load_mixture(model, {f"{q}/ids": np.array([3, 17], np.float32), f"{q}/router": np.zeros((2, 64), np.float32),
                         f"{q}/A": rng.normal(size=(2, 64)).astype(np.float32),
                         f"{q}/B": rng.normal(size=(2, 64)).astype(np.float32)}, MoREConfig(top_k=2))
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {g["lr"]: sorted(names[id(p)].rsplit(".", 1)[-1] for p in g["params"])
              for g in parameter_groups(model, 3e-4, {"expert_": 1e-3, "router": 3e-2})}
    assert groups == {1e-3: ["expert_A", "expert_B"], 3e-2: ["router"]}

    cfg = compose(["algorithm.lr.router=0.03"], algorithm="smartfed", preset="test")
    assert learning_rates(cfg, LR_PATTERNS) == {"router": 0.03}
    cfg = compose(["algorithm.lr.experts=0.001", "algorithm.lr.router=0.03"], algorithm="smartfed", preset="test")
    assert learning_rates(cfg, LR_PATTERNS) == {"expert_": 0.001, "router": 0.03}


def test_router_rounds_freezes_the_routers_from_the_next_round(tiny, tmp_path):
    from fedapps.config import ConfigError
    from fedapps.smartfed import plan_server
    from inprocess import context, fake_pool, train_round
    from strategies.codec import PayloadError

    _, model, _ = tiny
    with pytest.raises(ConfigError, match="router-only trains nothing else"):
        compose(["algorithm.router_rounds=1", "algorithm.mode=router-only"], algorithm="smartfed", preset="test")
    with pytest.raises(ConfigError, match="router_rounds must be null"):
        compose(["algorithm.router_rounds=0"], algorithm="smartfed", preset="test")
    cfg = compose([f"algorithm.pool={fake_pool(tmp_path, model)}", "algorithm.router_rounds=1", "train.local_steps=2",
                   "algorithm.budget_per_matrix=2", "algorithm.min_per_matrix=2", "algorithm.max_per_matrix=2"],
                  algorithm="smartfed", preset="test")
    strategy = plan_server(cfg, on_round_end=None, config_yaml="").strategy
    nodes = {1: context(1), 2: context(2)}
    for server_round in (1, 2):  # the seed's schedule: routers trained in round 1, frozen from round 2
        router = {m: strategy.state.router[m].copy() for m in strategy.expert_layout}
        A = {m: strategy.state.A[m].copy() for m in strategy.expert_layout}
        replies = train_round(cfg, strategy, server_round, nodes)
        fields = {k.rsplit("/", 1)[1] for r in replies for k in r.content["arrays"]}
        assert ("router" in fields) == (server_round == 1) and {"A", "B", "ids"} <= fields
        strategy.aggregate_train(server_round, replies)
        assert strategy.round_record()["accepted"] == 2, strategy.round_record()["refused"]
        assert any(not np.array_equal(A[m], strategy.state.A[m]) for m in A)
        assert any(not np.array_equal(router[m], strategy.state.router[m]) for m in router) == (server_round == 1)
    # once frozen, a reply that still carries router rows is refused
    reply = train_round(cfg, strategy, 2, {1: context(1)})[0]
    values = codec.decode(reply.content["arrays"])
    matrix = next(k.rsplit("/", 1)[0] for k in values if k.endswith("/A"))
    values[f"{matrix}/router"] = np.zeros((values[f"{matrix}/ids"].size, 64), np.float32)
    reply.content["arrays"] = sparse.encode(values)
    with pytest.raises(PayloadError, match="routers are frozen"):
        strategy.validate_reply(reply)


def test_an_int4_downlink_sends_the_expert_values_in_int4_and_clients_train_from_them(tiny, tmp_path):
    """algorithm.downlink=int4: the experts' values travel in int4 (ids in fp32), about a seventh of
    the fp32 downlink; the clients' deltas are from what they decoded, and the server's experts move."""
    from fedapps.config import ConfigError
    from fedapps.smartfed import plan_server
    from inprocess import context, fake_pool, train_round

    _, model, _ = tiny
    with pytest.raises(ConfigError, match="algorithm.downlink 'int8' is not a downlink format"):
        compose(["algorithm.downlink=int8"], algorithm="smartfed", preset="test")
    pool = fake_pool(tmp_path, model)
    plans = {fmt: plan_server(compose([f"algorithm.pool={pool}", f"algorithm.downlink={fmt}", "train.local_steps=2"],
                                      algorithm="smartfed", preset="test"), on_round_end=None, config_yaml="").strategy
             for fmt in ("fp32", "int4")}
    down = {fmt: s.downlink_arrays() for fmt, s in plans.items()}
    assert {a.stype for k, a in down["int4"].items() if not k.endswith("/ids")} == {codec.INT4}
    assert {a.stype for k, a in down["int4"].items() if k.endswith("/ids")} == {codec.FP32}
    assert codec.payload_bytes(down["int4"]) < codec.payload_bytes(down["fp32"]) / 4
    strategy = plans["int4"]
    cfg = compose([f"algorithm.pool={pool}", "algorithm.downlink=int4", "train.local_steps=2"], algorithm="smartfed",
                  preset="test")
    A = {m: strategy.state.A[m].copy() for m in strategy.expert_layout}
    replies = train_round(cfg, strategy, 1, {1: context(1), 2: context(2)})
    strategy.aggregate_train(1, replies)
    assert strategy.round_record()["accepted"] == 2, strategy.round_record()["refused"]
    assert any(not np.array_equal(A[m], strategy.state.A[m]) for m in A)


def test_sensitivity_importance_reaches_eeqa_from_real_clients(tiny, tmp_path):
    """algorithm.importance=sensitivity: the clients' replies carry a finite importance per active
    expert (measured in backward), the server accepts them and EEQA reallocates from them."""
    from fedapps.config import ConfigError
    from fedapps.smartfed import plan_server
    from inprocess import context, fake_pool, train_round

    _, model, _ = tiny
    with pytest.raises(ConfigError, match="importance must be one of"):
        compose(["algorithm.importance=gain"], algorithm="smartfed", preset="test")
    cfg = compose([f"algorithm.pool={fake_pool(tmp_path, model)}", "algorithm.importance=sensitivity",
                   "train.local_steps=2"], algorithm="smartfed", preset="test")
    strategy = plan_server(cfg, on_round_end=None, config_yaml="").strategy
    replies = train_round(cfg, strategy, 1, {1: context(1), 2: context(2)})
    reported = [v for r in replies for k, v in codec.decode(r.content["arrays"]).items() if k.endswith("/importance")]
    assert reported and all(np.all(np.isfinite(v[1])) and np.all(v[1] >= 0) for v in reported)
    assert any(np.any(v[1] > 0) for v in reported)
    strategy.aggregate_train(1, replies)
    assert strategy.round_record()["accepted"] == 2, strategy.round_record()["refused"]
