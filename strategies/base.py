"""The Postcard base strategy: FedAvg over a named-tensor payload, as a round of composed stages.

Every method aggregates *some* named tensors (LoRA factors, latents, gates, expert deltas).
:class:`PayloadFedAvg` composes one round from stages, each an object of its own module, chosen
once when the strategy is built (no stage asks which mode the run is in)::

    downlink -> screen -> decode -> check values -> bound -> release -> step -> finite? -> commit

* **downlink** (:mod:`strategies.downlink`): each node's message, the run's config on first
  contact, a latent channel's history, bytes per node;
* **screen** (:mod:`strategies.screening`): a client error, identity, metrics — a bad reply is
  refused by name, the round goes on with the others; nothing a client sends raises out of here;
* **decode** (the method's hook) after its declared layout is checked (:class:`UplinkSpec`), then
  :func:`strategies.bounds.check_values` (``robust.max_abs``, the method's own bound);
* **bound** (:mod:`strategies.bounds`): the ``robust`` caps and clips, or differential privacy's clip;
* **release** (:mod:`strategies.release`): the method's :meth:`~PayloadFedAvg.combine`, or the private
  mean of the clipped updates; a secure round's revealed sum (:mod:`strategies.secure_stages`) enters
  here too (its mean, value-checked);
* **step** (:mod:`strategies.step`): the server optimiser, the latent channel's expansion;
* **commit**: only a finite step inside the layout replaces the global state (else the round is
  refused, the state unchanged).

The combiner's one rule: differential privacy and secure aggregation release a mean of updates, so
they take only a *linear* combiner — the base's weighted mean, followed by :meth:`after_mean` (which a
method may override: e.g. a server learning rate). A strategy that overrides :meth:`combine` is
non-linear (``linear = False``, set when the class is defined, unless it declares ``linear = True``)
and is refused with either, here and when the config is composed (``fedapps.checks``).

What a method may override is :class:`~strategies.hooks.MethodHooks`; numpy only. Checkpoints:
:meth:`state_dict` / :meth:`load_state_dict` (each stage adds its own state; a subclass extends both).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from logging import WARNING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from strategies import codec, robust, uplink as up
from strategies.bounds import PrivacyClip, RobustBound
from strategies.channel import LatentChannel
from strategies.codec import PayloadError
from strategies.downlink import Downlink
from strategies.exchange import PlainExchange
from strategies.hooks import MethodHooks
from strategies.ledger import RoundLedger, RoundRecord
from strategies.privacy import Privacy
from strategies.release import PlainRelease, PrivateRelease, Sampling, check_releasable
from strategies.robust import Robustness
from strategies.screening import NUM_EXAMPLES, Reply, aggregate_metrics, screen
from strategies.secure_round import SecureSettings
from strategies.secure_stages import SecureStages
from strategies.server_opt import PREFIX as OPT_PREFIX, ServerOptimizer
from strategies.step import Combined, ModelStep, Step


class PayloadFedAvg(MethodHooks, FedAvg):
    """FedAvg over named fp32 tensors with Postcard's wire formats and accounting.

    ``initial_state`` fixes the federated layout: the keys and shapes every reply must
    carry (``uplink_keys`` may restrict replies to a subset, e.g. FFA-LoRA's B factors).
    """

    def __init__(self, *, initial_state: Mapping[str, np.ndarray], config_yaml: str, num_clients: int,
                 min_clients: int | None = None, fraction_train: float = 1.0, fraction_evaluate: float = 1.0,
                 uplink_format: str = "fp32", downlink_format: str = "fp32", uplink: str = "absolute",
                 topk_fraction: float | None = None, powersgd_rank: int | None = None,
                 uplink_keys: Iterable[str] | None = None, on_round_end: Callable[[RoundRecord], None] | None = None,
                 robustness: Robustness | None = None, secure: SecureSettings | None = None,
                 privacy: Privacy | None = None, channel: LatentChannel | None = None,
                 server_optimizer: ServerOptimizer | None = None) -> None:
        self.sampling = Sampling(int(num_clients), fraction_train, fraction_evaluate, min_clients)  # checked once
        super().__init__(fraction_train=fraction_train, fraction_evaluate=fraction_evaluate,
                         min_train_nodes=self.sampling.minimum, min_evaluate_nodes=self.sampling.minimum,
                         min_available_nodes=self.sampling.min_available)
        self.wire = up.Wire(uplink, uplink_format, downlink_format, topk_fraction, powersgd_rank)  # checked once
        self.global_state = {k: np.asarray(v, dtype=np.float32).copy() for k, v in initial_state.items()}
        self.uplink_keys = sorted(uplink_keys) if uplink_keys is not None else sorted(self.global_state)
        if missing := set(self.uplink_keys) - set(self.global_state):
            raise ValueError(f"uplink keys not in the global state: {sorted(missing)[:5]}")
        if channel is not None and (uplink != "delta" or uplink_format not in codec.FORMATS):
            raise ValueError("the latent channel sends each round's latents: uplink='delta', fp32 or int4")
        if channel is not None and channel.keys != self.uplink_keys:
            raise ValueError("the latent channel must cover exactly the federated tensors")
        self.channel, self.config_yaml, self.uplink = channel, config_yaml, self.wire.uplink
        self.uplink_format, self.downlink_format = self.wire.format, self.wire.downlink_format
        self.spec = up.UplinkSpec.build(self.layout(), uplink_format, topk_fraction=self.wire.topk_fraction,
                                        powersgd_rank=self.wire.powersgd_rank)
        self.robustness = robustness if robustness is not None else Robustness()
        self.secure, self.privacy = secure, privacy
        for what, settings in (("secure aggregation", secure), ("differential privacy", privacy)):
            if settings is not None:
                check_releasable(what, type(self), self.robustness.aggregator, uplink_format)
        self.server_opt = server_optimizer if server_optimizer is not None else ServerOptimizer()
        self.ledger = RoundLedger(on_round_end)
        self.sent: dict[str, list[Message]] = {}  # this round's messages per phase (ids set when pushed)
        self.banned: dict[int, str] = {}  # node -> why: proven cheats, never sent another message of this run
        self.downlink = Downlink(self, latent=self.latent_downlink)  # the stages
        self.bound = PrivacyClip(privacy) if privacy is not None else RobustBound(self.robustness)
        self.release = PrivateRelease(privacy) if privacy is not None else PlainRelease()
        self.model_step = ModelStep(self.server_opt, channel, uplink_format)
        self.secure_stages = SecureStages(self, secure) if secure is not None else None
        self.exchange = self.secure_stages or PlainExchange(self)  # what the runner drives each round

    # ------------------------------------------------------------------ the round ledger
    @property
    def history(self) -> list[RoundRecord]:
        return self.ledger.history

    @history.setter
    def history(self, records: list[RoundRecord]) -> None:
        self.ledger.history = list(records)

    def round_record(self) -> RoundRecord:
        """The current round's record so far (what ``on_round_end`` gets once the round is evaluated)."""
        return self.ledger.current

    def _start_round(self, server_round: int) -> None:
        if self.ledger.start(server_round):
            self.sent = {}

    def record_missing(self, server_round: int, node_id: int, phase: str, reason: str) -> None:
        """A node sent a message that gave no reply: recorded (``missing``); its next message carries the config."""
        self._start_round(server_round)
        self.ledger.missing(node_id, phase, reason)
        self.downlink.configured.discard(int(node_id))

    # ------------------------------------------------------------------ the downlink
    def layout(self) -> dict[str, tuple[int, ...]]:
        """What a training reply carries: the uplink keys' shapes, or the latent channel's vector."""
        if self.channel is not None:
            return self.channel.layout()
        return {k: tuple(self.global_state[k].shape) for k in self.uplink_keys}

    @property
    def latent_downlink(self) -> bool:
        """Whether the downlink is the latent channel's history of combined latents (not θ_fed)."""
        return self.channel is not None and self.channel.downlink == "latent"

    def downlink_arrays(self) -> ArrayRecord:
        """What every client receives, encoded once per global state."""
        return self.downlink.arrays()

    def federated_snapshot(self) -> ArrayRecord:
        """A latent downlink's alternative for a node that missed many rounds: the tensors now, fp32."""
        return self.downlink.snapshot(lambda: codec.encode({k: self.global_state[k] for k in self.channel.keys},
                                                           "fp32"))

    def global_arrays(self) -> ArrayRecord:
        """The whole global state as fp32 (what ``aggregate_train`` returns); the downlink when that is the same."""
        if self.downlink_format == "fp32" and self.uplink_keys == sorted(self.global_state) \
                and not self.downlink.latent and type(self).encode_downlink is MethodHooks.encode_downlink:
            return self.downlink_arrays()
        return codec.encode(self.global_state, "fp32")

    def _messages(self, templates: Iterable[Message], server_round: int, phase: str,
                  config: ConfigRecord) -> list[Message]:
        self._start_round(server_round)
        unbanned = [m for m in templates if int(m.metadata.dst_node_id) not in self.banned]
        self.sent[phase] = self.downlink.messages(unbanned, server_round, phase, config)
        return self.sent[phase]  # the grid gives them ids when it pushes them: replies are checked against those

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        chosen = self.release.sample(list(grid.get_node_ids()), server_round)
        if chosen is None:
            templates = super().configure_train(server_round, arrays, config, grid)
        else:
            config["server-round"] = server_round
            templates = self._construct_messages(
                RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config}), chosen, MessageType.TRAIN)
        return self._messages(templates, server_round, "train", config)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        return self._messages(super().configure_evaluate(server_round, arrays, config, grid), server_round, "eval",
                              config)

    def ban(self, node_id: int, reason: str) -> None:
        """Exclude a node from the rest of the run (logged, kept in the round record and the checkpoint)."""
        if int(node_id) not in self.banned:
            self.banned[int(node_id)] = reason
            self.ledger.exclude(int(node_id), reason)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> tuple[dict[str, np.ndarray], dict]:
        """(arrays, JSON-able metadata) that let a new server process continue this run."""
        moments, step_meta = self.model_step.state()
        meta = {"history": list(self.history), "banned": {str(k): v for k, v in self.banned.items()},
                **self.release.state(), **self.downlink.state(), **step_meta}
        return {**{k: v.copy() for k, v in self.global_state.items()}, **moments}, meta

    def load_state_dict(self, arrays: Mapping[str, np.ndarray], meta: Mapping) -> None:
        """Restore :meth:`state_dict`'s output; the layout (keys, shapes) must be this strategy's."""
        self.model_step.load(arrays, meta, list(self.global_state))
        expected = {k: tuple(v.shape) for k, v in self.global_state.items()}
        got = {k: tuple(np.shape(v)) for k, v in arrays.items() if not k.startswith(f"{OPT_PREFIX}/")}
        if set(got) != set(expected):
            raise ValueError(f"the checkpoint's tensors do not match this run's layout (unexpected "
                             f"{sorted(set(got) - set(expected))[:3]}, missing {sorted(set(expected) - set(got))[:3]})")
        for key, shape in expected.items():
            if got[key] != shape:
                raise ValueError(f"checkpoint tensor '{key}' has shape {got[key]}, this run expects {shape}")
        self.global_state = {k: np.asarray(arrays[k], dtype=np.float32).copy() for k in expected}
        self.history = list(meta.get("history", []))
        self.banned = {int(k): str(v) for k, v in (meta.get("banned") or {}).items()}
        self.release.load(meta)
        self.downlink.load(meta)
        self.ledger.current = {}

    # ------------------------------------------------------------------ reading a reply
    def screen(self, replies: Iterable[Message], phase: str) -> list[Reply]:
        """A phase's replies screened (:func:`strategies.screening.screen`): those that pass, with their metrics."""
        passed = screen(replies, sent=self.sent.get(phase, []), phase=phase, refuse=self.ledger.refuse,
                        read_metrics=lambda msg: self.reply_metrics(msg, phase), on_error=self.node_lost,
                        label="training" if phase == "train" else "evaluation", server_round=self.ledger.round)
        for reply in passed:  # it answered: it holds the latent rounds it was sent
            self.downlink.sync.confirmed(reply.node)
        return passed

    def node_lost(self, node_id: int) -> None:
        """A node that answered with an error (e.g. a restarted SuperNode): config and latent history again."""
        self.downlink.lost(node_id)

    @property
    def private(self) -> bool:
        """Secure aggregation or differential privacy: what a client reports is never kept per client."""
        return self.secure is not None or self.release.private

    # ------------------------------------------------------------------ the round
    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        """Screen, decode and check each reply, bound the accepted ones, release their combined update, commit."""
        self._start_round(server_round)
        nodes, payloads, weights, metrics = [], [], [], []
        for reply in self.screen(replies, "train"):
            try:
                self.check_reply_records(reply.msg)
                record, num_examples = self.reply_record(reply.msg)  # read once: decoded, then counted
                tensors = self.decode(record, reply.node)
                self.check_values(tensors)
            except Exception as err:  # noqa: BLE001 - whatever a client sends must not stop the run
                why = str(err) if isinstance(err, PayloadError) else f"malformed payload ({type(err).__name__}: {err})"
                self.ledger.refuse(reply.node, why, kind="payload")
                continue
            nodes.append(reply.node)
            payloads.append(tensors)
            weights.append(num_examples)
            metrics.append({NUM_EXAMPLES: num_examples} if self.private else reply.metrics)
            self.ledger.uploaded(reply.node, record, reply.msg, None if self.private else reply.metrics)
        out = None, None
        if payloads:
            payloads, weights = self.bound(self, nodes, payloads, weights)
            with np.errstate(over="ignore", invalid="ignore"):  # a non-finite aggregate is refused in conclude
                update = self.release.combined(self, server_round, payloads, weights)
            out = self.conclude(server_round, update, metrics, weights)
        else:
            log(WARNING, "round %s: no acceptable training reply; the global state is unchanged", server_round)
        self.train_ended(server_round)
        return out

    def step(self, server_round: int, update: Mapping[str, np.ndarray], *, combined: bool = True) -> Step:
        """The new global values from a combined update (:class:`~strategies.step.ModelStep`)."""
        return self.model_step(self.global_state, server_round, update, combined=combined)

    def conclude(self, server_round: int, combined, metrics: list[dict], weights: list):
        """The one tail of every path: step, and commit if finite and inside the layout (else the round refused)."""
        update, kept = (combined.update, combined.kept) if isinstance(combined, Combined) else (combined, None)
        with np.errstate(over="ignore", invalid="ignore"):  # a non-finite aggregate is refused below
            step = self.step(server_round, update)
        step.kept = kept
        for key, value in step.values.items():
            if key not in self.global_state or value.shape != self.global_state[key].shape:
                raise RuntimeError(f"aggregation produced a tensor '{key}' outside the layout")  # programming error
        if bad := sorted(k for k, v in step.values.items() if not np.all(np.isfinite(v))):
            self.ledger.refuse(None, f"the aggregate of {len(weights)} replies is not finite in {bad[:3]}; the round "
                                     "is refused", kind="round")
            return None, None
        self.commit(step)
        if step.latent is not None:
            self.downlink.history.append((int(server_round), step.latent))
        if step.moments is not None:
            self.model_step.moments = step.moments
        self.ledger.current["accepted"] = len(weights)
        return self.global_arrays(), aggregate_metrics(metrics, weights)

    # ------------------------------------------------------------------ evaluation
    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        self._start_round(server_round)
        metrics, weights = [], []
        for reply in self.screen(replies, "eval"):
            metrics.append(reply.metrics)
            weights.append(reply.metrics[NUM_EXAMPLES])
            if not self.private:
                self.ledger.store_metrics(reply.node, "eval", reply.metrics)
        aggregated = aggregate_metrics(metrics, robust.cap_weights(weights, self.robustness)) if metrics else None
        self.ledger.finish(aggregated)
        return aggregated
