"""The `postcard` Hydra CLI: each configuration is `flwr run` of this app through the checkout's own
local SuperLink; a sweep writes one comparison table; a failed run exits non-zero.

The sweep is slow (two `flwr run`s); the refusal of a bad choice starts no run (~1.5 s) and is not
marked slow.
"""

import csv
import os
import subprocess
import sys

import pytest

from postcard.deploy import flower_env
from postcard.superlink import stop as stop_superlinks


@pytest.fixture
def cli(tmp_path):
    home = tmp_path / "flwr-home"
    env = flower_env(home, POSTCARD_OUTPUTS=str(tmp_path))

    def run(*args, timeout=600):
        return subprocess.run([sys.executable, "-m", "postcard.cli", *args], env=env, capture_output=True, text=True,
                              timeout=timeout)

    yield run
    stop_superlinks(home)


@pytest.mark.slow
def test_sweep_writes_a_comparison_table(tmp_path, cli):
    proc = cli("-m", "algorithm=fedavg-lora,ffa-lora", "preset=test", "rounds=1", "train.local_steps=2")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "run_simulation" not in log  # Flower's deprecated in-process API is not used
    assert log.count("finished:completed") == 2
    tables = list(tmp_path.glob("sweeps/*/comparison.csv"))
    assert len(tables) == 1
    rows = list(csv.DictReader(open(tables[0])))
    assert [r["algorithm"] for r in rows] == ["fedavg-lora", "ffa-lora"]
    assert float(rows[1]["uplink_vs_fedavg_lora"]) < 1.0
    assert (tables[0].parent / "comparison.md").exists()
    assert (tables[0].parent / "comparison.png").exists()  # metric vs cumulative uplink bytes
    # each run's own folder in the sweep's, named by the swept value; no empty job folders of Hydra's beside them
    assert sorted(p.parent.name for p in tables[0].parent.glob("*/summary.json")) == \
        ["algorithm=fedavg-lora", "algorithm=ffa-lora"]
    assert sorted(p.name for p in tables[0].parent.iterdir() if p.is_dir()) == \
        ["algorithm=fedavg-lora", "algorithm=ffa-lora"]
    assert "\x1b[" not in log  # piped: no colour codes


def test_cli_refuses_a_bad_choice_with_the_valid_ones(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "postcard.cli", "algorithm=fedsgd"], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, POSTCARD_OUTPUTS=str(tmp_path)))
    assert proc.returncode == 2
    assert "fedavg-lora" in proc.stderr and "fedsgd" in proc.stderr
