"""``flower-superlink`` with its Fleet API alone on the public address.

Flower 1.42's ``flower-superlink`` serves the Fleet API (SuperNodes), the Control API (the
``flwr`` CLI: register node keys, list nodes and runs, submit and stop runs) and the
Runtime API (SuperExec and the ServerApp) from one HTTPS listener, ``--host:--port``
(``flwr/superlink/cli/flower_superlink.py``: one ``uvicorn.run``; ``--control-api-address``
and ``--fleet-api-address`` are deprecated and only move the legacy gRPC servers, which the
1.42 SuperNode no longer speaks). The Control API has no authentication of its own outside
Flower's enterprise edition (``FLWR_OIDC_ENABLED`` exits with "OIDC account authentication
is unavailable in this Flower distribution"; the default is ``NoOpControlAuthnPlugin``), and
TLS does not ask clients for a certificate. So whoever reaches that port with the public
``ca.crt`` can register a node key, list, and submit runs: SuperNode authentication guards
the Fleet API only.

This module runs the very same SuperLink — Flower's own argument parsing, FastAPI app,
lifespan (SuperExec, database) and TLS — on two listeners of one server:

* ``--host`` / ``--port`` (must be a loopback address, e.g. ``127.0.0.1:9093``): every API.
  The operator's ``flwr`` CLI reaches it on the server itself or through an SSH tunnel;
  SuperExec and the ServerApp reach the Runtime API there.
* ``--fleet-host`` / ``--fleet-port`` (e.g. ``0.0.0.0:9092``): the Fleet API's routes only
  (``/v1/fleet/...``, exactly the paths of Flower's Fleet router); any other path, method
  path or protocol on that listener gets ``404`` before it reaches Flower.

A request is let through to every API only when it arrived on the loopback listener's port
(fail closed: an unknown local address counts as public). On the public listener a request must
declare its body's length (``Content-Length``: Flower's SuperNode always does) and that length must
be at most ``--max-request-mb`` (default 32 MiB; a SuperNode's largest request is one object,
an array chunk of at most 5 MiB by default): else ``411``/``413`` before a byte of the body is read,
because Flower's protobuf layer reads the whole body before SuperNode authentication (three
unauthenticated 256 MB POSTs once raised the SuperLink from 137 MB to 1.68 GB resident).

Slow and idle connections on the public listener (:class:`postcard.fleetguard.FleetGuard`; issue #62, finding 6). uvicorn
0.49 has no header-read timeout: its keep-alive timer starts only after a first response and stops at
the next byte, so a connection that sent half its request headers stayed open for good (one stalled in its
TLS handshake, asyncio's 60 s), and about 1,000 of them took the 1,024 file descriptors of a default limit:
the operator's ``flwr`` and the registered SuperNodes got nothing until they were let go. Its own knobs do
not fit: ``limit_concurrency`` answers ``503`` after the headers (and counts the loopback listener's
connections too), ``h11_max_incomplete_event_size`` applies to h11 only (here httptools parses). So on
the public listener, and only there:

* ``--fleet-header-timeout`` (default 10 s): a connection's request headers must be complete within this
  long after it was accepted (its TLS handshake included) or after its previous response; else it is
  closed. A SuperNode sends its headers in one write right after the handshake: on a 500 ms
  round trip that is 1.5 s. Headers larger than 64 KiB are refused too (connection closed).
* ``--fleet-body-timeout`` (default 30 s): the longest silence inside a request body (a SuperNode's
  largest body, a 5 MiB chunk, arrives without pauses).
* ``--fleet-max-connections`` (default 512): open connections, counted from the moment one is accepted
  (before its TLS handshake). At the cap a new connection takes the place of the oldest one that is
  waiting for request headers (a stalled or idle one), else of the slowest request body if it came in
  slower than 32 KiB/s on average (one whose request is being answered is never closed), else it is
  closed at once; so a flood of slow connections does not lock out a SuperNode that sends its request
  at once. The soft file-descriptor limit (``RLIMIT_NOFILE``) is raised, within the
  hard one, to the cap plus 256 descriptors for everything else (the loopback listener, the database,
  SuperExec, logs), else the cap is lowered to fit: a flood of the Fleet port never takes the
  descriptors of the operator's listener.

The loopback listener is subject to none of these (uvicorn's own keep-alive timeout, 5 s, applies to
both). The server runs on asyncio's own event loop (not uvloop): the cap counts connections at
``accept()`` of the public listening socket (:class:`FleetGuard`).

    python -m postcard.fleetgate --fleet-host 0.0.0.0 --fleet-port 9092 \\
        --host 127.0.0.1 --port 9093 <every other flower-superlink argument> \\
        [--fleet-max-connections 512 --fleet-header-timeout 10 --fleet-body-timeout 30]

The process runs with the umask of ``POSTCARD_UMASK`` (default ``077``, ``fedapps.filemodes``): its
database (``--database``), Flower's files and the ServerApps' run folders are private to its user.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys

from postcard.fleetguard import (BODY_TIMEOUT, HEADER_TIMEOUT, MAX_CONNECTIONS, MAX_HEADER_BYTES,  # noqa: F401
                                 FleetGuard, fit_fd_limit, guarded_protocol)

FLEET_PREFIX = "/v1/fleet/"
MAX_REQUEST_MB = 32  # the largest body the public listener accepts, MiB


def fleet_paths() -> frozenset[str]:
    """The paths of Flower's Fleet HTTP router (what a SuperNode calls)."""
    from flwr.superlink.routers.fleet.router import router

    paths = frozenset(route.path for route in router.routes)
    assert paths and all(p.startswith(FLEET_PREFIX) for p in paths), paths
    return paths


class FleetOnly:
    """ASGI middleware: on any listener but the loopback one, only the Fleet routes pass."""

    def __init__(self, app, private_port: int, allowed: frozenset[str] | None = None,
                 max_body: int = MAX_REQUEST_MB * 2**20) -> None:
        self.app = app
        self.private_port = int(private_port)
        self.allowed = fleet_paths() if allowed is None else allowed
        self.max_body = int(max_body)

    @staticmethod
    async def _refuse(send, status: int, text: str) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": text.encode()})

    def _length_problem(self, scope) -> tuple[int, str] | None:
        """(status, text) when a public request's declared body length is missing, bad or too large."""
        lengths = [v for k, v in scope.get("headers") or [] if k.lower() == b"content-length"]
        if len(lengths) != 1 or not lengths[0].strip().isdigit():
            return 411, "Length Required: the Fleet API takes bodies of a declared length\n"
        if int(lengths[0]) > self.max_body:
            return 413, f"Payload Too Large: at most {self.max_body} bytes\n"
        return None

    def private(self, scope) -> bool:
        server = scope.get("server")
        return bool(server) and server[1] == self.private_port

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan" or self.private(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "http" and scope.get("path") in self.allowed and scope.get("method") == "POST":
            problem = self._length_problem(scope)
            if problem:
                await self._refuse(send, *problem)
            else:
                await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await self._refuse(send, 404, "Not Found: only the Fleet API is served here\n")
        else:  # websockets and anything else
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# ---------------------------------------------------------------------------- slow and idle connections
def make_server(app, guard: FleetGuard, **config):
    """A uvicorn server of ``app`` whose public listener (``guard.listen``) ``guard`` keeps: asyncio's
    selector loop (it calls the listening socket's ``accept()``), httptools with the guard's deadlines."""
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app=app, loop="asyncio", http=guarded_protocol(guard), **config))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m postcard.fleetgate", add_help=False,
        description="flower-superlink with the Fleet API alone on --fleet-host:--fleet-port; every other "
                    "argument is flower-superlink's (--host/--port: the loopback listener of every API)")
    parser.add_argument("--fleet-host", required=True, help="address of the Fleet API listener, e.g. 0.0.0.0")
    parser.add_argument("--fleet-port", type=int, required=True, help="port of the Fleet API listener, e.g. 9092")
    parser.add_argument("--max-request-mb", type=float, default=MAX_REQUEST_MB,
                        help=f"the largest request body the Fleet listener accepts, MiB (default {MAX_REQUEST_MB}; "
                             "raise it with FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE)")
    parser.add_argument("--fleet-max-connections", type=int, default=MAX_CONNECTIONS,
                        help=f"open connections on the Fleet listener (default {MAX_CONNECTIONS}); at the cap a new "
                             "one takes the place of the oldest one waiting for request headers")
    parser.add_argument("--fleet-header-timeout", type=float, default=HEADER_TIMEOUT,
                        help=f"seconds from a Fleet connection's accept (TLS handshake included) or its previous "
                             f"response to complete request headers, else it is closed (default {HEADER_TIMEOUT:g})")
    parser.add_argument("--fleet-body-timeout", type=float, default=BODY_TIMEOUT,
                        help=f"the longest silence inside a Fleet request body, seconds (default {BODY_TIMEOUT:g})")
    return parser


def split_args(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace, list[str]]:
    """(our arguments, flower-superlink's parsed arguments, flower-superlink's argv)."""
    from flwr.superlink.cli.flower_superlink import _parse_args_run_superlink

    ours, rest = build_parser().parse_known_args(argv)
    flower = _parse_args_run_superlink().parse_args(rest)  # exits on an argument Flower does not know
    if not is_loopback(flower.host):
        raise SystemExit(f"--host {flower.host}: the listener of every API (Control, Runtime) must be a loopback "
                         "address (127.0.0.1); put the public address in --fleet-host")
    if flower.insecure or not (flower.ssl_certfile and flower.ssl_keyfile and flower.ssl_ca_certfile):
        raise SystemExit("the Fleet listener needs TLS: give --ssl-ca-certfile, --ssl-certfile and --ssl-keyfile")
    if not flower.enable_supernode_auth:
        raise SystemExit("give --enable-supernode-auth: the Fleet API is the public one")
    if ours.fleet_port == flower.port:
        raise SystemExit("--fleet-port must differ from --port (the port tells the two listeners apart)")
    if ours.fleet_max_connections < 1 or ours.fleet_header_timeout <= 0 or ours.fleet_body_timeout <= 0:
        raise SystemExit("--fleet-max-connections must be at least 1 and the --fleet-*-timeout positive")
    return ours, flower, rest


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        build_parser().print_help()
        print("\nflower-superlink's arguments:")
        from flwr.superlink.cli.flower_superlink import _parse_args_run_superlink

        _parse_args_run_superlink().print_help()
        return 0
    ours, _, rest = split_args(argv)
    from fedapps.filemodes import umask

    os.umask(umask())  # before any thread or file: the database, Flower's files, the ServerApps' run folders

    import importlib

    from flwr.superlink.main import create_app
    from flwr.supercore.http_logging import get_uvicorn_log_config
    from flwr.supercore.logger import console_handler

    fsl = importlib.import_module("flwr.superlink.cli.flower_superlink")  # the module (the package exports a function)
    sys.argv = ["flower-superlink", *rest]  # Flower's config parser reads sys.argv (and logs its warnings)
    config = fsl._parse_superlink_lifespan_config()
    app = FleetOnly(create_app(config, fsl.SuperLinkLifespan), private_port=config.port,
                    max_body=int(ours.max_request_mb * 2**20))
    guard = FleetGuard(fit_fd_limit(ours.fleet_max_connections), ours.fleet_header_timeout, ours.fleet_body_timeout)
    sockets = [_listen(config.host, config.port), guard.listen(ours.fleet_host, ours.fleet_port)]
    print(f"[fleetgate] every API on https://{config.host}:{config.port} (loopback); "
          f"the Fleet API alone on https://{ours.fleet_host}:{ours.fleet_port} (at most {guard.max_connections} "
          f"connections; request headers within {guard.header_timeout:g} s, no body silence over "
          f"{guard.body_timeout:g} s)", flush=True)
    server = make_server(
        app, guard, host=config.host, port=config.port, reload=False, access_log=True,
        log_config=get_uvicorn_log_config(console_handler.level),
        ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile, workers=1, lifespan="on",
    )
    server.run(sockets=sockets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
