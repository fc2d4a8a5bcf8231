"""A round's training exchange: how the training messages become an aggregated round.

The runner hands the strategy's exchange the round's training messages and a ``send(server_round,
phase, messages) -> replies`` (push, then collect within the timeouts); the exchange decides how
many exchanges the round takes. :class:`PlainExchange` is one: the training replies, aggregated.
Secure aggregation's exchange is :class:`~strategies.secure_stages.SecureStages` (keys, shares,
delivery, the masked training replies, unmasking).
"""

from __future__ import annotations

from collections.abc import Callable


class PlainExchange:
    """One exchange: the training messages sent, their replies aggregated (``strategy.aggregate_train``)."""

    def __init__(self, strategy) -> None:
        self.strategy = strategy

    def run(self, server_round: int, messages: list, send: Callable) -> None:
        self.strategy.aggregate_train(server_round, send(server_round, "train", messages))
