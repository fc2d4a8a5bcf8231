"""Bounded influence of any one client: the ``robust`` settings and what they compute.

A Postcard server trusts no reply. :class:`~strategies.base.PayloadFedAvg` first *refuses*
what is malformed (layout, wire format, metrics, identity; see ``docs/robustness.md``),
then *bounds* what it accepts, with the functions here (numpy only):

``examples_multiple`` / ``max_examples``
    A reply's ``num-examples`` is its weight in the mean, and nothing proves it. Each
    weight is capped at ``examples_multiple`` × the round's *lower median* weight (and at
    ``max_examples`` if set). With one hostile client among ``n ≥ 2`` the lower median is
    an honest client's count, so the hostile weight is at most ``examples_multiple``
    honest ones.
``norm_clip`` / ``norm_multiple``
    Each client's *update* (its values minus the global values it was sent, or the delta it
    sent) is scaled down to at most ``norm_multiple`` × the lower median of the round's
    update norms (``norm_clip: median``) or to a fixed L2 norm (``norm_clip: <number>``).
``center`` / ``center_multiple``
    Centered clipping (Karimireddy, He & Jaggi, ICML 2021, with the coordinate-wise median as
    the center): each update's distance from the coordinate-wise median of the round's
    updates is scaled down to at most ``center_multiple`` × the lower median of those
    distances (``center: median``; ``none`` turns it off). The norm clip bounds how far an
    update reaches from zero, this one how far it reaches from the crowd: colluders who each
    stay inside the norm clip but all push one way (a sign flip, a slow drift) are pulled back
    to an honest client's spread. Applied after the norm clip. With one or two clients it
    changes nothing.
``max_abs``
    A value a client proposes (global + update) beyond ``±max_abs`` is refused outright:
    no honest LoRA factor, latent or weight comes near it, and it keeps float32 overflow
    out of the aggregate.
``aggregator``
    ``mean`` (the example-weighted FedAvg mean), or Flower's robust rules applied to the
    updates: ``median`` (coordinate-wise, as ``FedMedian``), ``trimmed-mean`` (Flower's
    ``trim_mean``, cutting ``trim_fraction`` at each end), ``krum`` / ``multi-krum``
    (Flower's ``select_multikrum`` with ``byzantine`` assumed hostile clients; multi-krum
    averages the ``n − byzantine`` selected updates by weight).

The bound this gives, with ``aggregator: mean``: if ``h`` honest clients report weights
``w_i`` and the round's update norms have lower median ``m``, one hostile client moves the
new global state by at most ``(c·w_med / (c·w_med + Σ w_i)) · k·m`` from the honest-only
mean (``c = examples_multiple``, ``k = norm_multiple``) — at most ``k·m`` in any case.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

import numpy as np
from flwr.app import Array, ArrayRecord, RecordDict
from flwr.serverapp.strategy.fedtrimmedavg import trim_mean
from flwr.serverapp.strategy.multikrum import select_multikrum

AGGREGATORS = ("mean", "median", "trimmed-mean", "krum", "multi-krum")


@dataclass(frozen=True)
class Robustness:
    """The ``robust`` config group (see the module docstring); the defaults are the group's."""

    aggregator: str = "mean"
    norm_clip: str | float | None = "median"
    norm_multiple: float = 1.5
    center: str | None = "median"
    center_multiple: float | None = 1.0
    examples_multiple: float | None = 1.0
    max_examples: int | None = None
    max_abs: float | None = 1.0e6
    trim_fraction: float = 0.2
    byzantine: int = 1

    def __post_init__(self) -> None:
        if self.aggregator not in AGGREGATORS:
            raise ValueError(f"robust.aggregator must be one of {list(AGGREGATORS)}, got {self.aggregator!r}")
        clip = self.norm_clip
        if clip not in (None, "none", "median"):
            try:
                ok = float(clip) > 0 and not isinstance(clip, bool)
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise ValueError(f"robust.norm_clip must be 'median', 'none' or a positive number, got {clip!r}")
        if self.center not in (None, "none", "median"):
            raise ValueError(f"robust.center must be 'median' or 'none', got {self.center!r}")
        if self.centers and self.center_multiple is None:
            raise ValueError("robust.center=median needs robust.center_multiple")
        for name in ("norm_multiple", "center_multiple", "examples_multiple", "max_abs"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"robust.{name} must be a positive number or null, got {value!r}")
        if self.norm_multiple is None and clip == "median":
            raise ValueError("robust.norm_clip=median needs robust.norm_multiple")
        if self.max_examples is not None and not (isinstance(self.max_examples, int) and self.max_examples >= 1):
            raise ValueError(f"robust.max_examples must be an integer >= 1 or null, got {self.max_examples!r}")
        if not 0.0 <= float(self.trim_fraction) < 0.5:
            raise ValueError(f"robust.trim_fraction must be in [0, 0.5), got {self.trim_fraction!r}")
        if not (isinstance(self.byzantine, int) and self.byzantine >= 0):
            raise ValueError(f"robust.byzantine must be an integer >= 0, got {self.byzantine!r}")

    @classmethod
    def from_mapping(cls, values: Mapping | None) -> Robustness:
        """From the composed ``robust`` group (unknown keys refused)."""
        values = dict(values or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known - {"name"})
        if unknown:
            raise ValueError(f"unknown robust settings {unknown}; known: {sorted(known)}")
        return cls(**{k: v for k, v in values.items() if k in known})

    @classmethod
    def off(cls) -> Robustness:
        """Plain FedAvg: no caps, no clipping, no magnitude bound (validation still applies)."""
        return cls(norm_clip=None, center=None, examples_multiple=None, max_examples=None, max_abs=None)

    @property
    def clips(self) -> bool:
        return self.norm_clip not in (None, "none")

    @property
    def centers(self) -> bool:
        return self.center not in (None, "none")


def lower_median(values: Sequence[float]) -> float:
    """The lower median (``sorted(values)[(n − 1) // 2]``): with one outlier among n ≥ 2
    values it is one of the others."""
    ordered = sorted(float(v) for v in values)
    return ordered[(len(ordered) - 1) // 2]


# What the one log line of a round's bounded replies calls far outside the bound (a WARNING; within it,
# the bounds are acting on honest-looking replies, an INFO line): a ``num-examples`` more than FAR_COUNT x
# the count it was capped at (honest partitions differ that much from the lower median: a Dirichlet(0.5)
# split or the natural one reaches 4-10x), an update norm more than FAR_NORM x the norm it was clipped to
# (6x the lower median at ``norm_multiple: 1.5``; one round's honest updates are within a few x).
FAR_COUNT = 10.0
FAR_NORM = 4.0


def cap_weights(weights: Sequence[int], settings: Robustness) -> list[int]:
    """Each ``num-examples`` capped at ``examples_multiple`` × the lower median (and ``max_examples``)."""
    capped = [int(w) for w in weights]
    if settings.examples_multiple is not None and capped:
        cap = max(1, int(settings.examples_multiple * lower_median(capped)))
        capped = [min(w, cap) for w in capped]
    if settings.max_examples is not None:
        capped = [min(w, settings.max_examples) for w in capped]
    return capped


def norm(update: Mapping[str, np.ndarray]) -> float:
    """L2 norm of a set of tensors, accumulated in float64."""
    return float(np.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64))) for v in update.values())))


def clip_bound(norms: Sequence[float], settings: Robustness) -> float | None:
    """The round's norm bound, or None when clipping is off."""
    if not settings.clips or not norms:
        return None
    if settings.norm_clip == "median":
        moving = [n for n in norms if n > 0]  # a client that changed nothing says nothing about the scale
        return float(settings.norm_multiple) * lower_median(moving) if moving else None
    return float(settings.norm_clip)


def clip_scales(norms: Sequence[float], settings: Robustness) -> list[float]:
    """Per client, the factor (≤ 1) that brings its update norm within the round's bound."""
    bound = clip_bound(norms, settings)
    if bound is None:
        return [1.0] * len(norms)
    return [1.0 if n <= bound else (bound / n if n > 0 else 1.0) for n in norms]


def center_scales(updates: Sequence[Mapping[str, np.ndarray]], settings: Robustness
                  ) -> tuple[dict[str, np.ndarray], list[float], list[float], float] | None:
    """Centered clipping: (the coordinate-wise median of the updates, per update the factor (≤ 1) on
    its distance from it, the distances, the bound ``center_multiple`` × their lower median); None when
    it is off or nothing is to be clipped. The clipped update is ``center + factor · (update − center)``
    (:func:`recenter`)."""
    if not settings.centers or len(updates) < 2:
        return None
    keys = sorted(updates[0])
    center = {k: np.median(np.stack([np.asarray(u[k], np.float64) for u in updates]), axis=0) for k in keys}
    distances = [norm({k: np.asarray(u[k], np.float64) - center[k] for k in keys}) for u in updates]
    moving = [d for d in distances if d > 0]
    if not moving:
        return None
    bound = float(settings.center_multiple) * lower_median(moving)
    # (1 + 1e-9): two clients sit at one distance from their median, their mean, up to rounding
    factors = [1.0 if d <= bound * (1 + 1e-9) else bound / d for d in distances]
    if all(f == 1.0 for f in factors):
        return None
    return center, factors, distances, bound


def recenter(update: Mapping[str, np.ndarray], center: Mapping[str, np.ndarray], factor: float) -> dict[str, np.ndarray]:
    """``center + factor · (update − center)`` (float64)."""
    return {k: center[k] + factor * (np.asarray(v, np.float64) - center[k]) for k, v in update.items()}


def weighted_mean(states: list[Mapping[str, np.ndarray]], weights: list[float]) -> dict[str, np.ndarray]:
    """Example-weighted mean of tensors with the same keys (float64 accumulation, float32 result)."""
    if not states:
        raise ValueError("weighted_mean needs at least one state")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("weights must sum to a positive number")
    out = {}
    for key in states[0]:
        acc = np.zeros(states[0][key].shape, dtype=np.float64)
        for state, weight in zip(states, weights):
            acc += float(weight) * state[key].astype(np.float64)
        out[key] = (acc / total).astype(np.float32)
    return out


def aggregate(updates: list[dict[str, np.ndarray]], weights: Sequence[float], settings: Robustness) -> dict[str, np.ndarray]:
    """Combine clients' dense updates (same keys and shapes) with a robust rule (not ``mean``:
    the caller keeps its own exact mean). Returns float64 tensors."""
    keys = sorted(updates[0])
    rule = settings.aggregator
    if rule == "median":
        return {k: np.median(np.stack([u[k].astype(np.float64) for u in updates]), axis=0) for k in keys}
    if rule == "trimmed-mean":
        return {k: trim_mean(np.stack([u[k].astype(np.float64) for u in updates]), float(settings.trim_fraction))
                for k in keys}
    # Krum / Multi-Krum: Flower's selection over records; the winners are averaged by weight
    contents = [RecordDict({"arrays": ArrayRecord({k: Array(np.ascontiguousarray(u[k], np.float64)) for k in keys})})
                for u in updates]
    select = 1 if rule == "krum" else max(1, len(updates) - int(settings.byzantine))
    chosen = select_multikrum(contents, int(settings.byzantine), select)
    picked = [i for i, content in enumerate(contents) if any(content is c for c in chosen)]
    total = float(sum(weights[i] for i in picked))
    return {k: sum(float(weights[i]) * updates[i][k].astype(np.float64) for i in picked) / total for k in keys}
