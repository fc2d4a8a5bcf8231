"""The `postcard` Hydra CLI: a bad choice is refused with the valid ones, before any run starts.

Its sweep (`postcard -m ...`: each configuration `flwr run` through the checkout's own local SuperLink,
one comparison table, a failed run exiting non-zero) runs in
tests/test_flwr_run.py::test_app_run_exits_with_how_the_run_ended_and_postcard_runs_the_same_experiment,
on the two-node Ray cluster of that test (#40: one SuperLink and one run fewer than a test of its own).
"""

import os
import subprocess
import sys


def test_cli_refuses_a_bad_choice_with_the_valid_ones(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "postcard.cli", "algorithm=fedsgd"], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, POSTCARD_OUTPUTS=str(tmp_path)))
    assert proc.returncode == 2
    assert "fedavg-lora" in proc.stderr and "fedsgd" in proc.stderr
