"""The step stage: a round's combined update -> the new values of the federated tensors.

:class:`ModelStep` applies, in order, the server optimiser (``strategy.server_optimizer``,
:mod:`strategies.server_opt`: the combined update is its pseudo-gradient; FedAvg adds it as it is)
and, when replies are latents, the latent channel's expansion (:meth:`LatentChannel.expand`; with
a latent downlink the combined ``z`` is first encoded as the clients will decode it). It returns a
:class:`Step` — nothing is kept until the strategy commits it (only a finite step is committed) —
and holds the optimiser's moments between rounds (:meth:`state` / :meth:`load`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord

from strategies import codec
from strategies.channel import LATENT_KEY, LatentChannel, apply_update
from strategies.server_opt import PREFIX as OPT_PREFIX, OptimizerState, ServerOptimizer


@dataclass
class Step:
    """What one round's combined update does: the new values of the federated tensors, and what the
    server keeps beside them once they are committed (the optimiser's moments, the latent as sent, and
    whatever the method's combine handed over: ``kept``)."""

    values: dict[str, np.ndarray]
    moments: OptimizerState | None = None
    latent: Array | None = None
    kept: object = None


@dataclass
class Combined:
    """A combine's result when the method keeps more than the tensors once the round is committed
    (SmartFed: its new expert state and the round's importance): ``kept`` reaches ``commit``."""

    update: dict[str, np.ndarray]
    kept: object = None


class ModelStep:
    """The server optimiser, then the latent channel's expansion; the optimiser's moments between rounds."""

    def __init__(self, optimizer: ServerOptimizer, channel: LatentChannel | None, uplink_format: str) -> None:
        self.optimizer = optimizer
        self.channel = channel
        self.uplink_format = uplink_format
        self.moments = OptimizerState()

    @property
    def latent_downlink(self) -> bool:
        return self.channel is not None and self.channel.downlink == "latent"

    def __call__(self, state: Mapping[str, np.ndarray], server_round: int, update: Mapping[str, np.ndarray], *,
                 combined: bool = True) -> Step:
        """``state + update`` (after the optimiser's step and the channel's expansion); ``combined=False``: one
        client's update, as it would move the state (no optimiser step, nothing to keep)."""
        moments = latent = None
        if combined and not self.optimizer.plain:
            update, moments = self.optimizer.step(update, self.moments)
        if self.channel is not None:
            if self.latent_downlink and np.all(np.isfinite(update[LATENT_KEY])):
                # the combined z as the clients will decode it from the downlink (a non-finite one is refused later)
                fmt = self.channel.downlink_format or self.uplink_format
                latent = codec.encode({LATENT_KEY: update[LATENT_KEY]}, fmt)[LATENT_KEY]
                record = ArrayRecord()
                record[LATENT_KEY] = latent
                update = codec.decode(record)
            update = self.channel.expand(server_round, update)
        return Step(apply_update(state, update), moments, latent if combined else None)

    def state(self) -> tuple[dict[str, np.ndarray], dict]:
        """(the moments' arrays, JSON-able metadata); empty for plain FedAvg."""
        if self.optimizer.plain:
            return {}, {}
        return self.moments.to_arrays(), {"server_optimizer": {"name": self.optimizer.name, "t": self.moments.t}}

    def load(self, arrays: Mapping[str, np.ndarray], meta, keys: list[str]) -> None:
        """Restore :meth:`state` (``arrays`` holds the moments among other tensors); ValueError for a checkpoint
        of another optimiser."""
        saved = meta.get("server_optimizer")
        if (saved or {}).get("name", "fedavg") != self.optimizer.name:
            raise ValueError(f"the checkpoint was written with server optimizer "
                             f"{(saved or {}).get('name', 'fedavg')!r}, this run uses {self.optimizer.name!r}")
        moments = {k: v for k, v in arrays.items() if k.startswith(f"{OPT_PREFIX}/")}
        self.moments = OptimizerState.from_arrays(int(saved["t"]), moments, keys) if saved else OptimizerState()
