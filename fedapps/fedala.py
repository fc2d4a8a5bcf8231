"""FedALA as its own ServerApp/ClientApp pair (``algorithm=fedala``).

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
ALA is skipped until the client has an adapter of its own (FedALA's first round).

Two caps the original has not, for CPU budgets (set them to null for the original):
``max_batches`` per pass and ``max_start_epochs`` for the start phase (whose README
warns that a small threshold can make round 1 hang).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message
from flwr.clientapp import ClientApp

from clients.adapters import all_lora_state, federated_state, load_federated_state
from clients.train import autocast, local_metrics, local_train
from clients.train import evaluate as evaluate_model
from fedapps.algorithms import ServerPlan, strategy_settings
from fedapps.baselines import prepare, round_seed
from fedapps.session import client_config, reply, session
from strategies import codec
from strategies.fedala import FedALA

LOCAL = "fedala.local"  # context.state: this node's own adapter
WEIGHTS = "fedala.weights"  # context.state: its ALA weights (top tensors)
STATUS = "fedala.status"  # context.state: which global it absorbed last, start phase done or not


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


# ---------------------------------------------------------------------------- client
def fingerprint(arrays: ArrayRecord) -> str:
    """Identity of a global adapter (its tensors' names and bytes)."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        digest.update(name.encode())
        digest.update(arrays[name].data)
    return digest.hexdigest()[:32]


def _tensors(record: ArrayRecord) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in codec.decode(record).items()}


def _store(context: Context, key: str, state: dict[str, torch.Tensor]) -> None:
    context.state[key] = codec.encode({k: v.detach().cpu().numpy() for k, v in state.items()}, "fp32")


def absorb_global(s, context: Context, arrays: ArrayRecord, server_round: int) -> dict[str, float]:
    """Bring this node's adapter up to date with the global one ``arrays`` (once per global).

    Leaves the node's (ALA'd) adapter in the model; returns ALA metrics.
    """
    names = model_order(s.model, s.extra["names"])
    fp = fingerprint(arrays)
    status = context.state.config_records.get(STATUS)
    has_local = LOCAL in context.state.array_records
    if status is not None and has_local and str(status["global"]) == fp:  # already absorbed
        load_federated_state(s.model, _tensors(context.state.array_records[LOCAL]))
        return {}
    global_state = _tensors(arrays)
    load_federated_state(s.model, global_state)
    if not has_local:  # FedALA's first round: the local model starts as the global one
        _store(context, LOCAL, global_state)
        context.state[STATUS] = ConfigRecord({"global": fp, "start-phase": 1})
        return {"ala-passes": 0}
    weights = _tensors(context.state.array_records[WEIGHTS]) if WEIGHTS in context.state.array_records else None
    start_phase = status is None or int(status["start-phase"]) == 1
    rng = np.random.default_rng(round_seed(s.cfg, server_round, s.partition_id) + 17)
    result = adaptive_local_aggregation(
        s.model, s.task, names, global_state, _tensors(context.state.array_records[LOCAL]), weights,
        s.cfg.algorithm.ala, batch_size=int(s.cfg.train.batch_size), rng=rng, start_phase=start_phase,
    )
    _store(context, LOCAL, result.state)
    _store(context, WEIGHTS, result.weights)
    context.state[STATUS] = ConfigRecord({"global": fp, "start-phase": 0})
    mean_weight = float(torch.cat([w.flatten() for w in result.weights.values()]).mean())
    return {"ala-passes": len(result.losses), "ala-loss": result.losses[-1], "ala-weight-mean": mean_weight,
            "ala-converged": int(result.converged)}


clientapp = ClientApp()


@clientapp.train()
def train(msg: Message, context: Context) -> Message:
    cfg = client_config(msg, context)
    s = session(cfg, context, prepare)
    server_round = int(msg.content["config"]["server-round"])
    ala_metrics = absorb_global(s, context, msg.content["arrays"], server_round)
    metrics = local_train(s.model, s.task, cfg.train, seed=round_seed(cfg, server_round, s.partition_id))
    metrics.update(ala_metrics)
    if cfg.algorithm.get("eval_local", False):
        metrics.update(local_metrics(s.model, s.task, cfg.eval))
    state = federated_state(s.model, s.extra["names"])
    _store(context, LOCAL, state)
    metrics["partition-id"] = s.partition_id
    return reply(msg, metrics, codec.encode({k: v.numpy() for k, v in state.items()}, str(cfg.algorithm.payload)))


@clientapp.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    cfg = client_config(msg, context)
    s = session(cfg, context, prepare)
    server_round = int(msg.content["config"].get("server-round", 0))
    ala_metrics = absorb_global(s, context, msg.content["arrays"], server_round)
    metrics = evaluate_model(s.model, s.task, cfg.eval)  # the personalised (ALA'd) adapter
    metrics.update(ala_metrics)
    metrics["partition-id"] = s.partition_id
    return reply(msg, metrics)


# ---------------------------------------------------------------------------- server
def plan_lora_server(cfg, strategy_cls, *, on_round_end, config_yaml: str, **strategy_kwargs) -> ServerPlan:
    """The server of a LoRA pair whose strategy is a FedAvgLoRA subclass (FedALA, FedSSI)."""
    if cfg.algorithm.trainable != "lora" or cfg.algorithm.lora.get("send", "all") != "all":
        raise ValueError(f"{cfg.algorithm.name} federates whole LoRA adapters: trainable=lora, lora.send=all")
    model, _, _ = prepare(cfg)
    strategy = strategy_cls(
        initial_state={k: v.numpy() for k, v in all_lora_state(model).items()},
        **strategy_settings(cfg, config_yaml=config_yaml, on_round_end=on_round_end),
        uplink_format=str(cfg.algorithm.payload),
        **strategy_kwargs,
    )

    def save_final(global_state: dict[str, np.ndarray], run_dir) -> dict:
        load_federated_state(model, {k: torch.from_numpy(v) for k, v in global_state.items()})
        target = run_dir / "adapter"  # the global adapter; personalised ones stay on the clients
        model.save_pretrained(str(target))
        return {"final_state": str(target)}

    return ServerPlan(strategy=strategy, save_final=save_final)


def plan_server(cfg, *, on_round_end, config_yaml: str) -> ServerPlan:
    return plan_lora_server(cfg, FedALA, on_round_end=on_round_end, config_yaml=config_yaml)
