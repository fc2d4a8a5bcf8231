"""The `postcard` Hydra CLI: a sweep runs each configuration and writes one comparison table."""

import csv
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_sweep_writes_a_comparison_table(tmp_path):
    env = dict(os.environ, POSTCARD_OUTPUTS=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "postcard.cli", "-m", "algorithm=fedavg-lora,ffa-lora", "preset=test",
         "rounds=1", "train.local_steps=2"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    tables = list(tmp_path.glob("sweeps/*/comparison.csv"))
    assert len(tables) == 1
    rows = list(csv.DictReader(open(tables[0])))
    assert [r["algorithm"] for r in rows] == ["fedavg-lora", "ffa-lora"]
    assert float(rows[1]["uplink_vs_fedavg_lora"]) < 1.0
    assert (tables[0].parent / "comparison.md").exists()
    assert (tables[0].parent / "comparison.png").exists()  # metric vs cumulative uplink bytes


def test_cli_refuses_a_bad_choice_with_the_valid_ones(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "postcard.cli", "algorithm=fedsgd"], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, POSTCARD_OUTPUTS=str(tmp_path)))
    assert proc.returncode != 0
    assert "fedavg-lora" in proc.stderr and "fedsgd" in proc.stderr
