"""Client-side glue shared by every algorithm's ClientApp.

* :func:`client_config` reads the resolved configuration the server sent in its first
  message (and keeps it in ``context.state`` for later rounds), so clients never
  re-compose or guess.
* :func:`partition_of` reads the node's partition from its node config.
* :func:`node_view` applies the node's own settings (its node config) to the run's config.
* :func:`session` keeps one prepared model + task per process (a Ray actor or a
  SuperNode's ClientApp process), built by the algorithm's ``prepare`` function and
  placed once on the node's device (CUDA when present).

Node config (``flower-supernode --node-config "..."``; in simulation Flower sets the
first two):

=================  =========================================================================
``partition-id``   this node's partition, 0..num-partitions-1 (required)
``num-partitions`` how many partitions the data is split into (= the run's clients)
``model-path``     a local HF checkpoint folder used instead of ``model.path`` on this node
                   (the same architecture as the server's model; e.g. weights on a local disk)
``data-path``      folder for this node's data and converted assets (``$POSTCARD_CACHE``:
                   the converted SmolLM2 checkpoint, the CIFAR-10 / Fashion-MNIST arrays)
``device``         ``auto`` (default: CUDA when present), ``cpu``, ``cuda`` or ``cuda:<i>``
=================  =========================================================================
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from omegaconf import OmegaConf

from fedapps.resolved import from_yaml
from strategies.screening import CONFIG_RECORD
from strategies.uplink import Wire

NODE_CONFIG_KEYS = ("partition-id", "num-partitions", "model-path", "data-path", "device")


class ClientSetupError(RuntimeError):
    pass


def client_config(msg: Message, context: Context):
    """The run's resolved config: from this message, else from the node's state."""
    if CONFIG_RECORD in msg.content.config_records:
        record = msg.content.config_records[CONFIG_RECORD]
        context.state[CONFIG_RECORD] = ConfigRecord({"yaml": str(record["yaml"])})
    if CONFIG_RECORD not in context.state.config_records:
        raise ClientSetupError("no run configuration received yet (the server sends it with its first message)")
    return parsed(str(context.state.config_records[CONFIG_RECORD]["yaml"]))


_PARSED: dict[str, object] = {}  # this process's run configs by their YAML (a few runs at most)
_RUN_KEYS: dict[int, tuple[object, tuple, str]] = {}  # id(config) -> (the config, SCOPE, its session key)


def parsed(text: str):
    """The run's config from its YAML, parsed once per process and read-only: a simulation's worker
    serves thousands of messages of one run, and parsing the YAML was 28% of a Fashion-MNIST client's
    message (bench/thousand.py)."""
    cfg = _PARSED.get(text)
    if cfg is None:
        if len(_PARSED) >= 4:
            _PARSED.clear()
        cfg = from_yaml(text)
        OmegaConf.set_readonly(cfg, True)  # shared by every message: a view that changes it is a copy
        _PARSED[text] = cfg
    return cfg


def _run_key(cfg) -> str:
    """The session cache's key of a run config (with this process's SCOPE), computed once per config."""
    kept = _RUN_KEYS.get(id(cfg))
    if kept is None or kept[0] is not cfg or kept[1] != SCOPE:
        if len(_RUN_KEYS) >= 8:
            _RUN_KEYS.clear()
        kept = (cfg, SCOPE, hashlib.sha256(repr((str(cfg), SCOPE)).encode()).hexdigest())
        _RUN_KEYS[id(cfg)] = kept
    return kept[2]


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


def node_view(cfg, context: Context):
    """The run's config as this node uses it: its ``model-path`` and ``device`` applied.

    ``data-path`` sets ``$POSTCARD_CACHE`` for this process (where assets are converted
    and cached). Other keys are left to the algorithms that read them.
    """
    node_config = context.node_config
    if "data-path" in node_config:
        folder = Path(str(node_config["data-path"])).expanduser()
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ClientSetupError(f"node-config data-path '{folder}' cannot be used: {err}") from None
        os.environ["POSTCARD_CACHE"] = str(folder)
    changes = {}
    if "model-path" in node_config:
        path = Path(str(node_config["model-path"])).expanduser()
        if cfg.model.kind != "causal_lm":
            raise ClientSetupError(f"node-config model-path applies to causal LMs; model '{cfg.model.name}' "
                                   f"is {cfg.model.kind}")
        if not (path / "config.json").is_file():
            raise ClientSetupError(f"node-config model-path '{path}' is not a HF checkpoint folder (no config.json)")
        changes["model.path"] = str(path)
    if "device" in node_config:
        changes["train.device"] = str(node_config["device"])
    if not changes:
        return cfg
    view = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    OmegaConf.set_struct(view, False)
    for key, value in changes.items():
        OmegaConf.update(view, key, value, force_add=True)
    OmegaConf.set_struct(view, True)
    return view


@dataclass
class Session:
    cfg: object
    partition_id: int
    num_partitions: int
    model: object
    tokenizer: object
    task: object
    extra: dict = field(default_factory=dict)
    device: object = None  # torch.device the model and batches live on


_MODELS: dict[str, tuple] = {}
_TASKS: dict[tuple, object] = {}
BUILDS = 0  # models this process has prepared (the warm node worker, postcard.worker, reports it)
SCOPE: tuple = ()  # postcard.worker sets (run id, FAB hash): part of the cache key, so no run reuses another's


def evict() -> None:
    """Forget this process's prepared model and tasks (postcard.worker: a new run, a failed message)."""
    _MODELS.clear()
    _TASKS.clear()


def session(cfg, context: Context, prepare: Callable[[object], tuple]) -> Session:
    """This process's prepared model for the run, and the task of this node's partition.

    ``prepare(cfg) -> (model, tokenizer, extra)`` builds the algorithm's model once per
    process: one Ray actor serves several simulated nodes in turn, and every message
    loads the node's federated state into the model before using it, so nodes share
    the model but never each other's weights. Per-node state that must survive between
    rounds belongs in ``context.state``. The model is moved once to the node's device
    (``train.device`` / node-config ``device``; CUDA when present) and the task's batches
    follow it; algorithm code that builds tensors itself should put them on ``device``.
    """
    from clients.tasks import make_task
    from clients.train import place_model, place_task, select_device

    cfg = node_view(cfg, context)
    pid, n = partition_of(context, cfg)
    global BUILDS
    run_key = _run_key(cfg)
    if run_key not in _MODELS:
        evict()  # one run per process at a time: free the previous model
        BUILDS += 1
        device = select_device(cfg.train.get("device", "auto"))
        model, tokenizer, extra = prepare(cfg)
        model = place_model(model, device, bf16=bool(cfg.train.get("bf16", True)),  # moved once per process
                            frozen_bf16=bool(cfg.train.get("frozen_bf16", False)))
        _MODELS[run_key] = (model, tokenizer, extra, device)
    model, tokenizer, extra, device = _MODELS[run_key]
    if (run_key, pid, n) not in _TASKS:
        _TASKS[(run_key, pid, n)] = place_task(make_task(cfg, pid, n, tokenizer), device)
    return Session(cfg, pid, n, model, tokenizer, _TASKS[(run_key, pid, n)], extra, device)


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


UPDATE_MEMORY = "postcard.update-memory"  # context.state: error-feedback residuals, PowerSGD warm starts


def uplink_record(cfg, context: Context, local: dict, received: dict, seed: int):
    """This round's uplink ArrayRecord in the algorithm's format (``algorithm.payload``).

    ``algorithm.uplink='delta'`` sends ``local − received`` (``topk``/``powersgd`` need it),
    compressed by :class:`strategies.compress.UpdateCompressor`; its error-feedback
    residuals and warm starts stay on this node in ``context.state``. int4 rounds
    stochastically, seeded by ``seed``.
    """
    import numpy as np

    from strategies import codec
    from strategies.compress import UpdateCompressor

    algorithm = cfg.algorithm
    wire = Wire.of(algorithm)
    fmt = wire.format
    compressor = UpdateCompressor(fmt, fraction=wire.topk_fraction, rank=wire.powersgd_rank,
                                  error_feedback=bool((algorithm.get("compression") or {}).get("error_feedback", True)),
                                  seed=int(cfg.seed))
    if wire.uplink == "delta":
        values = {k: np.asarray(v, np.float32) - np.asarray(received[k], np.float32) for k, v in local.items()}
    else:
        values = {k: np.asarray(v, np.float32) for k, v in local.items()}
    memory = {}
    if compressor.error_feedback or fmt == "powersgd":
        if UPDATE_MEMORY in context.state.array_records:
            memory = codec.decode(context.state.array_records[UPDATE_MEMORY])
    rng = np.random.default_rng(seed) if fmt in codec.QUANTISED else None
    record, memory = compressor.compress(values, memory, rng=rng)
    if memory:
        context.state[UPDATE_MEMORY] = codec.encode(memory, "fp32")
    return record
