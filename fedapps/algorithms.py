"""Which ServerApp/ClientApp pair serves which ``algorithm`` name."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

# algorithm name -> module holding its pair (``serverapp``, ``clientapp``, ``plan_server``)
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


def get(name: str):
    if name not in PAIRS:
        raise KeyError(f"no app pair for algorithm '{name}'; known: {', '.join(sorted(PAIRS))}")
    return importlib.import_module(PAIRS[name])
