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

About 30 s on a loaded 2-core machine (the SuperLink, one SuperNode, a dozen ``flwr`` calls and
one run submitted and stopped).
"""

from __future__ import annotations

import socket
import ssl
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from postcard import fleetgate
from postcard.deploy import (CONNECTION, LOOPBACK, ROOT, LoopbackCluster, _json_tail, executable, flower_env,
                             make_node_keys, write_connection)

OUTSIDER = "outsider"
# a run the operator submits (and stops at once): the tiny Llama, nothing to wait for
RUN_CONFIG = "preset='test' overrides='num_clients=1 rounds=1 train.local_steps=1 eval.max_batches=1'"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = LoopbackCluster(tmp_path_factory.mktemp("gated"), nodes=1)
    try:
        cluster.start()  # SuperLink, the operator registers the node's key, the SuperNode joins via the Fleet address
        yield cluster
    finally:
        cluster.stop()


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
    return _json_tail(proc.stdout).get("success") is False


def registered_keys(cluster) -> int:
    return len(_json_tail(cluster.cli(["supernode", "list", CONNECTION, "--format", "json"])).get("nodes", []))


def runs(cluster) -> list[dict]:
    return _json_tail(cluster.cli(["list", CONNECTION, "--format", "json"])).get("runs", [])


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
    nodes = _json_tail(cluster.cli(["supernode", "list", CONNECTION, "--format", "json"]))["nodes"]
    assert [(n["node-id"], n["status"]) for n in nodes] == [(cluster.registered[0], "online")]
    (_, public), = make_node_keys(tmp_path, 1, prefix="spare")
    out = cluster.cli(["supernode", "register", str(public), CONNECTION, "--format", "json"])
    spare = str(_json_tail(out)["node-id"])
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
