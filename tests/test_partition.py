"""Partitions: sizes, disjointness, determinism; Dirichlet skew grows as alpha falls; the disk
cache a fresh process reads instead of importing flwr-datasets."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from omegaconf import OmegaConf

from clients import partition
from clients.partition import PartitionError, held_out_split, natural_groups, partition_indices, train_test_split

LABELS = np.repeat(np.arange(10), 100)  # 1,000 examples, 10 balanced labels


@pytest.fixture(autouse=True)
def no_partition_cache(monkeypatch):
    """Every test here computes its partitions (determinism is not read back from a cache);
    the cache's own tests point it at a folder."""
    monkeypatch.setenv("POSTCARD_PARTITION_CACHE", "off")


def parts(method, n=5, seed=0, **kw):
    return [partition_indices(LABELS, method=method, num_partitions=n, partition_id=i, seed=seed, **kw) for i in range(n)]


@pytest.mark.parametrize("method", ["iid", "dirichlet", "natural"])
def test_partitions_are_disjoint_cover_everything_and_are_deterministic(method):
    kw = {"alpha": 0.5} if method == "dirichlet" else {}
    a, b = parts(method, **kw), parts(method, **kw)
    joined = np.concatenate(a)
    assert len(joined) == len(set(joined.tolist())) == len(LABELS)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_iid_sizes_are_equal_and_labels_mixed():
    p = parts("iid")
    assert [len(x) for x in p] == [200] * 5
    assert all(len(set(LABELS[x].tolist())) == 10 for x in p)


def test_seed_changes_the_split():
    assert not np.array_equal(parts("iid", seed=0)[0], parts("iid", seed=1)[0])


def test_natural_groups_go_round_robin_and_too_many_clients_fail():
    assert natural_groups(list("abcde"), 2) == [["a", "c", "e"], ["b", "d"]]
    p = parts("natural", n=10)
    assert all(len(set(LABELS[x].tolist())) == 1 for x in p)
    with pytest.raises(PartitionError, match="natural split has 10 groups"):
        parts("natural", n=11)


def skew(p):
    """Mean over clients of the total-variation distance of the label histogram to uniform."""
    tv = []
    for x in p:
        hist = np.bincount(LABELS[x], minlength=10) / max(1, len(x))
        tv.append(0.5 * np.abs(hist - 0.1).sum())
    return float(np.mean(tv))


def test_dirichlet_skew_grows_as_alpha_falls():
    values = [skew(parts("dirichlet", alpha=a, min_partition_size=5)) for a in (100.0, 1.0, 0.1)]
    assert values[0] < values[1] < values[2]
    assert values[0] < 0.15 and values[2] > 0.5


def test_bad_partition_input():
    with pytest.raises(PartitionError, match="unknown partition"):
        partition_indices(LABELS, method="shards", num_partitions=2, partition_id=0, seed=0)
    with pytest.raises(PartitionError, match="outside"):
        partition_indices(LABELS, method="iid", num_partitions=2, partition_id=2, seed=0)
    with pytest.raises(PartitionError, match="alpha must be > 0"):
        partition_indices(LABELS, method="dirichlet", num_partitions=2, partition_id=0, seed=0, alpha=0)


def test_train_test_split_is_disjoint_and_seeded():
    idx = np.arange(100, 200)
    train, test = train_test_split(idx, 0.2, seed=3)
    assert len(test) == 20 and len(train) == 80 and not set(train) & set(test)
    assert np.array_equal(test, train_test_split(idx, 0.2, seed=3)[1])
    with pytest.raises(PartitionError):
        train_test_split(np.arange(1), 0.2, seed=0)


def test_the_validation_split_comes_from_the_training_rows_and_never_touches_the_test_items():
    """task.eval_split=val (tuning) scores items carved from a client's training rows: the test items are
    the same as an ordinary run's and appear in neither the training nor the validation split."""
    idx = np.arange(300, 500)
    task = OmegaConf.create({"test_fraction": 0.2, "eval_split": "test"})
    train, test = held_out_split(idx, task, seed=5)
    assert np.array_equal(test, train_test_split(idx, 0.2, seed=5)[1])
    fit, val = held_out_split(idx, OmegaConf.merge(task, {"eval_split": "val"}), seed=5)
    assert not set(val) & set(test) and not set(fit) & set(test) and not set(fit) & set(val)
    assert sorted({*fit, *val}) == sorted(train) and len(val) == 32  # 20% of the 160 training rows
    fit, val = held_out_split(idx, OmegaConf.merge(task, {"eval_split": "val", "val_fraction": 0.5}), seed=5)
    assert len(val) == 80 and not set(val) & set(test)
    with pytest.raises(PartitionError, match="task.eval_split must be one of test, val, got 'dev'"):
        held_out_split(idx, OmegaConf.merge(task, {"eval_split": "dev"}), seed=5)


def test_natural_gives_each_client_its_whole_groups_in_the_tasks_order_and_nothing_else(capsys):
    """flwr-datasets' NaturalIdPartitioner over each example's client: client j holds exactly the
    examples of groups j, j+N, ... of the task's order; a group outside that order is nobody's."""
    rng = np.random.default_rng(0)
    labels = rng.choice(np.array(["hamlet", "macbeth", "tempest", "lear", "othello"]), size=500)
    order = ["tempest", "hamlet", "othello", "macbeth"]  # lear: not one of the task's groups
    for n in (1, 2, 3, 4):
        for j, groups in enumerate(natural_groups(order, n)):
            got = partition_indices(labels, method="natural", num_partitions=n, partition_id=j, seed=0,
                                    natural_order=order)
            np.testing.assert_array_equal(got, np.flatnonzero(np.isin(labels, groups)))
    assert capsys.readouterr().err == ""  # no progress bar per client


CHILD = """
import json, sys
import numpy as np
from clients.partition import partition_indices
labels = np.repeat(np.arange(10), 100)
kw = json.loads(sys.argv[1])
got = partition_indices(labels, partition_id=1, **kw)
print(json.dumps({"indices": got.tolist(), "imported": "flwr_datasets" in sys.modules}))
"""


def fresh_process(cache, **kw):
    import json

    env = {**os.environ, "POSTCARD_PARTITION_CACHE": str(cache), "PYTHONPATH": str(Path(__file__).parent.parent)}
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(kw)], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_later_process_reads_its_partition_from_the_cache_without_importing_flwr_datasets(tmp_path):
    kw = {"method": "dirichlet", "num_partitions": 4, "seed": 3, "alpha": 0.3}
    first, second = fresh_process(tmp_path, **kw), fresh_process(tmp_path, **kw)
    assert first["imported"] and not second["imported"]
    assert first["indices"] == second["indices"]
    expected = partition_indices(LABELS, partition_id=1, **kw)  # computed here: the cache is off
    assert second["indices"] == expected.tolist()
    assert len(list(tmp_path.glob("*.npy"))) == 1


def test_the_cache_key_holds_every_setting_and_the_labels(tmp_path, monkeypatch):
    monkeypatch.setenv("POSTCARD_PARTITION_CACHE", str(tmp_path))
    base = {"method": "dirichlet", "num_partitions": 4, "partition_id": 1, "seed": 3, "alpha": 0.3}
    variants = [base, {**base, "seed": 4}, {**base, "alpha": 0.5}, {**base, "partition_id": 2},
                {**base, "num_partitions": 5}, {**base, "min_partition_size": 5}, {**base, "method": "iid"}]
    for kw in variants:
        got = partition_indices(LABELS, **kw)
        monkeypatch.setenv("POSTCARD_PARTITION_CACHE", "off")
        assert np.array_equal(got, partition_indices(LABELS, **kw)), kw
        monkeypatch.setenv("POSTCARD_PARTITION_CACHE", str(tmp_path))
    other_labels = LABELS[::-1].copy()
    got = partition_indices(other_labels, **base)
    monkeypatch.setenv("POSTCARD_PARTITION_CACHE", "off")
    assert np.array_equal(got, partition_indices(other_labels, **base))
    # one file per partitioning: partition_id 2 reads the file partition_id 1 wrote (every client's indices)
    assert len(list(tmp_path.glob("*.npy"))) == len(variants)


def test_a_damaged_or_unwritable_cache_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv("POSTCARD_PARTITION_CACHE", str(tmp_path))
    kw = {"method": "iid", "num_partitions": 4, "partition_id": 0, "seed": 0}
    good = partition_indices(LABELS, **kw)
    (entry,) = tmp_path.glob("*.npy")
    packed = np.load(entry)
    entry.write_bytes(b"not an array")
    partition._PACKED.clear()  # a new process: nothing in memory
    assert np.array_equal(partition_indices(LABELS, **kw), good)
    bad = packed.copy()
    bad[-1] = 5_000  # out of range for these labels
    np.save(entry, bad)
    partition._PACKED.clear()
    assert np.array_equal(partition_indices(LABELS, **kw), good)
    assert np.array_equal(np.load(entry), packed)  # rewritten
    np.save(entry, np.array([0, 3, 2, 1, 7], dtype=np.int64))  # offsets that go back
    partition._PACKED.clear()
    assert np.array_equal(partition_indices(LABELS, **kw), good)
    partition._PACKED.clear()
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("POSTCARD_PARTITION_CACHE", str(blocker / "below"))  # cannot be created
    assert np.array_equal(partition_indices(LABELS, **kw), good)
