"""Issue #62, finding 7: colluders. By default (centered clipping on top of the count cap and the norm
clip) two colluders of ten move a round less than the honest step and end 10 rounds within 2x the
honest-only distance, whatever they send (bench/colluders.py measures every setting and attack)."""

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord

from bench.colluders import run
from fedapps.config import compose
from strategies import robust
from strategies.robust import Robustness
from test_trust_bounds import push, reply, strategy, Grid


@pytest.mark.parametrize("attack", ["sign-flip", "drift", "orthogonal"])
def test_two_colluders_of_ten_are_held_below_the_honest_step_by_default(attack):
    record = run(10, 2, attack, Robustness(), seed=0, rounds=10)
    assert max(record["per_round"]) <= 1.0
    assert record["final_attacked"] <= 2.0 * record["final_honest_only"]


def test_without_centered_clipping_a_sign_flip_of_two_colluders_of_ten_drags_the_model_away():
    """What the default changed (fails with the earlier default, the norm clip alone)."""
    record = run(10, 2, "sign-flip", Robustness(center=None), seed=0, rounds=10)
    assert record["final_attacked"] > 2.0 * record["final_honest_only"]


def test_the_default_composes_centered_clipping_and_robust_off_turns_it_off():
    assert Robustness.from_mapping(compose([]).robust).center == "median"
    assert not Robustness.from_mapping(compose(["robust=off"]).robust).centers


def one_round(updates, settings):
    strat = strategy(clients=len(updates), robustness=settings)
    nodes = list(range(1, len(updates) + 1))
    requests = push(strat.configure_train(1, ArrayRecord(), ConfigRecord(), Grid(nodes)))
    strat.aggregate_train(1, [reply(requests[v], updates[v - 1]) for v in nodes])
    return strat, strat.global_state["w"].astype(np.float64)


def test_two_clients_are_averaged_exactly_and_a_far_update_is_pulled_to_the_crowds_spread():
    rng = np.random.default_rng(3)
    pair = [rng.normal(size=400).astype(np.float32) for _ in range(2)]
    _, both = one_round(pair, Robustness(norm_clip=None))
    _, plain = one_round(pair, Robustness.off())
    assert np.array_equal(both, plain)  # with two clients the median is their mean: nothing to clip

    common = rng.normal(size=400)
    honest = [(common + 0.1 * rng.normal(size=400)).astype(np.float32) for _ in range(4)]
    far = (common + 5.0 * rng.normal(size=400)).astype(np.float32)  # inside the norm clip, far from the crowd
    strat, mean = one_round([*honest, far], Robustness(norm_clip=None))
    updates = [u.astype(np.float64) for u in [*honest, far]]
    center = np.median(np.stack(updates), axis=0)
    distances = [float(np.linalg.norm(u - center)) for u in updates]
    bound = sorted(distances)[(len(updates) - 1) // 2]  # 1x the lower median distance
    expected = np.mean([center + min(1.0, bound / d) * (u - center) for u, d in zip(updates, distances)], axis=0)
    assert np.allclose(mean, expected, atol=1e-6)
    kept = [b["node_id"] for b in strat.round_record()["bounded"] if b["kind"] == "center-clipped"]
    assert 5 in kept and len(kept) == 2  # the far one, and the honest one beyond the lower median
    assert np.linalg.norm(mean - np.mean(honest, axis=0)) < 0.25 * np.linalg.norm(far - np.mean(honest, axis=0))
    assert robust.center_scales([{"w": h} for h in honest[:1]], Robustness()) is None  # one client: nothing


def test_smartfed_keeps_the_norm_clip_alone():
    from strategies.smartfed import SmartFedStrategy

    assert SmartFedStrategy.dense_updates is False
