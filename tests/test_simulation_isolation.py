"""An in-process simulation starts a Ray instance of its own: another Ray cluster on the same
machine (a `ray start`, a test's Cluster, another user's run) must not capture it. The run beside
a live two-node cluster: tests/test_flwr_run.py::test_app_run_exits_with_how_the_run_ended_and_postcard_runs_the_same_experiment."""

from fedapps.simulation import ray_init_args


def test_ray_init_args_start_a_local_instance_unless_ray_address_names_a_cluster(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_init_args(3) == {"address": "local", "num_cpus": 3, "include_dashboard": False}
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert ray_init_args(3) == {"include_dashboard": False}  # the cluster's resources, not ours


def test_the_local_superlink_starts_its_own_ray_unless_told_a_cluster(monkeypatch):
    """#60: `python -m postcard.app_run` without RAY_ADDRESS joined another process's Ray cluster (one run
    failed, the next hung): every Flower process Postcard starts gets RAY_ADDRESS=local unless it names one."""
    from postcard.flwr_cli import flower_env

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert flower_env()["RAY_ADDRESS"] == "local"
    monkeypatch.setenv("RAY_ADDRESS", "")
    assert flower_env()["RAY_ADDRESS"] == "local"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert flower_env()["RAY_ADDRESS"] == "10.0.0.5:6379"
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert ray_init_args(2)["address"] == "local"  # "local" is no cluster to join
