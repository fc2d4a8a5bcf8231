"""The warm node worker: one long-lived process runs a SuperNode's ClientApp messages.

Flower 1.42 runs every ClientApp message in a new ``flwr-clientapp`` process (its SuperExec's
``SubprocessExecutor``): each message pays a Python start, the imports of torch and
transformers, and Postcard's model build. Started beside ``flower-supernode --isolation
process`` in place of ``flower-superexec``, this worker takes the node's ClientApp tasks from
the SuperNode's Runtime API itself and runs each in its own process, so the prepared model,
tokenizer and task data (``fedapps.session``) stay in memory for the run::

    flower-supernode --isolation process --host 127.0.0.1 --port 9094 ...   # no flower-superexec
    python -m postcard.worker --runtime-api-address 127.0.0.1:9094 --insecure --parent-pid <supernode pid>

How it keeps the cold path's behaviour (docs/deploy.md §9):

* the per-message work is Flower's own ``flwr-clientapp`` steps (``flwr/supernode/runtime/
  run_clientapp.py``: pull the task input, install the FAB, load the ClientApp, call it, push
  the reply and the context), so ``context.state`` goes back to the SuperNode after each message;
* the model cache is keyed by (run id, FAB hash, the node's resolved config)
  (``fedapps.session.SCOPE``); a new run evicts the previous one (``torch.cuda.empty_cache``
  under CUDA);
* a task of another FAB hash than the one whose code this process imported re-executes the
  process (``os.execv``) before it runs: Python keeps imported modules, and never runs stale code;
* a message that raises gets Flower's error reply, and the process's cache is dropped (a
  fresh state) with a log line; a process that dies is started again by the supervisor
  (the worker's main process), and the message it held expires on the SuperNode as a killed
  ``flwr-clientapp``'s does;
* a task whose message objects never arrive on the SuperNode (a pull it gave up after a SuperLink
  restart, "Ignoring message") is dropped, without a reply, once a newer task is pending: Flower's
  SuperExec would start the newer one beside it, this worker serves one task at a time
  (:meth:`Server.superseded`);
* the task heartbeat is sent here: Flower's (``flwr/supercore/heartbeat.py``) raises SIGINT in
  the process when the SuperNode rejects one (a stopped run); here the message's reply is
  dropped and so is the run's cache, and the worker lives on.

It relies on Flower internals, so it refuses any flwr other than the one it was written for
(one line, exit status 2). ``--events FILE`` appends one JSON line per message (process id,
run, FAB hash, models built so far, seconds, and the seconds of its steps: pulling the
message, loading the app, the ClientApp, pushing the reply): what the tests and
bench/overhead.py read.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from fedapps.pulls import prompt_object_pulls
from postcard.procs import watch_parent

FLWR_VERSION = "1.42.0"  # the Flower whose internals this module uses (see the module docstring)
STARTED = time.time()  # when this program started (a re-execution keeps the pid, not this)
PRELOAD = "torch,transformers,peft"  # what every Postcard ClientApp imports: ready before the first message
RELOAD_EXIT = 3  # the serving process ends itself so that its supervisor starts a fresh one
SUPERSEDED_CHECK = 2.0  # seconds between looks for a newer task while a message's objects are missing


def _log(text: str) -> None:
    print(f"[postcard-worker {os.getpid()}] {text}", file=sys.stderr, flush=True)


def check_flwr() -> str | None:
    """None when the installed flwr is the one this worker was written for, else the refusal line."""
    import flwr

    found = getattr(flwr, "__version__", "unknown")
    if found != FLWR_VERSION:
        return (f"postcard worker: written for flwr {FLWR_VERSION} (it uses its internals), found flwr {found}; "
                "run stock Flower (flower-supernode without --isolation process, or WARM=0)")
    return None


# ---------------------------------------------------------------------------- the serving process
class Heartbeat:
    """The task heartbeat of one message, sent every ~20 s; a rejection sets :attr:`rejected`
    (Flower's own sender raises SIGINT in the process instead)."""

    def __init__(self, client) -> None:
        from flwr.proto.runtime_pb2 import SendTaskHeartbeatRequest

        self.client, self.request = client, SendTaskHeartbeatRequest()
        self.rejected = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="postcard-task-heartbeat")

    def beat(self) -> None:
        import httpx

        try:
            if not self.client.SendTaskHeartbeat(self.request).success:
                self.rejected.set()
        except httpx.HTTPStatusError as err:
            if err.response.status_code not in (503, 504):
                self.rejected.set()
        except Exception:  # noqa: BLE001  (a transport error: try again at the next beat)
            pass

    def _run(self) -> None:
        from flwr.common.constant import HEARTBEAT_CALL_TIMEOUT, HEARTBEAT_DEFAULT_INTERVAL

        while not self._stop.is_set() and not self.rejected.is_set():
            self.beat()
            self._stop.wait(0.8 * (HEARTBEAT_DEFAULT_INTERVAL - HEARTBEAT_CALL_TIMEOUT))

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


class Superseded(Exception):
    """A task's message objects never arrived on the SuperNode, and a newer task is pending."""


class PullGuard:
    """The task's Runtime API client for ``pull_task_input``: a message object that is not
    available asks ``superseded()`` whether to give the task up (:meth:`Server.superseded`)."""

    def __init__(self, client, superseded) -> None:
        self._client, self._superseded = client, superseded

    def __getattr__(self, name: str):
        return getattr(self._client, name)

    def PullObject(self, request):  # noqa: N802  (the Runtime API's name)
        res = self._client.PullObject(request)
        if res.object_found and not res.object_available and self._superseded():
            raise Superseded(f"the objects of this task's message never arrived on the SuperNode "
                             f"(object {request.object_id[:12]}), and a newer task is pending: task dropped")
        return res


class Server:
    """The serving process: polls the SuperNode for ClientApp tasks and runs them here."""

    def __init__(self, args) -> None:
        self.args = args
        self.loaded_fab: str | None = args.loaded_fab  # the FAB whose code this process imported
        self.run_id: int | None = None
        self.served = 0
        self.restart = False  # set when this process must not serve another message
        self.poller = None  # the client that acquires tasks (no task token)
        self.next_task = None  # (token, task): a task claimed while another one's message never arrived
        self._lock = threading.Lock()
        self._checked = float("-inf")

    def client(self, token: str | None = None):
        from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
        from flwr.supercore.retry import make_simple_http_retry_invoker
        from flwr.supercore.runtime import RuntimeHttpClient
        from flwr.supercore.tls import validate_and_resolve_root_certificates

        interceptors = [RuntimeVersionHttpInterceptor(component_name="SuperExec" if token is None
                                                      else "flwr-clientapp")]
        if token is not None:
            interceptors.append(RuntimeTokenHttpInterceptor(token))
        return RuntimeHttpClient.from_server_address(
            server_address=self.args.runtime_api_address, insecure=self.args.insecure,
            root_certificates=validate_and_resolve_root_certificates(self.args.root_certificates, self.args.insecure),
            interceptors=interceptors, retry_invoker=make_simple_http_retry_invoker())

    def acquire(self):
        """A pending ClientApp task of this SuperNode, claimed: ``(token, task)``, or None."""
        from flwr.proto.runtime_pb2 import AcquireTaskRequest
        from flwr.supercore.constant import TaskType

        if self.poller is None:
            self.poller = self.client()
        res = self.poller.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP.value]))
        return (res.token, res.task) if res.HasField("task") and res.token else None

    def loop(self) -> None:
        if self.args.token:  # the task this process was re-executed for
            self.handle(self.args.token, self.args.task_fab, self.args.task_run)
        while True:
            claimed, self.next_task = self.next_task or self.acquire(), None
            if claimed:
                token, task = claimed
                if self.loaded_fab and task.fab_hash and task.fab_hash != self.loaded_fab:
                    self.reexec(token, task.fab_hash, task.run_id)
                self.handle(token, task.fab_hash, task.run_id)
                if self.restart:
                    sys.exit(RELOAD_EXIT)
            else:
                time.sleep(self.args.poll)

    def superseded(self) -> bool:
        """Called while a task's message objects are not available on the SuperNode: True once a
        newer task is pending there (claimed into :attr:`next_task`). The SuperNode (``flwr/supernode/
        start_client_internal.py``) receives one message at a time, and creates a message's task
        before it pulls the message's objects from the SuperLink; it receives the next message only
        once that pull has ended. So a task whose objects are missing while a newer task exists
        will never get them: a pull the SuperNode gave up (``RunNotRunningException`` for a run that
        ended meanwhile, e.g. one whose SuperLink was killed, leaves that task pending). Flower's
        SuperExec starts the newer task's process beside the stuck one; this worker serves one
        task at a time, so it drops the stuck one for the newer one."""
        with self._lock:
            if self.next_task is None and time.monotonic() - self._checked >= SUPERSEDED_CHECK:
                self._checked = time.monotonic()
                self.next_task = self.acquire()
            return self.next_task is not None

    def reexec(self, token: str, fab_hash: str, run_id: int) -> None:
        """A FAB whose code this process has not imported: start over as a new program (same pid)."""
        _log(f"task of FAB {fab_hash[:12]} (run {run_id}) but this process imported FAB {self.loaded_fab[:12]}: "
             "re-executing the worker so that no stale code runs")
        argv = [sys.executable, "-m", "postcard.worker", *self.args.base_argv, "--serve",
                "--token", token, "--task-fab", fab_hash, "--task-run", str(run_id)]
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, argv)

    def evict(self, why: str) -> None:
        session = sys.modules.get("fedapps.session")
        if session is not None and getattr(session, "_MODELS", None):
            session.evict()
            _log(f"model cache dropped: {why}")
        gc.collect()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def handle(self, token: str, fab_hash: str, run_id: int) -> None:
        """One ClientApp message, as ``flwr/supernode/runtime/run_clientapp.py`` runs it, in this process."""
        from flwr.app import Message
        from flwr.app.error import Error
        from flwr.cli.install import install_from_fab
        from flwr.clientapp.client_app import LoadClientAppError
        from flwr.clientapp.utils import get_load_client_app_fn
        from flwr.common.config import get_project_dir
        from flwr.common.constant import ErrorCode, SubStatus
        from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output

        start = time.perf_counter()
        stages = {}  # seconds per step: what a message costs outside the ClientApp, for bench/overhead.py
        if run_id != self.run_id:
            if self.run_id is not None:
                self.evict(f"run {run_id} replaces run {self.run_id}")
            self.run_id = run_id
        client = self.client(token)
        message = context = reply = None
        sub_status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
        failed = False
        try:
            with Heartbeat(client) as heartbeat:
                try:
                    message, context, run, fab = pull_task_input(PullGuard(client, self.superseded))
                    stages["pull"] = time.perf_counter() - start
                    if self.loaded_fab and fab.hash_str != self.loaded_fab:  # the task named no FAB hash
                        self.restart = True
                        raise RuntimeError(f"this worker process imported FAB {self.loaded_fab[:12]}, not "
                                           f"{fab.hash_str[:12]}: refused (the worker restarts for the next one)")
                    app_dir = get_project_dir(run.fab_id, run.fab_version, fab.hash_str)
                    if fab.hash_str != self.loaded_fab or not app_dir.is_dir():
                        install_from_fab(fab.content, skip_prompt=True)
                    self.loaded_fab = fab.hash_str
                    load = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
                    client_app = load(run.fab_id, run.fab_version, fab.hash_str)
                    session = sys.modules.get("fedapps.session")
                    if session is not None:
                        session.SCOPE = (run.run_id, fab.hash_str)
                    mark = time.perf_counter()
                    stages["load"] = mark - start - stages["pull"]
                    reply = client_app(message=message, context=context)
                    stages["app"] = time.perf_counter() - mark
                    sub_status, details = SubStatus.COMPLETED, ""
                except Exception as ex:  # noqa: BLE001  (as flwr-clientapp: an error reply)
                    failed = True
                    reason = f"{type(ex)}:<'{ex}'>"
                    code = ErrorCode.CLIENT_APP_RAISED_EXCEPTION
                    if isinstance(ex, LoadClientAppError):
                        reason = "An exception was raised when attempting to load `ClientApp`"
                        code = ErrorCode.LOAD_CLIENT_APP_EXCEPTION
                    _log(f"the ClientApp raised {type(ex).__name__}: {ex}")
                    details = reason
                    if message is not None:
                        reply = Message(Error(code=code, reason=reason), reply_to=message)
                if heartbeat.rejected.is_set():
                    _log(f"the SuperNode rejected the heartbeat of run {run_id} (stopped?): reply dropped")
                    reply = None
                    failed = True
                elif reply is not None and context is not None:
                    mark = time.perf_counter()
                    try:
                        push_message(client, reply, context)
                    except Exception as ex:  # noqa: BLE001
                        _log(f"failed to push the reply: {type(ex).__name__}: {ex}")
                    stages["push"] = time.perf_counter() - mark
                push_task_output(client=client, context=context, sub_status=sub_status, details=details)
        finally:
            client.close()
        if failed:
            self.evict("the message failed: the next one starts from a fresh state")
            self.run_id = None
        self.served += 1
        session = sys.modules.get("fedapps.session")
        event = {"pid": os.getpid(), "started": STARTED, "run": run_id, "fab": fab_hash or self.loaded_fab,
                 "served": self.served,
                 "builds": getattr(session, "BUILDS", 0), "status": sub_status,
                 "seconds": round(time.perf_counter() - start, 3), "time": time.time(),
                 "stages": {k: round(v, 3) for k, v in stages.items()}}
        _log(f"message {self.served} of this process (run {run_id}): {sub_status} in {event['seconds']:.2f} s; "
             f"models built by this process: {event['builds']}")
        if self.args.events:
            with open(self.args.events, "a") as handle:
                handle.write(json.dumps(event) + "\n")


def preload(modules: str) -> None:
    """Import the app's heavy libraries before the first task arrives (never the app's own code:
    that comes from the task's FAB)."""
    import importlib

    start = time.perf_counter()
    for name in filter(None, (m.strip() for m in modules.split(","))):
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001  (the app imports it again, and fails there if it must)
            _log(f"preloading {name} failed: {type(err).__name__}: {err}")
    if modules:
        _log(f"preloaded {modules} in {time.perf_counter() - start:.1f} s")


def serve(args) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor stops this process (SIGTERM)
    if args.parent_pid:
        watch_parent(args.parent_pid)
    preload(args.preload)
    _log(prompt_object_pulls())
    Server(args).loop()
    return 0


# ---------------------------------------------------------------------------- the supervisor
def supervise(args) -> int:
    """Run the serving process; start a new one whenever it dies, until the SuperNode is gone."""
    import psutil

    stop = threading.Event()

    def on_signal(signum, frame) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    child = None
    starts = quick_deaths = 0
    started = 0.0
    while not stop.is_set():
        if args.parent_pid and not psutil.pid_exists(args.parent_pid):
            _log(f"the SuperNode (pid {args.parent_pid}) is gone: stopping")
            break
        if child is None or child.poll() is not None:
            if child is not None:
                # one that dies at once (the SuperNode not up yet, a broken install) is restarted ever more slowly
                quick_deaths = quick_deaths + 1 if time.time() - started < 10 else 0
                delay = min(30.0, 2.0 ** quick_deaths) if quick_deaths else 1.0
                _log(f"the serving process {child.pid} exited with {child.returncode}: starting a new one "
                     f"in {delay:.0f} s")
                if stop.wait(delay):
                    break
            cmd = [sys.executable, "-m", "postcard.worker", *args.base_argv, "--serve",
                   "--parent-pid", str(os.getpid())]
            child = subprocess.Popen(cmd)
            started = time.time()
            starts += 1
            _log(f"serving process {child.pid} started (start {starts})")
        stop.wait(0.5)
    if child is not None and child.poll() is None:
        child.terminate()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    return 0


# ---------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m postcard.worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime-api-address", required=True,
                        help="the SuperNode's Runtime API, host:port (flower-supernode --host/--port)")
    tls = parser.add_mutually_exclusive_group()
    tls.add_argument("--insecure", action="store_true", help="plain HTTP to the Runtime API (loopback)")
    tls.add_argument("--root-certificates", default=None, help="CA of the Runtime API's certificate (HTTPS)")
    parser.add_argument("--parent-pid", type=int, default=None, help="stop when this process (the SuperNode) ends")
    parser.add_argument("--events", default=None, help="append one JSON line per message to this file")
    parser.add_argument("--poll", type=float, default=0.5, help="seconds between task polls when idle")
    parser.add_argument("--preload", default=PRELOAD,
                        help=f"libraries to import before the first task, comma-separated (default {PRELOAD}; '' none)")
    # internal: the serving process and its re-execution
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--token", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--task-fab", default="", help=argparse.SUPPRESS)
    parser.add_argument("--task-run", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--loaded-fab", default=None, help=argparse.SUPPRESS)
    return parser


def _base_argv(args) -> list[str]:
    """The user's options, passed on to the serving process (and to its re-execution)."""
    argv = ["--runtime-api-address", args.runtime_api_address, "--poll", str(args.poll), "--preload", args.preload]
    if args.insecure:
        argv.append("--insecure")
    if args.root_certificates:
        argv += ["--root-certificates", str(Path(args.root_certificates).resolve())]
    if args.events:
        argv += ["--events", str(Path(args.events).resolve())]
    return argv


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    refusal = check_flwr()
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    if not args.insecure and not args.root_certificates:
        print("postcard worker: give --insecure (plain HTTP on loopback) or --root-certificates", file=sys.stderr)
        return 2
    args.base_argv = _base_argv(args)
    if args.serve:
        if args.parent_pid:  # keep watching the supervisor after a re-execution
            args.base_argv += ["--parent-pid", str(args.parent_pid)]
        return serve(args)
    return supervise(args)


if __name__ == "__main__":
    sys.exit(main())
