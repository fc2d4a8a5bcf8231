"""FedSSI's client method: synaptic intelligence from a personalised surrogate model.

FedSSI (Li et al., "Rehearsal-Free Continual Federated Learning with Synergistic
Synaptic Intelligence", ICML 2025; no public code) regularises local training with
synaptic intelligence (SI; Zenke et al., 2017) whose importances come from a
*personalised surrogate model* (PSM) that balances the client's data against the global
model. Re-implemented from the paper's description over PEFT LoRA adapters; one round on
one client (:func:`ssi_round`):

1. **PSM** (``psm_steps`` AdamW steps from the global adapter θ_g) on
   ``lam · L_k(v) + (1 − lam)/2 · ||v − θ_g||²``, accumulating SI's path integral
   ``ω_i += −g_i · Δv_i`` with ``g = ∂L_k/∂v`` (the data term's gradient) at every step;
   then the PSM is discarded (the model goes back to θ_g).
2. **Importance**: ``Ω_i += relu(ω_i) / ((v_i − θ_g,i)² + xi)``, accumulated over rounds
   and kept on the client only. (``relu``: a parameter whose path *raised* the loss is
   given no importance rather than a negative, non-convex penalty.)
3. **Local training** from θ_g on ``L_k(θ) + c · Σ_i Ω_i (θ_i − θ_g,i)²``.

``psm_steps = 0`` drops the surrogate: Ω then accumulates along the local training path
itself (classic SI, Δ measured from θ_g) and weighs the next round's penalty.

Both loops are :func:`clients.train.local_train` with a hook (:class:`Surrogate`,
:class:`SynapticIntelligence`), so every training option (gradient checkpointing, bf16)
applies to them as to every method.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch

from clients.adapters import load_federated_state
from clients.train import TrainHooks, local_train


def _grad(param: torch.nn.Parameter) -> torch.Tensor:
    return param.grad if param.grad is not None else torch.zeros_like(param)


def si_importance(omega_path: dict[str, torch.Tensor], end: dict[str, torch.Tensor],
                  start: dict[str, torch.Tensor], xi: float) -> dict[str, torch.Tensor]:
    """SI's per-parameter importance of one period: ``relu(ω) / ((θ_end − θ_start)² + xi)``."""
    return {n: torch.relu(omega_path[n]) / ((end[n] - start[n]) ** 2 + xi) for n in omega_path}


class _PathIntegral(TrainHooks, ABC):
    """SI's path integral ``ω −= g_data · Δθ`` over the tensors ``names`` (when ``track``)."""

    def __init__(self, model, names, reference, track: bool) -> None:
        self.named = dict(model.named_parameters())
        self.names = list(names)
        self.reference = reference
        self.track = track
        self.path = {n: torch.zeros_like(self.named[n]) for n in self.names} if track else None
        self._data_grad: dict[str, torch.Tensor] = {}
        self._before: dict[str, torch.Tensor] = {}

    @abstractmethod
    def data_gradient(self, name: str) -> torch.Tensor:
        """The gradient of the data term alone, recovered from the whole objective's."""

    def after_backward(self) -> None:
        if self.track:
            with torch.no_grad():
                self._data_grad = {n: self.data_gradient(n) for n in self.names}
                self._before = {n: self.named[n].detach().clone() for n in self.names}

    def after_step(self) -> None:
        if self.track:
            with torch.no_grad():
                for n in self.names:
                    self.path[n] -= self._data_grad[n] * (self.named[n] - self._before[n])


class Surrogate(_PathIntegral):
    """The PSM's objective ``lam·L + (1 − lam)/2·||v − θ_g||²``, tracking SI's path integral."""

    def __init__(self, model, names, reference, lam: float) -> None:
        super().__init__(model, names, reference, track=True)
        self.data_weight = float(lam)

    def penalty(self) -> torch.Tensor:
        return 0.5 * (1 - self.data_weight) * sum(((self.named[n] - self.reference[n]) ** 2).sum()
                                                  for n in self.names)

    def data_gradient(self, name: str) -> torch.Tensor:
        lam = self.data_weight
        return (_grad(self.named[name]) - (1 - lam) * (self.named[name] - self.reference[name])) / lam


class SynapticIntelligence(_PathIntegral):
    """The SI penalty ``c·Σ Ω (θ − θ_ref)²`` (its mean is reported as ``si-penalty``); with
    ``track`` also SI's path integral of this training."""

    def __init__(self, model, names, reference, omega, c: float, track: bool) -> None:
        super().__init__(model, names, reference, track)
        self.omega = omega
        self.c = float(c)
        self.penalties: list[float] = []

    def penalty(self) -> torch.Tensor | float:
        value = self.c * sum((self.omega[n] * (self.named[n] - self.reference[n]) ** 2).sum() for n in self.names)
        self.penalties.append(float(value.detach()) if torch.is_tensor(value) else float(value))
        return value

    def data_gradient(self, name: str) -> torch.Tensor:
        return _grad(self.named[name]) - 2 * self.c * self.omega[name] * (self.named[name] - self.reference[name])

    def metrics(self) -> dict[str, float]:
        return {"si-penalty": float(np.mean(self.penalties))} if self.penalties else {}


def surrogate_path(model, task, names, reference, train_cfg, *, steps: int, lam: float, seed: int):
    """Train the PSM from ``reference`` (θ_g) for ``steps`` steps; return (ω path integral, end state, mean loss).

    The model is put back to ``reference`` afterwards.
    """
    hooks = Surrogate(model, names, reference, lam)
    metrics = local_train(model, task, train_cfg, seed=seed, hooks=hooks, steps=steps)
    end = {n: hooks.named[n].detach().clone() for n in hooks.names}
    load_federated_state(model, reference)
    return hooks.path, end, metrics["loss"]


def si_local_train(model, task, train_cfg, *, seed: int, names, reference, omega, c: float, track: bool):
    """``train.local_steps`` steps of :func:`clients.train.local_train` on ``L_k + c·Σ Ω (θ − θ_ref)²``.

    Returns (metrics, SI's path integral of this training, or None without ``track``).
    """
    hooks = SynapticIntelligence(model, names, reference, omega, c, track)
    metrics = local_train(model, task, train_cfg, seed=seed, hooks=hooks)
    return metrics, hooks.path


def ssi_round(model, task, names, reference, omega, train_cfg, *, c: float, lam: float, xi: float,
              psm_steps: int, seed: int) -> dict[str, float]:
    """One FedSSI round on a client whose model holds ``reference`` (θ_g): steps 1–3 of the
    module docstring. ``omega`` (Ω) is updated in place; returns the training metrics."""
    if psm_steps < 0 or xi <= 0 or c < 0 or not 0 < lam <= 1:
        raise ValueError(f"algorithm.ssi needs psm_steps >= 0, xi > 0, c >= 0 and 0 < lam <= 1; got "
                         f"psm_steps={psm_steps}, xi={xi}, c={c}, lam={lam}")
    extra = {}
    if psm_steps > 0:  # importance from the personalised surrogate, used this round
        path, end, psm_loss = surrogate_path(model, task, names, reference, train_cfg, steps=psm_steps, lam=lam,
                                             seed=seed + 1)
        for n, value in si_importance(path, end, reference, xi).items():
            omega[n] += value
        extra["psm-loss"] = psm_loss
    metrics, path = si_local_train(model, task, train_cfg, seed=seed, names=names, reference=reference,
                                   omega=omega, c=c, track=psm_steps == 0)
    if path is not None:  # classic SI: this round's path weighs the next round's penalty
        params = dict(model.named_parameters())
        end = {n: params[n].detach() for n in names}
        for n, value in si_importance(path, end, reference, xi).items():
            omega[n] += value
    metrics.update(extra)
    metrics["omega-mean"] = float(torch.cat([v.flatten() for v in omega.values()]).mean())
    return metrics
