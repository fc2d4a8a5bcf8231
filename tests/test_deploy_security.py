"""Who can do what to the SuperLink of docs/deploy.md §3.3 (``postcard.fleetgate``), on loopback.

A real SuperLink is started here as ``LoopbackCluster`` starts it: TLS, SuperNode
authentication, every API (Control, Runtime, Fleet) on ``127.0.0.1:<port>`` and the Fleet API
alone on ``127.0.0.2:<fleet_port>`` — the address the SuperNodes use, standing for the
server's public address. One registered SuperNode joins through that address.

An outsider holds what every participant holds, the public ``ca.crt``, and reaches only the
Fleet address: with plain ``flower-superlink`` (one port for all three APIs) it registered a
node key, listed nodes and runs, and could submit runs (issue #39). Here each of those is
refused, the Control port does not even accept a connection on the Fleet address, and the
operator (on 127.0.0.1, as over SSH on a server) still does all of it.

Slow connections (#62 finding 6): 200 connections to the Fleet address that send half a request
header and hang neither starve the operator's listener nor hold the Fleet listener past its header
deadline or connection cap (``FleetGuard``; this cluster runs with a 4 s deadline and a cap of 100 so
that both are reached in seconds). What the SuperLink writes is its user's alone (#62 finding 8).

About 45 s on a loaded 2-core machine (the SuperLink, one SuperNode, a dozen ``flwr`` calls, one run
submitted and stopped, and the slow-connection flood).
"""

from __future__ import annotations

import socket
import ssl
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from postcard import fleetgate
from postcard.certs import LOOPBACK, make_node_keys
from postcard.flwr_cli import CONNECTION, ROOT, executable, flower_env, json_tail, write_connection
from postcard.loopback import LoopbackCluster

OUTSIDER = "outsider"
# a run the operator submits (and stops at once): the tiny Llama, nothing to wait for
RUN_CONFIG = "preset='test' overrides='num_clients=1 rounds=1 train.local_steps=1 eval.max_batches=1'"
# the Fleet listener's limits in this cluster (postcard.fleetgate's defaults: 10 s and 512)
HEADER_TIMEOUT, MAX_CONNECTIONS = 4.0, 100


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.delenv("POSTCARD_UMASK", raising=False)  # the default: private
    cluster = LoopbackCluster(tmp_path_factory.mktemp("gated"), nodes=1, gate_options=(
        "--fleet-header-timeout", str(HEADER_TIMEOUT), "--fleet-max-connections", str(MAX_CONNECTIONS)))
    try:
        cluster.start()  # SuperLink, the operator registers the node's key, the SuperNode joins via the Fleet address
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def outsider(cluster):
    """An FLWR_HOME whose only connection is the Fleet address, with the public ca.crt."""
    home = cluster.folder / "outsider"
    write_connection(home, cluster.fleet_address, cluster.ca_cert, name=OUTSIDER)
    return home


def flwr(home: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([executable("flwr"), *args], env=flower_env(home), cwd=home, capture_output=True,
                          text=True, timeout=timeout)


def refused(proc: subprocess.CompletedProcess) -> bool:
    """The CLI call failed on the gate's 404 (``--format json`` calls exit 0 with ``"success": false``)."""
    text = proc.stdout + proc.stderr
    if "404 Not Found" not in text:
        return False
    if proc.returncode != 0:
        return True
    return json_tail(proc.stdout).get("success") is False


def registered_keys(cluster) -> int:
    return len(json_tail(cluster.cli(["supernode", "list", CONNECTION, "--format", "json"])).get("nodes", []))


def runs(cluster) -> list[dict]:
    return json_tail(cluster.cli(["list", CONNECTION, "--format", "json"])).get("runs", [])


# ---------------------------------------------------------------------------- listeners
def test_the_control_port_does_not_listen_on_the_fleet_address(cluster):
    fleet_host = cluster.fleet_host
    assert fleet_host != LOOPBACK and cluster.fleet_port != cluster.port
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((fleet_host, cluster.port), timeout=5).close()
    socket.create_connection((LOOPBACK, cluster.port), timeout=5).close()  # the operator's listener
    socket.create_connection((fleet_host, cluster.fleet_port), timeout=5).close()  # the SuperNodes' listener


@pytest.mark.parametrize("path", ["/v1/control/register-node", "/v1/control/list-nodes", "/v1/control/list-runs",
                                  "/v1/control/start-run", "/v1/runtime/acquire-task", "/v1/runtime/pull-task-input",
                                  "/openapi.json", "/docs", "/health", "/v1/fleet/../control/list-runs"])
def test_the_fleet_address_answers_404_to_everything_but_the_fleet_api(cluster, path):
    context = ssl.create_default_context(cafile=str(cluster.ca_cert))
    with httpx.Client(verify=context, timeout=30) as client:
        for method in ("POST", "GET"):
            response = client.request(method, f"https://{cluster.fleet_address}{path}", content=b"")
            assert response.status_code == 404 and b"only the Fleet API" in response.content, (method, path)
    # the same request on the operator's listener reaches Flower (anything but the gate's 404)
    with httpx.Client(verify=context, timeout=30) as client:
        response = client.get(f"https://{cluster.address}/openapi.json")
        assert response.status_code == 200 and "/v1/control/start-run" in response.text


def test_an_outsiders_huge_post_is_refused_before_the_superlink_reads_it(cluster):
    """#62 finding 5: three unauthenticated 256 MB POSTs raised the SuperLink from 137 MB to 1.68 GB; the gate
    answers 413 from the declared length alone (the body is never sent here)."""
    import socket as sockets

    context = ssl.create_default_context(cafile=str(cluster.ca_cert))
    host, port = cluster.fleet_address.rsplit(":", 1)
    with sockets.create_connection((host, int(port)), timeout=30) as raw, \
            context.wrap_socket(raw, server_hostname=host) as tls:
        tls.sendall(f"POST /v1/fleet/push-object HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/protobuf\r\n"
                    f"Content-Length: {256 * 2**20}\r\n\r\n".encode())
        answer = tls.recv(4096)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


# ---------------------------------------------------------------------------- an outsider (ca.crt only)
def test_an_outsider_cannot_register_a_node_key(cluster, outsider):
    (_, public), = make_node_keys(outsider / "keys", 1, prefix="attacker")
    before = registered_keys(cluster)
    proc = flwr(outsider, "supernode", "register", str(public), OUTSIDER, "--format", "json")
    assert refused(proc) and "node-id" not in proc.stdout, proc.stdout + proc.stderr
    assert registered_keys(cluster) == before == len(cluster.members)


def test_an_outsider_cannot_list_nodes(cluster, outsider):
    proc = flwr(outsider, "supernode", "list", OUTSIDER, "--format", "json")
    assert refused(proc) and str(cluster.registered[0]) not in proc.stdout, proc.stdout + proc.stderr


def test_an_outsider_cannot_list_runs(cluster, outsider):
    proc = flwr(outsider, "list", OUTSIDER, "--format", "json")
    assert refused(proc) and '"runs"' not in proc.stdout, proc.stdout + proc.stderr


def test_an_outsider_cannot_submit_a_run(cluster, outsider):
    before = len(runs(cluster))
    proc = flwr(outsider, "run", str(ROOT), OUTSIDER, "--run-config", RUN_CONFIG, timeout=300)
    text = proc.stdout + proc.stderr
    assert refused(proc) and "Successfully started run" not in text, text
    assert len(runs(cluster)) == before


# ---------------------------------------------------------------------------- the operator (127.0.0.1)
def test_the_operator_registers_lists_and_submits(cluster, tmp_path):
    # registered by the operator in cluster.start(); online through the Fleet address
    nodes = json_tail(cluster.cli(["supernode", "list", CONNECTION, "--format", "json"]))["nodes"]
    assert [(n["node-id"], n["status"]) for n in nodes] == [(cluster.registered[0], "online")]
    (_, public), = make_node_keys(tmp_path, 1, prefix="spare")
    out = cluster.cli(["supernode", "register", str(public), CONNECTION, "--format", "json"])
    spare = str(json_tail(out)["node-id"])
    assert registered_keys(cluster) == 2
    cluster.cli(["supernode", "unregister", spare, CONNECTION])
    before = len(runs(cluster))
    out = cluster.cli(["run", str(ROOT), CONNECTION, "--run-config", f"{RUN_CONFIG} output-dir='{tmp_path}'"],
                      timeout=300)
    run_id = out.split("Successfully started run")[1].split()[0]
    try:
        assert len(runs(cluster)) == before + 1
    finally:
        cluster.cli(["stop", run_id, CONNECTION])
    deadline = time.time() + 60
    while not cluster.run_status(int(run_id)).startswith("finished") and time.time() < deadline:
        time.sleep(1)


# ---------------------------------------------------------------------------- slow connections, private files
def closed_by_server(sock: socket.socket, within: float) -> bool:
    """The server closes ``sock`` within ``within`` seconds (end of stream, or a reset), as seen by its peer."""
    sock.settimeout(within)
    try:
        return sock.recv(4096) == b""
    except (ConnectionError, ssl.SSLError):
        return True
    except TimeoutError:
        return False


def test_half_sent_headers_on_the_fleet_address_neither_starve_the_operator_nor_stay(cluster):
    """#62 finding 6: a connection that sent half its headers stayed open (>= 40 s) and ~1,000 of them took the
    SuperLink's 1,024 file descriptors. Here 200 (twice this cluster's cap) on the Fleet address: the operator's
    listener answers, a well-formed Fleet request is answered, the SuperLink never holds more than the cap of
    them, each is closed within twice the header deadline, and the SuperNode stays online."""
    context = ssl.create_default_context(cafile=str(cluster.ca_cert))
    host, port = cluster.fleet_host, cluster.fleet_port
    link = psutil.Process(cluster.superlink.pid)
    fds_before = link.num_fds()
    stalled: list[socket.socket] = []
    try:
        for _ in range(2 * MAX_CONNECTIONS):
            tls = context.wrap_socket(socket.create_connection((host, port), timeout=30), server_hostname=host)
            tls.sendall(f"POST /v1/fleet/pull-messages HTTP/1.1\r\nHost: {host}\r\nContent-Ty".encode())
            stalled.append(tls)
        last_sent = time.monotonic()
        held = link.num_fds() - fds_before
        with httpx.Client(verify=context, timeout=30) as client:
            response = client.get(f"https://{cluster.address}/openapi.json")  # the operator's listener
            assert response.status_code == 200 and "/v1/control/start-run" in response.text
            response = client.post(f"https://{cluster.fleet_address}/health", content=b"")  # the gate's answer
            assert response.status_code == 404 and b"only the Fleet API" in response.content
        assert held <= MAX_CONNECTIONS + 20, (held, fds_before)  # the cap (and a few of the SuperLink's own)
        # the last one (the others were closed before it: evicted at the cap, or their deadline passed)
        assert closed_by_server(stalled[-1], max(0.1, last_sent + 2 * HEADER_TIMEOUT - time.monotonic()))
        assert all(closed_by_server(sock, 0.5) for sock in stalled)
    finally:
        for sock in stalled:
            sock.close()
    assert cluster.wait_online(1, timeout=60) == [cluster.registered[0]]


def test_what_the_superlink_writes_is_its_users_alone(cluster):
    """#62 finding 8: the SuperLink's state.db and the cluster's logs were world-readable (0644). Its processes
    start with umask 077 (POSTCARD_UMASK), the cluster folder is 0700."""
    def mode(path: Path) -> int:
        return stat.S_IMODE(path.stat().st_mode)

    state = cluster.folder / "superlink" / "state.db"
    assert state.is_file() and mode(state) == 0o600
    assert mode(cluster.folder) == 0o700
    written = [p for folder in ("superlink", "logs") for p in [cluster.folder / folder,
                                                              *(cluster.folder / folder).rglob("*")]]
    wrong = {str(p.relative_to(cluster.folder)): oct(mode(p)) for p in written
             if not p.is_symlink() and mode(p) != (0o700 if p.is_dir() else 0o600)}
    assert not wrong and len(written) > 3, wrong


# ---------------------------------------------------------------------------- the gate itself (no SuperLink)
def test_the_gate_lets_only_fleet_routes_through_on_any_other_port():
    import asyncio

    calls = []

    async def app(scope, receive, send):
        calls.append(scope.get("path", scope["type"]))

    gate = fleetgate.FleetOnly(app, private_port=9093)
    assert "/v1/fleet/pull-messages" in gate.allowed and all(p.startswith("/v1/fleet/") for p in gate.allowed)

    def call(scope) -> int | None:
        sent = []

        async def send(message):
            sent.append(message)

        asyncio.run(gate({"method": "POST", "headers": [(b"content-length", b"10")], **scope}, None, send))
        return sent[0].get("status") if sent else None

    assert call({"type": "http", "path": "/v1/control/list-runs", "server": ("127.0.0.1", 9093)}) is None  # passed
    assert call({"type": "http", "path": "/v1/control/list-runs", "server": ("10.0.0.5", 9092)}) == 404
    assert call({"type": "http", "path": "/v1/runtime/acquire-task", "server": ("10.0.0.5", 9092)}) == 404
    assert call({"type": "http", "path": "/v1/control/list-runs", "server": None}) == 404  # fail closed
    assert call({"type": "http", "path": "/v1/fleet/pull-messages", "server": ("10.0.0.5", 9092)}) is None
    assert call({"type": "http", "path": "/v1/fleet/pull-messages", "method": "GET",
                 "server": ("10.0.0.5", 9092)}) == 404
    assert call({"type": "lifespan"}) is None
    assert calls == ["/v1/control/list-runs", "/v1/fleet/pull-messages", "lifespan"]
    # #62 finding 5: a public request's body is capped before Flower reads it (its protobuf layer reads the
    # whole body before node authentication); no declared length: 411; the loopback listener is not capped
    fleet = {"type": "http", "path": "/v1/fleet/pull-messages", "server": ("10.0.0.5", 9092)}
    too_big = [(b"content-length", str(fleetgate.MAX_REQUEST_MB * 2**20 + 1).encode())]
    assert call({**fleet, "headers": too_big}) == 413
    assert call({**fleet, "headers": []}) == 411
    assert call({**fleet, "headers": [(b"content-length", b"12, 12")]}) == 411
    assert call({**fleet, "headers": [(b"Content-Length", str(fleetgate.MAX_REQUEST_MB * 2**20).encode())]}) is None
    assert call({"type": "http", "path": "/v1/control/list-runs", "server": ("127.0.0.1", 9093),
                 "headers": too_big}) is None


@pytest.fixture
def guarded_server(request):
    """``postcard.fleetgate.make_server`` of a small ASGI app in a thread (plain HTTP on 127.0.0.1): a
    loopback listener and a public one kept by a FleetGuard (by default a 1 s header and body deadline, a cap
    of 8; indirect parameters change them)."""
    guard = fleetgate.FleetGuard(**{"max_connections": 8, "header_timeout": 1.0, "body_timeout": 1.0,
                                    **getattr(request, "param", {})})

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    private, public = fleetgate._listen(LOOPBACK, 0), guard.listen(LOOPBACK, 0)
    server = fleetgate.make_server(app, guard, lifespan="off", log_level="error")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [private, public]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    assert server.started
    try:
        yield guard, private.getsockname()[1], guard.port
    finally:
        server.should_exit = True
        thread.join(10)


def test_the_fleet_guard_closes_slow_connections_and_keeps_its_cap(guarded_server):
    guard, private_port, public_port = guarded_server
    request = b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n"
    opened: list[socket.socket] = []

    def connect(port: int, data: bytes = b"") -> socket.socket:
        sock = socket.create_connection((LOOPBACK, port), timeout=10)
        opened.append(sock)
        if data:
            sock.sendall(data)
        return sock

    def answered(sock: socket.socket) -> bytes:
        sock.settimeout(10)
        data = b""
        while not data.endswith(b"ok"):
            chunk = sock.recv(4096)
            assert chunk, data
            data += chunk
        return data

    try:
        silent = connect(public_port)  # not a byte sent
        half = connect(public_port, b"GET /x HTTP/1.1\r\nHo")
        body = connect(public_port, b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
        kept = connect(public_port, request)
        assert answered(kept).startswith(b"HTTP/1.1 200")
        kept.sendall(b"GET /x HT")  # the next request, half sent: the deadline runs from the previous response
        loopback = connect(private_port, b"GET /x HTTP/1.1\r\nHo")  # the loopback listener has no deadline
        huge = connect(public_port)
        try:
            huge.sendall(b"GET /x HTTP/1.1\r\nX: " + b"a" * (fleetgate.MAX_HEADER_BYTES + 1024))
        except ConnectionError:  # closed while the rest was still being sent
            pass
        assert closed_by_server(huge, 0.9)  # over 64 KiB of headers: closed at once
        assert guard.closed.get(f"request headers over {fleetgate.MAX_HEADER_BYTES} bytes") == 1
        for sock in (silent, half, body, kept):
            assert closed_by_server(sock, 2.5)
        assert not closed_by_server(loopback, 0.5)
        # a flood of 40 half-sent requests: never more than 8 held; a whole request still gets through,
        # taking the place of the oldest one waiting; the loopback listener answers
        flood = [connect(public_port, b"GET /x HT") for _ in range(40)]
        assert closed_by_server(flood[0], 2.5)
        assert len(guard.open) <= 8
        assert answered(connect(public_port, request)).startswith(b"HTTP/1.1 200")
        assert answered(connect(private_port, request)).startswith(b"HTTP/1.1 200")
        assert all(closed_by_server(sock, 2.5) for sock in flood)
        assert guard.closed.get("evicted at the cap (waiting for request headers)", 0) >= 1
        assert guard.closed.get("a request body silent for 1 s") == 1
    finally:
        for sock in opened:
            sock.close()


@pytest.mark.parametrize("guarded_server", [{"max_connections": 4, "body_timeout": 30.0}], indirect=True)
def test_at_the_cap_the_slowest_request_body_gives_way(guarded_server):
    """Request bodies that trickle in (3 bytes of 100, then silence below the body deadline) hold every place:
    a whole request takes the place of the slowest one; the loopback listener is not counted."""
    guard, private_port, public_port = guarded_server
    trickling = []
    try:
        for _ in range(4):
            sock = socket.create_connection((LOOPBACK, public_port), timeout=10)
            trickling.append(sock)
            sock.sendall(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
        time.sleep(1.2)  # a body is judged by its rate once it has lasted a second
        assert len(guard.open) == 4 and not guard.waiting
        with socket.create_connection((LOOPBACK, public_port), timeout=10) as sock:
            sock.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        assert guard.closed == {"evicted at the cap (a slow request body)": 1}
        assert sum(closed_by_server(sock, 0.5) for sock in trickling) == 1
    finally:
        for sock in trickling:
            sock.close()


def test_the_fleet_listener_options_and_the_file_descriptor_limit():
    import resource

    argv = ["--fleet-host", "0.0.0.0", "--fleet-port", "9092", "--ssl-ca-certfile", "ca.crt", "--ssl-certfile",
            "server.pem", "--ssl-keyfile", "server.key", "--enable-supernode-auth", "--host", "127.0.0.1",
            "--port", "9093"]
    ours, _, _ = fleetgate.split_args(argv)
    assert (ours.fleet_max_connections, ours.fleet_header_timeout, ours.fleet_body_timeout) == (512, 10.0, 30.0)
    ours, _, _ = fleetgate.split_args([*argv, "--fleet-max-connections", "64", "--fleet-header-timeout", "2.5"])
    assert (ours.fleet_max_connections, ours.fleet_header_timeout) == (64, 2.5)
    with pytest.raises(SystemExit, match="at least 1"):
        fleetgate.split_args([*argv, "--fleet-max-connections", "0"])
    # a hard limit of 1,024 (a common default): the cap keeps 256 descriptors for the rest of the SuperLink
    code = ("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024)); "
            "from postcard.fleetgate import fit_fd_limit; print(fit_fd_limit(512), fit_fd_limit(1000))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.split()[-2:] == ["512", "768"], proc.stdout + proc.stderr
    assert "lowered to 768" in proc.stdout
    # a soft limit below the cap + 256 is raised (within the hard one)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.skip(f"hard RLIMIT_NOFILE {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (600, hard))
    try:
        assert fleetgate.fit_fd_limit(512) == 512 and resource.getrlimit(resource.RLIMIT_NOFILE)[0] == 768
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("change, message", [
    (["--host", "0.0.0.0"], "loopback"),
    (["--port", "9092"], "must differ"),
    (["--insecure"], "TLS"),
    (["DROP", "--enable-supernode-auth"], "--enable-supernode-auth"),
])
def test_the_gate_refuses_a_public_control_listener_or_no_tls_or_no_node_auth(change, message):
    argv = ["--fleet-host", "0.0.0.0", "--fleet-port", "9092", "--ssl-ca-certfile", "ca.crt", "--ssl-certfile",
            "server.pem", "--ssl-keyfile", "server.key", "--enable-supernode-auth", "--host", "127.0.0.1",
            "--port", "9093"]
    ours, flower, rest = fleetgate.split_args(argv)
    assert (ours.fleet_host, ours.fleet_port, flower.host, flower.port) == ("0.0.0.0", 9092, "127.0.0.1", 9093)
    if change[0] == "DROP":
        argv.remove(change[1])
    else:
        argv += change
    with pytest.raises(SystemExit, match=message):
        fleetgate.split_args(argv)
