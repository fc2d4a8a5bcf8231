"""Run a composed configuration in-process with Flower's simulation engine (Ray).

Used by the ``postcard`` CLI, the benchmarks and the tests; ``flwr run .`` remains the way to run
the registered app. The ServerApp runs in this process, so the run's summary comes back.

One part of Flower's simulation engine is replaced while a run is in flight here
(:func:`pending_first`): its thread that hands stored messages to the Ray workers asks the link
state for each *registered* node's next message every 0.1 s, and each ask scans every stored
message, so a pass costs registered nodes × messages in flight: at 1,000 nodes and 100 messages
a round it kept one of this machine's two cores busy and the round 26% slower than its clients'
work (bench/thousand.py). The replacement asks only for the nodes that have an undelivered
message; what each node gets, and when, is Flower's own ``get_message_ins``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from queue import Queue

from flwr.app import Context
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedapps.client_app import app as client_app
from fedapps.resolved import client_count
from fedapps.runner import run_server


def client_resources(cfg, num_clients: int) -> dict:
    """Ray resources of one simulated client from ``cfg.simulation``.

    ``client_gpus: auto`` shares the visible GPUs among all clients (each gets
    ``min(1, GPUs / clients)``; 0 without CUDA, so clients train on the CPU). Ray hides
    the GPUs from a client with no GPU share.
    """
    sim = cfg.get("simulation") or {}  # checked by fedapps.config.finalize
    cpus = float(sim.get("client_cpus", 1))
    gpus = sim.get("client_gpus", "auto")
    if gpus == "auto":
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        gpus = min(1.0, count / num_clients) if count else 0.0
    return {"num_cpus": cpus, "num_gpus": float(gpus)}


def pending_nodes(state, nodes) -> list[int]:
    """The nodes of ``nodes`` that have an undelivered message in ``state`` (Flower's in-memory link
    state, read under its lock); all of ``nodes`` for a state without that store."""
    store, lock = getattr(state, "message_ins_store", None), getattr(state, "lock", None)
    if store is None or lock is None:
        return list(nodes)
    with lock:
        waiting = {m.metadata.dst_node_id for m in store.values() if m.metadata.delivered_at == ""}
    return [node for node in nodes if node in waiting]


# how often the extractor looks for messages to hand out (Flower: 0.1 s; a look is one pass over the store) and
# the ServerApp polls for replies (Flower: 0.1 s; a poll checks every message in flight: 1 ms at 100)
POLL_SECONDS = 0.01
REPLY_POLL_SECONDS = 0.05


def pending_first(state, queue: Queue, nodes_mapping, f_stop: threading.Event) -> None:
    """Flower's ``vce_api.add_messages_to_queue`` (1.42): each node's next stored message
    (``get_message_ins(node_id, limit=1)``) onto the workers' queue, asked of the nodes with one
    waiting (:func:`pending_nodes`), not of every registered node; every :data:`POLL_SECONDS`
    instead of 0.1 s, now that a pass with nothing waiting is one look at the store."""
    while not f_stop.is_set():
        for node_id in pending_nodes(state, nodes_mapping.keys()):
            for msg in state.get_message_ins(node_id=node_id, limit=1):
                queue.put(msg)
        f_stop.wait(POLL_SECONDS)


@contextlib.contextmanager
def engine_patched():
    """Flower's simulation engine with :func:`pending_first` as its message extractor, for the
    duration of one in-process run (restored after)."""
    from flwr.server.superlink.fleet.vce import vce_api

    original = getattr(vce_api, "add_messages_to_queue", None)
    if original is None:  # another Flower: its own engine
        yield
        return
    vce_api.add_messages_to_queue = pending_first
    try:
        yield
    finally:
        vce_api.add_messages_to_queue = original


def ray_init_args(total_cpus: float | None = None) -> dict:
    """Ray's init arguments of an in-process simulation: a Ray instance of its own on this
    machine (``address='local'``), unless ``RAY_ADDRESS`` names a cluster to join. Without
    it ``ray.init`` joins any cluster another process started here (a ``ray start``, a
    test's ``Cluster``) and refuses our ``num_cpus``: the run crashed, and then hung."""
    if os.environ.get("RAY_ADDRESS", "local") != "local":
        return {"include_dashboard": False}  # the cluster's own resources
    return {"address": "local", "num_cpus": total_cpus or os.cpu_count() or 2, "include_dashboard": False}


def simulate(cfg, *, total_cpus: int | None = None, clients: ClientApp | None = None) -> dict:
    """Run ``cfg`` with ``cfg.num_clients`` (or the task's default) simulated SuperNodes.

    ``clients``: another ClientApp than Postcard's (e.g. one wrapped in a mod that
    misbehaves, to test the server against hostile clients)."""
    from flwr.simulation import run_simulation

    num_clients = client_count(cfg)
    resources = client_resources(cfg, num_clients)
    result: dict = {}
    server_app = ServerApp()

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        if hasattr(grid, "pull_interval"):  # Flower's InMemoryGrid polls for replies every 0.1 s
            grid.pull_interval = min(float(grid.pull_interval), REPLY_POLL_SECONDS)
        result.update(run_server(grid, cfg))

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # Ray's FutureWarning on every start
    with engine_patched():
        run_simulation(
            server_app=server_app,
            client_app=clients or client_app,
            num_supernodes=num_clients,
            backend_name="ray",
            backend_config={
                "client_resources": resources,
                "init_args": ray_init_args(total_cpus),
            },
        )
    if not result:
        raise RuntimeError("the simulated run did not finish; see the log above for the server's error")
    return result
