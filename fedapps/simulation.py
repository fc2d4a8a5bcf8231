"""Run a composed configuration in-process with Flower's simulation engine (Ray).

Used by the ``postcard`` CLI and the tests; ``flwr run .`` remains the way to run the
registered app. The ServerApp runs in this process, so the run's summary comes back.
"""

from __future__ import annotations

import os

from flwr.app import Context
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedapps.client_app import app as client_app
from fedapps.runner import client_count, run_server


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
        result.update(run_server(grid, cfg))

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # Ray's FutureWarning on every start
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
