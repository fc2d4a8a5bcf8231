"""Which ServerApp/ClientApp pair serves which ``algorithm`` name."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

# algorithm name -> module holding its pair (``clientapp``, ``plan_server``); every pair runs on
# Postcard's one ServerApp (fedapps.server_app), which calls the pair's ``plan_server``
PAIRS = {
    "fedavg-lora": "fedapps.baselines",
    "fedprox": "fedapps.baselines",
    "ffa-lora": "fedapps.baselines",
    "fedavg-full": "fedapps.baselines",
    "topk-ef": "fedapps.baselines",
    "powersgd": "fedapps.baselines",
    "flite": "fedapps.flite",
    "fednl": "fedapps.fednl",
    "fedala": "fedapps.fedala",
    "fedssi": "fedapps.fedssi",
    "smartfed": "fedapps.smartfed",
}


@dataclass
class ServerPlan:
    """What an algorithm gives the common runner: its strategy, and how to save the result."""

    strategy: object
    save_final: Callable  # (global_state: dict[str, np.ndarray], run_dir: Path) -> dict | None


def strategy_settings(cfg, *, config_yaml: str, on_round_end) -> dict:
    """The keyword arguments every strategy takes from the run's configuration: the bounds on
    each client's influence (the ``robust`` group), the YAML sent to each client once, the
    client count and minimum, the sampled fractions, and the runner's round-end callback."""
    from omegaconf import OmegaConf

    from strategies.robust import Robustness

    return dict(
        robustness=Robustness.from_mapping(OmegaConf.to_container(cfg.robust, resolve=True)),
        config_yaml=config_yaml,
        num_clients=int(cfg.num_clients),
        min_clients=cfg.strategy.min_clients,
        fraction_train=float(cfg.strategy.fraction_train),
        fraction_evaluate=float(cfg.strategy.fraction_evaluate),
        on_round_end=on_round_end,
    )


def get(name: str):
    if name not in PAIRS:
        raise KeyError(f"no app pair for algorithm '{name}'; known: {', '.join(sorted(PAIRS))}")
    return importlib.import_module(PAIRS[name])
