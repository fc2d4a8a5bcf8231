"""`make demo`'s program (postcard.demo): four methods through `flwr run`, one table and one plot.

(#40, overlaps weighed and kept: the CLI sweep (test_cli) is another entry point, Hydra's
`postcard -m`, whose table goes to the sweep's folder; the per-method simulations check what one
round of the demo cannot (learning over three rounds, exact payloads, exports). This test's own
claims, the four methods' table and uplink order, FLITE's 648 bytes, the report, are nowhere else.)
"""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from postcard.deploy import flower_env
from postcard.superlink import stop as stop_superlinks

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def test_demo_runs_all_four_methods_and_compares_them(tmp_path):
    flwr_home = tmp_path / "flwr-home"
    env = flower_env(flwr_home)  # this venv, offline, the local SuperLink ports of this FLWR_HOME
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "postcard.demo", "--model", "tiny-llama", "--clients", "2",
             "--pool", str(tmp_path / "pool"), "--outputs", str(tmp_path / "out"), "--overrides", "train.seq_len=32 rounds=1",
             "--report", str(tmp_path / "report")],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
        )
    finally:
        stop_superlinks(flwr_home)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "building shakespeare-histories, shakespeare-comedies" in log  # SmartFed's pool, made on the spot
    (demo,) = (tmp_path / "out").iterdir()
    for name in ("comparison.md", "comparison.csv", "comparison.png"):
        assert (demo / name).is_file(), name
    with open(demo / "comparison.csv") as handle:
        rows = {row["algorithm"]: row for row in csv.DictReader(handle)}
    assert list(rows) == ["fedavg-lora", "fednl", "flite", "smartfed"]
    up = {name: float(row["uplink_bytes_per_client_round"]) for name, row in rows.items()}
    assert up["flite"] == 648  # 1,280 int4 latents
    assert up["flite"] < min(up["fednl"], up["smartfed"]) and max(up["fednl"], up["smartfed"]) < up["fedavg-lora"]
    for name, row in rows.items():  # every method learns a little in one short round
        assert float(row["final_metric"]) < float(row["initial_metric"]), name
    assert f"plot: {demo / 'comparison.png'}" in log
    # --report (make bench): the same table as a benchmark report with the command that made it
    report = (tmp_path / "report" / "demo.md").read_text()
    assert "--model tiny-llama" in report and "![perplexity vs cumulative uplink bytes](comparison.png)" in report
    assert (demo / "comparison.md").read_text().strip() in report
    assert (tmp_path / "report" / "comparison.png").read_bytes() == (demo / "comparison.png").read_bytes()
