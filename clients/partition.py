"""Split a task's examples among clients: ``natural``, ``iid`` or ``dirichlet(alpha)``.

Partitioners work on labels only (one label per example: a play, an MMLU
super-category, an image class) and return example indices, so a task keeps its data in
whatever form suits it. All three are flwr-datasets' partitioners over a small
``datasets.Dataset`` of example indices: ``iid`` and ``dirichlet`` over the labels,
``natural`` (``NaturalIdPartitioner``) over each example's client, which gives each client
whole natural groups (client ``j`` gets groups ``j, j+N, j+2N, ...`` in the task's order).
"""

from __future__ import annotations

from collections.abc import Sequence

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
    from datasets import Dataset

    if method == "natural":
        return _natural(labels, num_partitions, partition_id, natural_order)
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner

    # a seeded shuffle first: flwr-datasets' IID partitioner takes contiguous shards
    order = np.random.default_rng(seed).permutation(len(labels))
    table = Dataset.from_dict({"index": order.tolist(), "label": [str(x) for x in labels[order]]})
    if method == "iid":
        partitioner = IidPartitioner(num_partitions=num_partitions)
    else:
        if alpha <= 0:
            raise PartitionError(f"dirichlet alpha must be > 0, got {alpha}")
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
    return np.sort(np.asarray(partitioner.load_partition(partition_id)["index"], dtype=np.int64))


def _natural(labels: np.ndarray, num_partitions: int, partition_id: int, natural_order) -> np.ndarray:
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
        partition = partitioner.load_partition(partition_id)  # natural ids 0..N-1 sort as partition ids
    return np.sort(np.asarray(partition["index"], dtype=np.int64))


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
