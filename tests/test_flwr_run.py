"""`flwr run .` of the registered app, on the real embedded SmolLM2 (a few steps); postcard.app_run's and
`postcard`'s exit codes and a Hydra sweep on a two-node Ray cluster."""

import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from postcard.flwr_cli import flower_env
from postcard.superlink import stop as stop_superlinks

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.ray]


def flwr_run(tmp_path, run_config: str, supernodes: int = 2, timeout: int = 900):
    flwr_home = tmp_path / "flwr-home"
    env = flower_env(flwr_home)  # this venv, offline, the local SuperLink ports of this FLWR_HOME
    flwr = shutil.which("flwr", path=env["PATH"])
    try:
        return subprocess.run(
            [flwr, "run", str(ROOT), "--stream",
             "--federation-config", f"num-supernodes={supernodes} client-resources-num-cpus=1",
             "--run-config", run_config],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout,
        )
    finally:
        stop_superlinks(flwr_home)


def two_ray_nodes():
    """A Ray cluster of two nodes on this machine (a head and a second node, one CPU each), as
    `ray start --head` + `ray start --address=...` make on two machines; its ``shutdown()``
    stops only its own processes."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def ray_placement(address: str) -> dict:
    """The cluster's nodes and, for every ClientApp actor it ever ran (dead ones included), its node."""
    code = ("import json, ray\nfrom ray._private import state\n"
            f"ray.init(address={address!r}, logging_level='ERROR')\n"
            "print(json.dumps({'nodes': sorted(n['NodeID'] for n in ray.nodes() if n['Alive']), "
            "'actors': [v['Address']['NodeID'] for v in state.actors().values() "
            "if v['ActorClassName'] == 'ClientAppActor']}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_flwr_run_fedavg_lora_on_embedded_smollm2(tmp_path):
    out = tmp_path / "runs"
    overrides = ("num_clients=2 rounds=1 train.local_steps=2 train.batch_size=2 train.seq_len=64 "
                 "eval.max_batches=1 eval.batch_size=4 algorithm.lora.target_modules=[q_proj,v_proj]")
    proc = flwr_run(tmp_path, f"algorithm='fedavg-lora' task='shakespeare' overrides='{overrides}' output-dir='{out}'")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    runs = list(out.iterdir())
    assert len(runs) == 1, log[-3000:]
    run = runs[0]
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "metrics.png", "adapter/adapter_config.json"):
        assert (run / name).exists(), name
    summary = json.loads((run / "summary.json").read_text())
    assert summary["model"] == "smollm2" and summary["num_clients"] == 2
    # LoRA r=8 on q (576x576) and v (576x192) of 30 layers, fp32
    assert summary["uplink_bytes_per_client_round"] == 30 * 8 * (576 + 576 + 576 + 192) * 4
    # a pretrained model on Shakespeare: far better than chance over 49,152 tokens
    assert summary["initial_metric"] < 200
    assert f"Results in {run}" in log


def test_a_preset_that_names_another_method_trains_it_under_plain_flwr_run(tmp_path):
    """#60: through `flwr run .` the app's run-config defaults (once algorithm='fedavg-lora',
    task='shakespeare') beat a preset's `override /algorithm`: `preset=fednl-cpu` trained FedAvg-LoRA. A
    preset of one's own (run config `config-dir`) that names FedProx on the instruction task trains that."""
    conf = tmp_path / "conf"
    (conf / "preset").mkdir(parents=True)
    (conf / "preset" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /algorithm: fedprox\n  - override /task: instructions\n"
        "  - override /model: tiny-llama\nnum_clients: 2\nrounds: 1\ntrain:\n  local_steps: 2\n  seq_len: 32\n"
        "eval:\n  max_batches: 1\n")
    out = tmp_path / "runs"
    proc = flwr_run(tmp_path, f"preset='mine' config-dir='{conf}' output-dir='{out}'")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    (summary,) = [json.loads(p.read_text()) for p in out.glob("*/summary.json")]
    assert (summary["status"], summary["algorithm"], summary["task"]) == ("completed", "fedprox", "instructions"), summary
    assert "final_perplexity" in summary  # the instruction task's response perplexity beside its accuracy


def test_app_run_exits_with_how_the_run_ended_and_postcard_runs_the_same_experiment(tmp_path):
    """`flwr run --stream` exits 0 for a failed run; postcard.app_run exits 2 for a refused configuration
    (at once: a bad key, SmartFed without a pool), 1 for a failed run (here through `postcard`, which submits with it), 0 when it completes.
    The runs go to a two-node Ray cluster (RAY_ADDRESS, docs/deploy.md §1). The completed runs are a
    Hydra sweep (`postcard -m algorithm=fedavg-lora,ffa-lora`: two `flwr run`s submitted through
    postcard.app_run, one comparison table in the sweep's folder; #40: this was a test of its own, with
    a SuperLink and a run of its own); their ClientApps ran on both nodes, and the fedavg-lora run's
    configuration run again by the in-process single-node simulation (fedapps.simulation, what the
    benchmarks use), beside that cluster, gives the same metrics, and so does the tests' in-process
    runner (tests/inprocess.run)."""
    flwr_home = tmp_path / "flwr-home"
    env = flower_env(flwr_home)  # this venv, offline, the local SuperLink ports of this FLWR_HOME
    cluster = two_ray_nodes()
    env["RAY_ADDRESS"] = cluster.address  # the SuperLink that `flwr run` starts, and its simulation, join it
    federation = ["--federation-config", "num-supernodes=2 client-resources-num-cpus=1"]
    out = tmp_path / "runs"

    def app_run(run_config: str):
        return subprocess.run([sys.executable, "-m", "postcard.app_run", str(ROOT), *federation,
                               "--run-config", run_config], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=600)

    try:
        # a configuration the server would refuse is refused before anything is submitted
        start = time.time()
        refused = app_run(f"preset='test' overrides='rounds=1 train.lrr=1' output-dir='{out}'")
        assert refused.returncode == 2 and time.time() - start < 30, (refused.stdout + refused.stderr)[-3000:]
        assert refused.stderr.strip() == ("postcard.app_run: unknown config key 'train.lrr'; did you mean "
                                          "'train.lr' or 'train.threads'?")
        # SmartFed without a pool: refused by `postcard` before anything is submitted (#60: once after 36 s)
        start = time.time()
        nopool = subprocess.run([sys.executable, "-m", "postcard.cli", "algorithm=smartfed", "preset=test",
                                 "rounds=1", f"algorithm.pool={tmp_path / 'no-pool'}", f"output_dir={out}"],
                                cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert nopool.returncode == 2 and time.time() - start < 30, (nopool.stdout + nopool.stderr)[-3000:]
        assert nopool.stderr.strip().startswith("postcard: no knowledge pool at") and \
            len(nopool.stderr.strip().splitlines()) == 1
        # a run its server refuses (a pool built for another backbone: only the server reads that): Flower
        # reports it failed, in one line, and `postcard` (which submits through postcard.app_run) exits 1
        other = tmp_path / "other-pool"
        (other / "a").mkdir(parents=True)
        (other / "pool.json").write_text(json.dumps({"format": 1, "backbone_fingerprint": "0" * 16, "backbone": {
            "model_type": "llama", "hidden_size": 8, "num_hidden_layers": 1}}))
        (other / "a" / "provenance.json").write_text("{}")
        failed = subprocess.run([sys.executable, "-m", "postcard.cli", "algorithm=smartfed", "preset=test",
                                 "rounds=1", f"algorithm.pool={other}", f"output_dir={out}"],
                                cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert failed.returncode == 1, (failed.stdout + failed.stderr)[-3000:]
        assert "finished:failed" in failed.stderr
        assert "was built for backbone" in failed.stdout + failed.stderr
        assert "Traceback" not in failed.stdout + failed.stderr  # one line, not Flower's traceback of the ServerApp
        assert "Since flwr 1.32" not in failed.stdout  # Flower's federation-size notes, filtered (#60)
        assert not out.exists()  # refused before any run folder
        # a sweep: `postcard -m`, each configuration `flwr run` through postcard.app_run, then one table
        sweeps = tmp_path / "cli"
        done = subprocess.run([sys.executable, "-m", "postcard.cli", "-m", "algorithm=fedavg-lora,ffa-lora",
                               "preset=test", "rounds=1", "train.local_steps=2"], cwd=ROOT,
                              env=dict(env, POSTCARD_OUTPUTS=str(sweeps)), capture_output=True, text=True, timeout=900)
        log = done.stdout + done.stderr
        assert done.returncode == 0, log[-3000:]
        assert "run_simulation" not in log  # Flower's deprecated in-process API is not used
        assert log.count("finished:completed") == 2
        assert "\x1b[" not in log  # piped: no colour codes
        (table,) = sweeps.glob("sweeps/*/comparison.csv")
        rows = list(csv.DictReader(open(table)))
        assert [r["algorithm"] for r in rows] == ["fedavg-lora", "ffa-lora"]
        assert float(rows[1]["uplink_vs_fedavg_lora"]) < 1.0
        assert (table.parent / "comparison.md").exists()
        assert (table.parent / "comparison.png").exists()  # metric vs cumulative uplink bytes
        # each run's own folder in the sweep's, named by the swept value; no empty job folders of Hydra's beside them
        assert sorted(p.name for p in table.parent.iterdir() if p.is_dir()) == \
            ["algorithm=fedavg-lora", "algorithm=ffa-lora"]
        run = table.parent / "algorithm=fedavg-lora"
        summary = json.loads((run / "summary.json").read_text())
        assert summary["status"] == "completed"
        assert json.loads((table.parent / "algorithm=ffa-lora" / "summary.json").read_text())["status"] == "completed"
        placement = ray_placement(cluster.address)
        assert len(placement["nodes"]) == 2
        assert set(placement["actors"]) == set(placement["nodes"]), placement  # ClientApps ran on both nodes
        # the same configuration through fedapps.simulation.simulate: the same experiment. It runs while
        # the two-node cluster is still up, without RAY_ADDRESS: the simulation starts a Ray instance of
        # its own (ray_init_args) instead of joining that cluster, which refused its num_cpus and hung the
        # run before (in a process of its own, so that a hang fails the test at its timeout)
        code = ("import json\nfrom fedapps.config import compose\nfrom fedapps.simulation import simulate\n"
                f"s = simulate(compose(['rounds=1', 'train.local_steps=2', 'output_dir={tmp_path / 'sim'}'], "
                "preset='test'))\nprint('SUMMARY', json.dumps(s))")
        local = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=local, capture_output=True, text=True,
                              timeout=300)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("SUMMARY ")]
        assert proc.returncode == 0 and lines, (proc.stdout + proc.stderr)[-3000:]
        same = json.loads(lines[-1].removeprefix("SUMMARY "))
    finally:
        stop_superlinks(flwr_home)
        cluster.shutdown()
    assert same["num_clients"] == summary["num_clients"] == 2
    assert same["metric_by_round"]["0"] == pytest.approx(summary["metric_by_round"]["0"], rel=1e-9)
    assert same["metric_by_round"]["1"] == pytest.approx(summary["metric_by_round"]["1"], rel=1e-6)
    # and through the tests' in-process runner (inprocess.run: run_server with the ClientApp in this process,
    # no Ray), which the per-method runs of the suite use in place of the simulation (#40): the same experiment
    from fedapps.config import compose
    from inprocess import run

    here = run(compose(["rounds=1", "train.local_steps=2", f"output_dir={tmp_path / 'inprocess'}"], preset="test"))
    assert here["num_clients"] == 2
    assert here["metric_by_round"]["0"] == pytest.approx(summary["metric_by_round"]["0"], rel=1e-9)
    assert here["metric_by_round"]["1"] == pytest.approx(summary["metric_by_round"]["1"], rel=1e-6)
