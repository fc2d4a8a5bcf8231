"""The MoRE layer's settings (:class:`MoREConfig`), torch-free: a run's are checked when its config is
composed (``fedapps.smartfed.check``), before any model is imported."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

GATE_MODES = ("softmax", "softmax-raw", "ones")
IMPORTANCE_MODES = ("usage", "sensitivity")
MODES = ("experts+router", "router-only")


@dataclass
class MoREConfig:
    """How :func:`apply_more` builds the mixture.

    Attributes:
        top_k: experts kept per token (clipped to the number of active experts).
        mode: ``"experts+router"`` or ``"router-only"`` (experts frozen, the paper's variant).
        gate_mode: ``"softmax"``, ``"softmax-raw"`` or ``"ones"`` (see the module docstring).
        router_seed, router_std: :func:`strategies.sparse.init_router` (same bits as the server).
        importance_decay: EMA factor of the importance statistic.
        importance: ``"usage"`` or ``"sensitivity"`` (see the module docstring).
        active: initial active expert indices per matrix (default: all experts active).
    """

    top_k: int = 2
    mode: str = "experts+router"
    gate_mode: str = "softmax"
    router_seed: int = 0
    router_std: float = 0.02
    importance_decay: float = 0.9
    importance: str = "usage"
    active: Mapping[str, Sequence[int]] | None = None

    def __post_init__(self):
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.gate_mode not in GATE_MODES:
            raise ValueError(f"gate_mode must be one of {GATE_MODES}, got {self.gate_mode!r}")
        if not 0.0 <= self.importance_decay < 1.0:
            raise ValueError(f"importance_decay must be in [0, 1), got {self.importance_decay}")
        if self.importance not in IMPORTANCE_MODES:
            raise ValueError(f"importance must be one of {IMPORTANCE_MODES}, got {self.importance!r}")

    @property
    def train_experts(self) -> bool:
        return self.mode == "experts+router"
