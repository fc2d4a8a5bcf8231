"""postcard.deploy without a cluster: certificates that TLS accepts, keys Flower accepts, pids."""

import socket
import ssl
import subprocess
import sys
import threading
import time
import tomllib

import psutil
import pytest

from postcard import certs, deploy, flwr_cli, loopback, procs


def test_certificates_give_a_tls_handshake_for_every_host_and_only_those(tmp_path):
    paths = certs.make_certificates(tmp_path, hosts=("localhost", "127.0.0.1"))
    assert {p.name for p in tmp_path.iterdir()} == {"ca.crt", "ca.key", "server.pem", "server.key"}
    assert paths["server.key"].stat().st_mode & 0o077 == 0 and paths["ca.key"].stat().st_mode & 0o077 == 0

    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(paths["server.pem"], paths["server.key"])
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve(count):
        for _ in range(count):
            conn, _ = listener.accept()
            try:
                with server_ctx.wrap_socket(conn, server_side=True):
                    pass
            except (ssl.SSLError, OSError):
                pass

    thread = threading.Thread(target=serve, args=(3,), daemon=True)
    thread.start()
    client_ctx = ssl.create_default_context(cafile=str(paths["ca.crt"]))
    for name in ("localhost", "127.0.0.1"):
        with socket.create_connection(("127.0.0.1", port)) as raw, client_ctx.wrap_socket(raw, server_hostname=name) as tls:
            assert tls.version() is not None
    with pytest.raises(ssl.SSLCertVerificationError):  # a name that is not in the certificate
        with socket.create_connection(("127.0.0.1", port)) as raw, client_ctx.wrap_socket(raw, server_hostname="superlink"):
            pass
    thread.join(timeout=5)
    listener.close()


def test_node_keys_are_what_flower_loads(tmp_path):
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key
    from flwr.cli.supernode.register import try_load_public_key

    pairs = certs.make_node_keys(tmp_path, 2)
    assert [(p.name, q.name) for p, q in pairs] == [("supernode-0", "supernode-0.pub"), ("supernode-1", "supernode-1.pub")]
    for private, public in pairs:
        key = load_ssh_private_key(private.read_bytes(), password=None)  # as flower-supernode loads it
        assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
        assert try_load_public_key(public)  # as `flwr supernode register` loads it (exits if it refuses)
        assert private.stat().st_mode & 0o077 == 0


def test_the_cli_connection_file(tmp_path):
    path = flwr_cli.write_connection(tmp_path / "home", "127.0.0.1:8000", tmp_path / "ca.crt")

    config = tomllib.loads(path.read_text())
    assert config["superlink"]["default"] == flwr_cli.CONNECTION
    assert config["superlink"][flwr_cli.CONNECTION] == {"address": "127.0.0.1:8000",
                                                      "root-certificates": str(tmp_path / "ca.crt")}


def test_kill_tree_stops_a_process_and_its_children():
    parent = subprocess.Popen([sys.executable, "-c",
                               "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                               "'import time; time.sleep(60)']); time.sleep(60)"], start_new_session=True)
    try:
        deadline = time.time() + 20
        while not psutil.Process(parent.pid).children() and time.time() < deadline:
            time.sleep(0.1)
        child = psutil.Process(parent.pid).children()[0].pid
        killed = procs.kill_tree(parent.pid)
        assert set(killed) == {parent.pid, child}
        parent.wait(timeout=5)
        assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    finally:
        if parent.poll() is None:
            parent.kill()


def test_cli_commands_write_certificates_and_keys(tmp_path):
    assert deploy.main(["certs", str(tmp_path / "c"), "--host", "superlink", "--host", "10.0.0.5"]) == 0
    assert deploy.main(["node-keys", str(tmp_path / "k"), "--nodes", "3"]) == 0
    assert len(list((tmp_path / "k").iterdir())) == 6
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((tmp_path / "c" / "server.pem").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["superlink"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["10.0.0.5"]


def test_a_run_is_waited_for_until_flwr_list_says_it_finished(tmp_path, monkeypatch):
    """`flwr run --stream` can return while the run goes on (a dropped log stream): the
    cluster then polls the run's status and only a finished status ends the wait."""
    cluster = loopback.LoopbackCluster(tmp_path, nodes=1)
    statuses = iter(["starting", "running", "running", "finished:completed"])
    asked = []

    def fake_cli(args, timeout=120.0):
        asked.append(args)
        return 'INFO log line\n{"success": true, "runs": [{"run-id": "7", "status": "%s"}]}' % next(statuses)

    monkeypatch.setattr(cluster, "cli", fake_cli)
    assert cluster.wait_run(7, timeout=30, poll=0.01) == "finished:completed"
    assert len(asked) == 4 and asked[0] == ["list", flwr_cli.CONNECTION, "--run-id", "7", "--format", "json"]

    monkeypatch.setattr(cluster, "cli", lambda args, timeout=120.0: '{"success": true, "runs": [{"status": "running"}]}')
    with pytest.raises(flwr_cli.DeployError, match="still 'running'"):
        cluster.wait_run(7, timeout=0.05, poll=0.01)
    monkeypatch.setattr(cluster, "cli", lambda args, timeout=120.0: '{"success": true, "runs": []}')
    with pytest.raises(flwr_cli.DeployError, match="does not know run 7"):
        cluster.wait_run(7, timeout=1, poll=0.01)


def test_rewriting_an_existing_key_file_leaves_it_readable_by_the_owner_only(tmp_path):
    """O_CREAT's mode applies only to a file it creates: a key written over an existing 0644 file
    kept 0644 (world-readable) until the mode was set on the descriptor (fchmod)."""
    import os

    cert_dir, keys = tmp_path / "certs", tmp_path / "keys"
    cert_dir.mkdir()
    keys.mkdir()
    for path in (cert_dir / "ca.key", cert_dir / "server.key", keys / "supernode-0", cert_dir / "ca.crt"):
        path.write_text("old")
        os.chmod(path, 0o644)
    paths = certs.make_certificates(cert_dir)
    (private, public), = certs.make_node_keys(keys, 1)
    for path in (paths["ca.key"], paths["server.key"], private):
        assert path.stat().st_mode & 0o777 == 0o600, (path, oct(path.stat().st_mode))
    assert paths["ca.crt"].stat().st_mode & 0o777 == 0o644 and public.stat().st_mode & 0o777 == 0o644
    assert b"PRIVATE KEY" in private.read_bytes()


def test_secrets_are_laid_out_one_folder_per_holder(tmp_path):
    folders = certs.layout_secrets(tmp_path, 2, hosts=("superlink", "127.0.0.1"))
    files = {name: sorted(p.name for p in folder.iterdir()) for name, folder in folders.items()}
    assert files == {"ca": ["ca.crt", "ca.key"], "superlink": ["ca.crt", "server.key", "server.pem"],
                     "public": ["ca.crt", "supernode-0.pub", "supernode-1.pub"],
                     "supernode-0": ["ca.crt", "supernode-0"], "supernode-1": ["ca.crt", "supernode-1"]}
    for folder, name in (("ca", "ca.key"), ("superlink", "server.key"), ("supernode-0", "supernode-0")):
        assert (tmp_path / folder / name).stat().st_mode & 0o777 == 0o600
    # the key pairs match, and a second run keeps every certificate and key (registered keys stay valid)
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key

    key = load_ssh_private_key((tmp_path / "supernode-1" / "supernode-1").read_bytes(), password=None)
    assert key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) \
        == (tmp_path / "public" / "supernode-1.pub").read_bytes().strip()
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    certs.layout_secrets(tmp_path, 2, hosts=("superlink", "127.0.0.1"))
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
