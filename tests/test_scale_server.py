"""bench/scale_server.py (issue #63, item 2) in miniature: the server's rounds driven by fake replies
train exactly the clients sampled, whatever the registered count, move the state and write their files."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import scale_server  # noqa: E402

from fedapps.outputs import read_metrics  # noqa: E402


@pytest.mark.parametrize("registered,sampled", [(1000, 100), (10000, 100), (50, 10), (500, 10), (7, 3)])
def test_the_fraction_samples_exactly_the_clients_asked_for(registered, sampled):
    from strategies.release import sample_size

    assert sample_size(registered, scale_server.fraction(registered, sampled)) == sampled


def test_rounds_train_the_sampled_clients_not_the_registered_ones(tmp_path):
    out, runs = tmp_path / "report", tmp_path / "runs"
    results = scale_server.benchmark(registered=[50, 500], sampled=10, rounds=2, out=out, in_process=True, runs=runs,
                                     command="test")
    report = json.loads((out / "scale-server.json").read_text())
    assert (out / "scale-server.md").read_text().count("ratio 500 ÷ 50") == 1
    label = "flite, wire grid, 10 sampled"
    assert set(results) == {label} and set(results[label]) == {"50", "500"}
    for n in (50, 500):
        (run,) = report["runs"][label][str(n)]
        assert run["state_moved"] > 0  # the aggregated z changed
        rows = run["per_round"]
        assert [r["round"] for r in rows] == [0, 1, 2]
        for row in rows[1:]:
            assert row["trained"] == row["accepted"] == 10  # exactly the sampled clients trained
            assert row["evaluated"] == 10 and row["messages"] == 20
            assert row["refused"] == row["missing"] == 0
            assert row["get_node_ids_calls"] == 7 and row["node_ids_read"] == 7 * n
        run_dir = Path(run["run_dir"])
        records = read_metrics(run_dir)  # the round records as the runner's RunDir writes them
        assert [r["round"] for r in records] == [0, 1, 2]
        assert sum("uplink_payload_bytes" in c for c in records[2]["clients"]) == 10
        assert (run_dir / "checkpoint.npz").is_file()
        from fedapps import checkpoint

        assert checkpoint.load(run_dir).round == 2


def test_fedavg_lora_replies_are_packed_and_aggregated(tmp_path):
    result = scale_server.run_one("fedavg-lora", 20, 4, 1, tmp_path, grid="plain")
    row = result["per_round"][1]
    assert row["trained"] == row["accepted"] == 4 and row["refused"] == 0
    assert result["state_moved"] > 0


@pytest.mark.parametrize("database", ["sqlite", "memory"])
def test_the_superlinks_node_list_is_timed_on_flowers_own_handler(database):
    row = scale_server.superlink_get_nodes(20, database, calls=2)
    assert row["nodes_returned"] == 20 and len(row["seconds"]) == 2 and row["response_bytes"] > 20 * 120


def test_a_round_reads_the_node_list_once_per_phase_not_seven_times(tmp_path, monkeypatch):
    """#63: the node list (every registered node, read on the SuperLink) was asked for seven times a round;
    through fedapps.runner.NodeListCache the server reads it once per phase."""
    import inprocess
    from fedapps.config import compose
    from fedapps.runner import NodeListCache

    calls = []
    real = inprocess.InProcessGrid.get_node_ids
    monkeypatch.setattr(inprocess.InProcessGrid, "get_node_ids", lambda self: calls.append(1) or real(self))
    summary = inprocess.run(compose(["rounds=2", "train.local_steps=1", f"output_dir={tmp_path}"], preset="test"))
    assert summary["status"] == "completed"
    # the start (wait for nodes), round 0's evaluation, then training and evaluation of each round: at most one
    # read per phase (the cache lasts half a second): 4 here, where there were 18
    assert len(calls) <= 1 + 1 + 2 * 2, len(calls)
    # and a caller waiting for nodes to join sees a fresh list once the cache is older than its ttl
    grid = NodeListCache(type("G", (), {"get_node_ids": lambda self: calls.append(1) or [1, 2]})(), ttl=0.0)
    before = len(calls)
    grid.get_node_ids(), grid.get_node_ids()
    assert len(calls) == before + 2
