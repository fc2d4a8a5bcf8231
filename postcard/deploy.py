"""Deployment helpers: certificates and keys, registration, and a loopback cluster run by pid.

The same app that ``flwr run .`` simulates runs unchanged on a real SuperLink with real
SuperNodes. This module holds what that needs besides Flower itself:

* certificates and keys (``postcard.certs``, re-exported here): :func:`make_certificates`,
  :func:`make_node_keys`, :func:`layout_secrets` (one folder per holder);
* :func:`register_keys` — ``flwr supernode register``, idempotent;
* :class:`LoopbackCluster` — the SuperLink of docs/deploy.md §3.3 (``postcard.fleetgate``:
  TLS, SuperNode authentication, every API on 127.0.0.1, the Fleet API alone on
  127.0.0.2) plus N SuperNodes (``flower-supernode``, or for warm nodes ``postcard.supernode``:
  the same SuperNode with shorter waits), each with its own ``FLWR_HOME``, its
  own key, log file and partition, driven through the ``flwr`` CLI exactly as a user
  would; every process is started here and stopped here by its process id (process
  helpers: ``postcard.procs``).

Command line (``make deploy-local`` calls the last one)::

    python -m postcard.deploy certs DIR [--host superlink.example.org --host 10.0.0.5]
    python -m postcard.deploy node-keys DIR --nodes 3 [--first 0]
    python -m postcard.deploy secrets DIR --nodes 3 [--host ...]   # ca/ superlink/ public/ supernode-<i>/
    python -m postcard.deploy register KEY.pub... --superlink HOST:PORT --root-certificates ca.crt
    python -m postcard.deploy flwr --superlink HOST:PORT --root-certificates ca.crt -- ls postcard
    python -m postcard.deploy local [--nodes 3] [--run-config "..."] [--outputs DIR] [--dir DIR] [--keep] [--cold]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from fedapps.filemodes import private_dir, private_file, umask
from postcard.certs import (  # noqa: F401  (re-exported: postcard.deploy.make_certificates, ...)
    CA_CERT, CA_KEY, LOOPBACK, SERVER_CERT, SERVER_KEY, layout_secrets, make_certificates, make_node_keys,
)
from postcard.procs import free_port, kill_tree, port_open  # noqa: F401  (re-exported)
from postcard.superlink import local_env

ROOT = Path(__file__).resolve().parent.parent  # the app folder (pyproject.toml)
CONNECTION = "postcard-local"  # name of the SuperLink connection in the CLI's config.toml
# on loopback the SuperNodes reach the Fleet API on a loopback address of its own, as they would reach
# the server's public address: the Control API (127.0.0.1 only) does not listen there
FLEET_LOOPBACK = "127.0.0.2"
# what `python -m postcard.deploy local` runs by default: the tiny Llama, one client per node, 2 short rounds
LOCAL_RUN_CONFIG = "preset='test' overrides='num_clients={nodes} rounds=2 train.local_steps=4'"


class DeployError(RuntimeError):
    """A cluster process failed to start or a CLI call failed; the message names its log."""


# ---------------------------------------------------------------------------- registration
def write_connection(flwr_home: str | Path, address: str, root_certificates: str | Path,
                     name: str = CONNECTION) -> Path:
    """``$FLWR_HOME/config.toml`` with one TLS connection ``name`` (the default) to ``address``."""
    flwr_home = Path(flwr_home)
    flwr_home.mkdir(parents=True, exist_ok=True)
    path = flwr_home / "config.toml"
    path.write_text(
        "[superlink]\n"
        f'default = "{name}"\n\n'
        f"[superlink.{name}]\n"
        f'address = "{address}"\n'
        f'root-certificates = "{Path(root_certificates).resolve()}"\n'
    )
    return path


def register_keys(flwr_home: str | Path, public_keys: list[str | Path], *, connection: str = CONNECTION,
                  retry_for: float = 0.0) -> dict[str, str]:
    """``flwr supernode register`` each public key; returns {key path: node id or 'already registered'}.

    A key the SuperLink already knows counts as registered (so this can run at every
    start). With ``retry_for`` > 0, connection failures are retried that long (a SuperLink
    that is still starting).
    """
    done: dict[str, str] = {}
    for key in public_keys:
        deadline = time.time() + retry_for
        while True:
            proc = subprocess.run(
                [executable("flwr"), "supernode", "register", str(key), connection, "--format", "json"],
                env=flower_env(Path(flwr_home)), capture_output=True, text=True, timeout=120,
            )
            text = proc.stdout + proc.stderr
            if proc.returncode == 0:
                done[str(key)] = str(_json_tail(proc.stdout)["node-id"])
                break
            if "already in use" in text:
                done[str(key)] = "already registered"
                break
            if time.time() >= deadline:
                raise DeployError(f"`flwr supernode register {key} {connection}` failed: {text.strip()[-1500:]}")
            time.sleep(2.0)
    return done


# ---------------------------------------------------------------------------- processes
def flower_env(flwr_home: Path | None = None, **extra: str) -> dict[str, str]:
    """The environment of every Flower process Postcard starts: this venv first, offline, no runtime
    installs, and the local SuperLink ports of its FLWR_HOME (``postcard.superlink.local_env``); FLWR_HOME
    is the checkout's ``.flwr`` unless set, so a checkout never reaches another one's local SuperLink."""
    env = dict(os.environ)
    env.update({
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_TELEMETRY_ENABLED": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    })
    env["FLWR_HOME"] = str(flwr_home) if flwr_home is not None else env.get("FLWR_HOME") or str(ROOT / ".flwr")
    env.update(extra)
    return local_env(env)


def executable(name: str) -> str:
    path = shutil.which(name, path=flower_env()["PATH"])
    if path is None:
        raise DeployError(f"'{name}' is not installed in {Path(sys.executable).parent}; run `make venv`")
    return path


@dataclass
class Node:
    index: int
    key: Path
    public_key: Path
    port: int
    home: Path
    log: Path
    node_config: str
    ca_cert: Path | None = None
    proc: subprocess.Popen | None = None
    worker: subprocess.Popen | None = None  # the warm node worker (postcard.worker) beside it, if warm
    events: Path | None = None  # the worker's one JSON line per message


@dataclass
class LoopbackCluster:
    """A SuperLink (TLS + SuperNode authentication) and SuperNodes on loopback, by pid.

    The SuperLink runs as ``postcard.fleetgate`` (section 3.3 of docs/deploy.md): every API
    (Control, Runtime, Fleet) on ``127.0.0.1:<port>`` — the operator's ``flwr`` CLI, the
    connection ``postcard-local`` — and the Fleet API alone on ``127.0.0.2:<fleet_port>``,
    the address the SuperNodes use (the server's public address in a real deployment).

    ``folder`` receives everything: ``secrets/`` (``postcard.certs.layout_secrets``: one
    folder per holder — ``ca/``, ``superlink/``, ``public/``, ``supernode-<i>/`` — and each
    process is given only its own), ``superlink/`` (the SuperLink's working directory,
    database and ``FLWR_HOME``), ``cli/`` (the ``flwr`` CLI's ``FLWR_HOME`` with the
    connection ``postcard-local``), ``node-<i>/`` (each SuperNode's ``FLWR_HOME``) and
    ``logs/``. Use it as a context manager, or call :meth:`stop`.

    ``supernode_nice``: the SuperNodes (and the ClientApp processes they start) run at this
    CPU niceness, so that on one machine the SuperLink keeps the CPU it would have on a
    machine of its own. Without it, five SmolLM2 clients on two cores starve the SuperLink
    until a database write waits past SQLite's 5 s lock timeout and Flower answers
    ``500 database is locked`` (docs/deploy.md §8). 0 runs them as the SuperLink runs.

    ``persistent``: the SuperLink keeps its state in ``superlink/state.db`` (runs and
    registered keys survive a restart of it, as ``--database`` does in a real deployment);
    False keeps it in memory, Flower's default, which no lock timeout can stop.

    ``gate_options``: more ``postcard.fleetgate`` arguments of the SuperLink, e.g.
    ``("--fleet-header-timeout", "4")``.

    Files: ``folder`` is private (``fedapps.filemodes``: mode ``0700`` unless ``POSTCARD_UMASK`` says
    otherwise), its logs ``0600``, and every process is started with the umask of ``POSTCARD_UMASK``
    (default ``077``): the SuperLink's ``state.db``, the SuperNodes' and workers' files and the run
    folders the ServerApp writes are readable by this user alone.

    ``warm``: each SuperNode runs with ``--isolation process`` (as ``postcard.supernode``) beside a
    warm node worker (``postcard.worker``: one long-lived process runs the node's ClientApp messages and keeps
    the prepared model for the run; its log ``logs/worker-<i>.log``, one JSON line per message
    in ``logs/worker-<i>.jsonl``) instead of Flower's ``flower-superexec``, which starts a new
    ``flwr-clientapp`` process per message (False: stock Flower).
    """

    folder: Path
    nodes: int = 3
    node_config: str = ""  # extra node-config entries for every node, e.g. "device='cpu'"
    supernode_nice: int = 10
    persistent: bool = True
    warm: bool = False
    gate_options: tuple[str, ...] = ()  # more postcard.fleetgate arguments for the SuperLink
    port: int = 0  # every API, on 127.0.0.1
    fleet_port: int = 0  # the Fleet API alone, on fleet_host
    fleet_host: str = FLEET_LOOPBACK
    superlink: subprocess.Popen | None = None
    members: list[Node] = field(default_factory=list)
    registered: dict[int, str] = field(default_factory=dict)  # node index -> SuperLink node id

    def __post_init__(self) -> None:
        self.folder = private_dir(Path(self.folder).resolve())
        for name in ("superlink", "cli", "logs"):
            private_dir(self.folder / name)
        self.port = self.port or free_port(LOOPBACK)
        self.fleet_port = self.fleet_port or free_port(self.fleet_host)
        self.secrets = layout_secrets(self.folder / "secrets", self.nodes,
                                      hosts=("localhost", LOOPBACK, self.fleet_host))
        link = self.secrets["superlink"]
        self.certs = {CA_CERT: link / CA_CERT, SERVER_CERT: link / SERVER_CERT, SERVER_KEY: link / SERVER_KEY}
        self.ca_cert = self.secrets["public"] / CA_CERT  # what the CLI and anyone else gets
        self.cli_home = self.folder / "cli"
        self._write_connection()
        for i in range(self.nodes):
            own = self.secrets[f"supernode-{i}"]
            config = f"partition-id={i} num-partitions={self.nodes} {self.node_config}".strip()
            self.members.append(Node(i, own / f"supernode-{i}", self.secrets["public"] / f"supernode-{i}.pub",
                                     free_port(), self.folder / f"node-{i}",
                                     self.folder / "logs" / f"supernode-{i}.log", config, ca_cert=own / CA_CERT))

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> LoopbackCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def address(self) -> str:
        """The operator's address: every API (Control included), on 127.0.0.1 only."""
        return f"{LOOPBACK}:{self.port}"

    control_address = address

    @property
    def fleet_address(self) -> str:
        """The SuperNodes' address: the Fleet API alone."""
        return f"{self.fleet_host}:{self.fleet_port}"

    def _write_connection(self) -> None:
        write_connection(self.cli_home, self.address, self.ca_cert)

    def start_superlink(self, wait: float = 60.0) -> None:
        """Start (or restart, same database and port) the SuperLink and wait for its port."""
        if self.superlink is not None and self.superlink.poll() is None:
            raise DeployError("the SuperLink is already running")
        home = self.folder / "superlink"
        log = _open_log(self.folder / "logs" / "superlink.log")
        cmd = [
            sys.executable, "-m", "postcard.fleetgate",
            "--fleet-host", self.fleet_host, "--fleet-port", str(self.fleet_port),
            "--ssl-ca-certfile", str(self.certs[CA_CERT]),
            "--ssl-certfile", str(self.certs[SERVER_CERT]),
            "--ssl-keyfile", str(self.certs[SERVER_KEY]),
            "--enable-supernode-auth",
            "--host", LOOPBACK, "--port", str(self.port),
            *(["--database", str(home / "state.db")] if self.persistent else []),
            "--disable-runtime-dependency-installation",
            *self.gate_options,
        ]
        # the ServerApp runs in the SuperLink's working directory (run folders use absolute paths anyway)
        self.superlink = subprocess.Popen(cmd, cwd=home, env=flower_env(home), stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True, umask=umask())
        log.close()
        self._wait_port(self.superlink, self.port, wait, self.folder / "logs" / "superlink.log")
        self._wait_port(self.superlink, self.fleet_port, wait, self.folder / "logs" / "superlink.log",
                        host=self.fleet_host)

    def register_nodes(self) -> dict[int, str]:
        """Register every node's public key (``flwr supernode register``); returns index -> node id."""
        for node in self.members:
            if node.index not in self.registered:
                ids = register_keys(self.cli_home, [node.public_key])
                self.registered[node.index] = ids[str(node.public_key)]
        return dict(self.registered)

    def _nice(self) -> list[str]:
        nice = shutil.which("nice") if self.supernode_nice else None  # coreutils; it execs, so the pid is the process's
        return [nice, "-n", str(self.supernode_nice)] if nice else []

    def spawn_supernode(self, key: Path, port: int, node_config: str, home: Path, log: Path,
                        ca_cert: Path | None = None, isolation: str = "subprocess") -> subprocess.Popen:
        """Start one ``flower-supernode`` on the Fleet address (TLS, authenticated with ``key``);
        ``isolation='process'``: without its ``flower-superexec`` (see :meth:`spawn_worker`), as
        ``postcard.supernode`` (the same SuperNode with shorter waits, docs/deploy.md section 9)."""
        private_dir(home)
        handle = _open_log(log)
        supernode = [sys.executable, "-m", "postcard.supernode"] if isolation == "process" else \
            [executable("flower-supernode")]
        cmd = [
            *self._nice(),
            *supernode,
            "--superlink", self.fleet_address,
            "--root-certificates", str(ca_cert or self.ca_cert),
            "--auth-supernode-private-key", str(key),
            "--node-config", node_config,
            "--host", LOOPBACK, "--port", str(port),
            *(["--isolation", isolation] if isolation != "subprocess" else []),
        ]
        proc = subprocess.Popen(cmd, cwd=home, env=flower_env(home), stdout=handle, stderr=subprocess.STDOUT,
                                start_new_session=True, umask=umask())
        handle.close()
        return proc

    def spawn_worker(self, node: Node) -> subprocess.Popen:
        """Start the warm node worker (``postcard.worker``) beside SuperNode ``node``: it polls the
        node's Runtime API (plain HTTP on 127.0.0.1) and stops when the SuperNode does."""
        node.events = self.folder / "logs" / f"worker-{node.index}.jsonl"
        handle = _open_log(self.folder / "logs" / f"worker-{node.index}.log")
        cmd = [*self._nice(), sys.executable, "-m", "postcard.worker",
               "--runtime-api-address", f"{LOOPBACK}:{node.port}", "--insecure",
               "--parent-pid", str(node.proc.pid), "--events", str(node.events)]
        proc = subprocess.Popen(cmd, cwd=node.home, env=flower_env(node.home), stdout=handle,
                                stderr=subprocess.STDOUT, start_new_session=True, umask=umask())
        handle.close()
        return proc

    def start_supernode(self, index: int, wait: float = 60.0) -> Node:
        """Start SuperNode ``index`` with its registered key and its partition (and its warm worker)."""
        node = self.members[index]
        if node.proc is not None and node.proc.poll() is None:
            raise DeployError(f"SuperNode {index} is already running")
        node.proc = self.spawn_supernode(node.key, node.port, node.node_config, node.home, node.log, node.ca_cert,
                                         isolation="process" if self.warm else "subprocess")
        self._wait_port(node.proc, node.port, wait, node.log)
        if self.warm:
            node.worker = self.spawn_worker(node)
        return node

    def worker_events(self, index: int) -> list[dict]:
        """The warm worker's JSON lines of SuperNode ``index`` (one per message it served)."""
        events = self.members[index].events
        if events is None or not events.is_file():
            return []
        return [json.loads(line) for line in events.read_text().splitlines() if line.strip()]

    def clientapp_pids(self, index: int) -> list[int]:
        """Process ids of the ClientApps SuperNode ``index`` is running right now."""
        node = self.members[index]
        if node.proc is None:
            return []
        try:
            children = psutil.Process(node.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        pids = []
        for child in children:
            try:
                if any("flwr-clientapp" in part for part in child.cmdline()):
                    pids.append(child.pid)
            except psutil.NoSuchProcess:
                continue
        return pids

    def start(self) -> LoopbackCluster:
        """SuperLink, key registration, then every SuperNode, waiting until all are online."""
        self.start_superlink()
        self.register_nodes()
        for node in self.members:
            self.start_supernode(node.index)
        self.wait_online(len(self.members))
        return self

    def wait_online(self, count: int, timeout: float = 120.0) -> list[str]:
        """Wait until ``count`` SuperNodes are online; returns their node ids."""
        deadline = time.time() + timeout
        online: list[str] = []
        while time.time() < deadline:
            online = self.online_nodes()
            if len(online) >= count:
                return online
            time.sleep(1.0)
        raise DeployError(f"{len(online)} of {count} SuperNodes online after {timeout:.0f} s; "
                          f"see the logs in {self.folder / 'logs'}")

    def online_nodes(self) -> list[str]:
        out = self.cli(["supernode", "list", CONNECTION, "--format", "json"])
        return [n["node-id"] for n in _json_tail(out).get("nodes", []) if n.get("status") == "online"]

    def kill_supernode(self, index: int) -> list[int]:
        node = self.members[index]
        pids = kill_tree(node.worker.pid) if node.worker is not None else []
        pids += kill_tree(node.proc.pid) if node.proc is not None else []
        node.proc = node.worker = None
        return pids

    def kill_superlink(self) -> list[int]:
        pids = kill_tree(self.superlink.pid) if self.superlink is not None else []
        self.superlink = None
        return pids

    def stop(self) -> list[int]:
        """Kill every process this cluster started (SuperNodes first), by pid."""
        pids = []
        for node in self.members:
            pids += self.kill_supernode(node.index)
        pids += self.kill_superlink()
        return pids

    # ------------------------------------------------------------------ the CLI
    def cli(self, args: list[str], timeout: float = 120.0) -> str:
        """Run ``flwr <args>`` against this cluster; returns stdout, raises DeployError on failure."""
        proc = subprocess.run([executable("flwr"), *args], env=flower_env(self.cli_home), cwd=self.folder,
                              capture_output=True, text=True, timeout=timeout, umask=umask())
        if proc.returncode != 0:
            raise DeployError(f"`flwr {' '.join(args)}` failed ({proc.returncode}): "
                              f"{(proc.stdout + proc.stderr).strip()[-2000:]}")
        return proc.stdout

    def run(self, run_config: str, *, app: str | Path = ROOT, timeout: float = 900.0,
            log_file: Path | None = None) -> subprocess.CompletedProcess:
        """``flwr run <app> postcard-local --stream --run-config <run_config>``, then waits for the run's end.

        ``flwr run --stream`` returns when its log stream ends, which can be before the run
        does (a stream the SuperLink drops under load): the run's status decides, polled
        with ``flwr list`` until it is ``finished:...`` (a line about it is added to stdout).
        """
        deadline = time.time() + timeout
        cmd = [executable("flwr"), "run", str(app), CONNECTION, "--stream", "--run-config", run_config]
        proc = subprocess.run(cmd, env=flower_env(self.cli_home), cwd=self.folder, capture_output=True,
                              text=True, timeout=timeout, umask=umask())
        started = re.search(r"Successfully started run (\d+)", proc.stdout + proc.stderr)
        if proc.returncode == 0 and started:
            status = self.wait_run(int(started.group(1)), max(1.0, deadline - time.time()))
            proc.stdout += f"[deploy] run {started.group(1)}: {status}\n"
        if log_file is not None:
            with _open_log(log_file, "w") as handle:
                handle.write(proc.stdout + proc.stderr)
        return proc

    def run_status(self, run_id: int) -> str:
        """The run's status as ``flwr list`` gives it (``running``, ``finished:completed``, ...)."""
        runs = _json_tail(self.cli(["list", CONNECTION, "--run-id", str(run_id), "--format", "json"]))["runs"]
        if not runs:
            raise DeployError(f"the SuperLink does not know run {run_id}")
        return str(runs[0]["status"])

    def wait_run(self, run_id: int, timeout: float, poll: float = 2.0) -> str:
        """Wait until run ``run_id`` is finished; returns its status (``finished:completed``, ...)."""
        deadline = time.time() + timeout
        while True:
            status = self.run_status(run_id)
            if status.startswith("finished"):
                return status
            if time.time() > deadline:
                raise DeployError(f"run {run_id} is still '{status}' after {timeout:.0f} s")
            time.sleep(poll)

    def submit(self, run_config: str, *, app: str | Path = ROOT, log_file: Path) -> subprocess.Popen:
        """Start ``flwr run ... --stream`` in the background (its output goes to ``log_file``)."""
        cmd = [executable("flwr"), "run", str(app), CONNECTION, "--stream", "--run-config", run_config]
        handle = _open_log(log_file, "w")
        proc = subprocess.Popen(cmd, env=flower_env(self.cli_home), cwd=self.folder, stdout=handle,
                                stderr=subprocess.STDOUT, start_new_session=True, umask=umask())
        handle.close()
        return proc

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _wait_port(proc: subprocess.Popen, port: int, timeout: float, log: Path, host: str = LOOPBACK) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if proc.poll() is not None:
                raise DeployError(f"process exited with code {proc.returncode} while starting; "
                                  f"last lines of {log}:\n{_tail(log)}")
            if port_open(host, port):
                return
            time.sleep(0.3)
        raise DeployError(f"port {port} did not open within {timeout:.0f} s; see {log}")


def _json_tail(text: str) -> dict:
    """The JSON object a ``flwr ... --format json`` call prints (after any log lines)."""
    start = text.find("{")
    if start < 0:
        raise DeployError(f"no JSON in the CLI output: {text[-500:]}")
    return json.loads(text[start:])


def _open_log(path: Path, mode: str = "a"):
    """A log file opened for writing, readable by this user alone (``fedapps.filemodes``)."""
    handle = open(path, mode)
    private_file(path)
    return handle


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# ---------------------------------------------------------------------------- make deploy-local
def run_local(nodes: int, run_config: str, outputs: Path, folder: Path | None = None, keep: bool = False,
              timeout: float = 7200.0, warm: bool = True) -> int:
    """Start a loopback cluster, ``flwr run`` the app through it, stop everything by pid.

    ``warm``: each SuperNode's messages run in a warm node worker (``postcard.worker``);
    False: stock Flower, a new ``flwr-clientapp`` process per message. Cluster files
    (certificates, keys, databases, logs) go to ``folder`` (default: a new temporary folder,
    removed after a successful run unless ``keep``); run folders go to ``outputs``.
    """
    base = Path(folder) if folder else Path(tempfile.mkdtemp(prefix="postcard-deploy-"))
    outputs = Path(outputs).resolve()
    config = f"{run_config} output-dir='{outputs}'".strip()
    print(f"[deploy] cluster folder: {base}", flush=True)
    t0 = time.time()
    with LoopbackCluster(base, nodes=nodes, persistent=False, warm=warm) as cluster:  # one run, no SuperLink restart
        cluster.start()
        print(f"[deploy] SuperLink: the Fleet API alone on {cluster.fleet_address}, every API on {cluster.address} "
              f"(TLS, SuperNode authentication) with {nodes} registered "
              f"SuperNodes online after {time.time() - t0:.0f} s; ClientApps: "
              + ("a warm node worker per SuperNode (postcard.worker; SuperNodes as postcard.supernode)" if warm else
                 "a new flwr-clientapp process per message (stock Flower)"), flush=True)
        print(f'[deploy] flwr run . {CONNECTION} --stream --run-config "{config}"', flush=True)
        proc = cluster.run(config, timeout=timeout, log_file=base / "logs" / "flwr-run.log")
        print((proc.stdout + proc.stderr)[-8000:], flush=True)
    print(f"[deploy] every process stopped; `flwr run` exited with {proc.returncode} after {time.time() - t0:.0f} s",
          flush=True)
    if proc.returncode == 0 and folder is None and not keep:
        shutil.rmtree(base, ignore_errors=True)
    else:
        print(f"[deploy] logs: {base / 'logs'}", flush=True)
    return proc.returncode


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m postcard.deploy", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    certs = sub.add_parser("certs", help="a CA and a SuperLink certificate (ca.crt, server.pem, server.key)")
    certs.add_argument("folder")
    certs.add_argument("--host", action="append", default=None,
                       help="a name or IP the SuperLink is reached at (repeat; default localhost and 127.0.0.1)")
    certs.add_argument("--days", type=int, default=365)
    keys = sub.add_parser("node-keys", help="SuperNode authentication key pairs (OpenSSH EC P-384)")
    keys.add_argument("folder")
    keys.add_argument("--nodes", type=int, required=True)
    keys.add_argument("--first", type=int, default=0, help="index of the first key (supernode-<first>)")
    secrets = sub.add_parser("secrets", help="CA, SuperLink certificate and SuperNode keys, one folder per holder "
                                             "(ca/, superlink/, public/, supernode-<i>/); existing ones are kept")
    secrets.add_argument("folder")
    secrets.add_argument("--nodes", type=int, required=True)
    secrets.add_argument("--host", action="append", default=None,
                         help="a name or IP the SuperLink is reached at (repeat; default localhost and 127.0.0.1)")
    secrets.add_argument("--days", type=int, default=365)
    register = sub.add_parser("register", help="register SuperNode public keys with a SuperLink (idempotent)")
    register.add_argument("public_keys", nargs="+")
    register.add_argument("--superlink", required=True, help="host:port of the SuperLink")
    register.add_argument("--root-certificates", required=True, help="the CA certificate (ca.crt)")
    register.add_argument("--retry-for", type=float, default=120.0, help="seconds to retry while it starts")
    cli = sub.add_parser("flwr", help="the flwr CLI with one connection `postcard` to --superlink (the operator's "
                                      "Control API address), e.g. in the SuperLink container's network namespace")
    cli.add_argument("--superlink", required=True, help="host:port of the Control API (127.0.0.1:9093)")
    cli.add_argument("--root-certificates", required=True, help="the CA certificate (ca.crt)")
    cli.add_argument("flwr_args", nargs=argparse.REMAINDER, help="-- then the flwr arguments (connection: postcard)")
    local = sub.add_parser("local", help="a loopback cluster with TLS and node auth, one `flwr run`, then stop")
    local.add_argument("--nodes", type=int, default=3)
    local.add_argument("--run-config", default=None,
                       help="the --run-config of `flwr run` (output-dir is added); default: "
                            + LOCAL_RUN_CONFIG.replace("{nodes}", "<nodes>").replace("%", "%%"))
    local.add_argument("--outputs", default="outputs", help="where run folders go (default ./outputs)")
    local.add_argument("--dir", default=None,
                       help="cluster folder: certificates, keys, databases, logs (default: temporary)")
    local.add_argument("--keep", action="store_true", help="keep the temporary cluster folder")
    local.add_argument("--cold", action="store_true",
                       help="stock Flower: flower-supernode and a new flwr-clientapp process per message (default: "
                            "a warm node worker per SuperNode, postcard.worker, beside postcard.supernode)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "certs":
        paths = make_certificates(args.folder, hosts=args.host or ("localhost", LOOPBACK), days=args.days)
        print("\n".join(str(p) for p in paths.values()))
    elif args.command == "node-keys":
        for private, public in make_node_keys(args.folder, args.nodes, first=args.first):
            print(f"{private}  {public}")
    elif args.command == "secrets":
        folders = layout_secrets(args.folder, args.nodes, hosts=args.host or ("localhost", LOOPBACK), days=args.days)
        for name, folder in folders.items():
            print(f"{name}: {' '.join(sorted(p.name for p in folder.iterdir()))}")
    elif args.command == "register":
        home = Path(tempfile.mkdtemp(prefix="postcard-register-"))
        try:
            write_connection(home, args.superlink, args.root_certificates)
            for key, node_id in register_keys(home, args.public_keys, retry_for=args.retry_for).items():
                print(f"{key}: {node_id}")
        finally:
            shutil.rmtree(home, ignore_errors=True)
    elif args.command == "flwr":
        home = Path(tempfile.mkdtemp(prefix="postcard-flwr-"))
        try:
            write_connection(home, args.superlink, args.root_certificates, name="postcard")
            flwr_args = args.flwr_args[1:] if args.flwr_args[:1] == ["--"] else args.flwr_args
            return subprocess.call([executable("flwr"), *flwr_args], env=flower_env(home))
        finally:
            shutil.rmtree(home, ignore_errors=True)
    else:
        run_config = args.run_config if args.run_config is not None else LOCAL_RUN_CONFIG.format(nodes=args.nodes)
        return run_local(args.nodes, run_config, Path(args.outputs), Path(args.dir) if args.dir else None, args.keep,
                         warm=not args.cold)
    return 0


if __name__ == "__main__":
    sys.exit(main())
