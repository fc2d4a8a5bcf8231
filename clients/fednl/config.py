"""FedNL's settings: how :func:`clients.fednl.model.add_delta_memory` builds the memory."""

from __future__ import annotations

import math
from dataclasses import dataclass

GATE_MODES = ("scalar", "channel")
BETA_MODES = ("input", "constant")
QK_ACTIVATIONS = ("silu", "identity")
MEMORY_HEADS = ("kv", "query")


@dataclass
class FedNLConfig:
    """How :func:`add_delta_memory` builds the dual-path attention."""

    chunk_size: int = 64  # tokens per chunk of the training-time (WY/UT) delta rule
    window: int | None = None  # softmax path's sliding window; None = the backbone's full attention
    sink: int = 4  # with a window: the first tokens the softmax path always sees (attention sinks)
    gate: str = "scalar"  # "scalar" | "channel": one alpha per layer, or one per attention channel
    gate_init_logit: float = -4.0  # alpha = sigmoid(logit) at init
    beta: str = "input"  # "input": sigmoid(W x + b) per head | "constant": sigmoid(b) per head
    beta_init_logit: float = 0.0  # b at init (W starts at zero): beta = 0.5
    qk_activation: str = "silu"  # applied to q, k before L2 normalisation in the memory path
    use_fla: bool | None = None  # fla's CUDA kernel: None = when usable, True = required, False = never
    # "kv": one memory (and one beta) per key/value head, read by each of its query heads (the default since
    # #44: the write path on a third of SmolLM2's heads); "query": one per query head, k/v repeated to them
    memory_heads: str = "kv"
    # subtract the causal running mean of the memory's keys (token t: the mean of keys 0..t) before the L2
    # norm: a pretrained model's keys share a large common direction (SmolLM2: mean cosine 0.8 between the
    # keys of one prompt), so every write overwrites every other; centred keys keep them apart (#44)
    key_centering: bool = False
    # the layers (indices) that carry a memory; None = every layer. The others keep the (windowed) softmax
    # path alone, with no gate and no β: fewer layers write and read, and θ is smaller
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive int, got {self.chunk_size!r}")
        if self.window is not None and (
            isinstance(self.window, bool) or not isinstance(self.window, int) or self.window <= 0
        ):
            raise ValueError(f"window must be None or a positive int, got {self.window!r}")
        if isinstance(self.sink, bool) or not isinstance(self.sink, int) or self.sink < 0:
            raise ValueError(f"sink must be a non-negative int, got {self.sink!r}")
        if self.gate not in GATE_MODES:
            raise ValueError(f"gate must be one of {GATE_MODES}, got {self.gate!r}")
        if self.beta not in BETA_MODES:
            raise ValueError(f"beta must be one of {BETA_MODES}, got {self.beta!r}")
        if self.qk_activation not in QK_ACTIVATIONS:
            raise ValueError(f"qk_activation must be one of {QK_ACTIVATIONS}, got {self.qk_activation!r}")
        if self.memory_heads not in MEMORY_HEADS:
            raise ValueError(f"memory_heads must be one of {MEMORY_HEADS}, got {self.memory_heads!r}")
        if not isinstance(self.key_centering, bool):
            raise ValueError(f"key_centering must be true or false, got {self.key_centering!r}")
        if self.layers is not None:
            layers = tuple(self.layers) if isinstance(self.layers, (list, tuple)) else None
            if (not layers or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers)
                    or len(set(layers)) != len(layers)):
                raise ValueError(f"layers must be None or distinct non-negative layer indices, got {self.layers!r}")
            self.layers = tuple(sorted(layers))
        if self.use_fla not in (None, True, False):
            raise ValueError(f"use_fla must be None, True or False, got {self.use_fla!r}")
        for name in ("gate_init_logit", "beta_init_logit"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or math.isnan(value):
                raise ValueError(f"{name} must be a number, got {value!r}")
