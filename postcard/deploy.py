"""Deployment helpers: certificates and keys, registration, and a loopback cluster run by pid.

The same app that ``flwr run .`` simulates runs unchanged on a real SuperLink with real
SuperNodes. This module holds what that needs besides Flower itself:

* certificates and keys (``postcard.certs``): ``make_certificates``, ``make_node_keys``,
  ``layout_secrets`` (one folder per holder);
* ``flwr supernode register``, idempotent, and the ``flwr`` CLI's environment (``postcard.flwr_cli``);
* a loopback cluster (``postcard.loopback.LoopbackCluster``): the SuperLink of docs/deploy.md §3.3
  and N SuperNodes, every process started and stopped by its pid; :func:`run_local` runs the app
  through one.

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
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from postcard.certs import LOOPBACK, layout_secrets, make_certificates, make_node_keys
from postcard.flwr_cli import CONNECTION, executable, flower_env, register_keys, write_connection
from postcard.loopback import LoopbackCluster

# what `python -m postcard.deploy local` runs by default: the tiny Llama, one client per node, 2 short rounds
LOCAL_RUN_CONFIG = "preset='test' overrides='num_clients={nodes} rounds=2 train.local_steps=4'"


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
