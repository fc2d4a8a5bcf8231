"""bench/secagg.py's scale path (issue #63 item 3) at n = 10: one secure round of FLITE's payload with 10% of
the clients dropping out mid-round (never uploading) or after uploading completes, and the unmasked mean is the
plain mean of the uploaders' quantised updates, so the benchmark's scale table cannot rot."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1  # messages outside a Flower run
    spec = importlib.util.spec_from_file_location("bench_secagg", ROOT / "bench" / "secagg.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_secagg", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("drop", ["upload", "unmask"])
def test_ten_clients_one_dropping_out_complete_with_the_exact_sum(bench, drop):
    row = bench.scale_row(10, drop)
    assert row["dropouts"] == 1 and row["threshold"] == 6
    assert row["completed"] and not row["refused_round"]
    assert row["uploaded"] == (9 if drop == "upload" else 10)
    assert row["exact"] and row["max_abs_error"] <= 1e-6
    assert row["plain_payload_bytes"] == 648 and row["masked_payload_bytes"] == 1280
    assert row["stage_bytes"]["shares/up"] > 0 and row["client_total_bytes"] > row["masked_payload_bytes"]
