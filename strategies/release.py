"""The release stage: the bounded replies (or a secure round's revealed sum) -> the round's combined update.

* :class:`PlainRelease` — the method's own ``combine`` over the bounded payloads; a secure round's
  sum of ``count`` updates becomes their mean.
* :class:`PrivateRelease` — differential privacy: the sum of the clipped updates (uniform weights),
  released by :meth:`strategies.privacy.Privacy.release` (central: noised; both modes: divided by the
  clients sampled) and counted for ε. It also samples the round's clients when the accountant
  assumes Poisson sampling, and keeps the largest rate a round trained at (the accountant's ``q``).

Differential privacy and secure aggregation release a *mean* of updates; a method reaches it only
through a linear combiner (``PayloadFedAvg.after_mean``): a strategy that overrides ``combine``
declares itself non-linear and is refused with either (``PayloadFedAvg.linear``).
"""

from __future__ import annotations

from dataclasses import dataclass
from logging import INFO, WARNING

import numpy as np
from flwr.common.logger import log

from strategies import codec


def sampling_minimum(num_clients: int, min_clients: int | None = None) -> int:
    """The fewest clients a round samples: ``min_clients``, or by default Flower's 2 (1 for a lone client)."""
    return int(min_clients) if min_clients else min(2, int(num_clients))


def sample_size(num_clients: int, fraction: float, min_clients: int | None = None) -> int:
    """Clients a round samples, as Flower's FedAvg does: ``max(⌊N·fraction⌋, minimum)``, at most N."""
    return min(int(num_clients), max(int(int(num_clients) * float(fraction)),
                                     sampling_minimum(num_clients, min_clients)))


@dataclass(frozen=True)
class Sampling:
    """Which clients a round samples (the ``strategy`` group's ``fraction_train``, ``fraction_evaluate`` and
    ``min_clients`` over ``num_clients``), checked once when built, as PEFT's configs check themselves: the
    config check (``fedapps.checks``) and the strategy build the same object; ValueError names the key."""

    num_clients: int
    fraction_train: float = 1.0
    fraction_evaluate: float = 1.0
    min_clients: int | None = None

    def __post_init__(self) -> None:
        for key, value, low in (("fraction_train", self.fraction_train, "("),
                                ("fraction_evaluate", self.fraction_evaluate, "[")):  # evaluation 0: none (Flower's)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    0 < value <= 1 or (low == "[" and value == 0)):
                raise ValueError(f"strategy.{key} must be a number in {low}0, 1] (the share of clients a round "
                                 f"samples), got {value!r}")
        least = self.min_clients
        if least is not None and (isinstance(least, bool) or not isinstance(least, int) or least < 1
                                  or least > int(self.num_clients)):
            raise ValueError(f"strategy.min_clients must be null or an integer in 1..num_clients "
                             f"({self.num_clients}), got {least!r}")

    @classmethod
    def from_mapping(cls, strategy, num_clients: int) -> Sampling:
        """From the ``strategy`` config block (a mapping) and the run's client count."""
        return cls(int(num_clients), strategy.get("fraction_train", 1.0), strategy.get("fraction_evaluate", 1.0),
                   strategy.get("min_clients"))

    @property
    def minimum(self) -> int:
        """The fewest clients a round trains and evaluates (:func:`sampling_minimum`)."""
        return sampling_minimum(self.num_clients, self.min_clients)

    @property
    def min_available(self) -> int:
        """Connected nodes a round waits for: every registered client by default, else the minimum."""
        return int(self.num_clients) if self.min_clients is None else self.minimum

    @property
    def train_size(self) -> int:
        """Clients a round trains, as Flower samples them (:func:`sample_size`)."""
        return sample_size(self.num_clients, self.fraction_train, self.min_clients)


def check_releasable(what: str, strategy: type, aggregator: str, uplink_format: str) -> None:
    """ValueError unless ``what`` (secure aggregation, differential privacy), which releases a mean of dense
    updates, can carry a strategy class with this robust aggregator and uplink format."""
    if not strategy.linear:
        raise ValueError(f"{strategy.__name__} combines replies its own way (it overrides combine); "
                         f"{what} releases a mean of updates, so the two cannot be used together")
    if aggregator != "mean":
        raise ValueError(f"{what} releases a mean of updates: robust aggregator '{aggregator}' does not fit "
                         "(use the mean)")
    if uplink_format not in codec.FORMATS:
        raise ValueError(f"{what} needs dense updates: uplink format '{uplink_format}' is not dense")


class PlainRelease:
    """No privacy: the method's combine; Flower's sampling."""

    private = False

    def sample(self, nodes: list[int], server_round: int) -> list[int] | None:
        """The nodes to train this round, or None: Flower's FedAvg samples them."""
        return None

    def combined(self, strategy, server_round: int, payloads: list, weights: list[int]) -> dict[str, np.ndarray]:
        return strategy.combine(payloads, weights)

    def of_sum(self, strategy, server_round: int, total: dict[str, np.ndarray], count: int) -> dict[str, np.ndarray]:
        """A secure round's revealed sum of ``count`` updates -> their mean (the linear combiner's input)."""
        return strategy.after_mean({k: v / count for k, v in total.items()})

    def state(self) -> dict:
        return {}

    def load(self, meta) -> None:
        pass


class PrivateRelease:
    """Differential privacy's release of the clipped updates' sum, and the sampling ε is accounted at."""

    private = True

    def __init__(self, privacy) -> None:
        self.privacy = privacy
        self.released = 0  # rounds whose noised aggregate (central) or noised updates (local) went out
        self.sampled_rate = 0.0  # the largest fraction of the connected nodes a round trained (the accountant's q)
        self.available = 0  # nodes connected when this round's training was configured

    def sample(self, nodes: list[int], server_round: int) -> list[int] | None:
        self.available = len(nodes)
        if not self.privacy.poisson:
            return None
        chosen = self.privacy.sample(nodes, server_round)  # the sampling the accountant assumes (#63)
        log(INFO, "configure_train: Poisson sampling at q = %.3g chose %d of %d nodes", self.privacy.sample_rate,
            len(chosen), len(nodes))
        return chosen

    def combined(self, strategy, server_round: int, payloads: list, weights: list[int]) -> dict[str, np.ndarray]:
        updates = [strategy.client_update(p) for p in payloads]
        total = {k: np.sum([u[k].astype(np.float64) for u in updates], axis=0) for k in updates[0]}
        return self.of_sum(strategy, server_round, total, len(payloads))

    def of_sum(self, strategy, server_round: int, total: dict[str, np.ndarray], count: int) -> dict[str, np.ndarray]:
        """The private mean (central: noised; both: over the clients sampled), the release counted for ε."""
        sampled = self._sampled(len(strategy.sent.get("train", [])), server_round, count)
        update = self.privacy.release(total, sampled, server_round)
        self.released += 1
        strategy.ledger.current["privacy"] = self.record()
        return strategy.after_mean(update)

    def record(self) -> dict:
        """ε spent so far (dp-accounting) and what it was accounted at."""
        return self.privacy.record(self.released, self.sampled_rate)

    def _sampled(self, sent: int, server_round: int, accepted: int) -> int:
        """The clients this round sampled (``sent`` training messages: the private mean's denominator); ε is
        accounted at the rate that happened if Flower sampled more than the noise was calibrated for."""
        sampled = max(1, sent or accepted)
        if self.privacy.poisson:  # sampled at q by construction: the count varies, the rate does not
            self.sampled_rate = max(self.sampled_rate, self.privacy.sample_rate)
            return sampled
        if self.available:
            rate = sampled / max(self.available, sampled)
            if rate > self.privacy.sample_rate + 1e-9 and rate > self.sampled_rate:
                log(WARNING, "round %s: %d of %d nodes trained, a sampling rate of %.3g, above the %.3g the noise "
                    "was calibrated for: ε is accounted at %.3g", server_round, sampled, self.available, rate,
                    self.privacy.sample_rate, rate)
            self.sampled_rate = max(self.sampled_rate, rate)
        return sampled

    def state(self) -> dict:
        return {"privacy_released": self.released, "sampled_rate": self.sampled_rate}

    def load(self, meta) -> None:
        self.released = int(meta.get("privacy_released", 0))
        self.sampled_rate = float(meta.get("sampled_rate", 0.0))
