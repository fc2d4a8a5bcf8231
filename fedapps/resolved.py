"""The run's resolved configuration as YAML, both ways: what the server sends each node once
(``ConfigRecord "postcard"``) and a run folder keeps (``config.yaml``). Below every other module of
``fedapps`` (``fedapps.config`` re-exports both), so a node reads its config without importing
composition."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def from_yaml(text: str) -> DictConfig:
    """:func:`to_yaml`'s text as a read-only (struct) config."""
    cfg = OmegaConf.create(text)
    OmegaConf.set_struct(cfg, True)
    return cfg


def client_count(cfg) -> int:
    """The run's clients: ``num_clients``, else the task's ``default_clients`` — the same number
    whether the run starts with ``flwr run`` or ``postcard``."""
    return int(cfg.get("num_clients") or cfg.task.default_clients)
