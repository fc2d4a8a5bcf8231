import contextlib
import fcntl
import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

# CIFAR-10 comes from the bigbench 1.0.0 sdist, which PyPI no longer has (removed on or before
# 2026-12-04): tests that read its images carry @pytest.mark.needs_cifar10 and are skipped, with
# this reason, on a machine without it (most tests only compose task=cifar10 and need no data).
NEEDS_CIFAR10 = ("CIFAR-10 is not available (no bigbench-1.0.0.tar.gz or converted vision-cifar10-v1 in "
                 "$POSTCARD_CACHE; bigbench 1.0.0 left PyPI): see `make assets-cifar10`")


def cifar10_available() -> bool:
    from clients.tasks.vision import available

    return available("cifar10")


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_cifar10: reads the real CIFAR-10 images (skipped when absent)")


def pytest_collection_modifyitems(config, items):
    marked = [item for item in items if item.get_closest_marker("needs_cifar10")]
    if marked and not cifar10_available():
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=NEEDS_CIFAR10))


# `make test` runs two pytest workers (pytest-xdist, --dist loadfile: a module's tests in one worker, so
# its module fixtures are built once). What the workers must not do at the same time is held by a lock
# they share (docs/testing.md, "Two workers").
@contextlib.contextmanager
def across_workers(tmp_path_factory, name: str):
    """Hold the lock ``name`` shared by this session's xdist workers; yields the folder they share
    (this session's base temporary folder when there is one process, nothing to lock)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield tmp_path_factory.getbasetemp()
        return
    shared = tmp_path_factory.getbasetemp().parent  # the workers' base folders lie side by side in it
    with open(shared / f"{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield shared
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def one_ray_test_at_a_time(request, tmp_path_factory):
    """Tests marked ``ray`` (a `flwr run` simulation, a Ray cluster) run one at a time across the
    workers: `flwr run`'s simulation calls ``ray.init()`` without an address, which joins a Ray cluster
    another test has up (test_app_run's two-node cluster) instead of starting its own.
    (``fedapps.simulation.simulate`` asks for a local instance of its own and needs no lock.)"""
    if request.node.get_closest_marker("ray") is None:
        yield
        return
    with across_workers(tmp_path_factory, "ray"):
        yield


# the demo's SmartFed pool sources (postcard.demo.POOL_SOURCES): plays the shakespeare task does not use
SMARTFED_SOURCES = ["shakespeare-histories", "shakespeare-comedies"]


@pytest.fixture(scope="session")
def tiny_llama_pool(tmp_path_factory):
    """A SmartFed knowledge pool for the tiny Llama, built once per session by `postcard pool build`
    (two short federated LoRA runs through the Ray simulation, fedapps.simulation.simulate):
    (pool folder, the names added, its root). Read by test_smartfed_app (which checks its provenance)
    and, as a copy, by test_demo (#40: the demo's own build of the same two sources was a second pair
    of runs; its build step is checked without them in test_demo)."""
    from postcard import pool as pool_cli

    with across_workers(tmp_path_factory, "smartfed-pool") as shared:  # built once, whichever worker asks first
        root = shared / "smartfed"
        pool, built = root / "pool", root / "added.json"
        if built.is_file():
            return pool, json.loads(built.read_text()), root
        root.mkdir(exist_ok=True)
        added = pool_cli.build(SMARTFED_SOURCES, ["preset=test", "rounds=1", "train.local_steps=2",
                                                  "eval.max_batches=1", f"output_dir={root / 'runs'}"], pool=pool)
        built.write_text(json.dumps(added))
        return pool, added, root


@pytest.fixture
def outputs(tmp_path, monkeypatch):
    """Run folders of this test go to a temporary folder."""
    folder = tmp_path / "outputs"
    monkeypatch.setenv("POSTCARD_OUTPUTS", str(folder))
    return folder


@pytest.fixture(autouse=True)
def task_identity():
    """Messages built outside a Flower run need a run/node identity (the ServerApp's)."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
