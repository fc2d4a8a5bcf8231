"""The bound stage: how much one accepted reply may move the round, before replies are combined.

Two stages, one chosen per run by the strategy (:class:`~strategies.base.PayloadFedAvg`):

* :class:`RobustBound` (the ``robust`` config group, :mod:`strategies.robust`): example counts
  capped, update norms clipped, then each update's distance from the round's coordinate-wise
  median update clipped (``robust.center``; dense updates only);
* :class:`PrivacyClip` (differential privacy): every update clipped to ``privacy.clip`` (central
  mode: the guarantee rests on the server's own clip) and uniform weights.

Both work on the method's payloads through the strategy's update hooks (``update_norm``,
``scale_update``, ``client_update``, ``with_update``), so a method with a payload of its own
(SmartFed's sparse expert parts) is bounded the same way. Each bounded reply is recorded in the
round's ``bounded`` list with its detail; the log gets one line a round
(:meth:`~strategies.ledger.RoundLedger.log_bounded`): INFO while every bounded reply is within
``robust.FAR_COUNT`` (10) × the count it was capped at and ``robust.FAR_NORM`` (4) × the norm it was
clipped to — the default bounds acting on honest-looking replies, as they do in most rounds — and a
WARNING naming the replies beyond that. The privacy clip is the mechanism itself: INFO.

:func:`check_values` is the per-value bound every reply (and a secure round's revealed mean) passes
before it is counted: ``robust.max_abs`` and the method's own bound per tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from strategies import robust
from strategies.codec import PayloadError
from strategies.robust import Robustness


def check_values(proposed: Iterable[tuple[str, np.ndarray]], max_abs: float | None,
                 method_bound: Callable[[str], float | None], slack: float = 0.0) -> None:
    """PayloadError for a tensor proposing a value beyond ``max_abs`` or ``method_bound(key)`` (+ ``slack``)."""
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is what this check refuses
        proposed = list(proposed)
    for key, values in proposed:
        bounds = [b for b in (max_abs, method_bound(key)) if b is not None]
        if not bounds or not np.size(values):
            continue
        bound = min(bounds)
        peak = float(np.max(np.abs(values)))
        if not peak <= bound + slack:
            which = "robust.max_abs" if bound == max_abs else "the method's bound for this tensor"
            raise PayloadError(f"tensor '{key}' proposes values up to {peak:.3g}, beyond ±{bound:g} ({which})")


class RobustBound:
    """Example counts capped, norms clipped, distances from the median update clipped (``robust``)."""

    def __init__(self, settings: Robustness) -> None:
        self.settings = settings

    def __call__(self, strategy, nodes: list[int], payloads: list, weights: list[int]) -> tuple[list, list[int]]:
        settings, ledger = self.settings, strategy.ledger
        effects, hostile = [], []
        capped = robust.cap_weights(weights, settings)
        counted = [(node, before, after) for node, before, after in zip(nodes, weights, capped) if after != before]
        for node, before, after in counted:
            detail = f"num-examples {before} counted as {after}"
            ledger.bound(node, "examples-capped", detail)
            if before > robust.FAR_COUNT * after:
                hostile.append(f"node {node}: {detail}")
        if counted:  # one cap for the round: examples_multiple x the lower median, or max_examples
            effects.append(f"example counts capped at {counted[0][2]} ({len(counted)})")
        if settings.clips:
            norms = [strategy.update_norm(p) for p in payloads]
            clipped = 0
            for i, (node, norm, factor) in enumerate(zip(nodes, norms, robust.clip_scales(norms, settings))):
                if factor < 1.0:
                    payloads[i] = strategy.scale_update(payloads[i], factor)
                    detail = f"update norm {norm:.4g} clipped to {norm * factor:.4g}"
                    ledger.bound(node, "norm-clipped", detail)
                    clipped += 1
                    if factor * robust.FAR_NORM < 1.0:
                        hostile.append(f"node {node}: {detail}")
            if clipped:
                bound = robust.clip_bound(norms, settings)
                to = (f"{settings.norm_multiple:g}x the lower median, {bound:.4g}" if settings.norm_clip == "median"
                      else f"robust.norm_clip {bound:g}")
                effects.append(f"update norms clipped to {to} ({clipped})")
        if settings.centers and strategy.dense_updates:  # after the norm clip, whose WARNING names a far-off update
            self.center(strategy, nodes, payloads, effects)
        ledger.log_bounded(len(nodes), effects, hostile)
        return payloads, capped

    def center(self, strategy, nodes: list[int], payloads: list, effects: list[str]) -> None:
        """Centered clipping (:func:`strategies.robust.center_scales`): each update's distance from the round's
        coordinate-wise median update brought within ``center_multiple`` × the lower median of those
        distances; the payloads replaced in place, each clipped one recorded. Never a WARNING of its own:
        honest updates that differ in size (more local data, another domain) sit many lower-median distances
        from the median; a hostile one is also far outside the count cap or the norm clip, which say so."""
        updates = [strategy.client_update(p) for p in payloads]
        centered = robust.center_scales(updates, self.settings)
        if centered is None:
            return
        center, factors, distances, bound = centered
        clipped = 0
        for i, (node, factor, distance) in enumerate(zip(nodes, factors, distances)):
            if factor < 1.0:
                payloads[i] = strategy.with_update(robust.recenter(updates[i], center, factor))
                detail = f"distance {distance:.4g} from the round's median update clipped to {bound:.4g}"
                strategy.ledger.bound(node, "center-clipped", detail)
                clipped += 1
        effects.append(f"distances from the median update clipped to {self.settings.center_multiple:g}x their "
                       f"lower median, {bound:.4g} ({clipped})")


class PrivacyClip:
    """Differential privacy's clip: uniform weights; central mode clips every update to ``privacy.clip``
    (local mode: each update is already noised, and clipping it again would only shrink the noise's signal)."""

    def __init__(self, privacy) -> None:
        self.privacy = privacy

    def __call__(self, strategy, nodes: list[int], payloads: list, weights: list[int]) -> tuple[list, list[int]]:
        privacy, ledger = self.privacy, strategy.ledger
        clipped = 0
        for i, node in enumerate(nodes):
            norm = strategy.update_norm(payloads[i]) if privacy.mode == "central" else 0.0
            if privacy.mode == "central":  # the server's own measure of what it sees (a trusted server)
                ledger.client(node)["update_norm"] = norm
            if norm > privacy.clip:
                payloads[i] = strategy.scale_update(payloads[i], privacy.clip / norm)
                if norm > 1.01 * privacy.clip:  # beyond an int4 payload's rounding of a clipped update
                    ledger.bound(node, "dp-clipped", f"update norm {norm:.4g} clipped to {privacy.clip:g}")
                    clipped += 1
        effects = [f"update norms clipped to privacy.clip {privacy.clip:g} ({clipped})"] if clipped else []
        ledger.log_bounded(len(nodes), effects, [])
        return payloads, [1] * len(payloads)
