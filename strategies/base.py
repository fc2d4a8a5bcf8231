"""The Postcard base strategy: FedAvg over a named-tensor payload, validated and metered.

Every method in Postcard aggregates *some* named tensors (LoRA factors, latents, gates,
expert deltas). :class:`PayloadFedAvg` owns what they share:

* the wire format of both directions (``strategies.codec``: fp32 or int4, raw bytes);
* the resolved run configuration, sent once to each node in its first message;
* one defensive path for every reply, training and evaluation alike
  (:mod:`strategies.screening`): a client error, identity (it answers a message sent this
  round, from the node it was sent to, in this run; one reply per node), metrics (one
  ``metrics`` record of finite numbers with a positive integer ``num-examples``), then the
  payload's declared layout and wire format *before* anything is decoded or allocated, its
  values and the method's own bounds. Whatever a reply holds, a bad one is refused with a
  logged reason naming the node (the round's ``refused`` entries), the round goes on with
  the others, and with no acceptable reply the global state stays as it was; nothing a
  client sends raises out of here;
* one aggregation pipeline, the same for every path (plain, differentially private,
  secure)::

      screen -> decode once -> check values -> bound (robust caps and clips | DP clip)
        -> combine (the method's hook)  | DP: noised sum / sampled  | secure: revealed sum / uploaders
        -> server optimiser step -> latent channel expansion -> finite? -> commit

  :meth:`PayloadFedAvg.combine` is the one hook a method overrides to combine replies its
  own way; differential privacy and secure aggregation release a plain mean of updates, so a
  strategy that overrides it is refused with either (at construction, with the reason);
* bounded influence (``strategies.robust``, the ``robust`` config group): example counts
  capped, update norms clipped, values bounded, and a choice of aggregator (the
  example-weighted mean, float64 accumulation, by default);
* atomic rounds: the new state is computed, checked to be finite, and only then replaces
  the global state (a non-finite aggregate refuses the whole round);
* exact byte accounting per node and round (payload bytes = the arrays' data; message
  bytes = Flower's count of the whole content), train/eval metrics and timings, kept in the
  round ledger (:mod:`strategies.ledger`) and handed to ``on_round_end`` once per round.

Secure aggregation's stages are a collaborator, :class:`~strategies.secure_stages.SecureStages`
(``strategy.secure_stages``), whose finished sum enters the same tail (:meth:`PayloadFedAvg.release`).

Subclasses change what a round sends (``train_config_for``), how a reply reads
(``reply_record``, ``check_reply_records``, ``decode``) or how replies combine
(``combine``); numpy only, no model code.

Checkpoints: :meth:`PayloadFedAvg.state_dict` returns what the server needs to continue a
run (the global state and the round history); :meth:`load_state_dict` restores it. A
subclass that keeps more server state between rounds (optimiser moments, a pool) extends
both. The runner writes them every round and reloads them on ``resume``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from logging import INFO, WARNING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from strategies import codec, compress, packing, robust
from strategies.channel import LATENT_KEY, LatentChannel, LatentSync, apply_update, history_key
from strategies.codec import PayloadError
from strategies.ledger import RoundLedger, RoundRecord
from strategies.privacy import Privacy
from strategies.robust import Robustness
from strategies.screening import (CONFIG_RECORD, NUM_EXAMPLES, ClientsFailed, Reply, aggregate_metrics,  # noqa: F401
                                  check_metrics, example_count, positive_count, screen)
from strategies.secure_round import SecureSettings
from strategies.secure_stages import SecureStages
from strategies.server_opt import PREFIX as OPT_PREFIX, OptimizerState, ServerOptimizer

UPLINKS = ("absolute", "delta")  # what clients send: their values, or their update (local − received)


def uplink_of(algorithm) -> str:
    """A method's ``uplink`` setting (its config block, a mapping): the one default, ``absolute``."""
    return str(algorithm.get("uplink", "absolute") or "absolute")


def weighted_mean(states: list[Mapping[str, np.ndarray]], weights: list[float]) -> dict[str, np.ndarray]:
    """Example-weighted mean of tensors with the same keys (float64 accumulation)."""
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


@dataclass
class Step:
    """What one round's combined update does: the new values of the federated tensors, and what the
    server keeps beside them once they are committed (the optimiser's moments, the latent as sent)."""

    values: dict[str, np.ndarray]
    moments: OptimizerState | None = None
    latent: Array | None = None


def sampling_minimum(num_clients: int, min_clients: int | None = None) -> int:
    """The fewest clients a round samples: ``min_clients``, or by default Flower's 2 (1 for a lone client)."""
    return int(min_clients) if min_clients else min(2, int(num_clients))


def sample_size(num_clients: int, fraction: float, min_clients: int | None = None) -> int:
    """Clients a round samples, as Flower's FedAvg does: ``max(⌊N·fraction⌋, minimum)``, at most N."""
    return min(int(num_clients), max(int(int(num_clients) * float(fraction)), sampling_minimum(num_clients,
                                                                                                  min_clients)))


class PayloadFedAvg(FedAvg):
    """FedAvg over named fp32 tensors with Postcard's wire formats and accounting.

    ``initial_state`` fixes the federated layout: the keys and shapes every reply must
    carry (``uplink_keys`` may restrict replies to a subset, e.g. FFA-LoRA's B factors).
    """

    #: a reply's update is a dense tensor per key (:meth:`client_update`), so it has a coordinate-wise
    #: median to be centered on (``robust.center``); a strategy of sparse updates says False
    dense_updates: bool = True

    def __init__(
        self,
        *,
        initial_state: Mapping[str, np.ndarray],
        config_yaml: str,
        num_clients: int,
        min_clients: int | None = None,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        uplink_format: str = "fp32",
        downlink_format: str = "fp32",
        uplink: str = "absolute",
        topk_fraction: float | None = None,
        powersgd_rank: int | None = None,
        uplink_keys: Iterable[str] | None = None,
        on_round_end: Callable[[RoundRecord], None] | None = None,
        robustness: Robustness | None = None,
        secure: SecureSettings | None = None,
        privacy: Privacy | None = None,
        channel: LatentChannel | None = None,
        server_optimizer: ServerOptimizer | None = None,
    ) -> None:
        least = sampling_minimum(num_clients, min_clients)
        super().__init__(
            fraction_train=fraction_train,
            fraction_evaluate=fraction_evaluate,
            min_train_nodes=least,
            min_evaluate_nodes=least,
            # every registered client connected before a round samples (the runner waits for them too)
            min_available_nodes=num_clients if min_clients is None else least,
        )
        if downlink_format not in codec.FORMATS:
            raise ValueError(f"unknown downlink format '{downlink_format}'; choose one of {sorted(codec.FORMATS)}")
        compress.check_format(uplink_format, topk_fraction, powersgd_rank)
        if uplink not in UPLINKS:
            raise ValueError(f"uplink must be one of {list(UPLINKS)}, got {uplink!r}")
        if uplink_format in ("topk", "powersgd") and uplink != "delta":
            raise ValueError(f"uplink format '{uplink_format}' compresses updates: it needs uplink='delta'")
        self.global_state = {k: np.asarray(v, dtype=np.float32).copy() for k, v in initial_state.items()}
        self.uplink_keys = sorted(uplink_keys) if uplink_keys is not None else sorted(self.global_state)
        missing = set(self.uplink_keys) - set(self.global_state)
        if missing:
            raise ValueError(f"uplink keys not in the global state: {sorted(missing)[:5]}")
        self.channel = channel
        self.latent_history: list[tuple[int, Array]] = []  # a latent downlink's combined z per round, as sent
        if channel is not None:
            if uplink != "delta" or uplink_format not in codec.FORMATS:
                raise ValueError("the latent channel sends each round's latents: uplink='delta', fp32 or int4")
            if channel.keys != self.uplink_keys:
                raise ValueError("the latent channel must cover exactly the federated tensors")
        self.config_yaml = config_yaml
        self.uplink_format = uplink_format
        self.downlink_format = downlink_format
        self.uplink = uplink
        self.uplink_budget = compress.max_nbytes(self.layout(), uplink_format, fraction=topk_fraction,
                                                 rank=powersgd_rank)
        self.uplink_stypes = compress.expected_stypes(self.layout(), uplink_format, rank=powersgd_rank)
        self.robustness = robustness if robustness is not None else Robustness()
        self.secure = secure
        self.privacy = privacy
        for what, settings, does in (("secure aggregation", secure, "hides each update"),
                                     ("differential privacy", privacy, "calibrates its noise to a mean of clipped "
                                                                       "updates")):
            if settings is None:
                continue
            if type(self).combine is not PayloadFedAvg.combine:
                raise ValueError(f"{type(self).__name__} combines replies its own way; {what} {does} and releases "
                                 "their plain mean, so the two cannot be used together")
            if self.robustness.aggregator != "mean":
                raise ValueError(f"{what} {does}: robust aggregator '{self.robustness.aggregator}' does not fit "
                                 "(use the mean)")
            if uplink_format not in codec.FORMATS:
                raise ValueError(f"{what} needs dense updates: uplink format '{uplink_format}' is not dense")
        self.privacy_released = 0  # rounds whose noised aggregate (central) or noised updates (local) went out
        self.sampled_rate = 0.0  # the largest fraction of the connected nodes a round trained (the accountant's q)
        self._available = 0  # nodes connected when this round's training was configured
        self.server_opt = server_optimizer if server_optimizer is not None else ServerOptimizer()
        self.opt_state = OptimizerState()
        self.secure_stages = SecureStages(self, secure) if secure is not None else None
        self.banned: dict[int, str] = {}  # node -> why: proven cheats, never sent another message of this run
        self.ledger = RoundLedger(on_round_end)
        self.sent: dict[str, list[Message]] = {}  # this round's messages per phase (ids set when pushed)
        self._downlink: ArrayRecord | None = None  # downlink_arrays() of the current global state
        self._snapshot: ArrayRecord | None = None  # federated_snapshot() of the current global state
        self.configured_nodes: set[int] = set()
        self.latent_sync = LatentSync()  # a latent downlink: the rounds each node holds (it is sent the rest)

    # ------------------------------------------------------------------ the round ledger
    @property
    def history(self) -> list[RoundRecord]:
        """Every finished round's record."""
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
        """A node that was sent a message but gave no reply (dead, unreachable or too slow).

        Logged and kept in the round's record (``missing``); the node gets the run's
        configuration again with its next message, in case it comes back as a new process.
        """
        self._start_round(server_round)
        self.ledger.missing(node_id, phase, reason)
        self.configured_nodes.discard(int(node_id))

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
        """What every client receives, encoded once per global state and reused until it changes
        (the train messages, the evaluation after aggregation, the next round's train messages)."""
        if self._downlink is None:
            self._downlink = self.encode_downlink()
        return self._downlink

    def encode_downlink(self) -> ArrayRecord:
        """The federated keys of the global state in the downlink format (a subclass sends its own),
        or, with a latent downlink, every committed round's combined latents (``latent/round-NNNNN``)."""
        if self.latent_downlink:
            record = ArrayRecord()
            for t, array in self.latent_history:
                record[history_key(t)] = array
            return record
        return codec.encode({k: self.global_state[k] for k in self.uplink_keys}, self.downlink_format)

    def federated_snapshot(self) -> ArrayRecord:
        """A latent downlink's alternative for a node that missed many rounds: the federated tensors the
        channel moves, as they are now, in fp32 (encoded once per global state)."""
        if self._snapshot is None:
            self._snapshot = codec.encode({k: self.global_state[k] for k in self.channel.keys}, "fp32")
        return self._snapshot

    def global_arrays(self) -> ArrayRecord:
        """The whole global state as fp32 (what ``aggregate_train`` returns, as Flower's strategies
        do): the downlink itself when that is the same record, so it is encoded once."""
        if self.downlink_format == "fp32" and self.uplink_keys == sorted(self.global_state) \
                and not self.latent_downlink and type(self).encode_downlink is PayloadFedAvg.encode_downlink:
            return self.downlink_arrays()
        return codec.encode(self.global_state, "fp32")

    def train_config_for(self, server_round: int, node_id: int, config: ConfigRecord) -> ConfigRecord:
        """Per-node train config; subclasses add method-specific keys."""
        config["uplink"] = self.uplink
        return config

    def _messages(self, base: Iterable[Message], server_round: int, phase: str, config: ConfigRecord) -> list[Message]:
        self._start_round(server_round)
        shared = self.downlink_arrays()
        out = []
        for template in base:
            node_id = template.metadata.dst_node_id
            node_cfg = ConfigRecord(dict(config))
            arrays = shared
            if self.latent_downlink:  # only the rounds this node has not confirmed (strategies.channel.LatentSync)
                node_cfg[LatentSync.SINCE] = self.latent_sync.since(node_id)
                arrays, dense = self.latent_sync.record_for(node_id, self.latent_history, shared,
                                                            snapshot=self.federated_snapshot)
                if dense:  # fewer bytes than the rounds it missed: the tensors themselves
                    node_cfg[LatentSync.SNAPSHOT] = self.latent_history[-1][0]
            if phase == "train":
                node_cfg = self.train_config_for(server_round, node_id, node_cfg)
            content = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: node_cfg})
            if node_id not in self.configured_nodes:
                content[CONFIG_RECORD] = ConfigRecord({"yaml": self.config_yaml})
                self.configured_nodes.add(node_id)
            client = self.ledger.client(node_id)
            client[f"{phase}_downlink_payload_bytes"] = codec.payload_bytes(arrays)
            client[f"{phase}_downlink_message_bytes"] = codec.message_bytes(content)
            out.append(Message(content=content, dst_node_id=node_id, message_type=template.metadata.message_type))
        self.sent[phase] = out  # the grid gives them ids when it pushes them: replies are checked against those
        return out

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        nodes = list(grid.get_node_ids())
        self._available = len(nodes)
        if self.privacy is not None and self.privacy.poisson:  # the sampling the accountant assumes (#63)
            chosen = self.privacy.sample(nodes, server_round)
            log(INFO, "configure_train: Poisson sampling at q = %.3g chose %d of %d nodes", self.privacy.sample_rate,
                len(chosen), len(nodes))
            config["server-round"] = server_round
            base = self._construct_messages(RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config}),
                                            chosen, MessageType.TRAIN)
        else:
            base = super().configure_train(server_round, arrays, config, grid)
        return self._messages(self._unbanned(base), server_round, "train", config)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        return self._messages(self._unbanned(super().configure_evaluate(server_round, arrays, config, grid)),
                              server_round, "eval", config)

    def _unbanned(self, messages: Iterable[Message]) -> list[Message]:
        """Flower's sampled messages less those to nodes excluded from the run (:attr:`banned`)."""
        return [m for m in messages if int(m.metadata.dst_node_id) not in self.banned]

    def ban(self, node_id: int, reason: str) -> None:
        """Exclude a node from the rest of the run (logged, kept in the round record and the checkpoint)."""
        node_id = int(node_id)
        if node_id in self.banned:
            return
        self.banned[node_id] = reason
        self.ledger.exclude(node_id, reason)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> tuple[dict[str, np.ndarray], dict]:
        """(arrays, JSON-able metadata) that let a new server process continue this run."""
        meta = {"history": list(self.history), "privacy_released": self.privacy_released,
                "sampled_rate": self.sampled_rate,
                "banned": {str(k): v for k, v in self.banned.items()}}
        if self.latent_downlink:  # the bytes as sent: a resumed run sends the clients the same history
            meta["latent_history"] = [[t, a.stype, list(a.shape), a.data.hex()] for t, a in self.latent_history]
        arrays = {k: v.copy() for k, v in self.global_state.items()}
        if not self.server_opt.plain:  # the server optimiser's moments, beside the state they move
            meta["server_optimizer"] = {"name": self.server_opt.name, "t": self.opt_state.t}
            arrays.update(self.opt_state.to_arrays())
        return arrays, meta

    def load_state_dict(self, arrays: Mapping[str, np.ndarray], meta: Mapping) -> None:
        """Restore :meth:`state_dict`'s output; the layout (keys, shapes) must be this strategy's."""
        moments = {k: v for k, v in arrays.items() if k.startswith(f"{OPT_PREFIX}/")}
        arrays = {k: v for k, v in arrays.items() if k not in moments}
        saved = meta.get("server_optimizer")
        if (saved or {}).get("name", "fedavg") != self.server_opt.name:
            raise ValueError(f"the checkpoint was written with server optimizer "
                             f"{(saved or {}).get('name', 'fedavg')!r}, this run uses {self.server_opt.name!r}")
        expected = {k: v.shape for k, v in self.global_state.items()}
        got = {k: tuple(np.shape(v)) for k, v in arrays.items()}
        if set(got) != set(expected):
            extra, missing = sorted(set(got) - set(expected))[:3], sorted(set(expected) - set(got))[:3]
            raise ValueError(f"the checkpoint's tensors do not match this run's layout "
                             f"(unexpected {extra}, missing {missing})")
        for key, shape in expected.items():
            if got[key] != tuple(shape):
                raise ValueError(f"checkpoint tensor '{key}' has shape {got[key]}, this run expects {tuple(shape)}")
        self.global_state = {k: np.asarray(arrays[k], dtype=np.float32).copy() for k in expected}
        self._downlink = self._snapshot = None
        self.history = list(meta.get("history", []))
        self.privacy_released = int(meta.get("privacy_released", 0))
        self.sampled_rate = float(meta.get("sampled_rate", 0.0))
        self.banned = {int(k): str(v) for k, v in (meta.get("banned") or {}).items()}
        self.latent_history = [(int(t), Array(dtype="float32", shape=tuple(shape), stype=str(stype),
                                              data=bytes.fromhex(data)))
                               for t, stype, shape, data in meta.get("latent_history", [])]
        self.opt_state = (OptimizerState.from_arrays(int(saved["t"]), moments, list(expected)) if saved
                          else OptimizerState())
        self.configured_nodes = set()  # a resumed run is a new Flower run: every node needs the config again
        self.latent_sync = LatentSync()  # ... and holds no latent round
        self.ledger.current = {}

    # ------------------------------------------------------------------ reading a reply
    def screen(self, replies: Iterable[Message], phase: str) -> list[Reply]:
        """Client errors, identity and metrics of a phase's replies (:func:`strategies.screening.screen`):
        the ones that pass, with their metrics; each refusal in the round's record."""
        passed = screen(replies, sent=self.sent.get(phase, []), phase=phase, refuse=self.ledger.refuse,
                        read_metrics=lambda msg: self.reply_metrics(msg, phase),
                        # e.g. a restarted SuperNode that lost the run's configuration (and its latent history):
                        # send it again next time
                        on_error=self.node_lost,
                        label="training" if phase == "train" else "evaluation", server_round=self.ledger.round)
        for reply in passed:  # it answered: it holds the latent rounds it was sent
            self.latent_sync.confirmed(reply.node)
        return passed

    def node_lost(self, node_id: int) -> None:
        """A node that answered with an error: its next message carries the run's config and the whole
        latent history again."""
        self.configured_nodes.discard(int(node_id))
        self.latent_sync.lost(node_id)

    def reply_metrics(self, msg: Message, phase: str = "train") -> dict:
        """A reply's checked metrics (:func:`check_metrics`); a method with a reply form of its own reads them there."""
        return check_metrics(msg.content)

    def reply_record(self, msg: Message) -> tuple[ArrayRecord, int]:
        """A training reply's ArrayRecord and its positive ``num-examples``; PayloadError if absent."""
        content = msg.content
        arrays = content.array_records
        if self.arrayrecord_key not in arrays:
            raise PayloadError(f"no ArrayRecord '{self.arrayrecord_key}' in the reply")
        if len(arrays) != 1:
            raise PayloadError(f"unexpected ArrayRecords {sorted(k for k in arrays if k != self.arrayrecord_key)[:3]} "
                               f"(a reply carries one, '{self.arrayrecord_key}')")
        return arrays[self.arrayrecord_key], example_count(content)

    def check_reply_records(self, msg: Message) -> None:
        """A method's own checks of a training reply's other records (e.g. FLITE's fingerprint),
        run before its payload is read, with secure aggregation or without; PayloadError if bad."""

    def check_layout(self, record: ArrayRecord) -> None:
        """The declared keys, shapes and wire formats of a reply, checked before anything is decoded:
        a reply cannot make the server allocate more than this run's layout."""
        expected = self.layout()
        if set(record) != set(expected):
            extra = sorted(set(record) - set(expected))[:3]
            missing = sorted(set(expected) - set(record))[:3]
            raise PayloadError(f"wrong key set (unexpected {extra}, missing {missing})")
        for key, shape in expected.items():
            array = record[key]
            declared = codec.check_declared(key, array, self.uplink_stypes[key])
            if declared != shape:
                raise PayloadError(f"tensor '{key}' has shape {declared}, expected {shape}")
            if array.stype in codec.DENSE and len(array.data) != codec.expected_nbytes(shape, array.stype):
                raise PayloadError(f"tensor '{key}' carries {len(array.data)} bytes, expected "
                                   f"{codec.expected_nbytes(shape, array.stype)} for shape {shape}")
        nbytes = codec.payload_bytes(record)
        if nbytes > self.uplink_budget:
            raise PayloadError(f"the payload carries {nbytes} bytes, more than the {self.uplink_budget} "
                               f"its format '{self.uplink_format}' allows")

    def decode(self, record: ArrayRecord, node_id: int):
        """A reply's record, its layout checked, as the payload :meth:`combine` takes (dense tensors; a
        method with a wire form of its own overrides it, e.g. SmartFed's sparse expert parts)."""
        self.check_layout(record)
        return codec.decode(record)

    def validate_reply(self, msg: Message) -> tuple[dict[str, np.ndarray], int]:
        """Check and decode one training reply (what the pipeline does to each); PayloadError says why not."""
        self.check_reply_records(msg)
        record, num_examples = self.reply_record(msg)
        return self.decode(record, int(msg.metadata.src_node_id)), num_examples

    def account_upload(self, reply: Reply, record: ArrayRecord) -> None:
        """An accepted training reply's bytes (payload, Flower's count, the wire) and metrics, in the round's record."""
        client = self.ledger.client(reply.node)
        client["uplink_payload_bytes"] = codec.payload_bytes(record)
        client["uplink_message_bytes"] = codec.message_bytes(reply.msg.content)
        try:  # a measurement: whatever a reply holds, it must not stop the round
            client["uplink_wire_bytes"] = packing.wire_bytes(reply.msg)
        except Exception:  # noqa: BLE001
            pass
        if not self.private:  # a private run keeps only the aggregate of what clients report
            self.ledger.store_metrics(reply.node, "train", reply.metrics)

    @property
    def private(self) -> bool:
        """Secure aggregation or differential privacy: what a client reports is never kept per client."""
        return self.secure is not None or self.privacy is not None

    # ------------------------------------------------------------------ bounded influence
    def client_update(self, payload: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """What a validated payload changes: ``payload − global`` (absolute uplink) or the delta itself."""
        if self.uplink == "delta":
            return payload
        return {k: v.astype(np.float64) - self.global_state[k] for k, v in payload.items()}

    def update_norm(self, payload) -> float:
        return robust.norm(self.client_update(payload))

    def scale_update(self, payload, factor: float):
        """The payload whose update is ``factor`` times this one's (the norm clip)."""
        if self.uplink == "delta":
            return {k: (v.astype(np.float64) * factor).astype(np.float32) for k, v in payload.items()}
        return {k: (self.global_state[k] + factor * (v.astype(np.float64) - self.global_state[k])).astype(np.float32)
                for k, v in payload.items()}

    def proposed_values(self, payload):
        """(key, values) a client proposes for the global state: what ``max_abs`` and
        :meth:`value_bounds` are checked against."""
        if self.channel is not None:  # latents: the values of the federated tensors they would move to
            yield from self.step(self.ledger.current.get("round", 0), payload, combined=False).values.items()
            return
        for key, value in payload.items():
            yield key, (value if self.uplink == "absolute" else self.global_state[key] + value)

    def value_bounds(self, key: str) -> float | None:
        """A method's own bound on the magnitude of a federated tensor (None: only ``max_abs``)."""
        return None

    def check_values(self, payload) -> None:
        """Refuse a payload proposing a value beyond ``robust.max_abs`` or the method's bound."""
        limit = self.robustness.max_abs
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is what this check refuses
            proposed = list(self.proposed_values(payload))
        for key, values in proposed:
            bounds = [b for b in (limit, self.value_bounds(key)) if b is not None]
            if not bounds or not np.size(values):
                continue
            bound = min(bounds)
            peak = float(np.max(np.abs(values)))
            if not peak <= bound:
                which = "robust.max_abs" if bound == limit else "the method's bound for this tensor"
                raise PayloadError(f"tensor '{key}' proposes values up to {peak:.3g}, beyond ±{bound:g} ({which})")

    def _bound(self, nodes: list[int], payloads: list, weights: list[int]) -> tuple[list, list[int]]:
        """Cap the example counts and clip the update norms of the accepted replies (recorded); with
        differential privacy, uniform weights and every update clipped to ``privacy.clip`` again.

        Each bounded reply is recorded in the round's ``bounded`` list (``metrics.jsonl``) with its
        detail; the log gets one line per round (:meth:`RoundLedger.log_bounded`). It is INFO while every
        bounded reply is within ``robust.FAR_COUNT`` (10) × the count it was capped at and
        ``robust.FAR_NORM`` (4) × the norm it was clipped to — the default bounds acting on
        honest-looking replies, as they do in most rounds (with ``examples_multiple: 1`` every count
        above the lower median is capped) — and a WARNING naming the replies beyond that. The privacy
        clip is the mechanism itself, applied to every update whatever its size: INFO."""
        if self.privacy is not None:
            # central: the server's own clip is what the guarantee rests on (a client's counts for nothing);
            # local: each update is already noised, and clipping it again would only shrink the noise's signal
            clipped = 0
            for i, node in enumerate(nodes):
                norm = self.update_norm(payloads[i]) if self.privacy.mode == "central" else 0.0
                if self.privacy.mode == "central":  # the server's own measure of what it sees (a trusted server)
                    self.ledger.client(node)["update_norm"] = norm
                if norm > self.privacy.clip:
                    payloads[i] = self.scale_update(payloads[i], self.privacy.clip / norm)
                    if norm > 1.01 * self.privacy.clip:  # beyond an int4 payload's rounding of a clipped update
                        self.ledger.bound(node, "dp-clipped", f"update norm {norm:.4g} clipped to {self.privacy.clip:g}")
                        clipped += 1
            effects = [f"update norms clipped to privacy.clip {self.privacy.clip:g} ({clipped})"] if clipped else []
            self.ledger.log_bounded(len(nodes), effects, [])
            return payloads, [1] * len(payloads)
        settings = self.robustness
        effects, hostile = [], []
        capped = robust.cap_weights(weights, settings)
        counted = [(node, before, after) for node, before, after in zip(nodes, weights, capped) if after != before]
        for node, before, after in counted:
            detail = f"num-examples {before} counted as {after}"
            self.ledger.bound(node, "examples-capped", detail)
            if before > robust.FAR_COUNT * after:
                hostile.append(f"node {node}: {detail}")
        if counted:  # one cap for the round: examples_multiple x the lower median, or max_examples
            effects.append(f"example counts capped at {counted[0][2]} ({len(counted)})")
        if settings.clips:
            norms = [self.update_norm(p) for p in payloads]
            scales = robust.clip_scales(norms, settings)
            clipped = 0
            for i, (node, norm, factor) in enumerate(zip(nodes, norms, scales)):
                if factor < 1.0:
                    payloads[i] = self.scale_update(payloads[i], factor)
                    detail = f"update norm {norm:.4g} clipped to {norm * factor:.4g}"
                    self.ledger.bound(node, "norm-clipped", detail)
                    clipped += 1
                    if factor * robust.FAR_NORM < 1.0:
                        hostile.append(f"node {node}: {detail}")
            if clipped:
                bound = robust.clip_bound(norms, settings)
                to = (f"{settings.norm_multiple:g}x the lower median, {bound:.4g}" if settings.norm_clip == "median"
                      else f"robust.norm_clip {bound:g}")
                effects.append(f"update norms clipped to {to} ({clipped})")
        if settings.centers and self.dense_updates:  # after the norm clip, whose WARNING names a far-off update
            self._center_clip(nodes, payloads, effects)
        self.ledger.log_bounded(len(nodes), effects, hostile)
        return payloads, capped

    def _center_clip(self, nodes: list[int], payloads: list, effects: list[str]) -> None:
        """Centered clipping (``robust.center``, :func:`strategies.robust.center_scales`): each update's
        distance from the round's coordinate-wise median update brought within ``center_multiple`` × the
        lower median of those distances; the payloads replaced in place, each clipped one recorded. Never
        a WARNING of its own: honest updates that differ in size (more local data, another domain) sit
        many lower-median distances from the median; a hostile one is also far outside the count cap or
        the norm clip, which say so."""
        updates = [self.client_update(p) for p in payloads]
        centered = robust.center_scales(updates, self.robustness)
        if centered is None:
            return
        center, factors, distances, bound = centered
        clipped = 0
        for i, (node, factor, distance) in enumerate(zip(nodes, factors, distances)):
            if factor < 1.0:
                payloads[i] = self.with_update(payloads[i], robust.recenter(updates[i], center, factor))
                detail = f"distance {distance:.4g} from the round's median update clipped to {bound:.4g}"
                self.ledger.bound(node, "center-clipped", detail)
                clipped += 1
        effects.append(f"distances from the median update clipped to {self.robustness.center_multiple:g}x their "
                       f"lower median, {bound:.4g} ({clipped})")

    def with_update(self, payload, update: Mapping[str, np.ndarray]):
        """The payload whose :meth:`client_update` is ``update``."""
        if self.uplink == "delta":
            return {k: np.asarray(v, np.float64).astype(np.float32) for k, v in update.items()}
        return {k: (self.global_state[k] + update[k]).astype(np.float32) for k in payload}

    # ------------------------------------------------------------------ the aggregation pipeline
    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        """Screen, decode and check each reply, bound the accepted ones, combine them (:meth:`combine`, or
        the private mean under differential privacy) and :meth:`release` the result."""
        self._start_round(server_round)
        nodes, payloads, weights, metrics = [], [], [], []
        for reply in self.screen(replies, "train"):
            try:
                self.check_reply_records(reply.msg)
                record, num_examples = self.reply_record(reply.msg)  # read once: decoded, then counted
                tensors = self.decode(record, reply.node)
                self.check_values(tensors)
            except PayloadError as err:
                self.ledger.refuse(reply.node, str(err), kind="payload")
                continue
            except Exception as err:  # noqa: BLE001 - whatever a client sends must not stop the run
                self.ledger.refuse(reply.node, f"malformed payload ({type(err).__name__}: {err})", kind="payload")
                continue
            nodes.append(reply.node)
            payloads.append(tensors)
            weights.append(num_examples)
            metrics.append({NUM_EXAMPLES: num_examples} if self.private else reply.metrics)
            self.account_upload(reply, record)
        if not payloads:
            log(WARNING, "round %s: no acceptable training reply; the global state is unchanged", server_round)
            out = None, None
        else:
            payloads, weights = self._bound(nodes, payloads, weights)
            with np.errstate(over="ignore", invalid="ignore"):  # a non-finite aggregate is refused in release
                if self.privacy is not None:  # the sum of the clipped updates (uniform weights), privately released
                    updates = [self.client_update(p) for p in payloads]
                    total = {k: np.sum([u[k].astype(np.float64) for u in updates], axis=0) for k in updates[0]}
                    update = self.mean_of_sum(server_round, total, len(payloads))
                else:
                    update = self.combine(payloads, weights)
            out = self.release(server_round, update, metrics, weights)
        self.train_ended(server_round)
        return out

    def combine(self, payloads: list[dict[str, np.ndarray]], weights: list[int]) -> dict[str, np.ndarray]:
        """The hook: the accepted, bounded payloads and their weights -> the round's combined update of
        the uplink keys, in payload space (what :meth:`release` turns into the new state).

        ``robust.aggregator='mean'``: the weighted mean of the clients' updates (with
        ``uplink='absolute'`` the mean of their values, minus the global state; with
        ``uplink='delta'`` the mean of the ``local − received`` they sent). Other aggregators
        combine the updates (see ``strategies.robust``). Not called under differential privacy
        or secure aggregation (a strategy that overrides it is refused with them)."""
        if self.robustness.aggregator != "mean":
            return robust.aggregate([self.client_update(p) for p in payloads], [float(w) for w in weights],
                                    self.robustness)
        mean = weighted_mean(payloads, [float(w) for w in weights])
        if self.uplink == "absolute":
            return {k: v.astype(np.float64) - self.global_state[k] for k, v in mean.items()}
        return mean

    def mean_of_sum(self, server_round: int, total: dict[str, np.ndarray], count: int) -> dict[str, np.ndarray]:
        """The combined update from the sum of ``count`` clipped updates (a secure round's revealed sum, or
        the clipped updates of a private round): ``total / count``, or under differential privacy the
        private mean (central: noised; both: over the clients sampled), the release counted for ε."""
        if self.privacy is None:
            return {k: v / count for k, v in total.items()}
        update = self.privacy.release(total, self._sampled(server_round, count), server_round)
        self.privacy_released += 1
        self.ledger.current["privacy"] = self.privacy.record(self.privacy_released, self.sampled_rate)
        return update

    def release(self, server_round: int, update: dict[str, np.ndarray], metrics: list[dict], weights: list):
        """The one tail of every path: the round's combined update (:meth:`combine`'s, or
        :meth:`mean_of_sum`'s) through :meth:`step`, and the new state committed if it is finite and
        inside the layout, else the round refused (the state unchanged)."""
        with np.errstate(over="ignore", invalid="ignore"):  # a non-finite aggregate is refused below
            step = self.step(server_round, update)
        for key, value in step.values.items():
            if key not in self.global_state or value.shape != self.global_state[key].shape:
                raise RuntimeError(f"aggregation produced a tensor '{key}' outside the layout")  # programming error
        bad = sorted(k for k, v in step.values.items() if not np.all(np.isfinite(v)))
        if bad:
            self.ledger.refuse(None, f"the aggregate of {len(weights)} replies is not finite in {bad[:3]}; the round "
                                     "is refused", kind="round")
            return None, None
        self.commit(step.values)
        if step.latent is not None:
            self.latent_history.append((int(server_round), step.latent))
        if step.moments is not None:
            self.opt_state = step.moments
        self.ledger.current["accepted"] = len(weights)
        return self.global_arrays(), aggregate_metrics(metrics, weights)

    def _sampled(self, server_round: int, accepted: int) -> int:
        """The clients this round sampled (the private mean's denominator); ε is accounted at the rate
        that happened if Flower sampled more than the noise was calibrated for."""
        sampled = max(1, len(self.sent.get("train", [])) or accepted)
        if self.privacy.poisson:  # sampled at q by construction: the count varies, the rate does not
            self.sampled_rate = max(self.sampled_rate, self.privacy.sample_rate)
            return sampled
        if self._available:
            rate = sampled / max(self._available, sampled)
            if rate > self.privacy.sample_rate + 1e-9 and rate > self.sampled_rate:
                log(WARNING, "round %s: %d of %d nodes trained, a sampling rate of %.3g, above the %.3g the noise "
                    "was calibrated for: ε is accounted at %.3g", server_round, sampled, self._available, rate,
                    self.privacy.sample_rate, rate)
            self.sampled_rate = max(self.sampled_rate, rate)
        return sampled

    def step(self, server_round: int, update: Mapping[str, np.ndarray], *, combined: bool = True) -> Step:
        """The new global values from a combined update in payload space: ``global + update``
        (through the latent channel's expansion first, when the payload is latents). A round's
        combined update is first the server optimiser's pseudo-gradient (``strategy.server_optimizer``,
        ``strategies.server_opt``): the step replaces it. ``combined=False``: one client's update, as it
        would move the state (no optimiser step)."""
        moments = latent = None
        if combined and not self.server_opt.plain:
            update, moments = self.server_opt.step(update, self.opt_state)
        if self.channel is not None:
            if self.latent_downlink and np.all(np.isfinite(update[LATENT_KEY])):
                # the combined z as the clients will decode it from the downlink (a non-finite one is refused later)
                fmt = self.channel.downlink_format or self.uplink_format
                latent = codec.encode({LATENT_KEY: update[LATENT_KEY]}, fmt)[LATENT_KEY]
                record = ArrayRecord()
                record[LATENT_KEY] = latent
                update = codec.decode(record)
            update = self.channel.expand(server_round, update)
        return Step(apply_update(self.global_state, update), moments, latent if combined else None)

    def commit(self, values: dict[str, np.ndarray]) -> None:
        """Replace the global values of the aggregated keys (a subclass keeps its own state in step)."""
        for key, value in values.items():
            self.global_state[key] = value.astype(np.float32)
        self._downlink = self._snapshot = None

    def train_ended(self, server_round: int) -> None:
        """Called once a round's training replies were aggregated (plain or secure), whether or not the
        global state changed: a subclass records what it derives from the state (FedNL: α per layer)."""

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
