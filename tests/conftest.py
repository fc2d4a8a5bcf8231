import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


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
