"""Split a task's examples among clients: ``natural``, ``iid`` or ``dirichlet(alpha)``.

Partitioners work on labels only (one label per example: a play, an MMLU
super-category, an image class) and return example indices, so a task keeps its data in
whatever form suits it. All three are flwr-datasets' partitioners over a small
``datasets.Dataset`` of example indices: ``iid`` and ``dirichlet`` over the labels,
``natural`` (``NaturalIdPartitioner``) over each example's client, which gives each client
whole natural groups (client ``j`` gets groups ``j, j+N, j+2N, ...`` in the task's order).

Every client's indices are drawn at once and cached, on disk and in the process
(:func:`cached_partition`): importing flwr-datasets (with ``datasets``, scipy and seaborn behind it)
costs 2-3 s, a stock Flower deployment starts a fresh process for every message (docs/deploy.md,
section 9), and drawing a Dirichlet partitioning of Fashion-MNIST among 1,000 clients takes about a
second: only the run's first message on a machine pays them; every later one reads a slice.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

PARTITIONS = ("natural", "iid", "dirichlet")


class PartitionError(ValueError):
    pass


def natural_groups(groups: Sequence[str], num_partitions: int) -> list[list[str]]:
    """Assign natural groups round-robin to clients; every client gets at least one."""
    groups = list(dict.fromkeys(groups))
    if num_partitions > len(groups):
        raise PartitionError(
            f"the natural split has {len(groups)} groups ({', '.join(map(str, groups))}) "
            f"but {num_partitions} clients were asked for; use fewer clients or partition=iid/dirichlet"
        )
    return [groups[j::num_partitions] for j in range(num_partitions)]


def partition_indices(
    labels: Sequence,
    *,
    method: str,
    num_partitions: int,
    partition_id: int,
    seed: int,
    alpha: float = 0.5,
    min_partition_size: int = 10,
    natural_order: Sequence[str] | None = None,
) -> np.ndarray:
    """Indices (into ``labels``) of the examples of client ``partition_id``."""
    if method not in PARTITIONS:
        raise PartitionError(f"unknown partition '{method}'; valid: {', '.join(PARTITIONS)}")
    if not 0 <= partition_id < num_partitions:
        raise PartitionError(f"partition id {partition_id} outside 0..{num_partitions - 1}")
    labels = np.asarray(labels)
    if method == "dirichlet" and alpha <= 0:
        raise PartitionError(f"dirichlet alpha must be > 0, got {alpha}")
    settings = {"method": method, "num_partitions": num_partitions,
                "natural_order": None if natural_order is None else [str(g) for g in natural_order]}
    if method != "natural":
        settings["seed"] = int(seed)
    if method == "dirichlet":
        settings.update(alpha=float(alpha), min_partition_size=int(min_partition_size))
    packed = cached_partition(labels, settings, lambda: _compute(labels, method, num_partitions, seed, alpha,
                                                                 min_partition_size, natural_order))
    start, stop = (int(v) for v in packed[partition_id:partition_id + 2])
    return packed[num_partitions + 1 + start:num_partitions + 1 + stop]


def partition_cache_dir() -> Path | None:
    """Where :func:`cached_partition` keeps indices: ``$POSTCARD_PARTITION_CACHE``, else
    ``partitions/`` in the asset cache (``$POSTCARD_CACHE``); ``off`` keeps none."""
    chosen = os.environ.get("POSTCARD_PARTITION_CACHE", "")
    if chosen.lower() == "off":
        return None
    if chosen:
        return Path(chosen).expanduser()
    from clients.assets import cache_dir

    return cache_dir() / "partitions"


@functools.lru_cache(maxsize=1)
def _code_and_versions() -> bytes:
    """This module's code and the versions of the libraries that draw a partition (a new flwr-datasets
    may draw differently: a new key, not a stale hit)."""
    from importlib.metadata import PackageNotFoundError, version

    out = Path(__file__).read_bytes()
    for package in ("flwr-datasets", "datasets"):
        try:
            out += f"{package}={version(package)};".encode()
        except PackageNotFoundError:
            out += f"{package}=none;".encode()
    return out


def _partition_key(labels: np.ndarray, settings: dict) -> str:
    """Everything a partitioning depends on: the labels (with their type), the settings, this module's
    code and the libraries' versions."""
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    h.update(_code_and_versions())
    h.update(labels.dtype.str.encode())
    h.update(str(len(labels)).encode())
    h.update(np.ascontiguousarray(labels.astype(str) if labels.dtype == object else labels).tobytes())
    return h.hexdigest()[:32]


# this process's partitionings (packed, see cached_partition), by cache folder and key: a simulation's worker
# serves many clients of one partitioning in turn, and each then reads a slice, not a file
_PACKED: dict[tuple[str, str], np.ndarray] = {}


def cached_partition(labels: np.ndarray, settings: dict, compute) -> np.ndarray:
    """``compute()``'s partitioning of ``labels`` into ``N = settings['num_partitions']`` clients, packed as
    one int64 array: the ``N + 1`` offsets, then every client's indices in turn (client ``j``'s are
    ``packed[N + 1 + offsets[j]:N + 1 + offsets[j + 1]]``). Read from this process's memory, else from the
    partition cache when an earlier process stored it for the same labels and settings
    (``clients.assets.cached_array``: atomic writes, a cache that cannot be read or written skipped),
    else computed once for every client; a stored array that is not such a packing of indices into
    ``labels`` is computed again."""
    from clients.assets import cached_array

    n = int(settings["num_partitions"])

    def valid(cached: np.ndarray) -> bool:
        if not (cached.dtype == np.int64 and cached.ndim == 1 and len(cached) >= n + 1):
            return False
        offsets, indices = cached[:n + 1], cached[n + 1:]
        return bool(offsets[0] == 0 and np.all(np.diff(offsets) >= 0) and offsets[-1] == len(indices)
                    and (len(indices) == 0 or 0 <= indices.min() <= indices.max() < len(labels)))

    folder = partition_cache_dir()
    key = _partition_key(labels, settings)
    memo = (str(folder), key)
    if memo not in _PACKED:
        if len(_PACKED) >= 4:
            _PACKED.clear()
        _PACKED[memo] = cached_array(folder, key, compute, valid) if folder is not None else compute()
    return _PACKED[memo]


def _pack(parts: list[np.ndarray]) -> np.ndarray:
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
    return np.concatenate([offsets, *[np.asarray(p, np.int64) for p in parts]]).astype(np.int64)


def _compute(labels: np.ndarray, method: str, num_partitions: int, seed: int, alpha: float,
             min_partition_size: int, natural_order) -> np.ndarray:
    """Every client's indices, packed (:func:`cached_partition`): one partitioner draws them all."""
    from datasets import Dataset

    if method == "natural":
        return _natural(labels, num_partitions, natural_order)
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner

    # a seeded shuffle first: flwr-datasets' IID partitioner takes contiguous shards
    order = np.random.default_rng(seed).permutation(len(labels))
    table = Dataset.from_dict({"index": order.tolist(), "label": [str(x) for x in labels[order]]})
    if method == "iid":
        partitioner = IidPartitioner(num_partitions=num_partitions)
    else:
        partitioner = DirichletPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            alpha=float(alpha),
            min_partition_size=int(min_partition_size),
            self_balancing=False,
            shuffle=True,
            seed=int(seed),
        )
    partitioner.dataset = table
    return _pack([np.sort(np.asarray(partitioner.load_partition(j)["index"], dtype=np.int64))
                  for j in range(num_partitions)])


def _natural(labels: np.ndarray, num_partitions: int, natural_order) -> np.ndarray:
    """flwr-datasets' NaturalIdPartitioner over each example's client (its natural group's, by
    :func:`natural_groups`; examples of groups outside ``natural_order`` belong to no client)."""
    import contextlib
    import io

    from datasets import Dataset
    from flwr_datasets.partitioner import NaturalIdPartitioner

    order = list(natural_order) if natural_order is not None else sorted(set(labels.tolist()))
    client_of = {group: j for j, groups in enumerate(natural_groups(order, num_partitions)) for group in groups}
    clients = [client_of.get(label, num_partitions) for label in labels.tolist()]  # num_partitions: nobody's
    partitioner = NaturalIdPartitioner(partition_by="client")
    partitioner.dataset = Dataset.from_dict({"index": list(range(len(labels))), "client": clients})
    with contextlib.redirect_stderr(io.StringIO()):  # its progress bar, per client, for a table of labels
        # natural ids 0..N-1 sort as partition ids
        return _pack([np.sort(np.asarray(partitioner.load_partition(j)["index"], dtype=np.int64))
                      for j in range(num_partitions)])


def public_split(labels: Sequence, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(public, rest)`` indices: a server-side public split, ``fraction`` of every class
    (stratified, so IID over classes), drawn with its own ``seed``; ``rest`` is what the
    clients partition. ``fraction == 0`` gives an empty public split."""
    if not 0.0 <= fraction < 1.0:
        raise PartitionError(f"task.public_fraction must be in [0, 1), got {fraction}")
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    public = []
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        public.append(members[: int(round(fraction * len(members)))])
    public_idx = np.sort(np.concatenate(public)) if public else np.zeros(0, np.int64)
    return public_idx, np.setdiff1d(np.arange(len(labels)), public_idx)


def train_test_split(indices: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded split of one client's indices into (train, test); both non-empty."""
    if len(indices) < 2:
        raise PartitionError(f"a client got {len(indices)} example(s); it needs at least 2 (train and test)")
    rng = np.random.default_rng(seed)
    shuffled = rng.permutation(indices)
    n_test = min(len(indices) - 1, max(1, int(round(len(indices) * test_fraction))))
    return np.sort(shuffled[n_test:]), np.sort(shuffled[:n_test])


EVAL_SPLITS = ("test", "val")


def held_out_split(indices: np.ndarray, task, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """One client's (train, held-out) by the task's ``eval_split``: ``test`` (the default) holds out
    ``task.test_fraction``; ``val`` keeps that same test share out of everything and carves
    ``task.val_fraction`` (default: ``test_fraction``) of what is left as a validation split, trained on
    by nobody and scored instead of the test items, for tuning hyperparameters (docs/benchmarks.md,
    "Protocol"). The test items are the same under both, so a tuned run never sees them."""
    which = str(task.get("eval_split", "test") or "test")
    if which not in EVAL_SPLITS:
        raise PartitionError(f"task.eval_split must be one of {', '.join(EVAL_SPLITS)}, got {which!r}")
    fraction = float(task.test_fraction)
    train, test = train_test_split(indices, fraction, seed=seed)
    if which == "test":
        return train, test
    val_fraction = task.get("val_fraction")
    val_fraction = fraction if val_fraction is None else float(val_fraction)
    if not 0.0 < val_fraction < 1.0:
        raise PartitionError(f"task.val_fraction must be in (0, 1), got {val_fraction}")
    # its own stream: the validation items do not depend on the test split's draw beyond being outside it
    return train_test_split(train, val_fraction, seed=seed + 7_919_000)


def partition_for(cfg, labels: Sequence, *, num_partitions: int, partition_id: int,
                  natural_order: Sequence[str] | None = None, seed: int | None = None) -> np.ndarray:
    """:func:`partition_indices` with the run's ``partition`` group (method, ``alpha``,
    ``min_partition_size``) and ``seed`` (or ``seed`` given)."""
    part = cfg.partition
    return partition_indices(
        labels,
        method=str(part.name),
        num_partitions=num_partitions,
        partition_id=partition_id,
        seed=int(cfg.seed if seed is None else seed),
        alpha=float(part.get("alpha", 0.5)),
        min_partition_size=int(part.get("min_partition_size", 10)),
        natural_order=natural_order,
    )
