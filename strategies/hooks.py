"""A method's hooks: what a strategy may override, and what each does by default.

:class:`~strategies.base.PayloadFedAvg` composes a round from stages (``strategies.base``); the
stages call back into the method only through these hooks, collected here so that a method's
author reads one class to know what they can change:

* what a round sends: :meth:`MethodHooks.train_config_for` (per-node config; call ``super()``),
  :meth:`MethodHooks.encode_downlink` (the downlink record);
* how a reply reads: :meth:`~MethodHooks.reply_metrics`, :meth:`~MethodHooks.reply_record`,
  :meth:`~MethodHooks.check_reply_records` (records of its own, e.g. FLITE's fingerprint),
  :meth:`~MethodHooks.decode` (a wire form of its own, e.g. SmartFed's sparse expert parts);
* what a payload changes: :meth:`~MethodHooks.client_update`, :meth:`~MethodHooks.update_norm`,
  :meth:`~MethodHooks.scale_update`, :meth:`~MethodHooks.with_update`,
  :meth:`~MethodHooks.proposed_values` and :meth:`~MethodHooks.value_bounds` (its own bound per tensor);
* how replies combine: :meth:`~MethodHooks.after_mean` (a linear method's last word on the mean
  update: it runs on every path, differential privacy and secure aggregation included) or
  :meth:`~MethodHooks.combine` (a rule of its own: the class becomes non-linear, ``linear = False``,
  and DP and secure aggregation refuse it), :meth:`~MethodHooks.commit` (what it keeps once a round
  is committed: ``step.kept``, handed over by a combine that returns :class:`~strategies.step.Combined`);
* :meth:`~MethodHooks.train_ended` (the state it derives after each round's training).

numpy only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message

from strategies import bounds, codec, robust, uplink as up
from strategies.codec import PayloadError
from strategies.screening import check_metrics, example_count
from strategies.step import Step


class MethodHooks:
    """The overridable part of :class:`~strategies.base.PayloadFedAvg` (a mixin: it reads the strategy's
    ``global_state``, ``uplink``, ``spec``, ``robustness``, ``channel``, ``downlink`` and ``ledger``)."""

    #: a reply's update is a dense tensor per key, so it has a coordinate-wise median (``robust.center``)
    dense_updates: ClassVar[bool] = True
    #: combine = after_mean(the weighted mean of the updates): what DP and secure aggregation can release
    linear: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "combine" in cls.__dict__ and "linear" not in cls.__dict__:
            cls.linear = False  # its own rule: not a mean DP or secure aggregation can release

    def encode_downlink(self) -> ArrayRecord:
        """The federated keys in the downlink format (a method may send its own; a latent downlink's history is
        the downlink stage's own, :meth:`strategies.downlink.Downlink.latent_record`)."""
        return codec.encode({k: self.global_state[k] for k in self.uplink_keys}, self.downlink_format)

    def train_config_for(self, server_round: int, node_id: int, config: ConfigRecord) -> ConfigRecord:
        """Per-node train config; subclasses add method-specific keys (and call this one)."""
        config["uplink"] = self.uplink
        return config

    def reply_metrics(self, msg: Message, phase: str = "train") -> dict:
        """A reply's checked metrics (:func:`check_metrics`); a method with a reply form of its own reads them there."""
        return check_metrics(msg.content)

    def reply_record(self, msg: Message) -> tuple[ArrayRecord, int]:
        """A training reply's ArrayRecord and its positive ``num-examples``; PayloadError if absent."""
        arrays = msg.content.array_records
        if self.arrayrecord_key not in arrays:
            raise PayloadError(f"no ArrayRecord '{self.arrayrecord_key}' in the reply")
        if len(arrays) != 1:
            raise PayloadError(f"unexpected ArrayRecords {sorted(k for k in arrays if k != self.arrayrecord_key)[:3]} "
                               f"(a reply carries one, '{self.arrayrecord_key}')")
        return arrays[self.arrayrecord_key], example_count(msg.content)

    def check_reply_records(self, msg: Message) -> None:
        """A method's own checks of a reply's other records (FLITE's fingerprint), before its payload is read."""

    def decode(self, record: ArrayRecord, node_id: int):
        """A reply's record, its layout checked, as the payload :meth:`combine` takes (a method may override)."""
        self.spec.check(record)
        return codec.decode(record)

    def validate_reply(self, msg: Message) -> tuple[dict[str, np.ndarray], int]:
        """Check and decode one training reply (what the pipeline does to each); PayloadError says why not."""
        self.check_reply_records(msg)
        record, num_examples = self.reply_record(msg)
        return self.decode(record, int(msg.metadata.src_node_id)), num_examples

    # ------------------------------------------------------------------ a payload's update and values
    def client_update(self, payload):
        return up.update_of(payload, self.uplink, self.global_state)

    def update_norm(self, payload) -> float:
        return robust.norm(self.client_update(payload))

    def scale_update(self, payload, factor: float):
        return up.scaled(payload, factor, self.uplink, self.global_state)

    def with_update(self, update: Mapping[str, np.ndarray]):
        return up.payload_of(update, self.uplink, self.global_state)

    def proposed_values(self, payload):
        """(key, values) a client proposes for the global state (latents: the tensors they would move to)."""
        if self.channel is not None:
            yield from self.step(self.ledger.current.get("round", 0), payload, combined=False).values.items()
        else:
            yield from up.proposed(payload, self.uplink, self.global_state)

    def value_bounds(self, key: str) -> float | None:
        """A method's own bound on the magnitude of a federated tensor (None: only ``max_abs``)."""
        return None

    def check_values(self, payload, slack: float = 0.0) -> None:
        """PayloadError for a payload proposing a value beyond ``robust.max_abs`` or the method's bound."""
        bounds.check_values(self.proposed_values(payload), self.robustness.max_abs, self.value_bounds, slack)

    def combine(self, payloads: list[dict[str, np.ndarray]], weights: list[int]):
        """The bounded payloads and their weights -> the round's combined update of the uplink keys: the
        weighted mean of the updates (``robust.aggregator`` may choose another rule), then :meth:`after_mean`.
        A method that overrides it combines by a rule of its own (``linear`` becomes False)."""
        if self.robustness.aggregator != "mean":
            return self.after_mean(robust.aggregate([self.client_update(p) for p in payloads],
                                                    [float(w) for w in weights], self.robustness))
        mean = robust.weighted_mean(payloads, [float(w) for w in weights])
        return self.after_mean(self.client_update(mean))  # the mean payload's update

    def after_mean(self, update: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A linear method's last word on the mean update, on every path (plain, DP, secure): as it is."""
        return update

    def commit(self, step: Step) -> None:
        """Replace the global values; a subclass keeps its own state from ``step.kept``."""
        for key, value in step.values.items():
            self.global_state[key] = value.astype(np.float32)
        self.downlink.changed()

    def train_ended(self, server_round: int) -> None:
        """A round's training replies were aggregated (state changed or not): FedNL records α per layer."""
