"""FedSSI as its own ServerApp/ClientApp pair (``algorithm=fedssi``).

FedSSI (Li et al., "Rehearsal-Free Continual Federated Learning with Synergistic
Synaptic Intelligence", ICML 2025; no public code) regularises local training with
synaptic intelligence (SI; Zenke et al., 2017) whose importances come from a
*personalised surrogate model* (PSM) that balances the client's data against the global
model. Re-implemented here from the paper's description over PEFT LoRA adapters; each
round, on each client (``algorithm.ssi``):

1. **PSM** (``psm_steps`` AdamW steps from the global adapter θ_g) on
   ``lam · L_k(v) + (1 − lam)/2 · ||v − θ_g||²``, accumulating SI's path integral
   ``ω_i += −g_i · Δv_i`` with ``g = ∂L_k/∂v`` (the data term's gradient) at every step;
   then the PSM is discarded (the model goes back to θ_g).
2. **Importance**: ``Ω_i += relu(ω_i) / ((v_i − θ_g,i)² + xi)``, accumulated over rounds
   and kept on the client only (``context.state``). (``relu``: a parameter whose path
   *raised* the loss is given no importance rather than a negative, non-convex penalty.)
3. **Local training** from θ_g on ``L_k(θ) + c · Σ_i Ω_i (θ_i − θ_g,i)²``; the trained
   adapter goes up, the server averages (:class:`strategies.fedssi.FedSSI`, which also
   sends ``ssi-c`` and ``ssi-lambda`` each round, as FedProx sends its mu).

``psm_steps = 0`` drops the surrogate: Ω then accumulates along the local training path
itself (classic SI, Δ measured from θ_g) and weighs the next round's penalty.
Evaluation scores the global adapter (FedSSI has no personalised model to evaluate).
"""

from __future__ import annotations

import time

import numpy as np
import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from clients.adapters import federated_state, load_federated_state
from clients.train import TrainingError, autocast, local_metrics
from clients.train import evaluate as evaluate_model
from fedapps.algorithms import ServerPlan
from fedapps.baselines import prepare, round_seed
from fedapps.fedala import plan_lora_server
from fedapps.session import client_config, reply, session
from strategies import codec
from strategies.fedssi import FedSSI

OMEGA = "fedssi.omega"  # context.state: this node's accumulated SI importance Ω


def _optimizer(params, train_cfg) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=float(train_cfg.lr), weight_decay=float(train_cfg.get("weight_decay", 0.0)))


def _clip(params, train_cfg) -> None:
    clip = float(train_cfg.get("max_grad_norm", 0.0) or 0.0)
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(params, clip)


def _finite(loss: torch.Tensor, train_cfg) -> None:
    if not torch.isfinite(loss):
        raise TrainingError(f"the training loss became {loss.item()}; lower train.lr (now {train_cfg.lr})")


def _grad(param: torch.nn.Parameter) -> torch.Tensor:
    return param.grad if param.grad is not None else torch.zeros_like(param)


def si_importance(omega_path: dict[str, torch.Tensor], end: dict[str, torch.Tensor],
                  start: dict[str, torch.Tensor], xi: float) -> dict[str, torch.Tensor]:
    """SI's per-parameter importance of one period: ``relu(ω) / ((θ_end − θ_start)² + xi)``."""
    return {n: torch.relu(omega_path[n]) / ((end[n] - start[n]) ** 2 + xi) for n in omega_path}


def surrogate_path(model, task, names, reference, train_cfg, *, steps: int, lam: float, seed: int):
    """Train the PSM from ``reference`` (θ_g) for ``steps`` steps; return (ω path integral, end state, mean loss).

    The model is put back to ``reference`` afterwards.
    """
    named = dict(model.named_parameters())
    params = [named[n] for n in names]
    optimizer = _optimizer(params, train_cfg)
    omega = {n: torch.zeros_like(named[n]) for n in names}
    rng = np.random.default_rng(seed)
    losses = []
    model.eval()
    for batch in task.train_batches(steps, int(train_cfg.batch_size), rng):
        with autocast(model):
            loss = task.loss(model, batch)
        _finite(loss, train_cfg)
        losses.append(loss.item())
        optimizer.zero_grad(set_to_none=True)
        (lam * loss + 0.5 * (1 - lam) * sum(((named[n] - reference[n]) ** 2).sum() for n in names)).backward()
        with torch.no_grad():  # the data term's gradient ∂L_k/∂v, recovered from the total one
            data_grad = {n: (_grad(named[n]) - (1 - lam) * (named[n] - reference[n])) / lam for n in names}
            before = {n: named[n].detach().clone() for n in names}
        _clip(params, train_cfg)
        optimizer.step()
        with torch.no_grad():
            for n in names:
                omega[n] -= data_grad[n] * (named[n] - before[n])
    optimizer.zero_grad(set_to_none=True)
    end = {n: named[n].detach().clone() for n in names}
    load_federated_state(model, reference)
    return omega, end, float(np.mean(losses))


def si_local_train(model, task, train_cfg, *, seed: int, names, reference, omega, c: float, track: bool):
    """``train.local_steps`` AdamW steps on ``L_k + c·Σ Ω (θ − θ_ref)²`` (as ``clients.train.local_train``).

    With ``track`` also returns SI's path integral ω of this training (data-term gradients).
    """
    torch.set_num_threads(max(1, int(train_cfg.get("threads", 1))))
    named = dict(model.named_parameters())
    params = [named[n] for n in names]
    optimizer = _optimizer(params, train_cfg)
    path = {n: torch.zeros_like(named[n]) for n in names} if track else None
    rng = np.random.default_rng(seed)
    losses, penalties = [], []
    start = time.perf_counter()
    model.eval()
    for batch in task.train_batches(int(train_cfg.local_steps), int(train_cfg.batch_size), rng):
        with autocast(model):
            loss = task.loss(model, batch)
        _finite(loss, train_cfg)
        losses.append(loss.item())
        penalty = c * sum((omega[n] * (named[n] - reference[n]) ** 2).sum() for n in names)
        penalties.append(float(penalty.detach()) if torch.is_tensor(penalty) else float(penalty))
        optimizer.zero_grad(set_to_none=True)
        (loss + penalty).backward()
        if track:
            with torch.no_grad():
                data_grad = {n: _grad(named[n]) - 2 * c * omega[n] * (named[n] - reference[n]) for n in names}
                before = {n: named[n].detach().clone() for n in names}
        _clip(params, train_cfg)
        optimizer.step()
        if track:
            with torch.no_grad():
                for n in names:
                    path[n] -= data_grad[n] * (named[n] - before[n])
    optimizer.zero_grad(set_to_none=True)
    metrics = {
        "loss": float(np.mean(losses)),
        "first-loss": float(losses[0]),
        "last-loss": float(losses[-1]),
        "si-penalty": float(np.mean(penalties)),
        "seconds": time.perf_counter() - start,
        "num-examples": int(task.num_train),
    }
    return metrics, path


# ---------------------------------------------------------------------------- client
clientapp = ClientApp()


@clientapp.train()
def train(msg: Message, context: Context) -> Message:
    cfg = client_config(msg, context)
    s = session(cfg, context, prepare)
    names = s.extra["names"]
    device = next(s.model.parameters()).device
    reference = {k: torch.from_numpy(v).to(device) for k, v in codec.decode(msg.content["arrays"]).items()}
    load_federated_state(s.model, reference)
    config = msg.content["config"]
    ssi = cfg.algorithm.ssi
    c = float(config.get("ssi-c", ssi.c))
    lam = float(config.get("ssi-lambda", ssi.lam))
    xi, psm_steps = float(ssi.xi), int(ssi.psm_steps)
    if psm_steps < 0 or xi <= 0 or c < 0 or not 0 < lam <= 1:
        raise ValueError(f"algorithm.ssi needs psm_steps >= 0, xi > 0, c >= 0 and 0 < lam <= 1; got "
                         f"psm_steps={psm_steps}, xi={xi}, c={c}, lam={lam}")
    seed = round_seed(cfg, int(config["server-round"]), s.partition_id)

    if OMEGA in context.state.array_records:
        omega = {k: torch.from_numpy(v).to(device) for k, v in codec.decode(context.state.array_records[OMEGA]).items()}
    else:
        omega = {n: torch.zeros_like(reference[n]) for n in names}
    extra = {}
    if psm_steps > 0:  # importance from the personalised surrogate, used this round
        path, end, psm_loss = surrogate_path(s.model, s.task, names, reference, cfg.train, steps=psm_steps,
                                             lam=lam, seed=seed + 1)
        for n, value in si_importance(path, end, reference, xi).items():
            omega[n] += value
        extra["psm-loss"] = psm_loss
    metrics, path = si_local_train(s.model, s.task, cfg.train, seed=seed, names=names, reference=reference,
                                   omega=omega, c=c, track=psm_steps == 0)
    if path is not None:  # classic SI: this round's path weighs the next round's penalty
        params = dict(s.model.named_parameters())
        end = {n: params[n].detach() for n in names}
        for n, value in si_importance(path, end, reference, xi).items():
            omega[n] += value
    context.state[OMEGA] = codec.encode({k: v.cpu().numpy() for k, v in omega.items()}, "fp32")
    metrics.update(extra)
    metrics["omega-mean"] = float(torch.cat([v.flatten() for v in omega.values()]).mean())
    if cfg.algorithm.get("eval_local", False):
        metrics.update(local_metrics(s.model, s.task, cfg.eval))
    metrics["partition-id"] = s.partition_id
    state = federated_state(s.model, names)
    return reply(msg, metrics, codec.encode({k: v.numpy() for k, v in state.items()}, str(cfg.algorithm.payload)))


@clientapp.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    cfg = client_config(msg, context)
    s = session(cfg, context, prepare)
    load_federated_state(s.model, {k: torch.from_numpy(v) for k, v in codec.decode(msg.content["arrays"]).items()})
    metrics = evaluate_model(s.model, s.task, cfg.eval)
    metrics["partition-id"] = s.partition_id
    return reply(msg, metrics)


# ---------------------------------------------------------------------------- server
def plan_server(cfg, *, on_round_end, config_yaml: str) -> ServerPlan:
    ssi = cfg.algorithm.ssi
    return plan_lora_server(cfg, FedSSI, on_round_end=on_round_end, config_yaml=config_yaml,
                            c=float(ssi.c), lam=float(ssi.lam))
