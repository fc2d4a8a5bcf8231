"""Postcard's registered ServerApp: compose the config, run the chosen algorithm's server."""

from __future__ import annotations

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedapps.config import compose_from_run_config
from fedapps.runner import run_server

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_server(grid, compose_from_run_config(context.run_config))
