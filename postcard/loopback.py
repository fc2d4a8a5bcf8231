"""A loopback cluster: the SuperLink of docs/deploy.md §3.3 and N SuperNodes on this machine, by pid.

:class:`LoopbackCluster` runs the SuperLink as ``postcard.fleetgate`` (TLS, SuperNode
authentication, every API on 127.0.0.1, the Fleet API alone on 127.0.0.2) plus N SuperNodes
(``flower-supernode``, or for warm nodes ``postcard.supernode``: the same SuperNode with shorter
waits), each with its own ``FLWR_HOME``, its own key, log file and partition, driven through the
``flwr`` CLI exactly as a user would; every process is started here and stopped here by its
process id (process helpers: ``postcard.procs``). ``python -m postcard.deploy local`` runs one.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from fedapps.filemodes import private_dir, umask
from postcard.certs import CA_CERT, LOOPBACK, SERVER_CERT, SERVER_KEY, layout_secrets
from postcard.flwr_cli import (CONNECTION, ROOT, DeployError, executable, flower_env, json_tail, open_log,
                               register_keys, tail, write_connection)
from postcard.procs import free_port, kill_tree, port_open

# on loopback the SuperNodes reach the Fleet API on a loopback address of its own, as they would reach
# the server's public address: the Control API (127.0.0.1 only) does not listen there
FLEET_LOOPBACK = "127.0.0.2"


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
        log = open_log(self.folder / "logs" / "superlink.log")
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
        handle = open_log(log)
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
        handle = open_log(self.folder / "logs" / f"worker-{node.index}.log")
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
        return [n["node-id"] for n in json_tail(out).get("nodes", []) if n.get("status") == "online"]

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
            with open_log(log_file, "w") as handle:
                handle.write(proc.stdout + proc.stderr)
        return proc

    def run_status(self, run_id: int) -> str:
        """The run's status as ``flwr list`` gives it (``running``, ``finished:completed``, ...)."""
        runs = json_tail(self.cli(["list", CONNECTION, "--run-id", str(run_id), "--format", "json"]))["runs"]
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
        handle = open_log(log_file, "w")
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
                                  f"last lines of {log}:\n{tail(log)}")
            if port_open(host, port):
                return
            time.sleep(0.3)
        raise DeployError(f"port {port} did not open within {timeout:.0f} s; see {log}")
