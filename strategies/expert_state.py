"""SmartFed's server side of the expert payload: the global mixture and its sparse FedAvg.

:class:`ExpertState` holds every expert of the pool's layout (A rows, B columns, router
rows); :meth:`ExpertState.gather` packs the active ones as a downlink
(:mod:`strategies.sparse`, the wire format both sides share).

Aggregation (:func:`aggregate`): each expert's (and router row's) delta is averaged over
the clients that sent it, weighted by their ``num-examples``, and added to the global
value; experts nobody sent keep their value. Importance is averaged the same way and is
NaN for experts nobody measured this round (:mod:`strategies.eeqa` keeps the memory).

numpy only: strategies never import clients or torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from strategies.codec import PayloadError
from strategies.sparse import VALUE_FIELDS, ExpertLayout, MatrixPayload, check_ids, init_router, validate


@dataclass
class ExpertState:
    """The server's global mixture: every expert's A row, B column and router row.

    ``A[m]``: ``(E, d_in)``; ``B[m]``: ``(E, d_out)`` (LoRA B columns, scale folded in,
    stored as rows); ``router[m]``: ``(E, d_in)``. All float32.
    """

    layout: ExpertLayout
    A: dict[str, np.ndarray] = field(default_factory=dict)
    B: dict[str, np.ndarray] = field(default_factory=dict)
    router: dict[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self):
        self.A, self.B, self.router = dict(self.A), dict(self.B), dict(self.router)
        for m, ml in self.layout.matrices.items():
            shapes = {"A": (ml.num_experts, ml.d_in), "B": (ml.num_experts, ml.d_out), "router": (ml.num_experts, ml.d_in)}
            for name, shape in shapes.items():
                table = getattr(self, name)
                if m not in table:
                    raise ValueError(f"state lacks {name} of matrix '{m}'")
                table[m] = np.ascontiguousarray(np.asarray(table[m], dtype=np.float32))
                if table[m].shape != shape:
                    raise ValueError(f"state {name} of '{m}' has shape {table[m].shape}, expected {shape}")

    @classmethod
    def initial(
        cls,
        layout: ExpertLayout,
        experts: Mapping[str, tuple[np.ndarray, np.ndarray]],
        router_seed: int = 0,
        router_std: float = 0.02,
    ) -> ExpertState:
        """From pooled experts ``{m: (A (E×d_in), B (d_out×E))}`` and :func:`init_router`."""
        A, B, router = {}, {}, {}
        for m, ml in layout.matrices.items():
            if m not in experts:
                raise ValueError(f"no experts given for matrix '{m}'")
            a, b = experts[m]
            A[m], B[m] = np.asarray(a, np.float32), np.asarray(b, np.float32).T
            router[m] = init_router(m, ml.num_experts, ml.d_in, router_seed, router_std)
        return cls(layout, A, B, router)

    def copy(self) -> ExpertState:
        return ExpertState(
            self.layout,
            {m: v.copy() for m, v in self.A.items()},
            {m: v.copy() for m, v in self.B.items()},
            {m: v.copy() for m, v in self.router.items()},
        )

    def gather(self, active: Mapping[str, Sequence[int]], include_experts: bool = True) -> dict[str, np.ndarray]:
        """The downlink: a packed *state* of the active experts' values, ids sorted.

        ``include_experts=False`` (router-only runs whose clients hold the pool) sends the
        ids and router rows only.
        """
        if not include_experts and self.layout.train_experts:
            raise ValueError("experts train in this run: the downlink must carry their A and B")
        out: dict[str, np.ndarray] = {}
        for m in self.layout:
            ids = np.asarray(sorted(int(i) for i in active.get(m, ())), dtype=np.int64)
            if ids.size == 0:
                continue
            check_ids(m, ids.astype(np.float64), self.layout[m].num_experts)
            A, B = (self.A[m][ids], self.B[m][ids]) if include_experts else (None, None)
            out.update(MatrixPayload(ids, self.router[m][ids], A, B).tensors(m))
        return out

    def to_tensors(self) -> dict[str, np.ndarray]:
        """Every expert as one packed state (for checkpoints)."""
        return self.gather({m: range(ml.num_experts) for m, ml in self.layout.matrices.items()})

    @classmethod
    def from_tensors(cls, layout: ExpertLayout, tensors: Mapping[str, np.ndarray]) -> ExpertState:
        parts = validate(tensors, layout, kind="state")
        A, B, router = {}, {}, {}
        for m, ml in layout.matrices.items():
            part = parts.get(m)
            if part is None or part.ids.size != ml.num_experts:
                raise PayloadError(f"a full state must hold every expert of '{m}'")
            order = np.argsort(part.ids)
            A[m], B[m], router[m] = part.A[order], part.B[order], part.router[order]
        return cls(layout, A, B, router)


def aggregate(
    state: ExpertState, updates: Sequence[tuple[Mapping[str, MatrixPayload], float]]
) -> tuple[ExpertState, dict[str, np.ndarray]]:
    """Example-weighted sparse FedAvg of validated updates (deltas).

    For every expert e of matrix m and each tensor X in (A, B, router)::

        X_e <- X_e + Σ_c n_c ΔX_{c,e} / Σ_c n_c      over the clients c that sent e

    Experts nobody sent keep their value. Importance: ``Σ_c n_c I_{c,e} / Σ_c n_c`` over
    the clients that reported it, NaN where nobody did.

    Args:
        state: the global state the clients started from (not modified).
        updates: ``(payload, num_examples)`` per client, payloads from :func:`decode`.

    Returns the new state and ``{matrix: importance (E,)}``.
    """
    new = state.copy()
    importance: dict[str, np.ndarray] = {}
    for _, weight in updates:
        if not np.isfinite(weight) or weight < 0:
            raise ValueError(f"num-examples weights must be finite and >= 0, got {weight}")
    for m, ml in state.layout.matrices.items():
        E = ml.num_experts
        sums = {n: np.zeros_like(getattr(state, n)[m], dtype=np.float64) for n in VALUE_FIELDS}
        weights = {n: np.zeros(E, np.float64) for n in (*VALUE_FIELDS, "importance")}
        imp_sum = np.zeros(E, np.float64)
        for payload, weight in updates:
            part = payload.get(m)
            if part is None or weight == 0:
                continue
            for name in VALUE_FIELDS:
                value = getattr(part, name)
                if value is not None:
                    sums[name][part.ids] += weight * value.astype(np.float64)
                    weights[name][part.ids] += weight
            if part.importance is not None:
                imp_sum[part.importance_ids] += weight * part.importance.astype(np.float64)
                weights["importance"][part.importance_ids] += weight
        for name in VALUE_FIELDS:
            hit = weights[name] > 0
            table = getattr(new, name)
            table[m][hit] = (table[m][hit].astype(np.float64) + sums[name][hit] / weights[name][hit, None]).astype(
                np.float32
            )
        imp = np.full(E, np.nan, np.float32)
        hit = weights["importance"] > 0
        imp[hit] = imp_sum[hit] / weights["importance"][hit]
        importance[m] = imp
    return new, importance
