"""Compressed updates (FLITE's baselines): top-k and PowerSGD with error feedback, delta FedAvg."""

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

from fedapps.config import ConfigError, compose
from strategies import codec
from strategies.baselines import FedAvgFull
from strategies.compress import UpdateCompressor, max_nbytes, topk_count

LAYOUT = {"conv": (8, 4, 3, 3), "fc": (10, 32), "bias": (10,)}


def update(seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return {k: (scale * rng.standard_normal(s)).astype(np.float32) for k, s in LAYOUT.items()}


def test_topk_keeps_the_largest_entries_in_8_bytes_each():
    delta = update()
    record, _ = UpdateCompressor("topk", fraction=0.1, error_feedback=False).compress(delta)
    dense = codec.decode(record)
    for name, value in delta.items():
        k = topk_count(value.size, 0.1)
        assert len(record[name].data) == 8 * k
        kept = np.flatnonzero(dense[name])
        assert len(kept) == k
        threshold = np.sort(np.abs(value).ravel())[-k]
        assert np.all(np.abs(value.ravel()[kept]) >= threshold)
        assert np.array_equal(dense[name].ravel()[kept], value.ravel()[kept])
    assert codec.payload_bytes(record) == max_nbytes(LAYOUT, "topk", fraction=0.1)


def test_powersgd_recovers_a_low_rank_update_exactly_and_sends_vectors_in_fp32():
    rng = np.random.default_rng(1)
    low = {"conv": (rng.standard_normal((8, 2)) @ rng.standard_normal((2, 36))).reshape(8, 4, 3, 3),
           "fc": rng.standard_normal((10, 2)) @ rng.standard_normal((2, 32)),
           "bias": rng.standard_normal(10)}
    low = {k: v.astype(np.float32) for k, v in low.items()}
    record, memory = UpdateCompressor("powersgd", rank=2, error_feedback=False).compress(low)
    dense = codec.decode(record)
    for name, value in low.items():
        np.testing.assert_allclose(dense[name], value, rtol=1e-4, atol=1e-5)
    assert record["conv"].stype == codec.LOWRANK and len(record["conv"].data) == 4 * 2 * (8 + 36)
    assert record["bias"].stype == codec.FP32
    assert memory["q/fc"].shape == (32, 2)  # the warm start for the next round stays on the client
    assert codec.payload_bytes(record) == max_nbytes(LAYOUT, "powersgd", rank=2)


@pytest.mark.parametrize("fmt, kwargs", [("topk", dict(fraction=0.05)), ("powersgd", dict(rank=1))])
def test_error_feedback_loses_nothing_over_rounds(fmt, kwargs):
    """Σ sent + residual = Σ updates: what compression drops is sent later, not lost."""
    comp = UpdateCompressor(fmt, error_feedback=True, **kwargs)
    memory, sent_total, true_total = {}, None, None
    for t in range(5):
        delta = update(seed=t)
        record, memory = comp.compress(delta, memory)
        sent = codec.decode(record)
        sent_total = sent if sent_total is None else {k: sent_total[k] + sent[k] for k in sent}
        true_total = delta if true_total is None else {k: true_total[k] + delta[k] for k in delta}
    for name in LAYOUT:
        np.testing.assert_allclose(sent_total[name] + memory[f"ef/{name}"], true_total[name], rtol=1e-4, atol=1e-4)


def _array(stype, shape, data):
    return Array(dtype="float32", shape=shape, stype=stype, data=data)


@pytest.mark.parametrize("array, reason", [
    (_array(codec.TOPK, (4, 4), np.array([3, 1], "<u4").tobytes() + np.ones(2, "<f4").tobytes()), "increasing"),
    (_array(codec.TOPK, (4, 4), np.array([2, 16], "<u4").tobytes() + np.ones(2, "<f4").tobytes()), "below 16"),
    (_array(codec.TOPK, (4, 4), b"\0" * 7), "8·k"),
    (_array(codec.TOPK, (4, 4), np.array([2], "<u4").tobytes() + np.array([np.nan], "<f4").tobytes()), "NaN"),
    (_array(codec.LOWRANK, (4, 6), b"\0" * 44), "4·r"),
    (_array(codec.LOWRANK, (6,), b"\0" * 28), "low-rank"),
])
def test_malformed_compressed_tensors_are_refused(array, reason):
    record = codec.encode({})
    record["w"] = array
    with pytest.raises(codec.PayloadError, match=reason):
        codec.decode(record)


def full_strategy(fmt="fp32", **kwargs):
    state = {k: np.ones(s, np.float32) for k, s in LAYOUT.items()}
    return FedAvgFull(initial_state=state, config_yaml="x: 1\n", num_clients=2, uplink_format=fmt, uplink="delta",
                      **kwargs)


def reply(node, record, n):
    request = Message(RecordDict({}), dst_node_id=node, message_type="train")
    return Message(RecordDict({"arrays": record, "metrics": MetricRecord({"num-examples": n})}), reply_to=request)


def test_delta_fedavg_adds_the_weighted_mean_of_compressed_updates():
    from strategies.robust import Robustness

    # robust=off: the example-weighted mean exactly (the default bounds would cap 3 at 1 and clip the larger update)
    s = full_strategy("topk", topk_fraction=0.5,
                      robustness=Robustness(norm_clip="none", center=None, examples_multiple=None, max_abs=None))
    comp = UpdateCompressor("topk", fraction=0.5, error_feedback=False)
    (r1, _), (r2, _) = comp.compress(update(1)), comp.compress(update(2))
    arrays, _ = s.aggregate_train(1, [reply(1, r1, 1), reply(2, r2, 3)])
    got = codec.decode(arrays)
    d1, d2 = codec.decode(r1), codec.decode(r2)
    for name in LAYOUT:
        np.testing.assert_allclose(got[name], 1.0 + (d1[name] + 3.0 * d2[name].astype(np.float64)) / 4, atol=1e-6)


def test_an_update_larger_than_its_format_allows_is_refused_and_the_state_kept():
    s = full_strategy("topk", topk_fraction=0.01)
    before = {k: v.copy() for k, v in s.global_state.items()}
    dense = ArrayRecord({k: codec.topk_array(v.shape, np.arange(v.size), v.reshape(-1)) for k, v in update().items()})
    arrays, _ = s.aggregate_train(1, [reply(1, dense, 5)])
    assert arrays is None
    assert "more than" in s.round_record()["refused"][0]["reason"]
    # and a dense fp32 update is not a top-k one at all
    s.aggregate_train(1, [reply(1, codec.encode(update(), "fp32"), 5)])
    assert "wire format 'postcard.fp32'" in s.round_record()["refused"][1]["reason"]
    assert all(np.array_equal(before[k], s.global_state[k]) for k in before)


def test_compression_config_is_checked_at_compose_time():
    cfg = compose(task="cifar10", algorithm="topk-ef")
    assert cfg.algorithm.payload == "topk" and cfg.algorithm.uplink == "delta"
    assert compose(task="cifar10", algorithm="powersgd").algorithm.compression.powersgd_rank == 4
    with pytest.raises(ConfigError, match="use channel=topk"):  # fedavg-lora sends absolute factors by itself
        compose(["algorithm.payload=topk"], algorithm="fedavg-lora")
    with pytest.raises(ConfigError, match="fedala. carries: fp32\)"):
        compose(["algorithm.payload=topk"], algorithm="fedala")
    with pytest.raises(ConfigError, match="fraction"):
        compose(["algorithm.compression.topk_fraction=2"], task="cifar10", algorithm="topk-ef")
    with pytest.raises(ConfigError, match="payload format"):
        compose(["algorithm.payload=int3"], task="cifar10", algorithm="fedavg-full")
