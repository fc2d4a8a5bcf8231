"""FedNL's server (the outer loop L0): example-weighted FedAvg over θ, and nothing else.

θ is what the clients' inner loops train (``clients.fednl``):

* ``meta-rules`` (default): LoRA A/B on q_proj, k_proj, v_proj + each layer's memory gate
  logit (``…self_attn.fednl_gate``) + its write-strength projection
  (``…self_attn.fednl_beta.weight`` / ``.bias``);
* ``gate``: the gate and β tensors only; each client's LoRA stays on the client.

The memory state S of every layer never reaches the server: it is per sequence and
restarts at zero. The strategy refuses at construction an initial state holding anything
else (a backbone weight, an MLP adapter, LoRA in ``gate`` mode), and every reply must
carry exactly the same key set (:class:`~strategies.base.PayloadFedAvg`). The gate is
averaged as a logit; each round's record also holds the mean α = sigmoid(gate) per layer.

Bounded influence: a gate or β value a client proposes beyond ±``MEMORY_BOUND`` is refused
(a logit of 30 already means α = 1 − 10⁻¹³: larger values only saturate or overflow the
sigmoid); the LoRA factors fall under the run's ``robust`` bounds like any other tensor.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

from strategies.base import PayloadFedAvg

MODES = ("meta-rules", "gate")
MEMORY_BOUND = 30.0  # |gate logit|, |β weight/bias| a reply may propose
_MEMORY = re.compile(r"(^|\.)fednl_(gate|beta)(\.|$)")
_QKV_LORA = re.compile(r"\.(q_proj|k_proj|v_proj)\.lora_[AB]\.")
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def theta_kind(name: str) -> str | None:
    """'memory' (gate, β), 'lora' (LoRA on q/k/v) or None (not part of θ)."""
    if _MEMORY.search(name):
        return "memory"
    if _QKV_LORA.search(name):
        return "lora"
    return None


def check_theta(names, mode: str) -> None:
    """Raise ValueError unless ``names`` is a valid θ for ``mode``."""
    if mode not in MODES:
        raise ValueError(f"FedNL payload mode must be one of {MODES}, got {mode!r}")
    kinds = {name: theta_kind(name) for name in names}
    foreign = sorted(n for n, k in kinds.items() if k is None)
    if foreign:
        raise ValueError(f"FedNL's θ holds tensors that are neither LoRA q/k/v nor gate/β: {foreign[:3]}")
    if "memory" not in kinds.values():
        raise ValueError("FedNL's θ has no memory gate/β tensor (names containing 'fednl_gate' / 'fednl_beta')")
    if mode == "gate" and "lora" in kinds.values():
        raise ValueError("payload mode 'gate' keeps LoRA on the clients, but the initial state holds LoRA tensors")
    if mode == "meta-rules" and "lora" not in kinds.values():
        raise ValueError("payload mode 'meta-rules' sends LoRA on q/k/v, but the initial state holds none")


def gate_alpha(state: Mapping[str, np.ndarray]) -> list[float]:
    """Mean α = sigmoid(gate logit) of each layer, in layer order."""
    gates = [(k, v) for k, v in state.items() if k.endswith("fednl_gate")]
    gates.sort(key=lambda kv: int(m.group(1)) if (m := _LAYER.search(kv[0])) else -1)
    return [float(np.mean(1.0 / (1.0 + np.exp(-v.astype(np.float64))))) for _, v in gates]


def gate_layers(state: Mapping[str, np.ndarray]) -> list[int]:
    """The layer index of each gate :func:`gate_alpha` reports, in the same order (FedNL's ``memory.layers``
    may leave layers without a memory)."""
    return sorted(int(m.group(1)) for k in state if k.endswith("fednl_gate") and (m := _LAYER.search(k)))


class FedNL(PayloadFedAvg):
    """FedAvg over FedNL's θ (meta-rules or gate-only), validated and metered."""

    def __init__(self, *, mode: str, initial_state: Mapping[str, np.ndarray], **kwargs) -> None:
        check_theta(list(initial_state), mode)
        super().__init__(initial_state=initial_state, **kwargs)
        self.mode = mode

    def value_bounds(self, key: str) -> float | None:
        return MEMORY_BOUND if theta_kind(key) == "memory" else None

    def train_ended(self, server_round: int) -> None:
        self.ledger.current["gate_alpha"] = gate_alpha(self.global_state)
        self.ledger.current["gate_layers"] = gate_layers(self.global_state)
