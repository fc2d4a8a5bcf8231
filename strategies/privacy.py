"""Client-level differential privacy: clipping, Gaussian noise and its accountant (numpy + dp-accounting).

DP-FedAvg (McMahan et al., ICLR 2018): each client's update (what it trained minus what it
received) is clipped to an L2 norm ``clip``; Gaussian noise hides any one client's presence.

* ``central`` (a trusted server): the server clips every update it can see again, sums the
  clipped updates, adds ``N(0, (z·clip)²)`` per value to the sum and divides by the number
  of clients it sampled (a fixed denominator, uniform weights). Add/remove-one-client
  adjacency: the sum's sensitivity is ``clip``.
* ``local`` (no trusted server): each client adds ``N(0, (2·z·clip)²)`` to its own clipped
  update before it leaves (replace-one adjacency of that update: sensitivity ``2·clip``);
  the server averages as usual.

The noise multiplier ``z`` comes from a target (ε, δ) over the planned rounds through
Google's ``dp-accounting`` (its RDP accountant and mechanism calibration), never from a
formula of ours; ε spent so far is what the same accountant reports after each round.
Server-side sampling is accounted as Poisson sampling with rate ``fraction_train`` (Flower
samples a fixed number of nodes: the usual approximation; exact at 1.0); local DP is
accounted without amplification (the server knows who was sampled).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from strategies import robust

# dp-accounting (3 s to import) is imported by the accountant's functions, when a run has privacy on

MODES = ("central", "local")


class PrivacyError(ValueError):
    """Privacy settings that cannot be used (says why)."""


def _event(noise_multiplier: float, sample_rate: float, rounds: int):
    from dp_accounting import dp_event

    step = dp_event.GaussianDpEvent(noise_multiplier)
    if sample_rate < 1.0:
        step = dp_event.PoissonSampledDpEvent(sample_rate, step)
    return dp_event.SelfComposedDpEvent(step, rounds)


@contextlib.contextmanager
def _quiet():
    """dp-accounting logs (through absl) every RDP order it leaves out: not the user's business. absl's
    first warning also calls ``logging.basicConfig()``, which gave the root logger a handler of its own:
    from then on every Flower log line was printed twice; a handler added during the call is removed."""
    logger, root = logging.getLogger("absl"), logging.getLogger()
    level, handlers = logger.level, list(root.handlers)
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)


def epsilon_spent(noise_multiplier: float, sample_rate: float, rounds: int, delta: float) -> float:
    """ε after ``rounds`` releases (RDP accountant of dp-accounting); 0 before the first."""
    if rounds <= 0:
        return 0.0
    from dp_accounting import rdp

    with _quiet():
        accountant = rdp.RdpAccountant()
        accountant.compose(_event(noise_multiplier, sample_rate, rounds))
        return float(accountant.get_epsilon(delta))


@functools.lru_cache(maxsize=64)
def noise_multiplier_for(epsilon: float, delta: float, rounds: int, sample_rate: float) -> float:
    """The smallest noise multiplier whose ``rounds`` releases spend at most ``epsilon`` (dp-accounting's
    calibration over its RDP accountant)."""
    if not (epsilon > 0 and 0 < delta < 1 and rounds >= 1 and 0 < sample_rate <= 1):
        raise PrivacyError(f"cannot calibrate noise for epsilon={epsilon}, delta={delta}, rounds={rounds}, "
                           f"sample rate={sample_rate}")
    from dp_accounting import rdp
    from dp_accounting.mechanism_calibration import ExplicitBracketInterval, calibrate_dp_mechanism

    with _quiet():
        return float(calibrate_dp_mechanism(rdp.RdpAccountant, lambda z: _event(z, sample_rate, rounds), epsilon,
                                            delta, ExplicitBracketInterval(0.05, 500.0), tol=1e-4))


@dataclass(frozen=True)
class Privacy:
    """A run's differential-privacy settings (the ``privacy`` config block), noise multiplier resolved."""

    mode: str
    clip: float
    delta: float
    noise_multiplier: float
    rounds: int
    sample_rate: float
    target_epsilon: float | None = None
    seed: int | None = None

    @classmethod
    def from_config(cls, block: Mapping | None, *, rounds: int, sample_rate: float) -> Privacy | None:
        """None when ``block.mode`` is off; otherwise the settings, ``noise_multiplier`` calibrated from
        ``epsilon`` unless given. PrivacyError says what is wrong."""
        if not block or block.get("mode") in (None, "off", False):
            return None
        mode = block.get("mode")
        if mode not in MODES:
            raise PrivacyError(f"privacy.mode must be off, central or local, got {mode!r}")
        clip, delta = _positive(block.get("clip"), "privacy.clip"), _positive(block.get("delta"), "privacy.delta")
        if not delta < 1:
            raise PrivacyError(f"privacy.delta must be in (0, 1), got {delta}")
        rate = 1.0 if mode == "local" else float(sample_rate)
        given, target = block.get("noise_multiplier"), block.get("epsilon")
        if given is not None:
            z, target = _positive(given, "privacy.noise_multiplier"), None
        else:
            target = _positive(target, "privacy.epsilon (or set privacy.noise_multiplier)")
            z = noise_multiplier_for(target, delta, int(rounds), rate)
        seed = block.get("seed")
        return cls(mode=mode, clip=clip, delta=delta, noise_multiplier=z, rounds=int(rounds), sample_rate=rate,
                   target_epsilon=target, seed=None if seed is None else int(seed))

    @property
    def client_std(self) -> float:
        """Local mode: the noise each client adds per value."""
        return 2.0 * self.noise_multiplier * self.clip

    @property
    def sum_std(self) -> float:
        """Central mode: the noise the server adds per value to the sum of clipped updates."""
        return self.noise_multiplier * self.clip

    def epsilon(self, rounds_released: int, sample_rate: float | None = None) -> float:
        """ε after ``rounds_released`` releases at the planned rate, or at ``sample_rate`` when a run
        sampled more than planned (the accountant then takes the larger)."""
        rate = max(self.sample_rate, float(sample_rate or 0.0))
        return epsilon_spent(self.noise_multiplier, min(1.0, rate), rounds_released, self.delta)

    def rng(self, *stream: int) -> np.random.Generator:
        """The noise generator: NumPy's PCG64 seeded from 128 bits of ``os.urandom`` (the noise must
        stay secret), or from ``seed`` and ``stream`` when ``privacy.seed`` is set (reproducible runs
        for testing: whoever knows the seed can subtract the noise)."""
        if self.seed is None:
            return np.random.default_rng(int.from_bytes(os.urandom(16), "little"))
        return np.random.default_rng([self.seed, *[int(s) for s in stream]])

    @property
    def poisson(self) -> bool:
        """Whether rounds sample their clients as the accountant assumes: each node on its own with
        probability ``sample_rate`` (below 1; at 1 every node trains and there is no sampling to amplify)."""
        return self.sample_rate < 1.0

    def sample(self, nodes, server_round: int) -> list[int]:
        """Poisson sampling of ``nodes``: each kept with probability ``sample_rate``, independently, from the
        secret generator (:meth:`rng`: who trains must stay unknown for the amplification to hold). A round
        may so sample no one: it then trains nobody and releases nothing."""
        nodes = sorted(int(v) for v in nodes)
        keep = self.rng(server_round, 1).random(len(nodes)) < self.sample_rate
        return [v for v, k in zip(nodes, keep) if k]

    def release(self, total: Mapping[str, np.ndarray], sampled: int, server_round: int) -> dict[str, np.ndarray]:
        """A round's private mean update from the sum of its clipped updates: central mode adds
        N(0, (z·clip)²) to the sum, then both modes divide by the number of clients sampled (a fixed
        denominator: a dropout does not change the sensitivity)."""
        if self.mode == "central":
            total = add_noise(total, self.sum_std, self.rng(server_round))
        return {k: v / sampled for k, v in total.items()}

    def record(self, rounds_released: int, sample_rate: float | None = None) -> dict:
        rate = min(1.0, max(self.sample_rate, float(sample_rate or 0.0)))
        return {"mode": self.mode, "epsilon": self.epsilon(rounds_released, rate), "delta": self.delta,
                "sample_rate": rate,
                "noise_multiplier": self.noise_multiplier, "clip": self.clip, "rounds_released": rounds_released,
                "target_epsilon": self.target_epsilon}


def _positive(value, key: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise PrivacyError(f"{key} must be a number > 0, got {value!r}") from None
    if isinstance(value, bool) or not (math.isfinite(number) and number > 0):
        raise PrivacyError(f"{key} must be a number > 0, got {value!r}")
    return number


def clip_update(update: Mapping[str, np.ndarray], clip: float) -> tuple[dict[str, np.ndarray], float]:
    """``update`` scaled to L2 norm at most ``clip`` (float64), and its norm before."""
    norm = robust.norm(update)  # the one L2 norm of a set of tensors (float64)
    factor = min(1.0, clip / norm) if norm > 0 else 1.0
    return {k: np.asarray(v, np.float64) * factor for k, v in update.items()}, norm


def add_noise(update: Mapping[str, np.ndarray], std: float, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """``update`` + N(0, std²) per value (keys in sorted order, so a seeded run is reproducible)."""
    return {k: np.asarray(update[k], np.float64) + rng.normal(0.0, std, np.shape(update[k])) for k in sorted(update)}
