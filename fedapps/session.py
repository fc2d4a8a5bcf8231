"""Client-side glue shared by every algorithm's ClientApp.

* :func:`client_config` reads the resolved configuration the server sent in its first
  message (and keeps it in ``context.state`` for later rounds), so clients never
  re-compose or guess.
* :func:`partition_of` reads the node's partition from its node config.
* :func:`session` keeps one prepared model + task per process (a Ray actor or a
  SuperNode's ClientApp process), built by the algorithm's ``prepare`` function.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedapps.config import from_yaml
from strategies.base import CONFIG_RECORD


class ClientSetupError(RuntimeError):
    pass


def client_config(msg: Message, context: Context):
    """The run's resolved config: from this message, else from the node's state."""
    if CONFIG_RECORD in msg.content.config_records:
        record = msg.content.config_records[CONFIG_RECORD]
        context.state[CONFIG_RECORD] = ConfigRecord({"yaml": str(record["yaml"])})
    if CONFIG_RECORD not in context.state.config_records:
        raise ClientSetupError("no run configuration received yet (the server sends it with its first message)")
    return from_yaml(str(context.state.config_records[CONFIG_RECORD]["yaml"]))


def partition_of(context: Context, cfg) -> tuple[int, int]:
    """(partition id, number of partitions) of this node."""
    node_config = context.node_config
    if "partition-id" not in node_config:
        raise ClientSetupError(
            "this SuperNode has no 'partition-id' in its node config; start it with "
            "--node-config \"partition-id=0 num-partitions=N\""
        )
    pid = int(node_config["partition-id"])
    n = int(node_config.get("num-partitions", cfg.num_clients or 0))
    if cfg.num_clients and n != int(cfg.num_clients):
        raise ClientSetupError(f"this node says num-partitions={n} but the run has num_clients={cfg.num_clients}")
    if not 0 <= pid < n:
        raise ClientSetupError(f"partition-id {pid} is outside 0..{n - 1}")
    return pid, n


@dataclass
class Session:
    cfg: object
    partition_id: int
    num_partitions: int
    model: object
    tokenizer: object
    task: object
    extra: dict = field(default_factory=dict)


_MODELS: dict[str, tuple] = {}
_TASKS: dict[tuple, object] = {}


def session(cfg, context: Context, prepare: Callable[[object], tuple]) -> Session:
    """This process's prepared model for the run, and the task of this node's partition.

    ``prepare(cfg) -> (model, tokenizer, extra)`` builds the algorithm's model once per
    process: one Ray actor serves several simulated nodes in turn, and every message
    loads the node's federated state into the model before using it, so nodes share
    the model but never each other's weights. Per-node state that must survive between
    rounds belongs in ``context.state``.
    """
    from clients.tasks import make_task

    pid, n = partition_of(context, cfg)
    run_key = hashlib.sha256(str(cfg).encode()).hexdigest()
    if run_key not in _MODELS:
        _MODELS.clear()  # one run per process at a time: free the previous model
        _TASKS.clear()
        _MODELS[run_key] = prepare(cfg)
    model, tokenizer, extra = _MODELS[run_key]
    if (run_key, pid, n) not in _TASKS:
        _TASKS[(run_key, pid, n)] = make_task(cfg, pid, n, tokenizer)
    return Session(cfg, pid, n, model, tokenizer, _TASKS[(run_key, pid, n)], extra)


def reply(msg: Message, metrics: dict, arrays=None) -> Message:
    """A reply with a MetricRecord 'metrics' (and an ArrayRecord 'arrays' for training)."""
    content = RecordDict({"metrics": MetricRecord({k: _metric(v) for k, v in metrics.items()})})
    if arrays is not None:
        content["arrays"] = arrays
    return Message(content=content, reply_to=msg)


def _metric(value):
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    return float(value)
