"""FedSSI's server: FedAvg over LoRA adapters, with the SI regularisation set per round.

FedSSI (Li et al., ICML 2025) regularises local training with synaptic intelligence
computed on a personalised surrogate model (``clients.fedssi``). As FedProx does with its
mu, the server sends the regularisation strength ``ssi-c`` and the surrogate's balance
``ssi-lambda`` with every training round, so a schedule can change them between rounds.
"""

from __future__ import annotations

from flwr.app import ConfigRecord

from strategies.baselines import FedAvgLoRA


class FedSSI(FedAvgLoRA):
    """FedAvg of LoRA adapters trained with the SI penalty c·Σ Ω (θ − θ_global)²."""

    def __init__(self, *, c: float, lam: float, **kwargs) -> None:
        if c < 0:
            raise ValueError(f"FedSSI's c must be >= 0, got {c}")
        if not 0.0 < lam <= 1.0:
            raise ValueError(f"FedSSI's lam must be in (0, 1], got {lam}")
        super().__init__(**kwargs)
        self.c = float(c)
        self.lam = float(lam)

    def train_config_for(self, server_round: int, node_id: int, config: ConfigRecord) -> ConfigRecord:
        config = super().train_config_for(server_round, node_id, config)
        config["ssi-c"] = self.c
        config["ssi-lambda"] = self.lam
        return config
