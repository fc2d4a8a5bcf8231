"""The local SuperLink of ``flwr run``: one per ``FLWR_HOME``, on ports of its own, stopped by pid.

``flwr run .`` (simulation) starts a local SuperLink on two fixed host-wide ports
(``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT`` 39091 and ``FLWR_LOCAL_CONTROL_API_PORT`` 39093)
and leaves it running. A second checkout on the same host would then silently submit its
runs to the first checkout's SuperLink (its venv, its working directory). Postcard's
commands (``make``, ``postcard``, ``python -m postcard.app_run``, the demo and the tests)
give every ``FLWR_HOME`` its own pair of ports, derived from the folder's path, and refuse
in one line a SuperLink on those ports that belongs to another ``FLWR_HOME``.

    python -m postcard.superlink env [FLWR_HOME]    # the exports for a shell: eval "$(...)"
    python -m postcard.superlink status [FLWR_HOME] # is this FLWR_HOME's SuperLink running, on which ports
    python -m postcard.superlink stop [FLWR_HOME]   # stop it with its SuperExec and simulation, by pid

``FLWR_HOME`` defaults to ``$FLWR_HOME``, else Flower's ``~/.flwr``; ``make`` sets it to the
checkout's ``.flwr``. Ports already set in the environment are kept.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path

from postcard.procs import kill_tree

HTTP_PORT_VAR = "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"
CONTROL_PORT_VAR = "FLWR_LOCAL_CONTROL_API_PORT"
PORT_BASE, PORT_PAIRS = 40000, 9000  # pairs (p, p+1) in 40000..57999: clear of Flower's 9091-9095 and 39091/39093


class SuperLinkBusy(RuntimeError):
    """The ports of this FLWR_HOME's local SuperLink are held by another one."""


def flwr_home(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get("FLWR_HOME") or "~/.flwr").expanduser().resolve()


def local_ports(home: str | Path) -> tuple[int, int]:
    """(Runtime HTTP API port, Control API port) of the local SuperLink of ``home``."""
    digest = hashlib.sha256(str(Path(home).expanduser().resolve()).encode()).digest()
    port = PORT_BASE + 2 * (int.from_bytes(digest[:8], "big") % PORT_PAIRS)
    return port, port + 1


def local_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with its FLWR_HOME's own local SuperLink ports (unless the ports are set already), and a
    simulation that starts a Ray instance of its own (``RAY_ADDRESS=local``) unless ``RAY_ADDRESS`` names
    a cluster: without it Ray joins the newest cluster another process started on this machine, where
    one run failed ("ActorPool is empty") and the next hung. Ray's FutureWarning on every start is
    answered as it asks (``RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0``)."""
    out = dict(env)
    http, control = local_ports(flwr_home(out))
    out.setdefault(HTTP_PORT_VAR, str(http))
    out.setdefault(CONTROL_PORT_VAR, str(control))
    if not out.get("RAY_ADDRESS"):
        out["RAY_ADDRESS"] = "local"
    out.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    return out


def _superlinks():
    import psutil

    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if any(Path(arg).name == "flower-superlink" for arg in cmdline[:2]):
            yield proc, cmdline


def _option(cmdline: list[str], name: str) -> str | None:
    for i, arg in enumerate(cmdline):
        if arg == name and i + 1 < len(cmdline):
            return cmdline[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _home_of(cmdline: list[str]) -> Path | None:
    """The FLWR_HOME of a local SuperLink: its log file is ``$FLWR_HOME/local-superlink/superlink.log``."""
    log_file = _option(cmdline, "--log-file")
    return Path(log_file).resolve().parent.parent if log_file else None


def running(home: str | Path) -> list[int]:
    """Process ids of the local SuperLink(s) started for ``home``."""
    home = Path(home).expanduser().resolve()
    return [proc.pid for proc, cmdline in _superlinks() if _home_of(cmdline) == home]


def check_free(env: Mapping[str, str]) -> None:
    """Refuse, in one line, a local SuperLink on ``env``'s ports that belongs to another FLWR_HOME."""
    home = flwr_home(env)
    # Flower's defaults when the variables are unset (flwr.cli.constant reads the variables at
    # import, so its constants are this process's values, not the defaults).
    ports = {str(env.get(HTTP_PORT_VAR, "39091")), str(env.get(CONTROL_PORT_VAR, "39093"))}
    for _, cmdline in _superlinks():
        other = _home_of(cmdline)
        control = (_option(cmdline, "--control-api-address") or "").rsplit(":", 1)[-1]
        if other is not None and other != home and ports & {_option(cmdline, "--port"), control}:
            raise SuperLinkBusy(
                f"the local SuperLink on port(s) {', '.join(sorted(ports))} belongs to FLWR_HOME {other}, not {home}; "
                f"stop it (python -m postcard.superlink stop {other}) or give this checkout other ports "
                f"(eval \"$(python -m postcard.superlink env {home})\")")


def stop(flwr_home: str | Path) -> list[int]:
    """Kill every local SuperLink started for ``flwr_home`` and everything it started, children first."""
    killed = []
    for pid in running(flwr_home):
        killed += kill_tree(pid, timeout=10)
    return killed


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or args[0] not in ("env", "status", "stop"):
        print(__doc__)
        return 0 if args[:1] in ([], ["-h"], ["--help"]) else 2
    command, rest = args[0], args[1:]
    home = Path(rest[0]).expanduser().resolve() if rest else flwr_home()
    http, control = local_ports(home)
    if command == "env":
        ray = local_env({**os.environ, "FLWR_HOME": str(home)})
        print(f"export FLWR_HOME={shlex.quote(str(home))} {HTTP_PORT_VAR}={http} {CONTROL_PORT_VAR}={control} "
              f"RAY_ADDRESS={shlex.quote(ray['RAY_ADDRESS'])} "
              f"RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO={ray['RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO']}")
    elif command == "status":
        pids = running(home)
        print(f"local SuperLink of {home} (ports {http}/{control}): "
              + (f"running, pid {', '.join(map(str, pids))}" if pids else "not running"))
    else:
        pids = stop(home)
        print(f"stopped {len(pids)} process(es) of the local SuperLink in {home}" if pids
              else f"no local SuperLink running in {home}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
