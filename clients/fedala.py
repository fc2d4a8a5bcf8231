"""FedALA's client method: Adaptive Local Aggregation of a global adapter into a local one.

FedALA (Zhang et al., "FedALA: Adaptive Local Aggregation for Personalized Federated
Learning", AAAI 2023; reference code TsingZ0/FedALA ``system/utils/ALA.py``) over PEFT
LoRA adapters of the frozen backbone. Each client keeps its own adapter between rounds
(``context.state``); when a new global adapter arrives it does not overwrite the local
one but mixes it in by **Adaptive Local Aggregation**:

* the lower LoRA tensors (all but the last ``layer_idx``, in model order) take the global
  values;
* each element of the top tensors becomes ``local + (global − local) · w`` with weights
  ``w ∈ [0, 1]`` (initialised to 1, kept by the client across rounds), learned on a random
  contiguous ``rand_percent`` % slice of the local training data by
  ``w ← clip(w − eta · ∂L/∂θ · (global − local), 0, 1)``, one pass per batch;
* the first time (the "start phase") the passes repeat until the standard deviation of
  the last ``num_pre_loss`` pass losses is below ``threshold``; later rounds make one pass.

As in FedALA's round (send → ALA → evaluate → train), ALA runs when a client first sees a
new global adapter: at the evaluation after aggregation, or at training if it did not
evaluate it; the ALA'd adapter is what is evaluated and what local training starts from.
The client uploads its trained adapter; the server averages (:class:`strategies.fedala.FedALA`).
ALA is skipped until the client has an adapter of its own (FedALA's first round). When ALA
runs and what the node keeps between rounds is Flower glue (``fedapps.fedala``).

Two caps the original has not, for CPU budgets (set them to null for the original):
``max_batches`` per pass and ``max_start_epochs`` for the start phase (whose README
warns that a small threshold can make round 1 hang).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from clients.train import autocast


class ALAError(ValueError):
    pass


@dataclass
class ALAResult:
    state: dict[str, torch.Tensor]  # the adapter after ALA (every tensor)
    weights: dict[str, torch.Tensor]  # learned weights of the top tensors
    losses: list[float] = field(default_factory=list)  # last batch loss of each pass
    converged: bool = False


def model_order(model, names) -> list[str]:
    """``names`` in the order of ``model.named_parameters()`` (bottom layer first)."""
    wanted = set(names)
    return [n for n, _ in model.named_parameters() if n in wanted]


def adaptive_local_aggregation(
    model,
    task,
    names: list[str],
    global_state: dict[str, torch.Tensor],
    local_state: dict[str, torch.Tensor],
    weights: dict[str, torch.Tensor] | None,
    ala,
    *,
    batch_size: int,
    rng: np.random.Generator,
    start_phase: bool,
) -> ALAResult:
    """ALA of ``global_state`` into ``local_state`` over the tensors ``names`` (model order).

    Leaves the result in the model and returns it with the updated weights. ``ala`` holds
    rand_percent, layer_idx, eta, threshold, num_pre_loss, max_batches, max_start_epochs.
    """
    layer_idx = int(ala.layer_idx)
    if not 0 < layer_idx <= len(names):
        raise ALAError(f"algorithm.ala.layer_idx must be in 1..{len(names)} (the adapter's tensors), got {layer_idx}")
    if not 0 < float(ala.rand_percent) <= 100:
        raise ALAError(f"algorithm.ala.rand_percent must be in (0, 100], got {ala.rand_percent}")
    lower, top = names[:-layer_idx], names[-layer_idx:]
    params = dict(model.named_parameters())
    if weights is None or set(weights) != set(top):
        weights = {n: torch.ones_like(global_state[n]) for n in top}
    glob = {n: global_state[n].to(params[n].device, params[n].dtype) for n in top}
    diff = {n: glob[n] - local_state[n].to(params[n].device, params[n].dtype) for n in top}
    weights = {n: w.to(params[n].device, params[n].dtype) for n, w in weights.items()}

    def mix() -> None:  # θ_top = local + (global − local) · w
        with torch.no_grad():
            for n in top:
                params[n].copy_(glob[n] - diff[n] + diff[n] * weights[n])

    with torch.no_grad():
        for n in lower:  # lower layers: the global values
            params[n].copy_(global_state[n])
    mix()

    # a random contiguous slice of rand_percent % of the training split, in batches
    train_idx = task.train_idx
    count = max(1, int(float(ala.rand_percent) / 100 * len(train_idx)))
    start = int(rng.integers(0, len(train_idx) - count + 1))
    subset = train_idx[start : start + count]
    batches = [subset[i : i + batch_size] for i in range(0, len(subset), batch_size)]
    if ala.get("max_batches"):
        batches = batches[: int(ala.max_batches)]

    eta, threshold, num_pre_loss = float(ala.eta), float(ala.threshold), int(ala.num_pre_loss)
    max_passes = int(ala.get("max_start_epochs") or 0)
    grad_flags = {n: params[n].requires_grad for n in names}
    for n in names:  # gradients only where weights are learned
        params[n].requires_grad_(n in top)
    losses, converged = [], False
    model.eval()
    try:
        while True:
            for idx in batches:
                with autocast(model):
                    loss = task.loss(model, task.collate(idx))
                grads = torch.autograd.grad(loss, [params[n] for n in top])
                with torch.no_grad():
                    for n, grad in zip(top, grads):
                        weights[n] = torch.clamp(weights[n] - eta * grad * diff[n], 0.0, 1.0)
                mix()
            losses.append(float(loss.item()))
            if not start_phase:
                break
            if len(losses) > num_pre_loss and float(np.std(losses[-num_pre_loss:])) < threshold:
                converged = True
                break
            if max_passes and len(losses) >= max_passes:
                break
    finally:
        for n, flag in grad_flags.items():
            params[n].requires_grad_(flag)
    state = {n: params[n].detach().clone() for n in names}
    return ALAResult(state=state, weights={n: w.detach().clone() for n, w in weights.items()}, losses=losses,
                     converged=converged)
