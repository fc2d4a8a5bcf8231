"""The Postcard base strategy: FedAvg over a named-tensor payload, validated and metered.

Every method in Postcard aggregates *some* named tensors (LoRA factors, latents, gates,
expert deltas). :class:`PayloadFedAvg` owns what they share:

* the wire format of both directions (``strategies.codec``: fp32 or int4, raw bytes);
* the resolved run configuration, sent once to each node in its first message;
* validation of every reply (key set, shapes, dtype, finiteness, example count); a bad
  reply is refused with a logged reason naming the node, the round goes on with the
  others, and with no acceptable reply the global state stays as it was;
* an example-weighted mean (float64 accumulation) over the accepted replies;
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
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from strategies import codec, compress
from strategies.codec import PayloadError

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
        self.config_yaml = config_yaml
        self.uplink_format = uplink_format
        self.downlink_format = downlink_format
        self.uplink = uplink
        self.uplink_budget = compress.max_nbytes(self.layout(), uplink_format, fraction=topk_fraction,
                                                 rank=powersgd_rank)
        self.on_round_end = on_round_end
        self.configured_nodes: set[int] = set()
        self.history: list[RoundRecord] = []
        self._round: RoundRecord = {}

    # ------------------------------------------------------------------ helpers
    def layout(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(self.global_state[k].shape) for k in self.uplink_keys}

    def downlink_arrays(self) -> ArrayRecord:
        """What every client receives: the federated keys of the global state."""
        return codec.encode({k: self.global_state[k] for k in self.uplink_keys}, self.downlink_format)

    def train_config_for(self, server_round: int, node_id: int, config: ConfigRecord) -> ConfigRecord:
        """Per-node train config; subclasses add method-specific keys."""
        config["uplink"] = self.uplink
        return config

    def _start_round(self, server_round: int) -> None:
        if self._round.get("round") != server_round:
            self._round = {"round": server_round, "t_start": time.time(), "clients": {}, "refused": [],
                           "missing": []}

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
        return {k: v.copy() for k, v in self.global_state.items()}, {"history": list(self.history)}

    def load_state_dict(self, arrays: Mapping[str, np.ndarray], meta: Mapping) -> None:
        """Restore :meth:`state_dict`'s output; the layout (keys, shapes) must be this strategy's."""
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
        self.history = list(meta.get("history", []))
        self.configured_nodes = set()  # a resumed run is a new Flower run: every node needs the config again
        self._round = {}

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
        return out

    # ------------------------------------------------------------------ training
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        return self._messages(super().configure_train(server_round, arrays, config, grid), server_round, "train", config)

    def reply_record(self, msg: Message) -> tuple[ArrayRecord, int]:
        """A training reply's ArrayRecord and its positive ``num-examples``; PayloadError if absent."""
        content = msg.content
        if self.arrayrecord_key not in content.array_records:
            raise PayloadError(f"no ArrayRecord '{self.arrayrecord_key}' in the reply")
        metrics = content.metric_records.get("metrics")
        if metrics is None or NUM_EXAMPLES not in metrics:
            raise PayloadError(f"no MetricRecord 'metrics' with '{NUM_EXAMPLES}'")
        num_examples = metrics[NUM_EXAMPLES]
        if not isinstance(num_examples, int) or num_examples <= 0:
            raise PayloadError(f"'{NUM_EXAMPLES}' must be a positive integer, got {num_examples!r}")
        return content.array_records[self.arrayrecord_key], num_examples

    def validate_reply(self, msg: Message) -> tuple[dict[str, np.ndarray], int]:
        """Decode and check one training reply; raise PayloadError with the reason."""
        record, num_examples = self.reply_record(msg)
        expected = self.layout()
        if set(record) != set(expected):
            extra = sorted(set(record) - set(expected))[:3]
            missing = sorted(set(expected) - set(record))[:3]
            raise PayloadError(f"wrong key set (unexpected {extra}, missing {missing})")
        tensors = codec.decode(record)
        for key, shape in expected.items():
            if tuple(tensors[key].shape) != shape:
                raise PayloadError(f"tensor '{key}' has shape {tuple(tensors[key].shape)}, expected {shape}")
        nbytes = codec.payload_bytes(record)
        if nbytes > self.uplink_budget:
            raise PayloadError(f"the payload carries {nbytes} bytes, more than the {self.uplink_budget} "
                               f"its format '{self.uplink_format}' allows")
        return tensors, num_examples

    def aggregate_payloads(self, payloads: list[dict[str, np.ndarray]], weights: list[int]) -> dict[str, np.ndarray]:
        """Combine accepted payloads into the new values of the uplink keys.

        ``uplink='absolute'``: the weighted mean of the clients' values. ``uplink='delta'``:
        the clients sent ``local − received``; the weighted mean update is added to the
        fp32 global state (the same result in fp32, but compressible: updates are small).
        """
        mean = weighted_mean(payloads, [float(w) for w in weights])
        if self.uplink == "absolute":
            return mean
        return {k: (self.global_state[k].astype(np.float64) + v).astype(np.float32) for k, v in mean.items()}

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        self._start_round(server_round)
        valid, errors = self._check_and_log_replies(list(replies), is_train=True, validate=False)
        self._refuse_errors(server_round, valid, errors, "training")
        payloads, weights, contents = [], [], []
        for msg in valid:
            node_id = msg.metadata.src_node_id
            try:
                tensors, num_examples = self.validate_reply(msg)
            except PayloadError as err:
                self._refuse(node_id, str(err))
                continue
            payloads.append(tensors)
            weights.append(num_examples)
            metrics = msg.content.metric_records["metrics"]
            contents.append(msg.content)
            client = self._client(node_id)
            client["uplink_payload_bytes"] = codec.payload_bytes(msg.content.array_records[self.arrayrecord_key])
            client["uplink_message_bytes"] = codec.message_bytes(msg.content)
            client.update({f"train_{k}": _plain(v) for k, v in metrics.items()})
        if not payloads:
            log(WARNING, "round %s: no acceptable training reply; the global state is unchanged", server_round)
            return None, None
        update = self.aggregate_payloads(payloads, weights)
        for key, value in update.items():
            if key not in self.global_state or value.shape != self.global_state[key].shape:
                raise RuntimeError(f"aggregation produced a tensor '{key}' outside the layout")  # programming error
            self.global_state[key] = value.astype(np.float32)
        metrics = self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        return codec.encode(self.global_state, "fp32"), metrics

    def _refuse_errors(self, server_round: int, valid: list, errors: list, phase: str) -> None:
        for msg in errors:
            self._refuse(msg.metadata.src_node_id, f"client error during {phase}: {msg.error.reason}")
            # e.g. a restarted SuperNode that lost the run's configuration: send it again next time
            self.configured_nodes.discard(int(msg.metadata.src_node_id))
        if errors and not valid:
            raise ClientsFailed(
                f"round {server_round}: every client failed during {phase}; first error: {errors[0].error.reason}"
            )

    def _refuse(self, node_id: int, reason: str) -> None:
        log(WARNING, "round %s: refused the reply of node %s: %s", self._round.get("round"), node_id, reason)
        self._round["refused"].append({"node_id": int(node_id), "reason": reason})

    # ------------------------------------------------------------------ evaluation
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        return self._messages(super().configure_evaluate(server_round, arrays, config, grid), server_round, "eval", config)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        self._start_round(server_round)
        valid, errors = self._check_and_log_replies(list(replies), is_train=False, validate=False)
        self._refuse_errors(server_round, valid, errors, "evaluation")
        contents = []
        for msg in valid:
            metrics = msg.content.metric_records.get("metrics")
            if metrics is None or not isinstance(metrics.get(NUM_EXAMPLES), int) or metrics[NUM_EXAMPLES] <= 0:
                self._refuse(msg.metadata.src_node_id, "evaluation reply without a positive 'num-examples'")
                continue
            contents.append(msg.content)
            self._client(msg.metadata.src_node_id).update({f"eval_{k}": _plain(v) for k, v in metrics.items()})
        aggregated = self.evaluate_metrics_aggr_fn(contents, self.weighted_by_key) if contents else None
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
