"""Server optimisers (strategy.server_optimizer): the update rules by hand, their bounds, and the
strategy's use of them: a step per round, moments kept only when a round commits, checkpointed."""

import numpy as np
import pytest

from strategies import codec
from strategies.robust import Robustness
from strategies.server_opt import OptimizerState, ServerOptimizer
from test_strategy import STATE, make_strategy, payload, reply

DELTA_1, DELTA_2 = np.array([0.5, -2.0, 0.0]), np.array([0.1, -2.0, 1.0])


def two_steps(name, **kw):
    opt = ServerOptimizer(name=name, **kw)
    first, state = opt.step({"x": DELTA_1}, OptimizerState())
    second, state = opt.step({"x": DELTA_2}, state)
    return first["x"], second["x"], state


def test_fedavg_is_the_update_as_it_is_and_keeps_no_state():
    step, state = ServerOptimizer().step({"x": DELTA_1}, OptimizerState())
    assert np.array_equal(step["x"], DELTA_1) and state.t == 0 and not state.m


def test_fedadam_by_hand():
    first, second, state = two_steps("fedadam", lr=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3)
    # t=1: m = 0.1Δ, v = 0.01Δ², bias-corrected m̂ = Δ, v̂ = Δ²: the step is lr·Δ/(|Δ| + τ)
    assert first == pytest.approx(0.1 * DELTA_1 / (np.abs(DELTA_1) + 1e-3))
    m = 0.9 * 0.1 * DELTA_1 + 0.1 * DELTA_2
    v = 0.99 * 0.01 * DELTA_1 ** 2 + 0.01 * DELTA_2 ** 2
    assert second == pytest.approx(0.1 * (m / 0.19) / (np.sqrt(v / (1 - 0.99 ** 2)) + 1e-3))
    assert state.t == 2 and state.m["x"] == pytest.approx(m) and state.v["x"] == pytest.approx(v)


def test_fedyogi_fedadagrad_fedavgm_by_hand():
    _, second, state = two_steps("fedyogi", lr=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3)
    v1 = 0.01 * DELTA_1 ** 2  # from zero: v − Δ² < 0, so v grows by (1 − β₂)Δ²
    v2 = v1 - 0.01 * DELTA_2 ** 2 * np.sign(v1 - DELTA_2 ** 2)
    m = 0.9 * 0.1 * DELTA_1 + 0.1 * DELTA_2
    assert state.v["x"] == pytest.approx(v2)
    assert second == pytest.approx(0.1 * (m / 0.19) / (np.sqrt(v2 / (1 - 0.99 ** 2)) + 1e-3))
    _, second, _ = two_steps("fedadagrad", lr=0.1, beta_1=0.9, tau=1e-3)
    assert second == pytest.approx(0.1 * m / (np.sqrt(DELTA_1 ** 2 + DELTA_2 ** 2) + 1e-3))
    first, second, _ = two_steps("fedavgm", lr=0.5, beta_1=0.9)
    assert first == pytest.approx(0.5 * DELTA_1) and second == pytest.approx(0.5 * (0.9 * DELTA_1 + DELTA_2))


@pytest.mark.parametrize("name, bound", [("fedadam", 0.1 / np.sqrt(0.01 * (1 - 0.81 / 0.99))),
                                         ("fedadagrad", 0.1 / np.sqrt(1 - 0.81))])
def test_an_adaptive_step_stays_within_its_documented_bound_whatever_the_updates(name, bound):
    """Adversarial update sequences (tiny, then huge, signs flipping): |step| ≤ lr·bound per coordinate."""
    opt, rng = ServerOptimizer(name=name, lr=1.0, tau=1e-12), np.random.default_rng(0)
    assert opt.step_bound() == pytest.approx(bound) and ServerOptimizer(name="fedyogi").step_bound() is None
    worst = 0.0
    for _ in range(100):
        state = OptimizerState()
        for _ in range(int(rng.integers(1, 30))):
            delta = rng.choice([1e-6, 1.0, 1e6], size=64) * rng.choice([-1.0, 1.0], size=64)
            step, state = opt.step({"x": delta}, state)
            worst = max(worst, float(np.max(np.abs(step["x"]))))
    assert 0.1 < worst <= bound


def test_bad_settings_are_refused_with_the_setting_named():
    with pytest.raises(ValueError, match="fedadm.*fedadam"):
        ServerOptimizer(name="fedadm")
    with pytest.raises(ValueError, match="beta_2"):
        ServerOptimizer(name="fedadam", beta_2=1.0)
    with pytest.raises(ValueError, match="unknown strategy.server_optimizer settings \\['eta'\\]"):
        ServerOptimizer.from_mapping({"name": "fedadam", "eta": 0.1})
    assert ServerOptimizer.from_mapping({"name": "fedyogi", "lr": "0.01"}).lr == 0.01


def test_the_strategy_steps_once_per_committed_round_and_a_refused_round_keeps_the_moments():
    # robust=off: the exact mean update (the default would clip 1.5 to 1.5x the lower-median norm, 0.5)
    strategy, _ = make_strategy(uplink="delta", server_optimizer=ServerOptimizer(name="fedadam", lr=0.01),
                                robustness=Robustness(norm_clip="none", center=None, examples_multiple=None, max_abs=None))
    arrays, _ = strategy.aggregate_train(1, [reply(1, payload(0.5), 10), reply(2, payload(1.5), 10)])
    # first step: lr·Δ/(|Δ| + τ) with Δ = 1.0 everywhere
    for key in STATE:
        assert codec.decode(arrays)[key] == pytest.approx(STATE[key] + 0.01 / (1 + 1e-3))
    assert strategy.model_step.moments.t == 1
    # a round whose only reply is refused: no step, the moments unchanged
    arrays, _ = strategy.aggregate_train(2, [reply(1, payload(9.0, **{"layer.extra": np.ones(2, np.float32)}))])
    assert arrays is None and strategy.model_step.moments.t == 1


def test_a_round_refused_after_the_step_does_not_keep_its_moments():
    """No bounds (robust off): fedavgm at lr 10 turns a mean update of 3e38 into a step beyond float32,
    the aggregate is not finite and the round is refused; the moments stay those of round 1."""
    from strategies.robust import Robustness

    strategy, _ = make_strategy(uplink="delta", robustness=Robustness.off(),
                                server_optimizer=ServerOptimizer(name="fedavgm", lr=10.0))
    strategy.aggregate_train(1, [reply(1, payload(0.5), 10)])
    before = {k: v.copy() for k, v in strategy.model_step.moments.m.items()}
    state = {k: v.copy() for k, v in strategy.global_state.items()}
    arrays, _ = strategy.aggregate_train(2, [reply(1, payload(3e38), 10)])
    assert arrays is None and "not finite" in strategy.round_record()["refused"][0]["reason"]
    assert strategy.model_step.moments.t == 1 and all(np.array_equal(strategy.model_step.moments.m[k], before[k]) for k in before)
    assert all(np.array_equal(strategy.global_state[k], state[k]) for k in state)


def test_the_moments_go_into_the_checkpoint_and_a_resumed_run_steps_as_the_first_would_have():
    opt = ServerOptimizer(name="fedyogi", lr=0.01)
    first, _ = make_strategy(uplink="delta", server_optimizer=opt)
    first.aggregate_train(1, [reply(1, payload(0.5), 10), reply(2, payload(1.5), 30)])
    arrays, meta = first.state_dict()
    assert meta["server_optimizer"] == {"name": "fedyogi", "t": 1} and "server-opt/v/layer.lora_A" in arrays
    resumed, _ = make_strategy(uplink="delta", server_optimizer=opt)
    resumed.load_state_dict(arrays, meta)
    a, _ = first.aggregate_train(2, [reply(1, payload(-0.5), 10)])
    b, _ = resumed.aggregate_train(2, [reply(1, payload(-0.5), 10)])
    assert all(np.array_equal(codec.decode(a)[k], codec.decode(b)[k]) for k in STATE)
    # a checkpoint of another optimiser is refused, by name
    plain, _ = make_strategy(uplink="delta")
    with pytest.raises(ValueError, match="'fedyogi', this run uses 'fedavg'"):
        plain.load_state_dict(arrays, meta)


def test_absolute_uplinks_step_on_the_mean_update():
    strategy, _ = make_strategy(server_optimizer=ServerOptimizer(name="fedavgm", lr=0.5, beta_1=0.9),
                                robustness=Robustness(norm_clip="none", center=None, examples_multiple=None, max_abs=None))  # robust=off: the exact mean update
    arrays, _ = strategy.aggregate_train(1, [reply(1, payload(2.0), 10), reply(2, payload(4.0), 10)])
    new = codec.decode(arrays)
    for key in STATE:  # the mean update is 3 − global; fedavgm's first step is lr times it
        assert new[key] == pytest.approx(STATE[key] + 0.5 * (3.0 - STATE[key]))


def test_the_config_refuses_a_bad_optimizer_and_one_smartfed_cannot_use():
    from fedapps.config import ConfigError, compose

    with pytest.raises(ConfigError, match="unknown server optimizer 'fedadm'"):
        compose(["strategy.server_optimizer.name=fedadm"], preset="test")
    with pytest.raises(ConfigError, match="smartfed.*not supported"):
        compose(["strategy.server_optimizer.name=fedadam"], preset="test", algorithm="smartfed")
    cfg = compose(["strategy.server_optimizer.name=fedyogi", "strategy.server_optimizer.lr=0.01"], preset="test",
                  algorithm="flite")
    assert cfg.strategy.server_optimizer.name == "fedyogi"
