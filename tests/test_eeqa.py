"""EEQA: quotas sum to the budget, respect bounds, follow importance; pruning."""

import numpy as np
import pytest

from strategies.eeqa import EEQA, allocate_quotas, select_active


def _bounds(names, lo, hi):
    return {m: lo for m in names}, {m: hi for m in names}


def test_quotas_sum_exactly_to_budget_and_respect_bounds():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 8))
        names = [f"m{i}" for i in range(n)]
        hi = {m: int(rng.integers(1, 9)) for m in names}
        lo = {m: int(rng.integers(0, hi[m] + 1)) for m in names}
        scores = {m: float(rng.choice([0.0, rng.random(), 10 * rng.random()])) for m in names}
        budget = int(rng.integers(sum(lo.values()), sum(hi.values()) + 5))
        q = allocate_quotas(scores, budget, lo, hi)
        assert sum(q.values()) == min(budget, sum(hi.values()))
        assert all(lo[m] <= q[m] <= hi[m] for m in names)


def test_proportional_when_exact():
    lo, hi = _bounds("abc", 1, 100)
    assert allocate_quotas({"a": 1.0, "b": 2.0, "c": 3.0}, 12, lo, hi) == {"a": 2, "b": 4, "c": 6}


def test_water_filling_reshares_what_a_capped_matrix_cannot_take():
    # c would get 3.5 but is capped at 2; a and b share the other 5 in ratio 1:2.
    q = allocate_quotas({"a": 1.0, "b": 2.0, "c": 3.0}, 7, {"a": 1, "b": 1, "c": 1}, {"a": 8, "b": 8, "c": 2})
    assert q == {"a": 2, "b": 3, "c": 2}


def test_budget_larger_than_capacity_activates_everything():
    q = allocate_quotas({"a": 1.0, "b": 0.0}, 100, {"a": 1, "b": 1}, {"a": 3, "b": 5})
    assert q == {"a": 3, "b": 5}


def test_zero_score_matrices_absorb_the_rest():
    q = allocate_quotas({"a": 0.0, "b": 0.0, "c": 3.0}, 10, {"a": 1, "b": 1, "c": 1}, {"a": 8, "b": 4, "c": 2})
    assert q == {"a": 6, "b": 2, "c": 2}  # c full; a and b share 6 extra by room 7:3


def test_budget_below_minimums_is_an_error():
    with pytest.raises(ValueError, match="minimum"):
        allocate_quotas({"a": 1.0, "b": 1.0}, 1, {"a": 1, "b": 1}, {"a": 4, "b": 4})
    with pytest.raises(ValueError, match="minimums"):
        EEQA({"a": 4, "b": 4}, budget=1)


def test_bad_inputs_are_refused():
    lo, hi = _bounds("ab", 1, 4)
    with pytest.raises(ValueError, match="finite"):
        allocate_quotas({"a": float("nan"), "b": 1.0}, 4, lo, hi)
    with pytest.raises(ValueError, match=">= 0"):
        allocate_quotas({"a": -1.0, "b": 1.0}, 4, lo, hi)
    with pytest.raises(ValueError, match="min <= max"):
        allocate_quotas({"a": 1.0, "b": 1.0}, 4, {"a": 3, "b": 1}, {"a": 2, "b": 4})


def test_monotone_in_importance():
    # Raising one matrix's score never lowers its own quota. (Another matrix may gain a
    # seat at a third's expense: largest remainder is not population-monotone.)
    rng = np.random.default_rng(1)
    for _ in range(400):
        n = int(rng.integers(2, 8))
        names = [f"m{i}" for i in range(n)]
        hi = {m: int(rng.integers(1, 9)) for m in names}
        lo = {m: int(rng.integers(0, hi[m] + 1)) for m in names}
        scores = {m: float(rng.choice([0.0, rng.random()])) for m in names}
        budget = int(rng.integers(sum(lo.values()), sum(hi.values()) + 3))
        before = allocate_quotas(scores, budget, lo, hi)
        m = names[int(rng.integers(n))]
        raised = dict(scores, **{m: scores[m] * (1 + 3 * rng.random()) + 0.5 * rng.random()})
        after = allocate_quotas(raised, budget, lo, hi)
        assert after[m] >= before[m]
        assert sum(after.values()) == sum(before.values())


def test_ties_are_deterministic():
    lo, hi = _bounds(["b", "a", "c"], 0, 5)
    q1 = allocate_quotas({"b": 1.0, "a": 1.0, "c": 1.0}, 4, lo, hi)
    q2 = allocate_quotas({"c": 1.0, "a": 1.0, "b": 1.0}, 4, lo, hi)
    assert q1 == q2 == {"a": 2, "b": 1, "c": 1}  # the leftover goes to the first name
    assert select_active(np.array([0.5, 0.9, 0.5, 0.5]), 2).tolist() == [0, 1]
    live = np.array([False, True, True, True])
    assert select_active(np.array([0.5, 0.9, 0.5, 0.5]), 2, live).tolist() == [1, 2]


def test_active_sets_are_the_most_important_experts():
    eeqa = EEQA({"a": 4, "b": 6}, budget=4)
    alloc = eeqa.step({"a": np.array([0.1, 0.9, 0.2, 0.8]), "b": np.array([1.0, 0, 0, 0, 0, 0.5])})
    assert alloc.quotas == {"a": 2, "b": 2} and alloc.total == 4
    assert alloc.active["a"].tolist() == [1, 3]
    assert alloc.active["b"].tolist() == [0, 5]


def test_first_round_shares_by_size_and_memory_imputes_unmeasured():
    eeqa = EEQA({"a": 4, "b": 8}, budget=6)
    assert eeqa.step().quotas == {"a": 2, "b": 4}
    # Only a's experts 0,1 measured: the rest of a gets their mean, b the global mean.
    alloc = eeqa.step({"a": np.array([3.0, 1.0, np.nan, np.nan])})
    assert alloc.importance["a"].tolist() == [3.0, 1.0, 2.0, 2.0]
    assert alloc.importance["b"].tolist() == [2.0] * 8
    # The memory keeps a value once measured, when later rounds do not measure it.
    alloc = eeqa.step({"a": np.array([np.nan, np.nan, 5.0, np.nan])})
    assert alloc.importance["a"].tolist() == [3.0, 1.0, 5.0, 3.0]


def test_pruning_after_patience_rounds():
    eeqa = EEQA({"a": 4, "b": 2}, budget=4, prune_threshold=0.5, prune_patience=2)
    low = {"a": np.array([1.0, 1.0, 0.01, 1.0]), "b": np.array([1.0, 1.0])}
    first = eeqa.step(low)
    assert all(v.size == 0 for v in first.pruned.values())
    eeqa.step({"a": np.full(4, np.nan)})  # unmeasured round: the counter does not move
    assert eeqa.low_rounds["a"].tolist() == [0, 0, 1, 0]
    second = eeqa.step(low)
    assert second.pruned["a"].tolist() == [2] and second.pruned["b"].size == 0
    assert 2 not in second.active["a"]
    third = eeqa.step(low)
    assert third.pruned["a"].size == 0  # reported once
    assert eeqa.pruned["a"].tolist() == [False, False, True, False]
    # Pruned experts leave the capacity: 3 + 2 live, budget 4.
    assert sum(third.quotas.values()) == 4 and third.quotas["a"] <= 3


def test_pruning_recovers_and_keeps_the_minimum():
    eeqa = EEQA({"a": 3}, budget=2, min_per_matrix=2, prune_threshold=0.9, prune_patience=1)
    alloc = eeqa.step({"a": np.array([0.0, 0.0, 3.0])})  # two low, but a must keep 2 alive
    assert alloc.pruned["a"].tolist() == [0]  # lowest importance, then smaller index
    assert alloc.quotas == {"a": 2}
    eeqa2 = EEQA({"a": 2}, budget=2, prune_threshold=0.5, prune_patience=2)
    eeqa2.step({"a": np.array([0.1, 1.0])})
    eeqa2.step({"a": np.array([1.0, 1.0])})  # recovered: the counter resets
    assert eeqa2.step({"a": np.array([0.1, 1.0])}).pruned["a"].size == 0


def test_state_dict_round_trip():
    eeqa = EEQA({"a": 3, "b": 2}, budget=3, prune_threshold=0.5, prune_patience=1)
    eeqa.step({"a": np.array([0.01, 1.0, np.nan]), "b": np.array([1.0, 2.0])})
    clone = EEQA({"a": 3, "b": 2}, budget=3, prune_threshold=0.5, prune_patience=1)
    clone.load_state_dict(eeqa.state_dict())
    nxt = {"a": np.array([1.0, 0.5, 0.2]), "b": np.array([np.nan, 1.0])}
    a, b = eeqa.step(nxt), clone.step(nxt)
    assert a.quotas == b.quotas
    assert all(np.array_equal(a.active[m], b.active[m]) for m in a.active)


def test_step_refuses_bad_importance():
    eeqa = EEQA({"a": 2}, budget=1)
    with pytest.raises(ValueError, match="shape"):
        eeqa.step({"a": np.ones(3)})
    with pytest.raises(ValueError, match="unknown"):
        eeqa.step({"z": np.ones(2)})
    with pytest.raises(ValueError, match=">= 0"):
        eeqa.step({"a": np.array([-1.0, 1.0])})
