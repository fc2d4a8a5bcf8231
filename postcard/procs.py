"""Process helpers shared by ``postcard.loopback``, ``postcard.fleetgate`` and ``postcard.superlink``.

Free ports, open ports, killing a process with its descendants by process id, and exiting when a
parent process ends. This
module imports nothing of Postcard's, so every other module can import it at the top
without a cycle.
"""

from __future__ import annotations

import os
import socket
import threading
import time

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


def watch_parent(pid: int) -> None:
    """Exit (without cleanup: the parent is gone) when process ``pid`` ends."""
    def alive() -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def watch() -> None:
        while alive():
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="postcard-parent-watch").start()
