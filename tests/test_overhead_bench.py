"""bench/overhead.py's report from parts: rows merged by (model, mode), protocols never mixed."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import overhead  # noqa: E402


def row(model, mode, wall, command="x", clients=5, rounds=2):
    return {"model": model, "mode": mode, "wall": wall, "client_work": wall / 2, "method": 1.0, "setup": 0.5,
            "overhead": wall / 2, "command": command, "clients": clients, "rounds": rounds}


def test_parts_merge_into_one_table_and_a_new_row_replaces_the_parts(tmp_path):
    part = tmp_path / "part.json"
    part.write_text(json.dumps({"command": "old", "results": [row("smollm2", "deployment", 380.0, "old"),
                                                              row("tiny-llama", "simulation", 9.0, "old")]}))
    merged = overhead.merge([row("tiny-llama", "simulation", 3.0, "new"), row("smollm2", "simulation", 75.0, "new")],
                            [part])
    assert [(r["model"], r["mode"], r["wall"]) for r in merged] == [
        ("tiny-llama", "simulation", 3.0), ("smollm2", "simulation", 75.0), ("smollm2", "deployment", 380.0)]
    text = overhead.report(merged, 5, 2)
    assert "`new`" in text and "`old`" in text and "| smollm2 | deployment | 380.00 | 190.00 | 0.50 | 190.00 | 50% |" in text


def test_parts_of_another_protocol_are_refused(tmp_path):
    part = tmp_path / "part.json"
    part.write_text(json.dumps({"results": [row("smollm2", "deployment", 380.0, clients=3)]}))
    with pytest.raises(SystemExit, match="different"):
        overhead.merge([row("tiny-llama", "simulation", 3.0)], [part])


def test_a_part_that_is_not_an_overhead_json_gets_a_clear_error(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    for path in (tmp_path / "bad.json", tmp_path / "missing.json"):
        with pytest.raises(SystemExit, match="is not an overhead.json"):
            overhead.merge([row("tiny-llama", "simulation", 3.0)], [path])


def test_the_warm_workers_steps_are_averaged_after_each_workers_first_message(tmp_path):
    for node, pulls in ((0, [9.0, 1.0, 3.0]), (1, [7.0, 2.0])):
        events = [{"stages": {"pull": p, "app": 10.0, "push": 0.5}} for p in pulls]
        (tmp_path / f"worker-{node}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    steps = overhead.worker_steps(tmp_path)
    assert steps == {"pull": 2.0, "app": 10.0, "push": 0.5}  # (1 + 3 + 2) / 3: the first messages left out
    text = overhead.report([{**row("smollm2", "warm", 40.0), "worker_steps": steps}], 5, 2)
    assert "smollm2: pull 2.00 s, app 10.00 s, push 0.50 s" in text
