"""Client-level differential privacy (strategies.privacy): the accountant, clipping, the noise, ε recorded."""

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from strategies import codec
from strategies.base import PayloadFedAvg
from strategies.privacy import Privacy, PrivacyError, add_noise, clip_update, epsilon_spent, noise_multiplier_for

STATE = {"w": np.zeros(20_000, np.float32)}


def privacy(**kw):
    block = {"mode": "central", "epsilon": 4.0, "delta": 1e-5, "clip": 0.5, "noise_multiplier": None, "seed": 7}
    block.update(kw)
    return Privacy.from_config(block, rounds=5, sample_rate=1.0)


def reply(node, values):
    request = Message(RecordDict({}), dst_node_id=node, message_type="train")
    content = RecordDict({"arrays": codec.encode({"w": values}), "metrics": MetricRecord({"num-examples": 10 * node})})
    return Message(content, reply_to=request)


def run_round(settings, updates, server_round=1):
    strategy = PayloadFedAvg(initial_state=STATE, config_yaml="", num_clients=len(updates), uplink="delta",
                             privacy=settings)
    strategy._start_round(server_round)
    strategy.sent["train"] = [Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=v, message_type="train")
                               for v in updates]
    strategy.aggregate_train(server_round, [reply(v, u) for v, u in updates.items()])
    return strategy


def test_the_noise_multiplier_spends_exactly_the_target_epsilon():
    z = noise_multiplier_for(4.0, 1e-5, 5, 1.0)
    assert epsilon_spent(z, 1.0, 5, 1e-5) == pytest.approx(4.0, rel=1e-3)
    assert epsilon_spent(0.98 * z, 1.0, 5, 1e-5) > 4.0  # the smallest such noise
    assert noise_multiplier_for(4.0, 1e-5, 20, 1.0) > z  # more rounds, more noise
    assert noise_multiplier_for(4.0, 1e-5, 5, 0.2) < z  # subsampling amplifies privacy
    assert epsilon_spent(z, 1.0, 0, 1e-5) == 0.0
    with pytest.raises(PrivacyError, match="privacy.clip must be a number > 0"):
        privacy(clip=0)
    with pytest.raises(PrivacyError, match="off, central or local"):
        privacy(mode="global")


def test_central_noise_has_the_accountants_standard_deviation_and_epsilon_is_recorded():
    settings = privacy()
    zeros = {v: np.zeros(20_000, np.float32) for v in (1, 2, 3, 4)}
    strategy = run_round(settings, zeros)
    noise = strategy.global_state["w"].astype(np.float64)
    # N(0, (z·clip)²) on the sum of the clipped updates, divided by the 4 sampled clients
    assert np.std(noise) == pytest.approx(settings.noise_multiplier * settings.clip / 4, rel=0.03)
    assert abs(np.mean(noise)) < 4 * settings.noise_multiplier * settings.clip / 4 / np.sqrt(noise.size)
    record = strategy.round_record()["privacy"]
    assert record["rounds_released"] == 1 and record["epsilon"] == pytest.approx(settings.epsilon(1))
    assert record["epsilon"] < 4.0  # one of five planned rounds
    # a seeded run is reproducible; an unseeded one draws its noise from os.urandom
    assert np.array_equal(run_round(settings, zeros).global_state["w"], strategy.global_state["w"])
    fresh = privacy(seed=None)
    assert not np.array_equal(run_round(fresh, zeros).global_state["w"], run_round(fresh, zeros).global_state["w"])


def test_clipping_bounds_every_clients_contribution_and_weights_are_uniform():
    settings = privacy(noise_multiplier=1e-9, epsilon=None)  # no noise to speak of: the clipped mean alone
    honest = np.full(20_000, 1e-4, np.float32)  # norm 0.014, under the clip
    hostile = np.full(20_000, 50.0, np.float32)  # norm 7071: clipped to 0.5
    strategy = run_round(settings, {1: honest, 2: honest, 3: honest, 4: hostile})
    shift = strategy.global_state["w"].astype(np.float64)
    expected = (3 * honest.astype(np.float64) + hostile / np.linalg.norm(hostile.astype(np.float64)) * 0.5) / 4
    np.testing.assert_allclose(shift, expected, rtol=1e-4)
    assert np.linalg.norm(shift - 3 * honest / 4) <= settings.clip / 4 + 1e-6  # at most clip / sampled clients
    assert [b["kind"] for b in strategy.round_record()["bounded"]] == ["dp-clipped"]


def test_local_noise_and_clipping_helpers():
    settings = privacy(mode="local")
    assert settings.sample_rate == 1.0 and settings.client_std == pytest.approx(2 * settings.noise_multiplier * 0.5)
    clipped, norm = clip_update({"a": np.full(4, 3.0), "b": np.full(5, 0.0)}, 1.5)
    assert norm == pytest.approx(6.0) and np.linalg.norm(clipped["a"]) == pytest.approx(1.5)
    noisy = add_noise({"a": np.zeros(50_000)}, 0.3, settings.rng(1, 2))
    assert np.std(noisy["a"]) == pytest.approx(0.3, rel=0.02)
    assert np.array_equal(noisy["a"], add_noise({"a": np.zeros(50_000)}, 0.3, settings.rng(1, 2))["a"])


def test_local_mode_the_server_averages_the_noised_updates_without_clipping_them_again():
    settings = privacy(mode="local")
    noised = {v: np.random.default_rng(v).normal(0, settings.client_std, 20_000).astype(np.float32) for v in (1, 2)}
    strategy = run_round(settings, noised)
    np.testing.assert_allclose(strategy.global_state["w"], (noised[1] + noised[2]) / 2, atol=1e-6)
    assert not strategy.round_record()["bounded"] and strategy.round_record()["privacy"]["mode"] == "local"


def test_the_accountant_leaves_the_root_logger_as_it_was():
    """q = 0.1 over RDP orders dp-accounting cannot converge on: absl's warning called logging.basicConfig(),
    the root logger kept a stderr handler, and every Flower line of a DP run at 1,000 clients printed twice."""
    import logging

    from strategies.privacy import epsilon_spent

    root = logging.getLogger()
    before = list(root.handlers)
    assert epsilon_spent(1.0, 0.1, 3, 1e-3) > 0
    assert root.handlers == before
