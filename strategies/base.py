"""The Postcard base strategy: FedAvg over a named-tensor payload, validated and metered.

Every method in Postcard aggregates *some* named tensors (LoRA factors, latents, gates,
expert deltas). :class:`PayloadFedAvg` owns what they share:

* the wire format of both directions (``strategies.codec``: fp32 or int4, raw bytes);
* the resolved run configuration, sent once to each node in its first message;
* one defensive path for every reply, training and evaluation alike: identity (it answers
  a message sent this round, from the node it was sent to, in this run; one reply per
  node), metrics (one ``metrics`` record of finite numbers with a positive integer
  ``num-examples``), then the payload's declared layout and wire format *before* anything
  is decoded or allocated, its values and the method's own bounds. Whatever a reply holds,
  a bad one is refused with a logged reason naming the node (recorded with its kind in the
  round record, ``refused``), the round goes on with the others, and with no acceptable
  reply the global state stays as it was; nothing a client sends raises out of here;
* bounded influence (``strategies.robust``, the ``robust`` config group): example counts
  capped, update norms clipped, values bounded, and a choice of aggregator (the
  example-weighted mean, float64 accumulation, by default);
* atomic rounds: the new state is computed, checked to be finite, and only then replaces
  the global state (a non-finite aggregate refuses the whole round);
* exact byte accounting per node and round (payload bytes = the arrays' data; message
  bytes = Flower's count of the whole content), train/eval metrics and timings, handed
  to ``on_round_end`` as one record per round.

Subclasses change what a round sends (``train_config_for``) or how replies combine
(``aggregate_payloads``); numpy only, no model code.

Checkpoints: :meth:`PayloadFedAvg.state_dict` returns what the server needs to continue a
run (the global state and the round history); :meth:`load_state_dict` restores it. A
subclass that keeps more server state between rounds (optimiser moments, a pool) extends
both. The runner writes them every round and reloads them on ``resume``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from logging import WARNING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from strategies import codec, compress, robust
from strategies.channel import LATENT_KEY, LatentChannel, apply_update, history_key
from strategies.codec import PayloadError
from strategies.privacy import Privacy, add_noise
from strategies.robust import Robustness
from strategies.secagg import SecAggCheat, SecAggError
from strategies.secure_round import KEYS, SHARES, UNMASK, SecureRound, SecureSettings
from strategies.server_opt import PREFIX as OPT_PREFIX, OptimizerState, ServerOptimizer

CONFIG_RECORD = "postcard"  # ConfigRecord holding the resolved YAML (first message to a node)
NUM_EXAMPLES = "num-examples"

UPLINKS = ("absolute", "delta")  # what clients send: their values, or their update (local − received)
RoundRecord = dict


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


class ClientsFailed(RuntimeError):
    """Every client of a round failed: nothing can go on (e.g. a setup error on all nodes)."""


class PayloadFedAvg(FedAvg):
    """FedAvg over named fp32 tensors with Postcard's wire formats and accounting.

    ``initial_state`` fixes the federated layout: the keys and shapes every reply must
    carry (``uplink_keys`` may restrict replies to a subset, e.g. FFA-LoRA's B factors).
    """

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
        min_clients = num_clients if min_clients is None else int(min_clients)
        super().__init__(
            fraction_train=fraction_train,
            fraction_evaluate=fraction_evaluate,
            min_train_nodes=min_clients,
            min_evaluate_nodes=min_clients,
            min_available_nodes=min_clients,
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
        self._pending_latent: tuple[int, Array] | None = None  # this round's, until the round commits
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
        if secure is not None and self.robustness.aggregator != "mean":
            raise ValueError(f"secure aggregation hides each update: robust aggregator "
                             f"'{self.robustness.aggregator}' needs them (use the mean)")
        if secure is not None and uplink_format not in codec.FORMATS:
            raise ValueError(f"secure aggregation sums dense values: uplink format '{uplink_format}' is not dense")
        self.privacy = privacy
        if privacy is not None and self.robustness.aggregator != "mean":
            raise ValueError(f"differential privacy's noise is calibrated to a mean of clipped updates: robust "
                             f"aggregator '{self.robustness.aggregator}' does not fit (use the mean)")
        if privacy is not None and uplink_format not in codec.FORMATS:
            raise ValueError(f"differential privacy clips and noises dense updates: uplink format '{uplink_format}' "
                             "is not dense")
        self.privacy_released = 0  # rounds whose noised aggregate (central) or noised updates (local) went out
        self.sampled_rate = 0.0  # the largest fraction of the connected nodes a round trained (the accountant's q)
        self._available = 0  # nodes connected when this round's training was configured
        self.server_opt = server_optimizer if server_optimizer is not None else ServerOptimizer()
        self.opt_state = OptimizerState()
        self._pending_opt: tuple[int, OptimizerState] | None = None  # this round's moments, until it commits
        self._secure: SecureRound | None = None
        self._secure_train: list[Message] = []
        self._secure_metrics: list[dict] = []
        self._secure_noted: set[int] = set()  # nodes whose leaving this secure round is already recorded
        self.banned: dict[int, str] = {}  # node -> why: proven cheats, never sent another message of this run
        self.on_round_end = on_round_end
        self._sent: dict[str, list[Message]] = {}  # this round's messages per phase (ids set when pushed)
        self._downlink: ArrayRecord | None = None  # downlink_arrays() of the current global state
        self.configured_nodes: set[int] = set()
        self.history: list[RoundRecord] = []
        self._round: RoundRecord = {}

    # ------------------------------------------------------------------ helpers
    def layout(self) -> dict[str, tuple[int, ...]]:
        """What a training reply carries: the uplink keys' shapes, or the latent channel's vector."""
        if self.channel is not None:
            return self.channel.layout()
        return {k: tuple(self.global_state[k].shape) for k in self.uplink_keys}

    def advance(self, server_round: int, update: Mapping[str, np.ndarray], *,
                combined: bool = True) -> dict[str, np.ndarray]:
        """The new global values from a combined update in payload space: ``global + update``
        (through the latent channel's expansion first, when the payload is latents). A round's
        combined update is first the server optimiser's pseudo-gradient (``strategy.server_optimizer``,
        ``strategies.server_opt``): the step replaces it, and its moments wait for :meth:`commit`.
        ``combined=False``: one client's update, as it would move the state (no optimiser step)."""
        if combined and not self.server_opt.plain:
            update, moments = self.server_opt.step(update, self.opt_state)
            self._pending_opt = (int(server_round), moments)
        if self.channel is not None:
            if self.latent_downlink and np.all(np.isfinite(update[LATENT_KEY])):
                # the combined z as the clients will decode it from the downlink (a non-finite one is refused later)
                fmt = self.channel.downlink_format or self.uplink_format
                array = codec.encode({LATENT_KEY: update[LATENT_KEY]}, fmt)[LATENT_KEY]
                self._pending_latent = (int(server_round), array)
                record = ArrayRecord()
                record[LATENT_KEY] = array
                update = codec.decode(record)
            update = self.channel.expand(server_round, update)
        return apply_update(self.global_state, update)

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

    def _start_round(self, server_round: int) -> None:
        if self._round.get("round") != server_round:
            self._round = {"round": server_round, "t_start": time.time(), "clients": {}, "refused": [],
                           "missing": [], "bounded": []}
            self._sent = {}

    def record_missing(self, server_round: int, node_id: int, phase: str, reason: str) -> None:
        """A node that was sent a message but gave no reply (dead, unreachable or too slow).

        Logged and kept in the round's record (``missing``); the node gets the run's
        configuration again with its next message, in case it comes back as a new process.
        """
        self._start_round(server_round)
        log(WARNING, "round %s: no %s reply from node %s: %s", server_round, phase, node_id, reason)
        self._round["missing"].append({"node_id": int(node_id), "phase": phase, "reason": reason})
        self.configured_nodes.discard(int(node_id))

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
        self._downlink = None
        self.history = list(meta.get("history", []))
        self.privacy_released = int(meta.get("privacy_released", 0))
        self.sampled_rate = float(meta.get("sampled_rate", 0.0))
        self.banned = {int(k): str(v) for k, v in (meta.get("banned") or {}).items()}
        self.latent_history = [(int(t), Array(dtype="float32", shape=tuple(shape), stype=str(stype),
                                              data=bytes.fromhex(data)))
                               for t, stype, shape, data in meta.get("latent_history", [])]
        self._pending_latent = None
        self.opt_state = (OptimizerState.from_arrays(int(saved["t"]), moments, list(expected)) if saved
                          else OptimizerState())
        self._pending_opt = None
        self.configured_nodes = set()  # a resumed run is a new Flower run: every node needs the config again
        self._round = {}

    def round_record(self) -> RoundRecord:
        """The current round's record so far (what ``on_round_end`` gets once the round is evaluated)."""
        return self._round

    def _client(self, node_id: int) -> dict:
        return self._round["clients"].setdefault(str(node_id), {"node_id": int(node_id)})

    def _messages(self, base: Iterable[Message], server_round: int, phase: str, config: ConfigRecord) -> list[Message]:
        self._start_round(server_round)
        arrays = self.downlink_arrays()
        out = []
        for template in base:
            node_id = template.metadata.dst_node_id
            node_cfg = ConfigRecord(dict(config))
            if phase == "train":
                node_cfg = self.train_config_for(server_round, node_id, node_cfg)
            content = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: node_cfg})
            if node_id not in self.configured_nodes:
                content[CONFIG_RECORD] = ConfigRecord({"yaml": self.config_yaml})
                self.configured_nodes.add(node_id)
            client = self._client(node_id)
            client[f"{phase}_downlink_payload_bytes"] = codec.payload_bytes(arrays)
            client[f"{phase}_downlink_message_bytes"] = codec.message_bytes(content)
            out.append(Message(content=content, dst_node_id=node_id, message_type=template.metadata.message_type))
        self._sent[phase] = out  # the grid gives them ids when it pushes them: replies are checked against those
        return out

    # ------------------------------------------------------------------ training
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        self._available = len(list(grid.get_node_ids()))
        return self._messages(self._unbanned(super().configure_train(server_round, arrays, config, grid)),
                              server_round, "train", config)

    def _unbanned(self, messages: Iterable[Message]) -> list[Message]:
        """Flower's sampled messages less those to nodes excluded from the run (:attr:`banned`)."""
        return [m for m in messages if int(m.metadata.dst_node_id) not in self.banned]

    def ban(self, node_id: int, reason: str) -> None:
        """Exclude a node from the rest of the run (logged, kept in the round record and the checkpoint)."""
        node_id = int(node_id)
        if node_id in self.banned:
            return
        log(WARNING, "round %s: node %s is excluded from the rest of the run: %s", self._round.get("round"),
            node_id, reason)
        self.banned[node_id] = reason
        self._round.setdefault("excluded", []).append({"node_id": node_id, "reason": reason})

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

    def reply_metrics(self, msg: Message, phase: str = "train") -> dict:
        """A reply's checked metrics (:func:`check_metrics`); a method with a reply form of its own reads them there."""
        return check_metrics(msg.content)

    def check_reply_records(self, msg: Message) -> None:
        """A method's own checks of a training reply's other records (e.g. FLITE's fingerprint),
        run before its payload is read, with secure aggregation or without; PayloadError if bad."""

    def validate_reply(self, msg: Message) -> tuple[dict[str, np.ndarray], int]:
        """Decode and check one training reply; raise PayloadError with the reason."""
        self.check_reply_records(msg)
        record, num_examples = self.reply_record(msg)
        self.check_layout(record)
        return codec.decode(record), num_examples

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
            yield from self.advance(self._round.get("round", 0), payload, combined=False).items()
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
        differential privacy, uniform weights and every update clipped to ``privacy.clip`` again."""
        if self.privacy is not None:
            # central: the server's own clip is what the guarantee rests on (a client's counts for nothing);
            # local: each update is already noised, and clipping it again would only shrink the noise's signal
            for i, node in enumerate(nodes):
                norm = self.update_norm(payloads[i]) if self.privacy.mode == "central" else 0.0
                if self.privacy.mode == "central":  # the server's own measure of what it sees (a trusted server)
                    self._client(node)["update_norm"] = norm
                if norm > self.privacy.clip:
                    payloads[i] = self.scale_update(payloads[i], self.privacy.clip / norm)
                    if norm > 1.01 * self.privacy.clip:  # beyond an int4 payload's rounding of a clipped update
                        self._record_bound(node, "dp-clipped",
                                           f"update norm {norm:.4g} clipped to {self.privacy.clip:g}")
            return payloads, [1] * len(payloads)
        settings = self.robustness
        capped = robust.cap_weights(weights, settings)
        for node, before, after in zip(nodes, weights, capped):
            if after != before:
                self._record_bound(node, "examples-capped", f"num-examples {before} counted as {after}")
        if settings.clips:
            norms = [self.update_norm(p) for p in payloads]
            scales = robust.clip_scales(norms, settings)
            for i, (node, norm, factor) in enumerate(zip(nodes, norms, scales)):
                if factor < 1.0:
                    payloads[i] = self.scale_update(payloads[i], factor)
                    self._record_bound(node, "norm-clipped", f"update norm {norm:.4g} clipped to {norm * factor:.4g}")
        return payloads, capped

    def _record_bound(self, node_id: int, kind: str, detail: str) -> None:
        log(WARNING, "round %s: node %s: %s", self._round.get("round"), node_id, detail)
        self._round["bounded"].append({"node_id": int(node_id), "round": self._round.get("round"), "kind": kind,
                                       "detail": detail})

    # ------------------------------------------------------------------ aggregation
    def aggregate_payloads(self, payloads: list[dict[str, np.ndarray]], weights: list[int]) -> dict[str, np.ndarray]:
        """Combine accepted payloads into the new values of the uplink keys (no side effects:
        :meth:`commit` applies the result once it is known to be finite).

        ``robust.aggregator='mean'``, ``uplink='absolute'``: the weighted mean of the clients'
        values. ``uplink='delta'``: the clients sent ``local − received``; the weighted mean
        update is added to the fp32 global state (the same result in fp32, but compressible:
        updates are small). Other aggregators combine the updates (see ``strategies.robust``).
        """
        if self.robustness.aggregator != "mean":
            combined = robust.aggregate([self.client_update(p) for p in payloads], [float(w) for w in weights],
                                        self.robustness)
            return self.advance(self._round.get("round", 0), combined)
        mean = weighted_mean(payloads, [float(w) for w in weights])
        if self.uplink == "absolute":
            if self.server_opt.plain:
                return mean
            mean = {k: v.astype(np.float64) - self.global_state[k] for k, v in mean.items()}  # the mean update
        return self.advance(self._round.get("round", 0), mean)

    def commit(self, update: dict[str, np.ndarray]) -> None:
        """Replace the global values of the aggregated keys (a subclass keeps its own state in step)."""
        for key, value in update.items():
            self.global_state[key] = value.astype(np.float32)
        self._downlink = None
        if self._pending_latent is not None and self._pending_latent[0] == self._round.get("round"):
            self.latent_history.append(self._pending_latent)
        self._pending_latent = None
        if self._pending_opt is not None and self._pending_opt[0] == self._round.get("round"):
            self.opt_state = self._pending_opt[1]
        self._pending_opt = None

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        out = self._aggregate_train(server_round, replies)
        self.train_ended(server_round)
        return out

    def _aggregate_train(self, server_round: int, replies: Iterable[Message]):
        self._start_round(server_round)
        nodes, payloads, weights, metrics = [], [], [], []
        for msg, reply_metrics in self._screen(replies, "train"):
            node_id = int(msg.metadata.src_node_id)
            try:
                tensors, num_examples = self.validate_reply(msg)
                self.check_values(tensors)
            except PayloadError as err:
                self._refuse(node_id, str(err), kind="payload")
                continue
            except Exception as err:  # noqa: BLE001 - whatever a client sends must not stop the run
                self._refuse(node_id, f"malformed payload ({type(err).__name__}: {err})", kind="payload")
                continue
            nodes.append(node_id)
            payloads.append(tensors)
            weights.append(num_examples)
            metrics.append({NUM_EXAMPLES: num_examples} if self.private else reply_metrics)
            self._account_upload(node_id, msg, reply_metrics)
        if not payloads:
            log(WARNING, "round %s: no acceptable training reply; the global state is unchanged", server_round)
            return None, None
        payloads, weights = self._bound(nodes, payloads, weights)
        with np.errstate(over="ignore", invalid="ignore"):  # a non-finite aggregate is refused below
            if self.privacy is not None:  # the sum of the clipped updates (uniform weights), noised in payload space
                updates = [self.client_update(p) for p in payloads]
                total = {k: np.sum([u[k].astype(np.float64) for u in updates], axis=0) for k in updates[0]}
                update = self._privatize(server_round, total, len(payloads))
            else:
                update = self.aggregate_payloads(payloads, weights)
        return self._apply(server_round, update, metrics, weights)

    def _account_upload(self, node_id: int, msg: Message, reply_metrics: dict) -> None:
        """An accepted training reply's bytes (payload, Flower's count, the wire) and metrics, in the round's record."""
        client = self._client(node_id)
        client["uplink_payload_bytes"] = codec.payload_bytes(self.reply_record(msg)[0])
        client["uplink_message_bytes"] = codec.message_bytes(msg.content)
        try:  # a measurement: whatever a reply holds, it must not stop the round
            client["uplink_wire_bytes"] = codec.wire_bytes(msg)
        except Exception:  # noqa: BLE001
            pass
        self._store_client_metrics(node_id, "train", reply_metrics)

    @property
    def private(self) -> bool:
        """Secure aggregation or differential privacy: what a client reports is never kept per client."""
        return self.secure is not None or self.privacy is not None

    def _store_client_metrics(self, node_id: int, phase: str, metrics: Mapping) -> None:
        """A reply's metrics in its node's round record as ``<phase>_<name>``, never over a field the
        server wrote (its byte accounting); in a private run not at all (only the aggregate is kept)."""
        if self.private:
            return
        client = self._client(node_id)
        for key, value in metrics.items():
            name = f"{phase}_{key}"
            if name in client:
                log(WARNING, "round %s: node %s reported a metric '%s', a name the server's own record uses; "
                    "left out", self._round.get("round"), node_id, key)
                continue
            client[name] = _plain(value)

    def train_ended(self, server_round: int) -> None:
        """Called once a round's training replies were aggregated (plain or secure), whether or not the
        global state changed: a subclass records what it derives from the state (FedNL: α per layer)."""

    def _privatize(self, server_round: int, total: dict[str, np.ndarray], accepted: int) -> dict[str, np.ndarray]:
        """The new state from the sum of the round's clipped updates: central DP adds N(0, (z·clip)²) to
        the sum and divides by the number of clients sampled (a fixed denominator); local DP (the
        clients added their noise) divides by the same. The release is counted for the accountant."""
        privacy = self.privacy
        sampled = max(1, len(self._sent.get("train", [])) or accepted)
        if self._available:  # ε from the rate that happened, if Flower sampled more than planned
            rate = sampled / max(self._available, sampled)
            if rate > privacy.sample_rate + 1e-9 and rate > self.sampled_rate:
                log(WARNING, "round %s: %d of %d nodes trained, a sampling rate of %.3g, above the %.3g the noise "
                    "was calibrated for: ε is accounted at %.3g", server_round, sampled, self._available, rate,
                    privacy.sample_rate, rate)
            self.sampled_rate = max(self.sampled_rate, rate)
        if privacy.mode == "central":
            total = add_noise(total, privacy.sum_std, privacy.rng(server_round))
        self.privacy_released += 1
        self._round["privacy"] = privacy.record(self.privacy_released, self.sampled_rate)
        return self.advance(server_round, {k: v / sampled for k, v in total.items()})

    def _apply(self, server_round: int, update: dict[str, np.ndarray], metrics: list[dict], weights: list):
        """Commit an aggregate that is finite and inside the layout; else refuse the round (state unchanged)."""
        for key, value in update.items():
            if key not in self.global_state or value.shape != self.global_state[key].shape:
                raise RuntimeError(f"aggregation produced a tensor '{key}' outside the layout")  # programming error
        bad = sorted(k for k, v in update.items() if not np.all(np.isfinite(v)))
        if bad:
            return self._refuse_round(server_round, f"the aggregate of {len(weights)} replies is not finite in "
                                                    f"{bad[:3]}; the round is refused")
        self.commit(update)
        self._round["accepted"] = len(weights)
        return self.global_arrays(), aggregate_metrics(metrics, weights)

    def _refuse_round(self, server_round: int, reason: str):
        log(WARNING, "round %s: %s and the global state is unchanged", server_round, reason)
        self._round["refused"].append({"node_id": None, "round": server_round, "phase": "train", "kind": "round",
                                       "reason": reason})
        return None, None

    # ------------------------------------------------------------------ secure aggregation
    # The runner drives a secure round as begin -> keys -> shares -> train -> unmask
    # (strategies.secure_round); each step takes the previous stage's replies and returns the
    # next stage's messages ([] once the round is abandoned: below the threshold).
    def secure_begin(self, server_round: int, train_messages: list[Message]) -> list[Message]:
        self._start_round(server_round)
        self._secure_train = list(train_messages)
        nodes = [int(m.metadata.dst_node_id) for m in self._secure_train]
        self._secure_noted = set()
        try:
            self._secure = SecureRound(self.secure, server_round, nodes, self.layout())
        except SecAggError as err:
            return self._secure_abandon(server_round, err)
        out = self._secure.keys_messages()
        for msg, train in zip(out, self._secure_train):  # a node that needs the run's config gets it first here
            if CONFIG_RECORD in train.content.config_records:
                msg.content[CONFIG_RECORD] = train.content[CONFIG_RECORD]
        return self._secure_sent(KEYS, out)

    def secure_keys(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        if self._secure is None:
            return []
        secure = self._secure
        try:
            out = secure.take_keys(self._stage_replies(replies, KEYS))
        except SecAggError as err:
            return self._secure_abandon(server_round, err)
        finally:
            self._note_secure_drops(KEYS, secure)
        return self._secure_sent(SHARES, out)

    def secure_shares(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        if self._secure is None:
            return []
        secure = self._secure
        try:
            secure.take_shares(self._stage_replies(replies, SHARES))
        except SecAggError as err:
            return self._secure_abandon(server_round, err)
        finally:
            self._note_secure_drops(SHARES, secure)
        before = {id(m): codec.message_bytes(m.content) for m in self._secure_train}
        out = [m for m in (self._secure.attach(m) for m in self._secure_train) if m is not None]
        for msg in out:
            self._secure_bytes(int(msg.metadata.dst_node_id), "down",
                               codec.message_bytes(msg.content) - before[id(msg)])
        self._sent["train"] = out
        return out

    def secure_upload(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """The masked training replies (screened as any reply, then their masked layout) -> unmask messages."""
        if self._secure is None:
            return []
        self._secure_metrics = []
        for msg, reply_metrics in self._screen(replies, "train"):
            node_id = _node(msg)
            try:
                self.check_reply_records(msg)
                record, _ = self.reply_record(msg)
                residues = self._secure.check_upload(record)
            except (PayloadError, SecAggError) as err:
                self._refuse(node_id, str(err), kind="payload")
                continue
            except Exception as err:  # noqa: BLE001 - whatever a client sends must not stop the run
                self._refuse(node_id, f"malformed payload ({type(err).__name__}: {err})", kind="payload")
                continue
            self._secure.upload(node_id, residues)
            self._secure_metrics.append({NUM_EXAMPLES: reply_metrics[NUM_EXAMPLES]})  # nothing else of it is kept
            self._account_upload(node_id, msg, reply_metrics)
        try:
            out = self._secure.unmask_messages()
        except SecAggError as err:
            return self._secure_abandon(server_round, err)
        return self._secure_sent(UNMASK, out)

    def secure_finish(self, server_round: int, replies: Iterable[Message]):
        """The unmask replies -> the mean of the uploaders' values (uniform weights), committed."""
        out = self._secure_finish(server_round, replies)
        self.train_ended(server_round)
        return out

    def _secure_finish(self, server_round: int, replies: Iterable[Message]):
        secure, self._secure = self._secure, None
        if secure is None:
            return None, None
        try:
            sums = secure.take_reveals(self._stage_replies(replies, UNMASK))
        except SecAggError as err:
            for node, why in (err.culprits.items() if isinstance(err, SecAggCheat) else ()):
                self.ban(node, f"secure aggregation, round {server_round}: {why}")
            self._secure = secure
            return self._secure_abandon(server_round, err) or (None, None)
        finally:
            self._note_secure_drops(UNMASK, secure)
        count = len(secure.masked)
        self._round["secure"] = {"uploaded": count, "participants": len(secure.participants),
                                 "threshold": secure.threshold, "bits": secure.fixed.bits,
                                 "modulus_bits": secure.fixed.modulus_bits, "clip": secure.fixed.clip,
                                 "dropped": {str(k): v for k, v in secure.dropped.items()}}
        # clients always mask their update (what they trained minus what they received), whatever
        # the method's uplink: updates are small, so a narrow clip range resolves them
        if self.privacy is not None:
            update = self._privatize(server_round, sums, count)
        else:
            update = self.advance(server_round, {k: v / count for k, v in sums.items()})
        return self._apply(server_round, update, self._secure_metrics, [1] * count)

    def _secure_sent(self, phase: str, messages: list[Message]) -> list[Message]:
        for msg in messages:
            self._secure_bytes(int(msg.metadata.dst_node_id), "down", codec.message_bytes(msg.content))
        self._sent[phase] = messages
        return messages

    def _secure_bytes(self, node_id: int, direction: str, nbytes: int) -> None:
        client = self._client(node_id)
        key = f"secagg_{direction}link_bytes"
        client[key] = client.get(key, 0) + int(nbytes)

    def _note_secure_drops(self, phase: str, secure: SecureRound | None = None) -> None:
        """Nodes the secure round dropped for what they sent (a bad key, share, reveal): each refused by name."""
        secure = secure or self._secure
        for node, why in sorted((secure.dropped if secure is not None else {}).items()):
            if node not in self._secure_noted:
                self._secure_noted.add(node)
                self._refuse(node, f"secure aggregation: {why}", kind="secagg", phase=phase)

    def _secure_abandon(self, server_round: int, err: Exception) -> list:
        self._secure = None
        self._refuse_round(server_round, f"secure aggregation: {err}")
        return []

    def _stage_replies(self, replies: Iterable[Message], phase: str) -> dict[int, Message]:
        """A secure stage's replies by node: client errors and identity problems refused (as in
        :meth:`_screen`); sizes and contents are checked by the stage itself."""
        sent = {str(m.metadata.message_id): m for m in self._sent.get(phase, []) if m.metadata.message_id}
        out: dict[int, Message] = {}
        for msg in replies:
            node_id = _node(msg)
            if _has_error(msg):
                self._refuse(node_id, f"client error during {phase}: {_error_reason(msg)}", kind="client-error",
                             phase=phase)
                self.configured_nodes.discard(node_id)
                continue
            reason = _identity_problem(msg, sent, set(out))
            if reason:
                self._refuse(node_id, reason, kind="identity", phase=phase)
                continue
            out[node_id] = msg
            try:
                self._secure_bytes(node_id, "up", codec.message_bytes(msg.content))
            except Exception:  # noqa: BLE001 - a measurement
                pass
        return out

    # ------------------------------------------------------------------ screening every reply
    def _screen(self, replies: Iterable[Message], phase: str) -> list[tuple[Message, dict]]:
        """Client errors, identity and metrics of a phase's replies: the ones that pass, with their metrics."""
        replies = list(replies)
        errors = [m for m in replies if _has_error(m)]
        valid = [m for m in replies if not _has_error(m)]
        label = "training" if phase == "train" else "evaluation"
        for msg in errors:
            self._refuse(_node(msg), f"client error during {label}: {_error_reason(msg)}", kind="client-error",
                         phase=phase)
            # e.g. a restarted SuperNode that lost the run's configuration: send it again next time
            self.configured_nodes.discard(_node(msg))
        if errors and not valid:
            raise ClientsFailed(f"round {self._round.get('round')}: every client failed during {label}; "
                                f"first error: {_error_reason(errors[0])}")
        sent = {str(m.metadata.message_id): m for m in self._sent.get(phase, []) if m.metadata.message_id}
        seen_nodes: set[int] = set()
        out = []
        for msg in valid:
            node_id = _node(msg)
            reason = _identity_problem(msg, sent, seen_nodes)
            if reason:
                self._refuse(node_id, reason, kind="identity", phase=phase)
                continue
            seen_nodes.add(node_id)
            try:
                metrics = self.reply_metrics(msg, phase)
            except PayloadError as err:
                self._refuse(node_id, str(err), kind="metrics", phase=phase)
                continue
            out.append((msg, metrics))
        return out

    def _refuse(self, node_id: int | None, reason: str, *, kind: str = "payload", phase: str = "train") -> None:
        log(WARNING, "round %s: refused the %s reply of node %s: %s", self._round.get("round"), phase, node_id, reason)
        self._round["refused"].append({"node_id": None if node_id is None else int(node_id),
                                       "round": self._round.get("round"), "phase": phase, "kind": kind,
                                       "reason": reason})

    # ------------------------------------------------------------------ evaluation
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        return self._messages(self._unbanned(super().configure_evaluate(server_round, arrays, config, grid)),
                              server_round, "eval", config)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        self._start_round(server_round)
        metrics, weights = [], []
        for msg, reply_metrics in self._screen(replies, "eval"):
            metrics.append(reply_metrics)
            weights.append(reply_metrics[NUM_EXAMPLES])
            self._store_client_metrics(_node(msg), "eval", reply_metrics)
        aggregated = aggregate_metrics(metrics, robust.cap_weights(weights, self.robustness)) if metrics else None
        self._finish_round(aggregated)
        return aggregated

    def _finish_round(self, aggregated: MetricRecord | None) -> None:
        record = self._round
        record["seconds"] = round(time.time() - record.pop("t_start"), 3)
        record["eval"] = {k: _plain(v) for k, v in (aggregated or {}).items()}
        record["clients"] = list(record["clients"].values())
        self.history.append(record)
        if self.on_round_end is not None:
            self.on_round_end(record)
        self._round = {}


def _plain(value):
    """MetricRecord values -> JSON-friendly Python numbers."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, (np.floating, float)):
        return float(value)
    if isinstance(value, (np.integer, int)):
        return int(value)
    return value


# ---------------------------------------------------------------------- reply screening helpers
MAX_METRIC_LIST = 4096  # the longest list a metric may be (e.g. one value per layer)
MAX_METRIC_KEYS = 64  # metrics one reply may carry
MAX_METRIC_NAME = 64  # characters in a metric's name
MAX_METRIC_VALUES = 8192  # numbers in one reply's metrics, lists included


def _node(msg: Message) -> int:
    return int(msg.metadata.src_node_id)


def _has_error(msg: Message) -> bool:
    try:
        return bool(msg.has_error())
    except Exception:  # noqa: BLE001 - a reply whose error cannot even be read is an error
        return True


def _error_reason(msg: Message) -> str:
    try:
        return str(msg.error.reason)
    except Exception:  # noqa: BLE001
        return "an unreadable error"


def _identity_problem(msg: Message, sent: Mapping[str, Message], seen_nodes: set[int]) -> str | None:
    """Why a reply cannot be counted as this round's answer of its node, or None.

    ``sent`` is this round's messages of the phase by id (empty when the messages were not
    pushed through a grid, e.g. a strategy driven by hand: then only duplicates are checked).
    """
    node_id = _node(msg)
    if sent:
        request = sent.get(str(msg.metadata.reply_to_message_id))
        if request is None:
            return "it answers no message sent in this round (a stale, replayed or unsolicited reply)"
        if int(request.metadata.dst_node_id) != node_id:
            return (f"it claims to come from node {node_id}, but the message it answers was sent to node "
                    f"{request.metadata.dst_node_id}")
        if int(msg.metadata.run_id) != int(request.metadata.run_id):
            return f"it carries run id {msg.metadata.run_id}, this run is {request.metadata.run_id}"
    if node_id in seen_nodes:
        return "a second reply from this node in this round (only its first is counted)"
    return None


def _finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and bool(np.isfinite(value))


def example_count(content: RecordDict) -> int:
    """A reply's positive integer ``num-examples`` (its weight); PayloadError if absent or not one."""
    metrics = content.metric_records.get("metrics")
    if metrics is None or NUM_EXAMPLES not in metrics:
        raise PayloadError(f"no MetricRecord 'metrics' with '{NUM_EXAMPLES}'")
    return positive_count(metrics[NUM_EXAMPLES])


def positive_count(value) -> int:
    """``value`` as a reply's ``num-examples``: a positive integer (not a bool); PayloadError otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise PayloadError(f"'{NUM_EXAMPLES}' must be a positive integer, got {value!r}")
    return value


def check_metrics(content: RecordDict) -> dict:
    """A reply's one MetricRecord ``metrics`` as a dict, checked: finite numbers (or short
    lists of them) and a positive integer ``num-examples``. PayloadError says what is wrong."""
    extra = sorted(k for k in content.metric_records if k != "metrics")
    if extra:
        raise PayloadError(f"unexpected MetricRecords {extra[:3]} (a reply carries one, 'metrics')")
    example_count(content)
    metrics = content.metric_records["metrics"]
    if len(metrics) > MAX_METRIC_KEYS:
        raise PayloadError(f"the metrics carry {len(metrics)} keys, more than {MAX_METRIC_KEYS}")
    long = [k for k in metrics if len(k) > MAX_METRIC_NAME]
    if long:
        raise PayloadError(f"metric name '{long[0][:MAX_METRIC_NAME]}...' is longer than {MAX_METRIC_NAME} characters")
    values = sum(len(v) if isinstance(v, list) else 1 for v in metrics.values())
    if values > MAX_METRIC_VALUES:
        raise PayloadError(f"the metrics carry {values} numbers, more than {MAX_METRIC_VALUES}")
    out = {}
    for key, value in metrics.items():
        if isinstance(value, list):
            if len(value) > MAX_METRIC_LIST or not all(_finite_number(v) for v in value):
                raise PayloadError(f"metric '{key}' must be a list of at most {MAX_METRIC_LIST} finite numbers")
        elif not _finite_number(value):
            raise PayloadError(f"metric '{key}' must be a finite number, got {value!r}")
        out[key] = value
    return out


def aggregate_metrics(metrics: list[Mapping], weights: list[int]) -> MetricRecord:
    """Per key, the weighted mean over the replies that report it (a missing key is not a 0);
    a key reported as a number by some and a list by others, or as lists of different
    lengths, is aggregated over the replies of the most common shape (one client's odd shape
    cannot hide the metric from everyone). ``num-examples`` is not aggregated (it is the weight), nor
    ``partition-id`` (a label: its mean means nothing)."""
    out = MetricRecord()
    keys = sorted({k for m in metrics for k in m} - {NUM_EXAMPLES, "partition-id"})
    for key in keys:
        pairs = [(m[key], float(w)) for m, w in zip(metrics, weights) if key in m]
        total = sum(w for _, w in pairs)
        if total <= 0:
            continue
        shapes = [len(v) if isinstance(v, list) else None for v, _ in pairs]
        if len(set(shapes)) != 1:  # the shape most replies report (a scalar on a tie); the others are left out
            common = max(set(shapes), key=lambda shape: (shapes.count(shape), shape is None))
            log(WARNING, "metric '%s' is reported in different shapes by different clients; %d of %d replies in "
                "the most common one are aggregated", key, shapes.count(common), len(shapes))
            pairs = [pair for pair, shape in zip(pairs, shapes) if shape == common]
            total = sum(w for _, w in pairs)
            shapes = [common]
        if shapes[0] is None:
            out[key] = float(sum(v * w for v, w in pairs) / total)
        else:
            out[key] = [float(x) for x in np.sum([np.asarray(v, np.float64) * w for v, w in pairs], axis=0) / total]
    return out
