"""Reply screening: what every reply must be before anything in it is read, and how the
accepted replies' metrics combine.

A reply is screened in this order, and refused at the first problem with a reason naming
its node: a client error; its identity (it answers a message sent this round, from the node
it was sent to, in this run; one reply per node); its metrics (one ``metrics`` record of at
most :data:`MAX_METRIC_KEYS` finite numbers or short lists, with a positive integer
``num-examples``). What passes is a :class:`Reply`; the payload's layout, wire format and
values are the strategy's to check next. Nothing here raises on what a client sends except
:class:`~strategies.codec.PayloadError` (caught and recorded by the caller) and
:class:`ClientsFailed` (every reply of a phase was a client error: a setup error everywhere).
"""

from __future__ import annotations

import re

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from logging import WARNING

import numpy as np
from flwr.app import Message, MetricRecord, RecordDict
from flwr.common.logger import log

from strategies.codec import PayloadError

CONFIG_RECORD = "postcard"  # ConfigRecord holding the resolved YAML (a node's first message of a run)
NUM_EXAMPLES = "num-examples"
MAX_METRIC_LIST = 4096  # the longest list a metric may be (e.g. one value per layer)
MAX_METRIC_KEYS = 64  # metrics one reply may carry
MAX_METRIC_NAME = 64  # characters in a metric's name
MAX_METRIC_VALUES = 8192  # numbers in one reply's metrics, lists included


class ClientsFailed(RuntimeError):
    """Every client of a round failed: nothing can go on (e.g. a setup error on all nodes)."""


@dataclass
class Reply:
    """A screened reply: its node, the message and its checked metrics (None for a secure stage's reply)."""

    node: int
    msg: Message
    metrics: dict | None = None


Refuse = Callable[..., None]  # (node_id, reason, *, kind, phase): the ledger's refuse


def screen(replies: Iterable[Message], *, sent: Iterable[Message], phase: str, refuse: Refuse,
           read_metrics: Callable[[Message], dict] | None = None, on_error: Callable[[int], None] = lambda node: None,
           label: str | None = None, all_failed_raises: bool = True, server_round=None) -> list[Reply]:
    """The replies of one phase that pass: client errors, identity, then (``read_metrics``) metrics.

    ``sent``: this phase's messages (their ids, once pushed, are what a reply must answer);
    ``on_error(node)``: called for each client error (e.g. send the node the run's config again).
    With ``all_failed_raises``, :class:`ClientsFailed` when every reply is a client error."""
    label = label or phase
    replies = list(replies)
    errors = [m for m in replies if has_error(m)]
    for msg in errors:
        refuse(node_of(msg), f"client error during {label}: {error_reason(msg)}", kind="client-error", phase=phase)
        on_error(node_of(msg))
    valid = [m for m in replies if not has_error(m)]
    if errors and not valid and all_failed_raises:
        raise ClientsFailed(f"round {server_round}: every client failed during {label}; first error: {error_reason(errors[0])}")
    by_id = {str(m.metadata.message_id): m for m in sent if m.metadata.message_id}
    seen: set[int] = set()
    out = []
    for msg in valid:
        node = node_of(msg)
        reason = identity_problem(msg, by_id, seen)
        if reason:
            refuse(node, reason, kind="identity", phase=phase)
            continue
        seen.add(node)
        metrics = None
        if read_metrics is not None:
            try:
                metrics = read_metrics(msg)
            except PayloadError as err:
                refuse(node, str(err), kind="metrics", phase=phase)
                continue
        out.append(Reply(node, msg, metrics))
    return out


def node_of(msg: Message) -> int:
    return int(msg.metadata.src_node_id)


def has_error(msg: Message) -> bool:
    try:
        return bool(msg.has_error())
    except Exception:  # noqa: BLE001 - a reply whose error cannot even be read is an error
        return True


ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def error_reason(msg: Message) -> str:
    """A client's error in one line, without colour codes: Postcard's own client says it in one line
    already; for a traceback relayed by Flower (Ray's ``ClientAppException``) its last ``Message:`` or its
    last line, capped at 500 characters (the whole text stays in the client's log)."""
    try:
        text = ANSI.sub("", str(msg.error.reason))
    except Exception:  # noqa: BLE001
        return "an unreadable error"
    if "Message:" in text:
        text = text.rsplit("Message:", 1)[1]
    elif "\n" in text.strip():
        text = [line for line in text.strip().splitlines() if line.strip()][-1]
    text = " ".join(text.split()).strip("'\"<> ")
    return text[:500] + ("…" if len(text) > 500 else "")


def identity_problem(msg: Message, sent: Mapping[str, Message], seen_nodes: set[int]) -> str | None:
    """Why a reply cannot be counted as this round's answer of its node, or None.

    ``sent`` is this round's messages of the phase by id (empty when the messages were not
    pushed through a grid, e.g. a strategy driven by hand: then only duplicates are checked).
    """
    node_id = node_of(msg)
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


def finite_number(value) -> bool:
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
            if len(value) > MAX_METRIC_LIST or not all(finite_number(v) for v in value):
                raise PayloadError(f"metric '{key}' must be a list of at most {MAX_METRIC_LIST} finite numbers")
        elif not finite_number(value):
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
