"""An in-process simulation starts a Ray instance of its own: another Ray cluster on the same
machine (a `ray start`, a test's Cluster, another user's run) must not capture it. The run beside
a live two-node cluster: tests/test_flwr_run.py::test_app_run_exits_with_how_the_run_ended_and_postcard_runs_the_same_experiment."""

from fedapps.simulation import ray_init_args


def test_ray_init_args_start_a_local_instance_unless_ray_address_names_a_cluster(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_init_args(3) == {"address": "local", "num_cpus": 3, "include_dashboard": False}
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert ray_init_args(3) == {"include_dashboard": False}  # the cluster's resources, not ours
