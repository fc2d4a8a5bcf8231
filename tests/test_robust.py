"""Bounded influence: robust aggregators, caps and clips, atomic rounds, evaluation replies,
SmartFed's allocation, and what a run records (numpy level, fast)."""

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from fedapps.config import ConfigError, compose
from hostile import NODES, SPEC_BY_NAME, FakeGrid, configured_round, honest_payload, push, reply_to
from strategies import codec, robust
from strategies.baselines import FedAvgLoRA
from strategies.robust import Robustness

STATE = {"w": np.zeros((4, 5), np.float32), "b": np.zeros(3, np.float32)}


def five_clients(robustness, outlier=1e3, seed=0):
    """Four honest updates around 1.0 and one outlier; -> (new state, honest mean)."""
    rng = np.random.default_rng(seed)
    strategy = FedAvgLoRA(initial_state=STATE, config_yaml="", num_clients=5, robustness=robustness)
    honest = [{k: (1.0 + 0.1 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in STATE.items()}
              for _ in range(4)]
    bad = {k: np.full(v.shape, outlier, np.float32) for k, v in STATE.items()}
    replies = []
    for node, tensors in enumerate([*honest, bad], start=1):
        request = Message(RecordDict({}), dst_node_id=node, message_type="train")
        replies.append(Message(RecordDict({"arrays": codec.encode(tensors),
                                           "metrics": MetricRecord({"num-examples": 10})}), reply_to=request))
    strategy.aggregate_train(1, replies)
    mean = {k: np.mean([h[k] for h in honest], axis=0) for k in STATE}
    spread = max(robust.norm({k: h[k] - mean[k] for k in STATE}) for h in honest)
    return strategy, mean, spread


def distance(strategy, mean):
    return robust.norm({k: strategy.global_state[k].astype(np.float64) - mean[k] for k in mean})


@pytest.mark.parametrize("aggregator", ["median", "trimmed-mean", "krum", "multi-krum"])
def test_robust_aggregators_keep_one_outlier_of_five_near_the_honest_mean(aggregator):
    """Without any clipping, the aggregator alone keeps a 1e3 outlier out: the result stays
    within the honest clients' own spread of their mean."""
    strategy, mean, spread = five_clients(Robustness(aggregator=aggregator, norm_clip=None, trim_fraction=0.2))
    assert distance(strategy, mean) <= spread
    plain, mean, _ = five_clients(Robustness.off())
    assert distance(plain, mean) > 100 * spread  # the plain mean is dragged far away


def test_the_mean_with_the_norm_clip_stays_within_its_documented_bound():
    settings = Robustness(center=None)  # the mean with the norm clip alone (centered clipping: test_colluders.py)
    strategy, mean, spread = five_clients(settings)
    assert [b["node_id"] for b in strategy.round_record()["bounded"]] == [5]
    # bound: share (1/5) x (clipped norm + largest honest norm), clipped norm <= 10 x lower median
    honest_norm = robust.norm({k: np.ones(v.shape) for k, v in STATE.items()}) * 1.1
    assert distance(strategy, mean) <= 0.2 * (10 * honest_norm + honest_norm)


def test_weights_are_capped_at_a_multiple_of_the_lower_median_and_norms_clipped():
    settings = Robustness(examples_multiple=4.0, max_examples=100)
    assert robust.cap_weights([10, 20, 10**18], settings) == [10, 20, 80]  # 4 x the lower median, 20
    assert robust.cap_weights([500, 600], settings) == [100, 100]
    assert robust.lower_median([3.0, 1.0, 1e9]) == 3.0 and robust.lower_median([1.0, 1e9]) == 1.0
    assert robust.clip_scales([1.0, 2.0, 100.0], Robustness(norm_multiple=10.0)) == [1.0, 1.0, 0.2]
    assert robust.clip_scales([0.0, 0.0], Robustness()) == [1.0, 1.0]  # nobody moved: nothing to clip to
    assert robust.clip_scales([1.0, 5.0], Robustness(norm_clip=2.0)) == [1.0, 0.4]


@pytest.mark.parametrize("bad, message", [
    (dict(aggregator="mode"), "robust.aggregator"), (dict(norm_clip="sometimes"), "robust.norm_clip"),
    (dict(norm_multiple=-1.0), "robust.norm_multiple"), (dict(max_examples=0), "robust.max_examples"),
    (dict(trim_fraction=0.5), "robust.trim_fraction"), (dict(byzantine=-1), "robust.byzantine"),
    (dict(center="mean"), "robust.center"), (dict(center_multiple=0), "robust.center_multiple"),
])
def test_bad_robust_settings_are_refused_at_compose_time(bad, message):
    key, value = next(iter(bad.items()))
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        compose([f"robust.{key}={value}"], preset="test")


def test_every_robust_choice_reaches_the_strategy_and_smartfed_refuses_robust_rules():
    from fedapps.method import strategy_settings

    for choice in ("default", "median", "trimmed-mean", "krum", "multi-krum", "off"):
        cfg = compose(preset="test", robust=choice)
        settings = strategy_settings(cfg, config_yaml="", on_round_end=None)["robustness"]
        assert settings.aggregator == {"default": "mean", "off": "mean"}.get(choice, choice)
    assert not strategy_settings(compose(preset="test", robust="off"), config_yaml="",
                                 on_round_end=None)["robustness"].clips
    with pytest.raises(ConfigError, match="smartfed"):
        compose(preset="test", algorithm="smartfed", robust="krum")


def test_a_non_finite_aggregate_refuses_the_round_and_keeps_the_state():
    """With every bound off, two clients at 3e38 overflow the mean: the round is refused whole."""
    strategy = FedAvgLoRA(initial_state=STATE, config_yaml="", num_clients=2, robustness=Robustness.off())
    replies = []
    for node in (1, 2):
        request = Message(RecordDict({}), dst_node_id=node, message_type="train")
        tensors = {k: np.full(v.shape, 3e38, np.float32) for k, v in STATE.items()}
        replies.append(Message(RecordDict({"arrays": codec.encode(tensors),
                                           "metrics": MetricRecord({"num-examples": 10})}), reply_to=request))
    strategy.uplink = "delta"  # a global value of 3e38 plus a mean delta of 3e38 overflows float32
    strategy.global_state = {k: np.full(v.shape, 3e38, np.float32) for k, v in STATE.items()}
    arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is None and all(np.all(v == np.float32(3e38)) for v in strategy.global_state.values())
    assert strategy.round_record()["refused"][-1]["kind"] == "round"


def eval_replies(strategy, metrics_for):
    requests = push(strategy.configure_evaluate(1, strategy.downlink_arrays(), ConfigRecord(), FakeGrid()))
    out = []
    for node in NODES:
        values = {"num-examples": 10, "perplexity": 20.0 + node, "loss": 3.0}
        values.update(metrics_for.get(node, {}))
        out.append(Message(RecordDict({"metrics": MetricRecord({k: v for k, v in values.items() if v is not None})}),
                           reply_to=requests[node]))
    return out


@pytest.mark.parametrize("hostile, outcome", [
    ({"perplexity": float("nan")}, "refused"),
    ({"loss": [1.0, 2.0]}, "odd shape left out"),
    ({"num-examples": 10**18}, "capped"),
    ({"perplexity": None}, "missing"),
    ({"num-examples": -1}, "refused"),
])
def test_evaluation_replies_are_screened_and_a_missing_key_is_not_a_zero(hostile, outcome):
    strategy = SPEC_BY_NAME["fedavg-lora"].build()
    aggregated = strategy.aggregate_evaluate(1, eval_replies(strategy, {4: hostile}))
    honest = np.mean([21.0, 22.0, 23.0])
    if outcome == "refused":
        assert strategy.history[-1]["refused"][0]["node_id"] == 4
        assert aggregated["perplexity"] == pytest.approx(honest)
    elif outcome == "odd shape left out":  # one client's list cannot hide the others' loss (issue #39, finding 7)
        assert aggregated["loss"] == pytest.approx(3.0) and aggregated["perplexity"] == pytest.approx(22.5)
    elif outcome == "capped":  # 10**18 counted as 1 x the lower median (10): one client's claim sets nothing
        assert aggregated["perplexity"] == pytest.approx((10 * (21 + 22 + 23) + 10 * 24) / 40)
    else:
        assert aggregated["perplexity"] == pytest.approx(honest)


def test_smartfed_importance_cannot_steer_the_allocation_beyond_its_share():
    """A client reporting its importance x1e6 gives the same next allocation as reporting it x1."""
    spec = SPEC_BY_NAME["smartfed"]
    allocations = []
    for factor in (1.0, 1e6):
        strategy = spec.build()
        requests = configured_round(strategy, 1)
        replies = []
        for node in NODES:
            tensors = codec.decode(honest_payload(spec, strategy, node, 1))
            if node == 4:
                for key in [k for k in tensors if k.endswith("/importance")]:
                    tensors[key][1] *= factor
            replies.append(reply_to(requests[node], codec.encode(tensors)))
        strategy.aggregate_train(1, replies)
        allocations.append({m: list(v) for m, v in strategy.allocation.active.items()})
    assert allocations[0] == allocations[1]


def test_smartfed_keeps_its_allocation_after_a_round_with_no_accepted_reply():
    spec = SPEC_BY_NAME["smartfed"]
    strategy = spec.build()
    before = {m: list(v) for m, v in strategy.allocation.active.items()}
    rounds = strategy.eeqa.rounds
    requests = configured_round(strategy, 1)
    garbage = [reply_to(requests[n], codec.encode({"x/ids": np.zeros(1, np.float32)})) for n in NODES]
    assert strategy.aggregate_train(1, garbage) == (None, None)
    assert {m: list(v) for m, v in strategy.allocation.active.items()} == before and strategy.eeqa.rounds == rounds
    assert strategy.round_record()["smartfed"]["reallocated"] is False


def test_collect_replies_hands_a_second_reply_to_the_strategy_which_refuses_it():
    """The runner never drops an extra reply silently: the strategy refuses it as a duplicate."""
    from fedapps.runner import collect_replies

    strategy = SPEC_BY_NAME["fedavg-lora"].build()
    messages = strategy.configure_train(1, strategy.downlink_arrays(), ConfigRecord(), FakeGrid())

    class TwiceGrid(FakeGrid):
        def push_messages(self, msgs):
            return list(push(list(msgs)).values()) and [m.metadata.message_id for m in msgs]

        def pull_messages(self, ids):
            out = []
            for msg in messages:
                if msg.metadata.message_id in ids:
                    out.append(reply_to(msg, honest_payload(SPEC_BY_NAME["fedavg-lora"], strategy,
                                                            msg.metadata.dst_node_id, 1)))
                    if msg.metadata.dst_node_id == 4:
                        out.append(reply_to(msg, honest_payload(SPEC_BY_NAME["fedavg-lora"], strategy, 4, 1,
                                                                scale=50.0)))
            return out

    replies, missing = collect_replies(TwiceGrid(), messages, timeout=5, poll=0.01)
    assert len(replies) == 5 and not missing
    strategy.aggregate_train(1, replies)
    refused = strategy.round_record()["refused"]
    assert [(r["node_id"], r["kind"]) for r in refused] == [(4, "identity")] and "second reply" in refused[0]["reason"]


def test_refusals_and_bounds_are_counted_by_kind_in_the_summary(tmp_path, monkeypatch):
    from fedapps.outputs import count_by_kind

    history = [{"refused": [{"kind": "identity"}, {"kind": "payload"}, {"kind": "payload"}],
                "bounded": [{"kind": "norm-clipped"}]}, {"refused": [], "bounded": []}]
    assert count_by_kind(history, "refused") == {"identity": 1, "payload": 2}
    assert count_by_kind(history, "bounded") == {"norm-clipped": 1}
