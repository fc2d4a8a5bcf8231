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
    for item in items:
        item.add_marker(pytest.mark.xdist_group(xdist_group(item)))


def xdist_group(item) -> str:
    """Where `make test` (pytest-xdist, ``-n 2 --dist loadgroup``) runs a test. A module's tests stay
    together (module fixtures: a TLS cluster, a model are built once); every test that starts Ray
    (marked ``ray``, or reading the session's pool, built through Ray) runs in one worker, one after
    the other: `flwr run`'s simulation calls ``ray.init()`` without an address, which joins a Ray
    cluster another test has up (test_app_run's two-node cluster) instead of starting its own."""
    if item.get_closest_marker("ray") or "tiny_llama_pool" in getattr(item, "fixturenames", ()):
        return "ray"
    return item.nodeid.split("::", 1)[0]


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

    root = tmp_path_factory.mktemp("smartfed")
    pool = root / "pool"
    added = pool_cli.build(SMARTFED_SOURCES, ["preset=test", "rounds=1", "train.local_steps=2", "eval.max_batches=1",
                                              f"output_dir={root / 'runs'}"], pool=pool)
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
