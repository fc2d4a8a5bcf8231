"""The server side of a run, common to every algorithm.

``run_server(grid, cfg)``: make the run folder, let the algorithm build its strategy and
initial state, wait for the SuperNodes, evaluate the initial model (round 0), run the
rounds, save the final global state, write the summary and plots.
"""

from __future__ import annotations

import time
from logging import INFO

from flwr.app import ConfigRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from omegaconf import OmegaConf

from fedapps import algorithms
from fedapps.config import to_yaml
from fedapps.outputs import RunDir


class ServerSetupError(RuntimeError):
    pass


def wait_for_nodes(grid: Grid, wanted: int | None, seconds: float) -> int:
    """Wait until ``wanted`` nodes (or, if None, at least one and a stable count) connect."""
    deadline = time.time() + float(seconds)
    last, stable_since = -1, time.time()
    while True:
        count = len(list(grid.get_node_ids()))
        if count != last:
            last, stable_since = count, time.time()
        if wanted is not None and count >= wanted:
            return count
        if wanted is None and count > 0 and time.time() - stable_since >= 2.0:
            return count
        if time.time() > deadline:
            if wanted is None and count > 0:
                return count
            hint = "in simulation pass --federation-config \"num-supernodes=N\"; in deployment start more SuperNodes"
            raise ServerSetupError(f"{count} SuperNode(s) connected after {seconds:.0f} s, {wanted or 1} needed ({hint})")
        time.sleep(0.5)


def run_server(grid: Grid, cfg) -> dict:
    pair = algorithms.get(cfg.algorithm.name)
    wanted = int(cfg.num_clients) if cfg.num_clients else None
    count = wait_for_nodes(grid, wanted, float(cfg.strategy.node_wait))
    OmegaConf.set_struct(cfg, False)
    cfg.num_clients = wanted or count  # resolved before the config is written and sent
    OmegaConf.set_struct(cfg, True)
    out = RunDir(cfg)
    log(INFO, "Postcard: %s on %s with %s, %d clients, %d rounds -> %s",
        cfg.algorithm.name, cfg.task.name, cfg.model.name, cfg.num_clients, cfg.rounds, out.path)
    plan = pair.plan_server(cfg, on_round_end=out.write_round, config_yaml=to_yaml(cfg))
    strategy = plan.strategy
    log(INFO, "federated tensors: %d (%s values); uplink format %s",
        len(strategy.uplink_keys), f"{sum(strategy.global_state[k].size for k in strategy.uplink_keys):,}",
        strategy.uplink_format)

    # round 0: every client evaluates the initial global state
    initial = strategy.downlink_arrays()
    replies = grid.send_and_receive(strategy.configure_evaluate(0, initial, ConfigRecord(), grid),
                                    timeout=float(cfg.strategy.timeout))
    strategy.aggregate_evaluate(0, replies)

    strategy.start(
        grid=grid,
        initial_arrays=initial,
        num_rounds=int(cfg.rounds),
        timeout=float(cfg.strategy.timeout),
        train_config=ConfigRecord(),
        evaluate_config=ConfigRecord(),
    )
    extra = plan.save_final(strategy.global_state, out.path) or {}
    return out.finish(strategy.history, extra)
