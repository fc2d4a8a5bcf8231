"""An in-process simulation starts a Ray instance of its own: another Ray cluster on the same
machine (a `ray start`, a test's Cluster, another user's run) must not capture it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedapps.simulation import ray_init_args

ROOT = Path(__file__).resolve().parent.parent


def test_ray_init_args_start_a_local_instance_unless_ray_address_names_a_cluster(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_init_args(3) == {"address": "local", "num_cpus": 3, "include_dashboard": False}
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert ray_init_args(3) == {"include_dashboard": False}  # the cluster's resources, not ours


@pytest.mark.slow
def test_a_simulation_runs_beside_another_ray_cluster_on_the_machine(tmp_path):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        code = ("from fedapps.config import compose\nfrom fedapps.simulation import simulate\n"
                f"s = simulate(compose(['rounds=1', 'train.local_steps=1', 'output_dir={tmp_path}'], preset='test'))\n"
                "print('STATUS', s['status'])")
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
        assert "STATUS completed" in proc.stdout, (proc.stdout + proc.stderr)[-3000:]
    finally:
        cluster.shutdown()
