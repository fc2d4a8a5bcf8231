"""Process helpers shared by ``postcard.loopback``, ``postcard.fleetgate`` and ``postcard.superlink``.

Free ports, open ports, and killing a process with its descendants by process id. This
module imports nothing of Postcard's, so every other module can import it at the top
without a cycle.
"""

from __future__ import annotations

import socket

import psutil

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def kill_tree(pid: int, timeout: float = 15.0) -> list[int]:
    """Kill a process and all its descendants (children first), by process id."""
    try:
        root = psutil.Process(pid)
        family = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return []
    killed = []
    for member in family:
        try:
            member.kill()
            killed.append(member.pid)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=timeout)
    return killed
