"""FedALA as a Postcard method (``algorithm=fedala``): Flower glue only.

The method — Adaptive Local Aggregation of each new global LoRA adapter into the client's
own (FedALA, Zhang et al., AAAI 2023) — is ``clients.fedala``. This module keeps each
node's adapter, its ALA weights and which global it absorbed last in ``context.state``,
runs ALA once per new global (at the evaluation after aggregation, or at training if the
client did not evaluate it, as FedALA's round send → ALA → evaluate → train), trains with
the one local loop and replies with the trained adapter; the server averages
(:class:`strategies.fedala.FedALA`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import hashlib

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context

from fedapps.baselines import plan_lora_server, prepare, restore
from fedapps.method import ClientCall, Method, ServerPlan, Update, round_seed
from strategies import codec
from strategies.fedala import FedALA

if TYPE_CHECKING:  # annotations only
    import torch

LOCAL = "fedala.local"  # context.state: this node's own adapter
WEIGHTS = "fedala.weights"  # context.state: its ALA weights (top tensors)
STATUS = "fedala.status"  # context.state: which global it absorbed last, start phase done or not


# ---------------------------------------------------------------------------- client
def fingerprint(arrays: ArrayRecord) -> str:
    """Identity of a global adapter (its tensors' names and bytes)."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        digest.update(name.encode())
        digest.update(arrays[name].data)
    return digest.hexdigest()[:32]


def _tensors(record: ArrayRecord) -> dict[str, torch.Tensor]:
    import torch

    return {k: torch.from_numpy(v) for k, v in codec.decode(record).items()}


def _store(context: Context, key: str, state: dict[str, torch.Tensor]) -> None:
    context.state[key] = codec.encode({k: v.detach().cpu().numpy() for k, v in state.items()}, "fp32")


def absorb_global(s, context: Context, arrays: ArrayRecord, server_round: int) -> dict[str, float]:
    """Bring this node's adapter up to date with the global one ``arrays`` (once per global).

    Leaves the node's (ALA'd) adapter in the model; returns ALA metrics.
    """
    import torch

    from clients.adapters import load_federated_state
    from clients.fedala import adaptive_local_aggregation, model_order

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
    flat = torch.cat([w.flatten() for w in result.weights.values()])
    return {"ala-passes": len(result.losses), "ala-loss": result.losses[-1], "ala-weight-mean": float(flat.mean()),
            "ala-weight-min": float(flat.min()), "ala-weight-max": float(flat.max()),
            "ala-converged": int(result.converged)}


def train(call: ClientCall) -> Update:
    from clients.adapters import federated_state
    from clients.train import local_metrics, local_train

    cfg, s = call.cfg, call.session
    ala_metrics = absorb_global(s, call.context, call.arrays, call.server_round)
    metrics = local_train(s.model, s.task, cfg.train, seed=call.seed)
    metrics.update(ala_metrics)
    if call.scores_local:
        metrics.update(local_metrics(s.model, s.task, cfg.eval))
    state = federated_state(s.model, s.extra["names"])
    _store(call.context, LOCAL, state)
    return Update(metrics, codec.encode({k: v.numpy() for k, v in state.items()}, str(cfg.algorithm.payload)))


def evaluate(call: ClientCall) -> dict:
    from clients.train import evaluate as evaluate_model

    s = call.session
    ala_metrics = absorb_global(s, call.context, call.arrays, call.server_round)
    metrics = evaluate_model(s.model, s.task, call.cfg.eval)  # the personalised (ALA'd) adapter
    metrics.update(ala_metrics)
    return metrics


# ---------------------------------------------------------------------------- server
def plan_server(cfg, *, on_round_end, config_yaml: str) -> ServerPlan:
    return plan_lora_server(cfg, FedALA, on_round_end=on_round_end, config_yaml=config_yaml)


# ---------------------------------------------------------------------------- reading a run
def ala_weights_by_round(records: list[dict]) -> list[dict]:
    """The clients' ALA weights after each round's ALA, from a run's round records (``fedapps.outputs.read_metrics``:
    the ``ala-weight-*``
    metrics of :func:`absorb_global`): min of the minima, mean of the means, max of the maxima (rounds
    where no client ran ALA are left out). Read by the benchmarks that report whether the weights move."""
    import statistics

    rows = []
    for record in records:
        clients = [c for c in record["clients"] if "eval_ala-weight-mean" in c]
        if clients:
            rows.append({"round": record["round"],
                         "min": min(c.get("eval_ala-weight-min", c["eval_ala-weight-mean"]) for c in clients),
                         "mean": statistics.fmean(c["eval_ala-weight-mean"] for c in clients),
                         "max": max(c.get("eval_ala-weight-max", c["eval_ala-weight-mean"]) for c in clients)})
    return rows


METHOD = Method("fedala", prepare, train, evaluate, plan_server, restore, strategy=FedALA)  # the global adapter
