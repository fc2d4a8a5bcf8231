"""FedALA's server: FedAvg over the clients' LoRA adapters (Zhang et al., AAAI 2023).

All of FedALA's method runs on the clients (``clients.fedala``): each keeps its own
adapter and learns, on local data, how much of the global one to take in (Adaptive Local
Aggregation) before evaluating and training. The server averages what they send, as
TsingZ0/FedALA's ``serverALA`` does; the class exists so runs and logs name the method.
"""

from __future__ import annotations

from strategies.baselines import FedAvgLoRA


class FedALA(FedAvgLoRA):
    """Example-weighted FedAvg of the LoRA adapters the clients trained after their ALA."""
