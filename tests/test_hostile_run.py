"""End to end: runs on the tiny Llama in which one client misbehaves every round.

The hostile client is Postcard's own ClientApp wrapped in a Flower mod (tests/hostile_app.py)
that corrupts its replies: round 1 a training payload full of NaN (refused), round 2 an
update 1,000x its real size (accepted, clipped to the norm bound), and every evaluation a
NaN perplexity (refused). The run must finish, learn, record each refusal and bound with
the node, round, kind and reason in metrics.jsonl, and count them by kind in summary.json,
with ``flwr run`` of an app whose ClientApp is the hostile one and whose ServerApp is Postcard's.

(#40: the same scenario also ran in-process, ``simulate(cfg, clients=hostile)``, with the same
checks: that run is cut. ``flwr run`` is what users run and asserts all it did and the log line;
the in-process simulation's equality with ``flwr run`` is test_flwr_run's.)
"""

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from fedapps.outputs import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def check_run(summary: dict) -> None:
    rounds = read_metrics(summary["run_dir"])
    assert [r["round"] for r in rounds] == [0, 1, 2]
    node = {c["node_id"] for r in rounds for c in r["clients"] if c.get("eval_partition-id") == 0
            or c.get("train_partition-id") == 0}
    refused = [(r["round"], x["phase"], x["kind"], x["node_id"]) for r in rounds for x in r["refused"]]
    assert refused and {n for *_, n in refused} <= node, refused
    assert sorted((rnd, phase, kind) for rnd, phase, kind, _ in refused) == [
        (0, "eval", "metrics"), (1, "eval", "metrics"), (1, "train", "payload"), (2, "eval", "metrics")]
    assert all(x["reason"] for r in rounds for x in r["refused"])
    bounded = [(r["round"], b["kind"], b["node_id"]) for r in rounds for b in r["bounded"]]
    # the 1,000x update clipped; with the default examples_multiple=1 the larger of the two partitions is
    # also counted as the smaller one (an honest node's count may be the one capped)
    assert (2, "norm-clipped") in [(rnd, kind) for rnd, kind, n in bounded if n in node], bounded
    # and, clipped, still the farthest from the round's median update: pulled in by the centered clip too
    assert {(rnd, kind) for rnd, kind, _ in bounded} <= {(2, "norm-clipped"), (2, "examples-capped"),
                                                         (2, "center-clipped")}, bounded
    assert [kind for _, kind, n in bounded if n not in node] in ([], ["examples-capped"]), bounded
    assert summary["refused_by_kind"] == {"metrics": 3, "payload": 1}
    assert summary["bounded_by_kind"]["norm-clipped"] == 1
    assert set(summary["bounded_by_kind"]) <= {"norm-clipped", "examples-capped", "center-clipped"}
    # the model still learns, and the reported metric is the honest clients'
    assert np.isfinite(summary["final_metric"]) and summary["final_metric"] < summary["initial_metric"]


APP_PYPROJECT = """
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "postcard-hostile"
version = "0.1.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "postcard"

[tool.flwr.app.components]
serverapp = "fedapps.server_app:app"
clientapp = "hostile_app:app"

[tool.flwr.app.config]
algorithm = "fedavg-lora"
task = "shakespeare"
model = ""
partition = ""
preset = ""
robust = ""
overrides = ""
output-dir = ""
"""


def test_flwr_run_with_one_hostile_supernode(tmp_path):
    from postcard.flwr_cli import flower_env
    from postcard.superlink import stop as stop_superlinks

    app = tmp_path / "app"
    app.mkdir()
    (app / "pyproject.toml").write_text(APP_PYPROJECT)
    shutil.copy(Path(__file__).with_name("hostile_app.py"), app / "hostile_app.py")
    out = tmp_path / "runs"
    home = tmp_path / "flwr-home"
    env = flower_env(home)  # this venv, offline, the local SuperLink ports of this FLWR_HOME
    overrides = "rounds=2 num_clients=3 train.local_steps=4"
    try:
        proc = subprocess.run(
            [shutil.which("flwr", path=env["PATH"]), "run", str(app), "--stream",
             "--federation-config", "num-supernodes=3 client-resources-num-cpus=1",
             "--run-config", f"preset='test' overrides='{overrides}' output-dir='{out}'"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    finally:
        stop_superlinks(home)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    runs = list(out.iterdir())
    assert len(runs) == 1 and (runs[0] / "summary.json").exists(), log[-3000:]
    check_run(json.loads((runs[0] / "summary.json").read_text()))
    assert "refused the train reply of node" in log
