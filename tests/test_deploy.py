"""Deployment over loopback: a real SuperLink and three SuperNodes, TLS and node authentication.

One cluster (``postcard.loopback.LoopbackCluster``) serves the whole module: certificates and
SuperNode keys are generated here, the keys registered with ``flwr supernode register``,
and FedNL under secure aggregation (every present algorithm with ``POSTCARD_DEPLOY_ALL=1``) runs
through ``flwr run . postcard-local`` with the tiny Llama. Then the faults, on a SmartFed run (its
pool on the nodes): a SuperNode without a registered key is refused, a SuperNode
killed in the middle of a round does not stop the run, and a run whose SuperLink was
killed resumes from its last checkpoint. Every process is stopped by its pid at the end.

Each ClientApp message starts a fresh process (Flower's subprocess isolation), so a run costs
a few seconds per node and phase: about 3 minutes per algorithm on a loaded 2-core machine.
Run a part with ``-k``, e.g. ``pytest tests/test_deploy.py -k "fednl or dead_supernode"``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import psutil
import pytest

from fedapps import registry
from fedapps import checkpoint as ckpt
from postcard.certs import make_node_keys
from postcard.loopback import LoopbackCluster
from postcard.procs import free_port, kill_tree
from fedapps.outputs import read_metrics

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
NODES = 3
# small and quick: 3 clients of the tiny Llama, 2 local steps, 1 evaluation batch
BASE = "num_clients=3 train.local_steps=2 eval.max_batches=1"


# the app pairs exercised through the cluster by default: FedNL (under secure aggregation); SmartFed
# (a pool on the nodes) goes through it in the faults test below. Every pair shares the runner and the
# client dispatch these runs exercise, and every method runs through `flwr run` in simulation
# (the demo) and alone in simulation; `make test-deploy-all` (POSTCARD_DEPLOY_ALL=1) runs every
# present algorithm through the cluster, FLITE included (~1.5 min each).
DEFAULT_DEPLOYED = ("fednl",)


def present_algorithms() -> list[str]:
    """Registered methods whose conf/algorithm/<name>.yaml exists."""
    present = [name for name in sorted(registry.METHODS) if (ROOT / "conf" / "algorithm" / f"{name}.yaml").is_file()]
    if os.environ.get("POSTCARD_DEPLOY_ALL") == "1":
        return present
    return [name for name in present if name in DEFAULT_DEPLOYED]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cluster")
    cluster = LoopbackCluster(folder, nodes=NODES)
    try:
        cluster.start()
        yield cluster
    finally:
        started = process_family([cluster.superlink, *(n.proc for n in cluster.members)])
        cluster.stop()
    assert not [pid for pid in started if alive(pid)], "cluster processes left running"


def process_family(procs) -> list[int]:
    pids = []
    for proc in procs:
        if proc is None:
            continue
        pids.append(proc.pid)
        try:
            pids += [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return pids


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def run_config(algorithm: str, out: Path, overrides: str) -> str:
    return f"algorithm='{algorithm}' preset='test' output-dir='{out}' overrides='{BASE} {overrides}'"


def only_run(out: Path) -> Path:
    runs = [p for p in out.iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def wait_for(condition, timeout: float, what: str, poll: float = 0.5):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def checkpoint_round(run_dir: Path) -> int:
    try:
        return ckpt.load(run_dir).round
    except ckpt.ResumeError:
        return -1


# ---------------------------------------------------------------------------- authentication
def test_a_supernode_without_a_registered_key_is_refused(cluster):
    (key, _), = make_node_keys(cluster.folder / "unregistered", 1, prefix="intruder")
    log = cluster.folder / "logs" / "intruder.log"
    proc = cluster.spawn_supernode(key, free_port(), f"partition-id=0 num-partitions={NODES}",
                                   cluster.folder / "intruder", log)
    try:
        proc.wait(timeout=120)
    finally:
        kill_tree(proc.pid)
    text = log.read_text()
    assert proc.returncode != 0 and "Failed to activate SuperNode" in text, text[-2000:]
    assert len(cluster.online_nodes()) == NODES  # the registered nodes are unaffected


def test_supernodes_and_their_clientapps_leave_the_cpu_to_the_superlink(cluster):
    """On one machine the SuperNodes run niced (their ClientApps inherit it): starved of CPU,
    the SuperLink's SQLite writes time out and Flower answers 500 (docs/deploy.md §8)."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, cluster.superlink.pid) == own
    for node in cluster.members:
        assert os.getpriority(os.PRIO_PROCESS, node.proc.pid) == min(19, own + cluster.supernode_nice)


# ---------------------------------------------------------------------------- every algorithm
def smartfed_pool(tmp_path_factory) -> str:
    """SmartFed mixes the LoRA adapters of a knowledge pool: a one-adapter pool for the tiny
    Llama (a LoRA with small seeded B factors, added with `postcard pool add`)."""
    import torch

    from fedapps import baselines
    from postcard import pool as pool_cli
    from fedapps.config import compose, to_yaml

    root = tmp_path_factory.mktemp("smartfed-pool")
    run = root / "lora-run"
    run.mkdir()
    cfg = compose(preset="test", algorithm="fedavg-lora")
    (run / "config.yaml").write_text(to_yaml(cfg))
    model, _, _ = baselines.prepare(cfg)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.01 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(str(run / "adapter"))
    pool_cli.add(run, pool=root / "pool")
    return f"algorithm.pool={root / 'pool'}"


# what an algorithm needs before its first run (extra overrides), made on the spot
PREREQUISITES = {"smartfed": smartfed_pool}
# FedNL goes through the cluster under secure aggregation (its extra stages: messages of their own)
SECURE = ("fednl",)


@pytest.mark.parametrize("algorithm", present_algorithms())
def test_each_algorithm_runs_through_the_tls_cluster(cluster, algorithm, tmp_path, tmp_path_factory):
    out = tmp_path / "runs"
    extra = PREREQUISITES[algorithm](tmp_path_factory) if algorithm in PREREQUISITES else ""
    extra += " secure_aggregation.enabled=true" if algorithm in SECURE else ""
    proc = cluster.run(run_config(algorithm, out, f"rounds=1 {extra}"), timeout=600,
                       log_file=cluster.folder / "logs" / f"run-{algorithm}.log")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert out.is_dir(), log[-4000:]
    run = only_run(out)
    for name in ("config.yaml", "metrics.jsonl", "summary.json", ckpt.CHECKPOINT):
        assert (run / name).exists(), f"{name} missing; the run's log ends with:\n{log[-4000:]}"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["algorithm"] == algorithm and summary["model"] == "tiny-llama" and summary["num_clients"] == NODES
    assert summary["refused_replies"] == 0 and summary["missing_replies"] == 0
    assert Path(summary.get("final_state", run)).exists()
    rounds = read_metrics(run)
    assert [r["round"] for r in rounds] == [0, 1]
    # every SuperNode trained (its partition id in its reply; under secure aggregation a reply carries no
    # metrics and none is kept per client) and sent a payload
    trained = [c for c in rounds[1]["clients"] if c.get("uplink_payload_bytes")]
    if algorithm in SECURE:
        assert len(trained) == NODES and not [k for c in trained for k in c if k.startswith("train_")
                                              and not k.endswith("_bytes")]
    else:
        assert sorted(c["train_partition-id"] for c in trained) == list(range(NODES))
    assert all(c["uplink_payload_bytes"] > 0 for c in trained)
    if algorithm in SECURE:  # keys, shares, masked uploads and unmasking went through TLS and node auth
        assert rounds[1]["secure"]["uploaded"] == NODES and not rounds[1]["secure"]["dropped"]
        assert all(c["secagg_uplink_bytes"] > 0 for c in trained)
    assert ckpt.load(run).round == 1
    assert f"Results in {run}" in log


# ---------------------------------------------------------------------------- faults
def test_a_dead_supernode_and_a_killed_superlink_do_not_lose_the_run(cluster, tmp_path, tmp_path_factory):
    """One run, two faults (one scenario keeps the test short: every round costs a ClientApp
    process per node). Round 1: a SuperNode is killed while it trains; the round completes
    with the two others (strategy.min_clients=2) and the node is logged as missing. After
    round 1's checkpoint the SuperLink is killed with its ServerApp. Everything is restarted
    and the same run (run_name + resume=auto) continues from round 2, not round 1. The run is
    SmartFed's: its pool opened on every node, its sparse expert payloads aggregated without the
    dead node's."""
    out = tmp_path / "runs"
    pool = smartfed_pool(tmp_path_factory)
    run = out / "faults"
    victim = NODES - 1
    config = run_config("smartfed", out, f"rounds=2 run_name=faults resume=auto {pool} "
                                         "strategy.min_clients=2 strategy.straggler_timeout=10")
    first_log = cluster.folder / "logs" / "run-faults-1.log"
    first = cluster.submit(config, log_file=first_log)
    try:
        wait_for(lambda: checkpoint_round(run) >= 0, 480, "round 0")
        round0 = set(cluster.clientapp_pids(victim))  # possibly still exiting after its round-0 reply
        wait_for(lambda: set(cluster.clientapp_pids(victim)) - round0, 180, "the victim's round-1 ClientApp", poll=0.2)
        cluster.kill_supernode(victim)  # in the middle of round 1's training
        wait_for(lambda: checkpoint_round(run) >= 1, 480, "round 1 completed without the dead node")
        cluster.kill_superlink()  # with its ServerApp, in round 2
    finally:
        kill_tree(first.pid)
    log = first_log.read_text()
    dead = int(cluster.registered[victim])
    assert checkpoint_round(run) == 1 and not (run / "summary.json").exists(), log[-3000:]
    round1 = read_metrics(run)[1]
    assert sorted(c["train_partition-id"] for c in round1["clients"] if "train_loss" in c) == [0, 1]
    assert {m["node_id"] for m in round1["missing"] if m["phase"] == "train"} == {dead}
    assert f"no train reply from node {dead}" in log

    cluster.start_superlink()  # same database: the registered keys are still known
    # the SuperLink refuses to activate a node it still counts as online (until its last
    # heartbeat's patience runs out): restart the killed SuperNode only once it is offline
    wait_for(lambda: str(dead) not in cluster.online_nodes(), 300, "the dead SuperNode to be marked offline", poll=2)
    cluster.start_supernode(victim)
    wait_for(lambda: str(dead) in cluster.online_nodes(), 180, "the restarted SuperNode to come back online", poll=2)
    cluster.wait_online(NODES)
    # the same run (run_name + resume=auto); a node may first skip the killed run's queued
    # message before it polls the new one, so the stragglers are waited for longer this time
    config = run_config("smartfed", out, f"rounds=2 run_name=faults resume=auto {pool} "
                                         "strategy.min_clients=2 strategy.straggler_timeout=120")
    proc = cluster.run(config, timeout=600, log_file=cluster.folder / "logs" / "run-faults-2.log")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert f"Resuming {run} from its checkpoint after round 1" in log
    assert "[ROUND 1/2]" not in log and "[ROUND 2/2]" in log
    rounds = read_metrics(run)
    assert [r["round"] for r in rounds] == [0, 1, 2]
    # the restarted node got the run's configuration again and trained in round 2
    assert sorted(c["train_partition-id"] for c in rounds[2]["clients"] if "train_loss" in c) == [0, 1, 2]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_after_round"] == 1 and summary["missing_replies"] >= 1
    assert ckpt.load(run).round == 2
