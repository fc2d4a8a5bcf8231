"""Wire format, byte accounting, validation and averaging of PayloadFedAvg."""

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from strategies import codec
from strategies.base import PayloadFedAvg
from strategies.baselines import FedProx, FFALoRA
from strategies.robust import weighted_mean
from strategies.screening import CONFIG_RECORD

STATE = {"layer.lora_A": np.ones((4, 8), np.float32), "layer.lora_B": np.zeros((8, 4), np.float32)}


def make_strategy(cls=PayloadFedAvg, **kw):
    records = []
    strategy = cls(initial_state=STATE, config_yaml="a: 1\n", num_clients=2, on_round_end=records.append, **kw)
    return strategy, records


def reply(node_id, arrays, num_examples=10, **metrics):
    request = Message(RecordDict({}), dst_node_id=node_id, message_type="train")
    content = RecordDict({"metrics": MetricRecord({"num-examples": num_examples, "loss": 1.0, **metrics})})
    if arrays is not None:
        content["arrays"] = arrays
    return Message(content, reply_to=request)


def payload(scale, **changes):
    tensors = {k: np.full(v.shape, scale, np.float32) for k, v in STATE.items()}
    tensors.update(changes)
    return codec.encode(tensors)


def test_fp32_bytes_are_exactly_the_tensor_bytes_and_round_trip():
    record = codec.encode(STATE)
    assert codec.payload_bytes(record) == sum(v.nbytes for v in STATE.values()) == 256
    assert sum(len(a.data) for a in record.values()) == codec.payload_bytes(record)
    decoded = codec.decode(record)
    assert all(np.array_equal(decoded[k], STATE[k]) for k in STATE)


def test_message_bytes_count_the_whole_content():
    content = RecordDict({"arrays": codec.encode(STATE), "metrics": MetricRecord({"num-examples": 3})})
    assert codec.message_bytes(content) == 256 + len("layer.lora_A") + len("layer.lora_B") + 8 + len("num-examples")


def test_weighted_mean_identity_and_weights():
    a = {"x": np.array([1.0, 2.0], np.float32)}
    b = {"x": np.array([3.0, 6.0], np.float32)}
    assert np.allclose(weighted_mean([a, b], [1, 3])["x"], [2.5, 5.0])
    assert np.array_equal(weighted_mean([a, a, a], [5, 1, 2])["x"], a["x"])


def test_aggregate_is_the_example_weighted_mean_and_bytes_are_recorded():
    from strategies.robust import Robustness

    # robust=off: FedAvg's example-weighted mean exactly (the default caps 30 at the lower median, 10)
    strategy, _ = make_strategy(robustness=Robustness(norm_clip="none", center=None, examples_multiple=None, max_abs=None))
    arrays, metrics = strategy.aggregate_train(1, [reply(1, payload(1.0), 10), reply(2, payload(4.0), 30)])
    new = codec.decode(arrays)
    assert np.allclose(new["layer.lora_A"], 3.25) and np.allclose(strategy.global_state["layer.lora_B"], 3.25)
    clients = strategy.round_record()["clients"]
    assert clients["1"]["uplink_payload_bytes"] == 256
    assert metrics["loss"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    "bad, reason",
    [
        (lambda: payload(9.0, **{"layer.extra": np.ones(2, np.float32)}), "wrong key set"),
        (lambda: codec.encode({"layer.lora_A": np.ones((4, 8), np.float32)}), "wrong key set"),
        (lambda: payload(9.0, **{"layer.lora_B": np.ones((4, 8), np.float32)}), "has shape"),
        (lambda: ArrayRecord({**{k: v for k, v in payload(9.0).items()},
                              "layer.lora_B": Array(dtype="float64", shape=(8, 4), stype=codec.FP32, data=b"\0" * 256)}),
         "dtype float64"),
        (lambda: ArrayRecord({**{k: v for k, v in payload(9.0).items()},
                              "layer.lora_B": Array(dtype="float32", shape=(8, 4), stype=codec.FP32,
                                                    data=np.full((8, 4), np.nan, np.float32).tobytes())}),
         "NaN or Inf"),
        (lambda: ArrayRecord({**{k: v for k, v in payload(9.0).items()},
                              "layer.lora_B": Array(dtype="float32", shape=(8, 4), stype=codec.FP32, data=b"\0" * 10)}),
         "carries 10 bytes"),
        (lambda: ArrayRecord({**{k: v for k, v in payload(9.0).items()},
                              "layer.lora_B": Array(np.zeros((8, 4), np.float32))}), "unknown array stype"),
    ],
)
def test_a_malformed_payload_is_refused_and_the_global_state_is_unchanged(bad, reason, caplog):
    strategy, records = make_strategy()
    before = {k: v.copy() for k, v in strategy.global_state.items()}
    arrays, _ = strategy.aggregate_train(1, [reply(7, bad())])
    assert arrays is None
    assert all(np.array_equal(strategy.global_state[k], before[k]) for k in before)
    assert strategy.round_record()["refused"][0]["node_id"] == 7 and reason in strategy.round_record()["refused"][0]["reason"]


def test_a_bad_reply_does_not_stop_the_good_ones():
    strategy, _ = make_strategy()
    nan = payload(1.0)
    nan["layer.lora_A"] = Array(dtype="float32", shape=(4, 8), stype=codec.FP32, data=np.full((4, 8), np.inf, np.float32).tobytes())
    arrays, _ = strategy.aggregate_train(1, [reply(1, payload(2.0), 10), reply(2, nan, 1000), reply(3, payload(2.0), 0)])
    assert np.allclose(codec.decode(arrays)["layer.lora_A"], 2.0)
    refused = {r["node_id"]: r["reason"] for r in strategy.round_record()["refused"]}
    assert set(refused) == {2, 3} and "num-examples" in refused[3]


def test_a_round_where_every_client_crashed_aborts_the_run():
    from flwr.app import Error

    strategy, _ = make_strategy()
    request = Message(RecordDict({}), dst_node_id=4, message_type="train")
    crashed = Message(Error(code=0, reason="CUDA out of memory"), reply_to=request)
    with pytest.raises(RuntimeError, match="every client failed.*CUDA out of memory"):
        strategy.aggregate_train(1, [crashed])


def test_missing_arrays_or_metrics_are_refused():
    strategy, _ = make_strategy()
    request = Message(RecordDict({}), dst_node_id=4, message_type="train")
    no_metrics = Message(RecordDict({"arrays": payload(1.0)}), reply_to=request)
    arrays, _ = strategy.aggregate_train(1, [reply(3, None), no_metrics])
    assert arrays is None and len(strategy.round_record()["refused"]) == 2


def test_fedprox_sends_mu_and_ffa_federates_only_b():
    prox, _ = make_strategy(FedProx, proximal_mu=0.1)
    assert prox.train_config_for(1, 5, ConfigRecord())["proximal-mu"] == pytest.approx(0.1)
    with pytest.raises(ValueError):
        make_strategy(FedProx, proximal_mu=-1.0)
    ffa, _ = make_strategy(FFALoRA)
    assert ffa.uplink_keys == ["layer.lora_B"] and set(codec.decode(ffa.downlink_arrays())) == {"layer.lora_B"}


class FakeGrid:
    def __init__(self, nodes):
        self.nodes = nodes

    def get_node_ids(self):
        return self.nodes


def test_config_goes_once_per_node_and_downlink_bytes_are_recorded():
    strategy, records = make_strategy()
    grid = FakeGrid([11, 12])
    first = list(strategy.configure_train(1, strategy.downlink_arrays(), ConfigRecord(), grid))
    assert all(CONFIG_RECORD in m.content.config_records for m in first)
    strategy.aggregate_train(1, [reply(11, payload(1.0)), reply(12, payload(1.0))])
    strategy.aggregate_evaluate(1, [])
    second = list(strategy.configure_train(2, strategy.downlink_arrays(), ConfigRecord(), grid))
    assert not any(CONFIG_RECORD in m.content.config_records for m in second)
    assert records[0]["clients"][0]["train_downlink_payload_bytes"] == 256
    assert records[0]["clients"][0]["uplink_payload_bytes"] == 256


def test_fedprox_penalty_is_half_mu_times_the_squared_distance_and_holds_training_near_the_reference():
    import torch

    from clients.train import Proximal, local_train
    from clients.tasks import make_task
    from fedapps import baselines
    from fedapps.config import compose

    cfg = compose(["train.local_steps=3", "train.lr=0.05"], preset="test", algorithm="fedprox")
    moved = {}
    for mu in (0.0, 50.0):
        model, tok, extra = baselines.prepare(cfg)
        reference = {n: p.detach().clone() for n, p in model.named_parameters() if n in extra["names"]}
        if mu:
            hook = Proximal(model, mu, reference)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if name in reference:
                        param.add_(0.1)
                expected = 0.5 * mu * sum(0.01 * v.numel() for v in reference.values())
                assert float(hook.penalty()) == pytest.approx(expected, rel=1e-4)
                for name, param in model.named_parameters():
                    if name in reference:
                        param.sub_(0.1)
        local_train(model, make_task(cfg, 0, 2, tok), cfg.train, seed=0, proximal_mu=mu,
                    reference=reference if mu else None)
        params = dict(model.named_parameters())
        moved[mu] = sum(float(((params[n].detach() - v) ** 2).sum()) for n, v in reference.items())
    assert 0 < moved[50.0] < moved[0.0]  # the proximal term pulls the weights back towards the reference


class _Doubling(PayloadFedAvg):
    """A method combining replies its own way: twice the mean update."""

    def combine(self, payloads, weights):
        return {k: 2.0 * v for k, v in super().combine(payloads, weights).items()}

    reads = 0

    def reply_record(self, msg):
        type(self).reads += 1
        return super().reply_record(msg)


def test_a_methods_combine_is_the_one_hook_every_plain_round_runs_and_each_reply_is_read_once():
    from strategies.robust import Robustness

    strategy, _ = make_strategy(_Doubling, robustness=Robustness(norm_clip="none", center=None, examples_multiple=None))
    _Doubling.reads = 0
    strategy.aggregate_train(1, [reply(1, payload(2.0)), reply(2, payload(4.0))])
    # the clients' mean update is (3 − 1) for A (from 1) and 3 for B (from 0): doubled, then added
    assert np.allclose(strategy.global_state["layer.lora_A"], 1 + 2 * 2.0)
    assert np.allclose(strategy.global_state["layer.lora_B"], 2 * 3.0)
    assert _Doubling.reads == 2  # one read per reply: decoded and counted from the same record


def test_a_strategy_with_its_own_combine_is_refused_under_privacy_or_secure_aggregation():
    from strategies.privacy import Privacy
    from strategies.secure_round import SecureSettings

    dp = Privacy.from_config({"mode": "central", "clip": 0.5, "delta": 1e-5, "noise_multiplier": 1.0},
                             rounds=2, sample_rate=1.0)
    assert not _Doubling.linear and PayloadFedAvg.linear  # overriding combine makes a class non-linear
    with pytest.raises(ValueError, match=r"_Doubling combines replies its own way \(it overrides combine\); "
                                         "differential privacy"):
        make_strategy(_Doubling, uplink="delta", privacy=dp)
    with pytest.raises(ValueError, match=r"_Doubling combines replies its own way \(it overrides combine\); "
                                         "secure aggregation"):
        make_strategy(_Doubling, uplink="delta", secure=SecureSettings(bits=16, clip=0.5))
    make_strategy(PayloadFedAvg, uplink="delta", privacy=dp)  # the plain mean is what both release
    make_strategy(_DoublingMean, uplink="delta", privacy=dp)  # a linear combiner: after_mean
    assert _DeclaredLinear.linear  # a combine override may declare itself linear


class _DoublingMean(PayloadFedAvg):
    """The same rule as _Doubling, as a linear combiner: twice the mean update, on every path."""

    def after_mean(self, update):
        return {k: 2.0 * v for k, v in update.items()}


class _DeclaredLinear(PayloadFedAvg):
    linear = True

    def combine(self, payloads, weights):
        return super().combine(payloads, weights)


def test_a_linear_combiner_runs_on_every_path_plain_and_secure():
    """#61: after_mean is applied to the plain mean and to a secure round's revealed mean alike (the same
    doubled step from the same updates), where an overridden combine was refused under secure aggregation."""
    from strategies.secure_local import local_round
    from strategies.secure_round import SecureSettings

    from strategies.robust import Robustness

    updates = {v: {k: np.full(s.shape, 0.01 * v, np.float32) for k, s in STATE.items()} for v in (3, 5, 8)}
    expected = {k: STATE[k] + 2 * np.mean([u[k] for u in updates.values()], axis=0) for k in STATE}
    plain, _ = make_strategy(_DoublingMean, uplink="delta", robustness=Robustness.off())
    plain.aggregate_train(1, [reply(v, codec.encode(u, "fp32"), num_examples=1) for v, u in updates.items()])
    for key, value in expected.items():
        np.testing.assert_allclose(plain.global_state[key], value, atol=1e-6)
    secure, _ = make_strategy(_DoublingMean, uplink="delta", secure=SecureSettings(bits=20, clip=0.5))
    local_round(secure, updates)
    expected = {k: STATE[k] + 2 * np.mean([u[k] for u in updates.values()], axis=0) for k in STATE}
    for key, value in expected.items():
        np.testing.assert_allclose(secure.global_state[key], value, atol=2e-6)  # 20-bit quantisation


@pytest.mark.parametrize("name", [s.name for s in __import__("hostile").SPECS])
def test_every_strategys_train_config_carries_what_the_base_adds(name):
    """#61: FedProx and FedSSI overrode train_config_for without super() and dropped the base's `uplink`
    key; every strategy of the hostile catalogue (one per method and wire) must carry it."""
    from hostile import SPEC_BY_NAME

    strategy = SPEC_BY_NAME[name].build()
    config = strategy.train_config_for(1, 7, ConfigRecord({"lr": 0.1}))
    assert config["uplink"] == strategy.uplink and config["lr"] == 0.1
