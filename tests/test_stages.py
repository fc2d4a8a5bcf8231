"""#61: each stage of the round on its own (strategies/uplink.py, bounds.py, release.py, step.py, downlink.py):
the numbers each must produce and the errors each must raise, without a round around it."""

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from strategies import codec, uplink
from strategies.base import PayloadFedAvg
from strategies.bounds import PrivacyClip, RobustBound, check_values
from strategies.codec import PayloadError
from strategies.privacy import Privacy
from strategies.release import PlainRelease, PrivateRelease, check_releasable
from strategies.robust import Robustness
from strategies.server_opt import ServerOptimizer
from strategies.step import ModelStep

STATE = {"a": np.full((2, 3), 0.5, np.float32), "b": np.zeros(4, np.float32)}


def strategy(**kw):
    return PayloadFedAvg(initial_state=STATE, config_yaml="run: 1\n", num_clients=3, **kw)


def test_an_update_means_the_same_whichever_the_uplink():
    update = {"a": np.full((2, 3), 0.25), "b": np.arange(4.0)}
    for form in uplink.UPLINKS:
        payload = uplink.payload_of(update, form, STATE)
        np.testing.assert_allclose(uplink.update_of(payload, form, STATE)["b"], update["b"])
        halved = uplink.update_of(uplink.scaled(payload, 0.5, form, STATE), form, STATE)
        np.testing.assert_allclose(halved["a"], 0.125, atol=1e-7)
        proposed = dict(uplink.proposed(payload, form, STATE))
        np.testing.assert_allclose(proposed["a"], 0.75)  # the global 0.5 + the update 0.25, in either form
    with pytest.raises(ValueError, match="needs uplink='delta'"):
        uplink.check_settings(uplink="absolute", uplink_format="topk", downlink_format="fp32", topk_fraction=0.1,
                              powersgd_rank=None)


def test_the_uplink_spec_refuses_a_record_before_decoding_it():
    spec = uplink.UplinkSpec.build({"a": (2, 3), "b": (4,)}, "fp32")
    good = codec.encode({k: v for k, v in STATE.items()}, "fp32")
    spec.check(good)
    assert spec.budget == 4 * 10
    with pytest.raises(PayloadError, match="wrong key set"):
        spec.check(codec.encode({"a": STATE["a"]}, "fp32"))
    with pytest.raises(PayloadError, match="has shape"):
        spec.check(codec.encode({"a": np.zeros((3, 2), np.float32), "b": STATE["b"]}, "fp32"))


def test_value_checks_name_the_bound_and_allow_a_slack():
    check_values([("a", np.array([0.9]))], 1.0, lambda key: None)
    with pytest.raises(PayloadError, match=r"beyond ±0.5 \(the method's bound"):
        check_values([("a", np.array([0.9]))], 1.0, lambda key: 0.5)
    check_values([("a", np.array([0.55]))], 1.0, lambda key: 0.5, slack=0.1)
    with pytest.raises(PayloadError, match="robust.max_abs"):
        check_values([("a", np.array([np.inf]))], 1.0, lambda key: None)


def test_the_robust_bound_caps_counts_and_clips_norms_and_records_each():
    s = strategy(uplink="delta")
    settings = Robustness(norm_clip="median", norm_multiple=1.0, center=None, examples_multiple=1.0)
    payloads = [{k: np.full(v.shape, x, np.float32) for k, v in STATE.items()} for x in (0.1, 0.1, 1.0)]
    s.ledger.start(1)
    out, weights = RobustBound(settings)(s, [1, 2, 3], payloads, [10, 10, 500])
    assert weights == [10, 10, 10]  # capped at the lower median
    assert s.update_norm(out[2]) == pytest.approx(s.update_norm(out[0]), rel=1e-6)  # clipped to the median norm
    assert {b["kind"] for b in s.round_record()["bounded"]} == {"examples-capped", "norm-clipped"}


def test_the_privacy_clip_clips_every_update_to_its_clip_with_uniform_weights():
    dp = Privacy.from_config({"mode": "central", "clip": 0.5, "delta": 1e-5, "noise_multiplier": 1.0},
                             rounds=2, sample_rate=1.0)
    s = strategy(uplink="delta", privacy=dp)
    s.ledger.start(1)
    payloads = [{k: np.full(v.shape, x, np.float32) for k, v in STATE.items()} for x in (0.01, 2.0)]
    out, weights = PrivacyClip(dp)(s, [1, 2], payloads, [30, 70])
    assert weights == [1, 1]
    assert s.update_norm(out[0]) == pytest.approx(s.update_norm(payloads[0]))  # inside the clip: as it was
    assert s.update_norm(out[1]) == pytest.approx(0.5, rel=1e-6)


def test_the_release_stages_plain_mean_and_private_release():
    s = strategy(uplink="delta")
    total = {"a": np.full((2, 3), 3.0), "b": np.zeros(4)}
    np.testing.assert_allclose(PlainRelease().of_sum(s, 1, total, 3)["a"], 1.0)
    dp = Privacy.from_config({"mode": "central", "clip": 1.0, "delta": 1e-5, "noise_multiplier": 1.0},
                             rounds=2, sample_rate=1.0)
    private = strategy(uplink="delta", privacy=dp)
    private.ledger.start(1)
    release = private.release
    assert isinstance(release, PrivateRelease) and release.released == 0
    noised = release.of_sum(private, 1, total, 3)
    assert release.released == 1 and private.round_record()["privacy"]["epsilon"] > 0
    assert not np.allclose(noised["a"], 1.0)  # central noise on the sum
    release.load({"privacy_released": 4, "sampled_rate": 0.5})
    assert release.state() == {"privacy_released": 4, "sampled_rate": 0.5}
    with pytest.raises(ValueError, match="robust aggregator 'median' does not fit"):
        check_releasable("differential privacy", PayloadFedAvg, "median", "fp32")


def test_the_model_step_applies_the_optimiser_and_keeps_its_moments_across_a_checkpoint():
    plain = ModelStep(ServerOptimizer(), None, "fp32")
    step = plain(STATE, 1, {"a": np.full((2, 3), 0.25), "b": np.ones(4)})
    np.testing.assert_allclose(step.values["a"], 0.75)
    assert step.moments is None and plain.state() == ({}, {})
    adam = ModelStep(ServerOptimizer(name="fedadam", lr=0.1), None, "fp32")
    step = adam(STATE, 1, {"a": np.full((2, 3), 0.25), "b": np.ones(4)})
    assert step.moments is not None and not np.allclose(step.values["a"], 0.75)
    adam.moments = step.moments
    arrays, meta = adam.state()
    again = ModelStep(ServerOptimizer(name="fedadam", lr=0.1), None, "fp32")
    again.load(arrays, meta, list(STATE))
    assert again.moments.t == 1
    with pytest.raises(ValueError, match="written with server optimizer 'fedadam'"):
        plain.load(arrays, meta, list(STATE))


def test_the_downlink_encodes_once_per_state_and_sends_the_config_on_first_contact():
    s = strategy()
    s.ledger.start(1)  # the round's record the downlink writes its bytes into
    first = s.downlink.arrays()
    assert s.downlink.arrays() is first
    template = [Message(RecordDict({}), dst_node_id=n, message_type="train") for n in (7, 8)]
    sent = s.downlink.messages(template, 1, "train", ConfigRecord({"server-round": 1}))
    assert all("postcard" in m.content.config_records for m in sent)
    again = s.downlink.messages(template[:1], 2, "train", ConfigRecord({"server-round": 2}))
    assert "postcard" not in again[0].content.config_records
    s.downlink.lost(7)  # a node that lost its state gets the config again
    assert "postcard" in s.downlink.messages(template[:1], 3, "eval", ConfigRecord())[0].content.config_records
    s.commit(s.step(1, {"a": np.ones((2, 3)), "b": np.ones(4)}))
    assert s.downlink.arrays() is not first and isinstance(s.downlink.arrays(), ArrayRecord)


def test_the_exchange_is_chosen_once_and_the_runner_drives_only_it():
    """The runner branches on no mode: it hands the round to the strategy's exchange (one exchange, or secure
    aggregation's stages)."""
    from strategies.exchange import PlainExchange
    from strategies.secure_round import SecureSettings
    from strategies.secure_stages import SecureStages

    assert isinstance(strategy().exchange, PlainExchange)
    assert isinstance(strategy(uplink="delta", secure=SecureSettings(bits=16, clip=0.5)).exchange, SecureStages)
    s, sent = strategy(uplink="delta"), []
    s.exchange.run(1, [], lambda server_round, phase, messages: sent.append(phase) or [])
    assert sent == ["train"] and s.round_record()["round"] == 1


def test_sampling_is_checked_once_where_it_is_built_by_the_config_check_and_the_strategy_alike():
    from strategies.release import Sampling

    sampling = Sampling(1000, fraction_train=0.1)
    assert (sampling.minimum, sampling.min_available, sampling.train_size) == (2, 1000, 100)
    assert Sampling(10, 0.1, 1.0, min_clients=4).min_available == 4  # a minimum given: rounds wait for it only
    for bad, match in (({"fraction_train": 0}, r"strategy.fraction_train must be a number in \(0, 1\]"),
                       ({"fraction_evaluate": 1.5}, r"strategy.fraction_evaluate must be a number in \[0, 1\]"),
                       ({"min_clients": 11}, r"strategy.min_clients must be null or an integer in 1..num_clients")):
        with pytest.raises(ValueError, match=match):
            Sampling.from_mapping(bad, 10)
        with pytest.raises(ValueError, match=match):  # the strategy refuses what the config check refuses
            PayloadFedAvg(initial_state=STATE, config_yaml="", num_clients=10, **bad)


def test_the_wire_settings_have_one_default_per_key_and_are_checked_when_built():
    """#61: a method's payload, downlink, uplink and compression, read once (strategies.uplink.Wire) by the
    config check, the strategy's keyword arguments and the clients; the defaults fp32 / fp32 / absolute."""
    assert uplink.Wire.of({}) == uplink.Wire("absolute", "fp32", "fp32", None, None)
    wire = uplink.Wire.of({"payload": "topk", "uplink": "delta", "compression": {"topk_fraction": 0.1}})
    assert wire.strategy_kwargs()["uplink_format"] == "topk" and wire.topk_fraction == 0.1
    with pytest.raises(ValueError, match="needs uplink='delta'"):
        uplink.Wire.of({"payload": "topk", "compression": {"topk_fraction": 0.1}})
    with pytest.raises(ValueError, match="unknown downlink format"):
        uplink.Wire.of({"downlink": "int3"})
