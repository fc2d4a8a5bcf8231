"""The baseline strategies: FedAvg-LoRA, FedProx, FFA-LoRA and FedAvg over full weights.

They differ only in what is federated and what each round tells the clients; the
validation, averaging and accounting are :class:`~strategies.base.PayloadFedAvg`'s.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import ConfigRecord

from strategies.base import PayloadFedAvg


class FedAvgLoRA(PayloadFedAvg):
    """FedAvg over PEFT LoRA factors (A and B of every adapted projection)."""


class FedAvgFull(PayloadFedAvg):
    """FedAvg over every trainable weight of the model."""


class FedProx(PayloadFedAvg):
    """FedAvg whose clients add (mu/2)·||w − w_global||² to their loss (Li et al., 2020).

    The server's only part is sending ``proximal-mu`` with each training round.
    """

    def __init__(self, *, proximal_mu: float, **kwargs) -> None:
        if proximal_mu < 0:
            raise ValueError(f"proximal_mu must be >= 0, got {proximal_mu}")
        super().__init__(**kwargs)
        self.proximal_mu = float(proximal_mu)

    def train_config_for(self, server_round: int, node_id: int, config: ConfigRecord) -> ConfigRecord:
        config = super().train_config_for(server_round, node_id, config)
        config["proximal-mu"] = self.proximal_mu
        return config


def lora_b_keys(state: Mapping[str, np.ndarray]) -> list[str]:
    return sorted(k for k in state if "lora_B" in k)


class FFALoRA(PayloadFedAvg):
    """FFA-LoRA (Sun et al., 2024): A stays at its shared seeded init; only B is sent.

    With A identical on every client, averaging B averages the update ΔW = B A exactly.
    """

    def __init__(self, *, initial_state: Mapping[str, np.ndarray], **kwargs) -> None:
        keys = lora_b_keys(initial_state)
        if not keys:
            raise ValueError("FFA-LoRA needs LoRA B factors in the initial state (keys containing 'lora_B')")
        super().__init__(initial_state={k: initial_state[k] for k in keys}, uplink_keys=keys, **kwargs)
