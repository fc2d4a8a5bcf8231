"""Server optimisers: how a round's combined update moves the global state (numpy only).

FedAvg adds the clients' mean update ``Δ`` to the global values as it is. The adaptive
federated optimisers of Reddi et al. (2021, "Adaptive Federated Optimization", the family
of Flower's ``FedAvgM``, ``FedAdagrad``, ``FedAdam`` and ``FedYogi``) treat ``Δ`` as a
pseudo-gradient and step with server-side moments, per coordinate:

``fedavgm``   ``m ← β₁·m + Δ``;                                   step ``η·m``
``fedadagrad`` ``m ← β₁·m + (1−β₁)·Δ``, ``v ← v + Δ²``;             step ``η·m / (√v + τ)``
``fedadam``   ``m ← β₁·m + (1−β₁)·Δ``, ``v ← β₂·v + (1−β₂)·Δ²``;   step ``η·m̂ / (√v̂ + τ)``
``fedyogi``   as fedadam, with ``v ← v − (1−β₂)·Δ²·sign(v − Δ²)``

``m̂ = m / (1 − β₁ᵗ)`` and ``v̂ = v / (1 − β₂ᵗ)`` correct the zero initialisation after
``t`` steps (Kingma & Ba; Flower's FedAdam does the same with ``t = round + 1``), so the
first step of fedadam / fedyogi is ``η·sign(Δ)`` (for ``|Δ| ≫ τ``): ``η`` is the size of a
step per coordinate, in the units of the federated values. The moments start at zero; a
step is computed without changing them (:meth:`ServerOptimizer.step` returns the new
state), and the strategy keeps the new state only when the round commits, so a refused
round leaves them as they were. They are checkpointed with the run.

A hostile client's reach: the robust layer bounds its share of each round's ``Δ``
(``strategies.robust``); the optimiser then bounds the step per coordinate. fedadam (with
``β₁² < β₂``): ``|m̂|/√v̂ ≤ (1−β₁)/√((1−β₂)(1−β₁²/β₂))`` by Cauchy–Schwarz over the rounds
(2.34 at the defaults; the bias correction only lowers it), so a step is at most about
``2.34·η`` whatever ``Δ`` was; fedadagrad: ``(1−β₁)/√(1−β₁²)`` (0.23); fedyogi: at most
``η·max|Δ|/τ`` (the trivial bound; its ``v`` shrinks more slowly than Adam's in practice);
fedavgm: ``η·Σ β₁ᵏ·|Δ|``, at most ``η·max|Δ|/(1−β₁)``. ``tests/test_server_opt.py`` checks the
fedadam and fedadagrad bounds on adversarial sequences.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

import numpy as np

OPTIMIZERS = ("fedavg", "fedavgm", "fedadagrad", "fedadam", "fedyogi")
PREFIX = "server-opt"  # checkpoint keys: server-opt/m/<key>, server-opt/v/<key>


@dataclass(frozen=True)
class ServerOptimizer:
    """The ``strategy.server_optimizer`` settings; ``name='fedavg'`` is plain FedAvg (no state)."""

    name: str = "fedavg"
    lr: float = 1.0
    beta_1: float = 0.9
    beta_2: float = 0.99
    tau: float = 1e-3

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"unknown server optimizer {self.name!r}; choose one of {list(OPTIMIZERS)}")
        if not (np.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"strategy.server_optimizer.lr must be a positive number, got {self.lr!r}")
        for name in ("beta_1", "beta_2"):
            if not 0.0 <= float(getattr(self, name)) < 1.0:
                raise ValueError(f"strategy.server_optimizer.{name} must be in [0, 1), got {getattr(self, name)!r}")
        if not (np.isfinite(self.tau) and self.tau > 0):
            raise ValueError(f"strategy.server_optimizer.tau must be a positive number, got {self.tau!r}")

    @classmethod
    def from_mapping(cls, values: Mapping | None) -> ServerOptimizer:
        """From the composed ``strategy.server_optimizer`` mapping (unknown keys refused)."""
        values = dict(values or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown strategy.server_optimizer settings {unknown}; known: {sorted(known)}")
        kwargs = {k: (str(v) if k == "name" else float(v)) for k, v in values.items() if v is not None}
        return cls(**kwargs)

    def step_bound(self) -> float | None:
        """The most one step moves a coordinate, whatever the updates were (the module docstring):
        fedadam (``β₁² < β₂``) and fedadagrad; None where it depends on the updates' size."""
        b1, b2 = float(self.beta_1), float(self.beta_2)
        if self.name == "fedadam" and b1 * b1 < b2:
            return self.lr * (1.0 - b1) / float(np.sqrt((1.0 - b2) * (1.0 - b1 * b1 / b2)))
        if self.name == "fedadagrad":
            return self.lr * (1.0 - b1) / float(np.sqrt(1.0 - b1 * b1))
        return None

    @property
    def plain(self) -> bool:
        """FedAvg: the update is applied as it is, and there is no state."""
        return self.name == "fedavg"

    def step(self, update: Mapping[str, np.ndarray], state: OptimizerState) -> tuple[dict, OptimizerState]:
        """(the step to add to the global values, the moments after it) for the combined update
        ``update``; ``state`` is not changed."""
        if self.plain:
            return {k: np.asarray(v) for k, v in update.items()}, state
        t = state.t + 1
        b1, b2 = float(self.beta_1), float(self.beta_2)
        m_new, v_new, out = {}, {}, {}
        for key, value in update.items():
            delta = np.asarray(value, dtype=np.float64)
            m = state.m.get(key, np.zeros(delta.shape))
            v = state.v.get(key, np.zeros(delta.shape))
            if self.name == "fedavgm":
                m_new[key] = b1 * m + delta
                out[key] = self.lr * m_new[key]
                continue
            m_new[key] = b1 * m + (1.0 - b1) * delta
            square = delta * delta
            if self.name == "fedadagrad":
                v_new[key] = v + square
                out[key] = self.lr * m_new[key] / (np.sqrt(v_new[key]) + self.tau)
                continue
            if self.name == "fedadam":
                v_new[key] = b2 * v + (1.0 - b2) * square
            else:  # fedyogi
                v_new[key] = v - (1.0 - b2) * square * np.sign(v - square)
            m_hat = m_new[key] / (1.0 - b1 ** t)
            v_hat = v_new[key] / (1.0 - b2 ** t)
            out[key] = self.lr * m_hat / (np.sqrt(v_hat) + self.tau)
        return out, OptimizerState(t=t, m=m_new, v=v_new)


@dataclass(frozen=True)
class OptimizerState:
    """A server optimiser's moments after ``t`` steps (float64 arrays per federated key)."""

    t: int = 0
    m: Mapping[str, np.ndarray] | None = None
    v: Mapping[str, np.ndarray] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "m", dict(self.m or {}))
        object.__setattr__(self, "v", dict(self.v or {}))

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The moments as checkpoint arrays (``server-opt/m/<key>``, ``server-opt/v/<key>``)."""
        out = {f"{PREFIX}/m/{k}": np.asarray(v) for k, v in self.m.items()}
        out.update({f"{PREFIX}/v/{k}": np.asarray(v) for k, v in self.v.items()})
        return out

    @classmethod
    def from_arrays(cls, t: int, arrays: Mapping[str, np.ndarray], keys: list[str]) -> OptimizerState:
        """The inverse of :meth:`to_arrays`; a moment for a key outside ``keys`` is refused."""
        m, v = {}, {}
        for name, value in arrays.items():
            kind, _, key = name.removeprefix(f"{PREFIX}/").partition("/")
            if kind not in ("m", "v") or key not in keys:
                raise ValueError(f"checkpoint moment {name!r} does not belong to this run's layout")
            (m if kind == "m" else v)[key] = np.asarray(value, dtype=np.float64)
        return cls(t=int(t), m=m, v=v)
