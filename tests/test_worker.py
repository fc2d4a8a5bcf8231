"""The warm node worker (``postcard.worker``) over the loopback TLS cluster, on the tiny Llama.

One SuperNode (``flower-supernode --isolation process``) with its warm worker in place of
``flower-superexec`` (``LoopbackCluster(warm=True)``), one-round runs in order:

1. run A: its three messages (round-0 evaluation, training, evaluation) are served by one
   process, which builds the model once, and no ``flwr-clientapp`` process is started;
2. run B, another config (LoRA rank 4): served by the same process with a new model;
3. run C, A's config from another FAB (the app with one more comment line): the worker
   re-executes itself before running it (a new program, one model build); its process is
   killed after the first message, the supervisor starts a new one and the run completes
   with model outputs bit-identical to A's (A trained warm, C in a freshly started process);
4. (with ``POSTCARD_DEPLOY_ALL=1``: ~2 min more) run D, two rounds, whose SuperLink is killed
   after round 1's checkpoint and restarted: the same worker serves the resumed run (its
   SuperNode may first hold a task of the killed run whose message never arrives: the worker
   gives way to the newer task, docs/deploy.md section 9), which continues from round 2.

85 s alone on this 2-core machine (2026-12-05, runs A-C), 110-140 s when shared with other jobs (each run starts a
ServerApp process too). Every process is stopped by its pid at the end.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import psutil
import pytest

from fedapps.outputs import read_metrics
from postcard import worker
from postcard.flwr_cli import ROOT
from postcard.loopback import LoopbackCluster
from postcard.procs import kill_tree
from test_deploy import checkpoint_round, only_run, wait_for

# the run's config: the tiny Llama, one client, one round of 2 steps, one evaluation batch
BASE = "num_clients=1 rounds=1 train.local_steps=2 eval.max_batches=1"
# the folders of the app a FAB is built from (what `flwr run` packs of the checkout)
APP_PARTS = ("pyproject.toml", "README.md", "fedapps", "clients", "strategies", "conf", "postcard")


def test_the_worker_refuses_another_flwr_in_one_line(monkeypatch, capsys):
    import flwr

    monkeypatch.setattr(flwr, "__version__", "1.43.0")
    assert worker.main(["--runtime-api-address", "127.0.0.1:1", "--insecure"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "flwr 1.42.0" in err and "1.43.0" in err


def test_postcard_supernode_worker_is_the_worker(monkeypatch, capsys):
    from postcard import cli

    monkeypatch.setattr(sys, "argv", ["postcard", "supernode-worker", "--help"])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    assert exit_.value.code == 0 and "--runtime-api-address" in capsys.readouterr().out


def test_a_rejected_heartbeat_marks_the_message_and_sends_no_signal(monkeypatch):
    """Flower's own sender raises SIGINT in the process (a stopped run); the worker's only says so."""
    import signal
    from types import SimpleNamespace

    monkeypatch.setattr(signal, "raise_signal", lambda sig: pytest.fail(f"signal {sig} raised"))
    answers = iter([True, False])
    client = SimpleNamespace(SendTaskHeartbeat=lambda request: SimpleNamespace(success=next(answers)))
    beat = worker.Heartbeat(client)
    beat.beat()
    assert not beat.rejected.is_set()
    beat.beat()
    assert beat.rejected.is_set()


def test_a_task_of_another_fab_re_executes_the_worker_before_it_runs(monkeypatch):
    """The process imported FAB 'old': a task of FAB 'new' is never run by it (os.execv first)."""
    from types import SimpleNamespace

    task = SimpleNamespace(fab_hash="new" * 8, run_id=7)
    poller = SimpleNamespace(AcquireTask=lambda request: SimpleNamespace(HasField=lambda name: True, token="tok",
                                                                         task=task))
    args = worker.build_parser().parse_args(["--runtime-api-address", "127.0.0.1:1", "--insecure",
                                             "--serve", "--loaded-fab", "old" * 8])
    args.base_argv = worker._base_argv(args)
    server = worker.Server(args)
    monkeypatch.setattr(server, "client", lambda token=None: poller)
    monkeypatch.setattr(server, "handle", lambda *a: pytest.fail("ran a task of a FAB it did not import"))
    execs = []

    def execv(path, argv):
        execs.append(argv)
        raise SystemExit(0)

    monkeypatch.setattr(worker.os, "execv", execv)
    with pytest.raises(SystemExit):
        server.loop()
    (argv,) = execs
    assert argv[argv.index("--token") + 1] == "tok" and argv[argv.index("--task-fab") + 1] == task.fab_hash
    assert "--loaded-fab" not in argv  # the new program has imported nothing


def test_a_task_whose_message_never_arrives_gives_way_to_a_newer_one(monkeypatch):
    """After a SuperLink restart the SuperNode may give up pulling a message of a run that is no
    longer running ("Ignoring message"): its task stays pending with the message's objects never
    available, and the next run's task comes after it. Flower's SuperExec starts the newer task
    beside the stuck one; the worker, serving one at a time, drops the stuck task (no reply, task
    failed) and serves the newer one instead of waiting out Flower's 2-hour object pull."""
    import threading
    from types import SimpleNamespace

    from flwr.app import Context, RecordDict
    from flwr.common.serde import context_to_proto, fab_to_proto, run_to_proto
    from flwr.proto.message_pb2 import Message as MessageProto, ObjectTree, PullObjectResponse
    from flwr.proto.runtime_pb2 import (AcquireTaskResponse, PullAppMessagesResponse, PullTaskInputResponse,
                                        PushTaskOutputResponse)
    from flwr.proto.task_pb2 import Task
    from flwr.supercore.fab import Fab
    from flwr.supercore.run import Run

    over = threading.Event()  # ends the stuck pull of an unfixed worker once the test is over
    stale, new = Task(task_id=1, run_id=11, fab_hash="f" * 64), Task(task_id=2, run_id=22, fab_hash="f" * 64)
    claims = iter([AcquireTaskResponse(task=stale, token="stale"), AcquireTaskResponse(task=new, token="new")])
    poller = SimpleNamespace(AcquireTask=lambda request: next(claims, AcquireTaskResponse()))
    outputs, replies = [], []

    def pull_object(request):
        if over.is_set():
            raise RuntimeError("test over")
        return PullObjectResponse(object_found=True, object_available=False)  # preregistered, never pulled

    run = Run.create_empty(11)
    run.fab_hash = "f" * 64
    stale_client = SimpleNamespace(
        PullTaskInput=lambda request: PullTaskInputResponse(
            context=context_to_proto(Context(run_id=11, node_id=5, node_config={}, state=RecordDict(),
                                             run_config={})),
            run=run_to_proto(run), fab=fab_to_proto(Fab("f" * 64, b"", {})), task_id=1),
        PullMessages=lambda request: PullAppMessagesResponse(messages_list=[MessageProto()],
                                                             message_object_trees=[ObjectTree(object_id="ab" * 32)]),
        PullObject=pull_object, ConfirmMessageReceived=lambda request: None,
        PushMessages=lambda request: replies.append(request),
        PushTaskOutput=lambda request: outputs.append(request) or PushTaskOutputResponse(),
        SendTaskHeartbeat=lambda request: SimpleNamespace(success=True),
        close=lambda: None)
    args = worker.build_parser().parse_args(["--runtime-api-address", "127.0.0.1:1", "--insecure", "--serve",
                                             "--preload", ""])
    args.base_argv = worker._base_argv(args)
    server = worker.Server(args)
    monkeypatch.setattr(server, "client", lambda token=None: poller if token is None else stale_client)
    handle, served = server.handle, []

    def serve(token, fab_hash, run_id):
        if token == "new":
            served.append(run_id)
            raise SystemExit(0)
        handle(token, fab_hash, run_id)

    monkeypatch.setattr(server, "handle", serve)
    thread = threading.Thread(target=lambda: pytest.raises(SystemExit, server.loop), daemon=True)
    thread.start()
    thread.join(timeout=20)
    over.set()
    assert not thread.is_alive(), "the worker is still waiting for the stale task's message"
    assert served == [22] and not replies
    assert [o.sub_status for o in outputs] == ["failed"] and "newer task" in outputs[0].details


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = LoopbackCluster(tmp_path_factory.mktemp("warm"), nodes=1, warm=True)
    started = []
    try:
        cluster.start()
        yield cluster
    finally:
        for proc in (cluster.superlink, *(n.proc for n in cluster.members), *(n.worker for n in cluster.members)):
            if proc is not None:
                started.append(proc.pid)
                try:
                    started += [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
                except psutil.NoSuchProcess:
                    pass
        cluster.stop()
    assert not [pid for pid in started if psutil.pid_exists(pid)
                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE], "cluster processes left running"


@pytest.mark.slow
class TestWarmWorker:
    """In order: each test reads what the previous ones left in the worker's event file."""

    runs: dict = {}

    def config(self, out: Path, extra: str = "") -> str:
        return f"preset='test' output-dir='{out}' overrides='{BASE} {extra}'"

    def run(self, cluster, name: str, config: str, app: Path = ROOT) -> Path:
        proc = cluster.run(config, app=app, timeout=240, log_file=cluster.folder / "logs" / f"run-{name}.log")
        text = proc.stdout + proc.stderr
        assert proc.returncode == 0 and "finished:completed" in text, text[-3000:] + worker_log(cluster)
        return only_run(config_out(config))

    def test_one_process_serves_a_run_and_builds_the_model_once(self, cluster, tmp_path):
        run = self.run(cluster, "a", self.config(tmp_path / "a"))
        events = cluster.worker_events(0)
        assert len(events) == 3, events  # round 0's evaluation, round 1's training and evaluation
        assert len({e["pid"] for e in events}) == 1 and len({e["run"] for e in events}) == 1
        assert [e["builds"] for e in events] == [1, 1, 1]  # built for the first message only
        assert all(e["status"] == "completed" for e in events)
        assert not cluster.clientapp_pids(0)  # Flower started no flwr-clientapp process
        self.runs["a"] = (run, events)
        self.runs["last"] = events[-1]

    def test_another_config_is_not_served_stale_state(self, cluster, tmp_path):
        """LoRA rank 4 instead of 8: A's model would not even load B's global state."""
        assert "a" in self.runs, "needs the first run"
        before = len(cluster.worker_events(0))
        run = self.run(cluster, "b", self.config(tmp_path / "b", "algorithm.lora.r=4"))
        events = cluster.worker_events(0)[before:]
        assert len(events) == 3 and {e["pid"] for e in events} == {self.runs["a"][1][0]["pid"]}
        assert {e["run"] for e in events} != {self.runs["a"][1][0]["run"]}
        assert [e["builds"] for e in events] == [2, 2, 2]  # a new model, in the same process
        assert "model cache dropped: run" in worker_log(cluster)
        (a_round,), (b_round,) = (read_metrics(r)[1]["clients"] for r in (self.runs["a"][0], run))
        assert a_round["uplink_payload_bytes"] == 2 * b_round["uplink_payload_bytes"]  # rank 8, rank 4
        self.runs["last"] = events[-1]

    def test_a_new_fab_restarts_the_worker_and_a_killed_worker_is_replaced(self, cluster, tmp_path):
        """A's config from another FAB (the app with one more comment line): the worker re-executes
        itself for it; then its process is killed after the first message, the supervisor starts
        a new one, the run completes, and its model outputs are bit-identical to A's (A trained
        in a warm process, this run in a freshly started one)."""
        assert "a" in self.runs, "needs the first run"
        app = tmp_path / "app"
        app.mkdir()
        for part in APP_PARTS:
            src = ROOT / part
            if src.is_dir():
                shutil.copytree(src, app / part, ignore=shutil.ignore_patterns("__pycache__"))
            elif src.is_file():
                shutil.copy2(src, app / part)
        with open(app / "fedapps" / "__init__.py", "a") as handle:
            handle.write("# another FAB (tests/test_worker.py)\n")
        before = len(cluster.worker_events(0))
        out = tmp_path / "c"
        proc = cluster.submit(self.config(out), app=app, log_file=cluster.folder / "logs" / "run-c.log")
        try:
            first = wait_for(lambda: cluster.worker_events(0)[before:], 180, "run C's first message", poll=0.1)[0]
            victim = psutil.Process(first["pid"])
            victim.kill()  # the serving process, between run C's messages
            victim.wait(10)
            proc.wait(timeout=240)
        finally:
            kill_tree(proc.pid)
        status = cluster.wait_run(first["run"], 60)
        assert status == "finished:completed", status + worker_log(cluster)
        events = cluster.worker_events(0)[before:]
        previous = self.runs["last"]
        assert [e["run"] for e in events] == [first["run"]] * 3
        # a new program for the new FAB (execv keeps the pid), then a new process after the kill
        assert first["fab"] != previous["fab"] and first["pid"] == previous["pid"]
        assert first["started"] > previous["started"] and first["builds"] == 1
        assert {e["pid"] for e in events[1:]} == {events[1]["pid"]} != {first["pid"]}
        assert [e["builds"] for e in events[1:]] == [1, 1]
        log = worker_log(cluster)
        assert "re-executing the worker" in log and f"serving process {first['pid']} exited" in log
        assert model_outputs(only_run(out)) == model_outputs(self.runs["a"][0])


    @pytest.mark.skipif(os.environ.get("POSTCARD_DEPLOY_ALL") != "1",
                        reason="two more runs and a SuperLink restart (~2 min): make test-deploy-all")
    def test_a_killed_superlink_and_the_resumed_run_are_served_by_the_worker(self, cluster, tmp_path):
        out = tmp_path / "d"
        config = self.config(out, "run_name=faults resume=auto").replace("rounds=1", "rounds=2")
        run = out / "faults"
        before = len(cluster.worker_events(0))
        proc = cluster.submit(config, log_file=cluster.folder / "logs" / "run-d1.log")
        try:
            wait_for(lambda: checkpoint_round(run) >= 1, 240, "round 1's checkpoint", poll=0.2)
            cluster.kill_superlink()  # with its ServerApp, in round 2
        finally:
            kill_tree(proc.pid)
        assert checkpoint_round(run) == 1 and not (run / "summary.json").exists()
        killed = cluster.worker_events(0)[before:]
        cluster.start_superlink()  # same database: the node's key is still registered
        cluster.wait_online(1, timeout=180)
        resumed = self.run(cluster, "d2", config)
        assert resumed == run
        log = (cluster.folder / "logs" / "run-d2.log").read_text()
        assert "Resuming" in log and "[ROUND 1/2]" not in log and "[ROUND 2/2]" in log, log[-3000:]
        assert [r["round"] for r in read_metrics(run)] == [0, 1, 2]
        events = cluster.worker_events(0)[before + len(killed):]
        new_run = {e["run"] for e in events if e["status"] == "completed"}
        assert len(new_run) == 1 and new_run != {e["run"] for e in killed}, events
        # one long-lived worker process served both runs (no flwr-clientapp started)
        assert {e["pid"] for e in killed + events} == {killed[0]["pid"]} and not cluster.clientapp_pids(0)


# ---------------------------------------------------------------------------- helpers
def config_out(config: str) -> Path:
    return Path(config.split("output-dir='", 1)[1].split("'", 1)[0])


def model_outputs(run: Path) -> list:
    """Each round's client metrics without timings, node ids and message sizes (a message carries
    timings, and the first one the run's config with its output folder)."""
    return [[{k: v for k, v in c.items() if "seconds" not in k and k != "node_id"
              and not k.endswith(("message_bytes", "wire_bytes"))} for c in r["clients"]] for r in read_metrics(run)]


def worker_log(cluster) -> str:
    path = cluster.folder / "logs" / "worker-0.log"
    return "\n--- worker log:\n" + (path.read_text()[-3000:] if path.is_file() else "(none)")
