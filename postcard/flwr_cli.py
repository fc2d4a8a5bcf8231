"""The Flower command line as Postcard drives it: the environment of every Flower process it starts,
the ``flwr`` connection file, SuperNode key registration, and the small helpers around them (the
JSON a ``flwr ... --format json`` call prints, private log files). Used by ``postcard.deploy`` (its
command line), ``postcard.loopback`` (a cluster on loopback) and the benchmarks that start Flower.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from fedapps.filemodes import private_file
from postcard.superlink import local_env

ROOT = Path(__file__).resolve().parent.parent  # the app folder (pyproject.toml)
CONNECTION = "postcard-local"  # name of the SuperLink connection in the CLI's config.toml


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
                done[str(key)] = str(json_tail(proc.stdout)["node-id"])
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


def json_tail(text: str) -> dict:
    """The JSON object a ``flwr ... --format json`` call prints (after any log lines)."""
    start = text.find("{")
    if start < 0:
        raise DeployError(f"no JSON in the CLI output: {text[-500:]}")
    return json.loads(text[start:])


def open_log(path: Path, mode: str = "a"):
    """A log file opened for writing, readable by this user alone (``fedapps.filemodes``)."""
    handle = open(path, mode)
    private_file(path)
    return handle


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
