"""Stop the local SuperLink that `flwr run` leaves running (and everything it started).

``python -m postcard.superlink [FLWR_HOME]`` stops the SuperLink whose state lives under
``FLWR_HOME`` (default ``$FLWR_HOME`` or ``~/.flwr``), with its SuperExec and any
simulation it still runs, by process id.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import psutil

from postcard.deploy import kill_tree


def stop(flwr_home: str | Path) -> list[int]:
    """Kill every flower-superlink process started for ``flwr_home``, children first."""
    home = str(Path(flwr_home).expanduser().resolve())
    killed = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "flower-superlink" not in cmdline or home not in cmdline:
            continue
        killed += kill_tree(proc.pid, timeout=10)
    return killed


if __name__ == "__main__":
    home = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("FLWR_HOME", "~/.flwr")
    pids = stop(home)
    print(f"stopped {len(pids)} process(es) of the local SuperLink in {home}" if pids else f"no local SuperLink running in {home}")
