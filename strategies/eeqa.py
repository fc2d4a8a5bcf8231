r"""Elastic Expert Quota Allocation (EEQA) for SmartFed, numpy only.

A global budget of ``B`` active experts is shared out among the target matrices each
round in proportion to their measured importance; within a matrix the most important
experts are the active ones; experts that stay unimportant are pruned.

**The SmartFed paper's exact EEQA formula is not public** (the code is unreleased and the
summaries only name an "importance score"). What follows is this project's documented
formula, in the spirit of the paper and of AdaLoRA's budget scheduling.

Notation (one round): matrices ``m`` with experts ``e = 0..E_m-1``; the round's reported
importance ``s_{m,e} >= 0`` (clients' EMA of gate mass × expert output norm, averaged by
the server; NaN = nobody measured ``e`` this round, e.g. it was inactive).

1. **Memory.** ``I_{m,e} <- s_{m,e}`` where measured, else the last measured value. An
   expert never measured is imputed with ``w ·`` the mean measured importance of its
   matrix, else of all matrices, else ``w · 1`` (so round 0 shares the budget in
   proportion to matrix sizes). ``w = unmeasured_weight``: 1 (default) is neutral — a
   measured expert below its matrix's mean then gives way to an unmeasured one, which
   explores the pool quickly but replaces part of the active set every round; ``w < 1``
   keeps experts that were measured (and trained) unless they fall below ``w`` × the mean.
2. **Pruning** (off when ``prune_threshold == 0``). An expert is *low* in a round when it is
   measured and ``s_{m,e} < prune_threshold · mean_{e' measured in m} s_{m,e'}`` (relative
   to its peers, so the threshold is scale-free across matrices). A counter of consecutive
   low rounds is kept per expert (unmeasured rounds leave it as is, a non-low measured round
   resets it); at ``prune_patience`` the expert is pruned for good, lowest importance
   first, never leaving a matrix with fewer than ``min_per_matrix`` live experts.
3. **Bounds.** With ``n_m`` live experts: ``lo_m = min(q_min, n_m)``,
   ``hi_m = min(q_max, n_m)``, total ``T = min(B, Σ_m hi_m)`` — the quotas sum to exactly
   ``T`` (an error if ``Σ_m lo_m > T``).
4. **Proportional shares with water-filling.** ``S_m = Σ_{e live} I_{m,e}``; find
   ``λ >= 0`` with ``Σ_m clip(λ S_m, lo_m, hi_m) = T`` and set
   ``q*_m = clip(λ S_m, lo_m, hi_m)`` (matrices at a bound are fixed and the rest of the
   budget is re-shared among the others). If even ``λ -> ∞`` leaves budget over (matrices
   with ``S_m = 0``), the rest goes to those matrices in proportion to their room
   ``hi_m - lo_m``. Computed in exact rational arithmetic (``fractions.Fraction``), so the
   result is the same on every machine.
5. **Largest remainder.** ``q_m = ⌊q*_m⌋``, then one more expert to each of the
   ``T - Σ_m ⌊q*_m⌋`` matrices with the largest fractional parts ``q*_m - ⌊q*_m⌋``
   (ties: larger ``S_m``, then matrix name). Since ``lo``/``hi`` are integers every
   ``q_m`` stays within ``[lo_m, hi_m]`` and ``Σ_m q_m = T`` exactly.
   Raising one matrix's importance never lowers its own quota (as with any
   largest-remainder method, another matrix may then gain an expert at a third's expense).
6. **Active sets.** Matrix ``m``'s active experts are its ``q_m`` live experts of largest
   ``I_{m,e}`` (ties: smaller index), returned sorted by index.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

IntPerMatrix = int | Mapping[str, int]


def _per_matrix(value: IntPerMatrix | None, names, default: Mapping[str, int]) -> dict[str, int]:
    if value is None:
        return dict(default)
    if isinstance(value, Mapping):
        unknown = set(value) - set(names)
        if unknown:
            raise ValueError(f"bounds given for unknown matrices {sorted(unknown)}")
        return {m: int(value.get(m, default[m])) for m in names}
    return {m: int(value) for m in names}


def _water_fill(weights: dict[str, Fraction], lo: dict[str, int], hi: dict[str, int], total: int) -> dict[str, Fraction]:
    """Exact ``q_m = clip(λ w_m, lo_m, hi_m)`` with ``Σ q_m = total`` (zero weights stay at lo)."""

    def filled(lam: Fraction) -> Fraction:
        return sum((min(max(lam * w, lo[m]), hi[m]) for m, w in weights.items()), Fraction(0))

    positive = [m for m, w in weights.items() if w > 0]
    points = sorted({Fraction(b) / weights[m] for m in positive for b in (lo[m], hi[m])} | {Fraction(0)})
    if filled(points[-1]) <= total:  # every positive-weight matrix is at its top
        return {m: Fraction(hi[m]) if weights[m] > 0 else Fraction(lo[m]) for m in weights}
    # The smallest breakpoint index j with filled(points[j]) >= total (filled is non-decreasing).
    left, right = 0, len(points) - 1
    while left < right:
        mid = (left + right) // 2
        if filled(points[mid]) >= total:
            right = mid
        else:
            left = mid + 1
    if left == 0:
        lam = points[0]
    else:
        a, b = points[left - 1], points[left]
        fa, fb = filled(a), filled(b)
        lam = a + (b - a) * (total - fa) / (fb - fa)  # filled is linear on [a, b]
    return {m: min(max(lam * w, Fraction(lo[m])), Fraction(hi[m])) for m, w in weights.items()}


def allocate_quotas(
    scores: Mapping[str, float],
    budget: int,
    lo: Mapping[str, int],
    hi: Mapping[str, int],
) -> dict[str, int]:
    """Integer quotas ``q_m ∈ [lo_m, hi_m]`` with ``Σ q_m = min(budget, Σ hi_m)``, shares ∝ score.

    Steps 3–5 of the module docstring: exact water-filling, then largest remainder.

    Args:
        scores: ``S_m >= 0`` per matrix (finite).
        budget: the global number of active experts ``B >= 0``.
        lo, hi: integer bounds per matrix, ``0 <= lo_m <= hi_m``.
    """
    names = sorted(scores)
    if set(lo) != set(names) or set(hi) != set(names):
        raise ValueError("scores, lo and hi must cover the same matrices")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    for m in names:
        if not (0 <= lo[m] <= hi[m]):
            raise ValueError(f"matrix '{m}': need 0 <= min <= max, got min={lo[m]}, max={hi[m]}")
        if not math.isfinite(scores[m]) or scores[m] < 0:
            raise ValueError(f"matrix '{m}': score must be finite and >= 0, got {scores[m]}")
    if not names:
        return {}
    total = min(int(budget), sum(hi.values()))
    if sum(lo.values()) > total:
        raise ValueError(
            f"the budget {budget} cannot give every matrix its minimum: the minimums add up to {sum(lo.values())}"
        )

    weights = {m: Fraction(float(scores[m])) for m in names}
    if all(w == 0 for w in weights.values()):
        weights = {m: Fraction(hi[m]) for m in names}  # nothing measured: share by size
    share = _water_fill(weights, lo, hi, total)
    left = total - sum(share.values())
    if left > 0:
        # Every matrix with a positive score is at its maximum; the zero-score matrices
        # (still at their minimum) take the rest in proportion to their room.
        zero = [m for m in names if weights[m] == 0]
        room = {m: Fraction(hi[m] - lo[m]) for m in zero}
        target = sum((share[m] for m in zero), Fraction(0)) + left
        share.update(_water_fill(room, {m: lo[m] for m in zero}, {m: hi[m] for m in zero}, target))

    quotas = {m: math.floor(share[m]) for m in names}
    seats = total - sum(quotas.values())
    order = sorted(
        (m for m in names if quotas[m] < hi[m]),
        key=lambda m: (-(share[m] - quotas[m]), -weights[m], m),
    )
    if seats < 0 or seats > len(order):  # impossible with exact arithmetic
        raise AssertionError(f"largest remainder has {seats} seats for {len(order)} matrices")
    for m in order[:seats]:
        quotas[m] += 1
    return quotas


def select_active(importance: np.ndarray, quota: int, live: np.ndarray | None = None) -> np.ndarray:
    """Indices of the ``quota`` live experts of largest importance (ties: smaller index), sorted."""
    importance = np.asarray(importance, dtype=np.float64)
    live = np.ones(importance.shape, bool) if live is None else np.asarray(live, bool)
    candidates = np.flatnonzero(live)
    if quota > candidates.size:
        raise ValueError(f"quota {quota} exceeds the {candidates.size} live experts")
    order = candidates[np.lexsort((candidates, -importance[candidates]))]
    return np.sort(order[:quota])


@dataclass
class Allocation:
    """One round of EEQA.

    Attributes:
        quotas: active experts per matrix (sums to ``total``).
        active: per matrix, the sorted indices of its active experts.
        pruned: per matrix, the experts pruned *this* round (sorted indices).
        importance: per matrix, the importance used (memory with imputation), ``(E,)``.
        total: ``min(budget, live capacity)``.
    """

    quotas: dict[str, int]
    active: dict[str, np.ndarray]
    pruned: dict[str, np.ndarray]
    importance: dict[str, np.ndarray]
    total: int


class EEQA:
    """Stateful EEQA: importance memory, pruning counters, and per-round allocation.

    Args:
        num_experts: experts per matrix (``ExpertLayout.num_experts``).
        budget: the global number of active experts ``B``.
        min_per_matrix: ``q_min`` (int, or per matrix); default 1.
        max_per_matrix: ``q_max`` (int, or per matrix); default: the matrix's expert count.
        prune_threshold: relative threshold of step 2 (0 disables pruning).
        prune_patience: ``P``, consecutive low rounds before an expert is pruned.
        unmeasured_weight: ``w`` of step 1, the imputed importance of never-measured experts
            relative to the mean measured one (> 0).
    """

    def __init__(
        self,
        num_experts: Mapping[str, int],
        budget: int,
        *,
        min_per_matrix: IntPerMatrix = 1,
        max_per_matrix: IntPerMatrix | None = None,
        prune_threshold: float = 0.0,
        prune_patience: int = 3,
        unmeasured_weight: float = 1.0,
    ):
        if not num_experts:
            raise ValueError("EEQA needs at least one matrix")
        self.names = sorted(num_experts)
        self.num_experts = {m: int(num_experts[m]) for m in self.names}
        if any(n <= 0 for n in self.num_experts.values()):
            raise ValueError("every matrix needs at least one expert")
        if budget < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        if prune_threshold < 0 or prune_patience < 1:
            raise ValueError("prune_threshold must be >= 0 and prune_patience >= 1")
        if not (math.isfinite(unmeasured_weight) and unmeasured_weight > 0):
            raise ValueError(f"unmeasured_weight must be > 0, got {unmeasured_weight}")
        self.unmeasured_weight = float(unmeasured_weight)
        self.budget = int(budget)
        self.min_per_matrix = _per_matrix(min_per_matrix, self.names, {m: 1 for m in self.names})
        self.max_per_matrix = _per_matrix(max_per_matrix, self.names, self.num_experts)
        self.prune_threshold = float(prune_threshold)
        self.prune_patience = int(prune_patience)
        self.memory = {m: np.full(n, np.nan) for m, n in self.num_experts.items()}
        self.low_rounds = {m: np.zeros(n, np.int64) for m, n in self.num_experts.items()}
        self.pruned = {m: np.zeros(n, bool) for m, n in self.num_experts.items()}
        self.rounds = 0
        self._check_bounds()

    def _check_bounds(self) -> None:
        lo = {m: min(self.min_per_matrix[m], int((~self.pruned[m]).sum())) for m in self.names}
        hi = {m: min(self.max_per_matrix[m], int((~self.pruned[m]).sum())) for m in self.names}
        if sum(lo.values()) > min(self.budget, sum(hi.values())):
            raise ValueError(
                f"budget {self.budget} is below the sum of per-matrix minimums ({sum(lo.values())})"
            )

    def _imputed(self) -> dict[str, np.ndarray]:
        known_all = np.concatenate([v[np.isfinite(v)] for v in self.memory.values()])
        fallback = float(known_all.mean()) if known_all.size else 1.0
        out = {}
        for m, v in self.memory.items():
            known = v[np.isfinite(v)]
            fill = self.unmeasured_weight * (float(known.mean()) if known.size else fallback)
            out[m] = np.where(np.isfinite(v), v, fill)
        return out

    def _prune(self, importance: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        newly = {m: np.zeros(0, np.int64) for m in self.names}
        if self.prune_threshold == 0:
            return newly
        for m in self.names:
            s = importance.get(m)
            if s is None:
                continue
            measured = np.isfinite(s) & ~self.pruned[m]
            if not measured.any():
                continue
            low = measured & (s < self.prune_threshold * s[measured].mean())
            self.low_rounds[m][low] += 1
            self.low_rounds[m][measured & ~low] = 0
            due = np.flatnonzero((self.low_rounds[m] >= self.prune_patience) & ~self.pruned[m])
            can = int((~self.pruned[m]).sum()) - self.min_per_matrix[m]
            if due.size == 0 or can <= 0:
                continue
            order = due[np.lexsort((due, self.memory[m][due]))][:can]  # lowest importance first
            self.pruned[m][order] = True
            newly[m] = np.sort(order)
        return newly

    def step(self, importance: Mapping[str, np.ndarray] | None = None) -> Allocation:
        """One round: fold in the round's importance, prune, and allocate quotas/active sets.

        ``importance`` maps matrices to ``(E_m,)`` arrays (NaN = not measured); matrices
        absent count as unmeasured. ``None`` (e.g. round 1) allocates from memory alone.
        """
        importance = dict(importance or {})
        unknown = set(importance) - set(self.names)
        if unknown:
            raise ValueError(f"importance for unknown matrices {sorted(unknown)}")
        for m, s in importance.items():
            s = np.asarray(s, dtype=np.float64)
            if s.shape != (self.num_experts[m],):
                raise ValueError(f"importance of '{m}' has shape {s.shape}, expected ({self.num_experts[m]},)")
            if np.any(np.isinf(s)) or np.any(s[np.isfinite(s)] < 0):
                raise ValueError(f"importance of '{m}' must be >= 0 and finite (NaN = unmeasured)")
            importance[m] = s
            self.memory[m] = np.where(np.isfinite(s), s, self.memory[m])

        newly = self._prune(importance)
        imputed = self._imputed()
        live = {m: ~self.pruned[m] for m in self.names}
        lo = {m: min(self.min_per_matrix[m], int(live[m].sum())) for m in self.names}
        hi = {m: min(self.max_per_matrix[m], int(live[m].sum())) for m in self.names}
        scores = {m: float(imputed[m][live[m]].sum()) for m in self.names}
        quotas = allocate_quotas(scores, self.budget, lo, hi)
        active = {m: select_active(imputed[m], quotas[m], live[m]) for m in self.names}
        self.rounds += 1
        return Allocation(quotas, active, newly, imputed, sum(quotas.values()))

    def state_dict(self) -> dict:
        """JSON-able state (memory with NaN as None, counters, pruned masks)."""
        return {
            "rounds": self.rounds,
            "memory": {m: [None if not np.isfinite(x) else float(x) for x in v] for m, v in self.memory.items()},
            "low_rounds": {m: v.tolist() for m, v in self.low_rounds.items()},
            "pruned": {m: np.flatnonzero(v).tolist() for m, v in self.pruned.items()},
        }

    def load_state_dict(self, state: Mapping) -> None:
        if set(state["memory"]) != set(self.names):
            raise ValueError("EEQA state covers different matrices")
        self.rounds = int(state["rounds"])
        for m in self.names:
            self.memory[m] = np.array([np.nan if x is None else x for x in state["memory"][m]], np.float64)
            self.low_rounds[m] = np.asarray(state["low_rounds"][m], np.int64)
            self.pruned[m] = np.zeros(self.num_experts[m], bool)
            self.pruned[m][np.asarray(state["pruned"][m], np.int64)] = True
