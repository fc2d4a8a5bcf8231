"""The latent channel on a client (``channel=latent``, ``fedapps.channel``): the federated tensors
trained only through this round's latents.

:func:`latent_training` attaches the latents to the client's model
(``torch.nn.utils.parametrize``: each federated tensor becomes ``received + ΔW(z)``, the received
value frozen) for the length of local training, and :class:`LatentRun` encodes ``z`` as the uplink.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from fedapps.channel import cached_factors, settings_of
from strategies.channel import LATENT_KEY


class LatentDelta(nn.Module):
    """A parametrization: the frozen received value plus ``ΔW(z)``; ``z`` (zeros) is what trains."""

    def __init__(self, A: torch.Tensor, B: torch.Tensor, V: torch.Tensor, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape = tuple(shape)
        self.z = nn.Parameter(torch.zeros(V.shape[0], dtype=torch.float32, device=A.device))
        self.register_buffer("A", A, persistent=False)
        self.register_buffer("B", B, persistent=False)
        self.register_buffer("V", V, persistent=False)

    def forward(self, received: torch.Tensor) -> torch.Tensor:
        s = self.z @ self.V
        return received + ((self.A * s) @ self.B).reshape(self.shape).to(received.dtype)


class LatentRun:
    """One round's latents on a client: attached by :func:`latent_training`, read after it."""

    def __init__(self) -> None:
        self.z: np.ndarray | None = None

    def record(self, cfg, context, seed: int):
        """The uplink: ``{LATENT_KEY: z}`` in ``channel.format`` (int4 with seeded stochastic rounding)."""
        from fedapps.session import uplink_record

        return uplink_record(cfg, context, {LATENT_KEY: self.z}, {LATENT_KEY: np.zeros_like(self.z)}, seed)


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr


@contextlib.contextmanager
def latent_training(call, model: nn.Module, names: list[str]):
    """Train ``names`` (the federated tensors, holding the received values) only through this round's
    latents: yields a :class:`LatentRun` (None when the run's channel is not latent). On exit the
    model's tensors hold ``received + ΔW(z)`` as plain parameters again, and ``run.z`` the latents."""
    settings = settings_of(call.cfg)
    if settings is None:
        yield None
        return
    params = dict(model.named_parameters())
    factors = cached_factors(settings, tuple((n, tuple(params[n].shape)) for n in sorted(names)),
                             int(call.server_round))
    run, attached = LatentRun(), []
    try:
        for name in sorted(names):
            param = params[name]
            module, attr = _owner(model, name)
            A, B, V = (t.to(param.device) for t in factors[name])
            parametrize.register_parametrization(module, attr, LatentDelta(A, B, V, tuple(param.shape)), unsafe=True)
            attached.append((name, module, attr, param.requires_grad))
            module.parametrizations[attr].original.requires_grad_(False)
        yield run
        run.z = np.concatenate([module.parametrizations[attr][0].z.detach().cpu().numpy()
                                for _, module, attr, _ in attached]).astype(np.float32)
    finally:
        for name, module, attr, trainable in reversed(attached):
            parametrize.remove_parametrizations(module, attr, leave_parametrized=True)
            getattr(module, attr).requires_grad_(trainable)
