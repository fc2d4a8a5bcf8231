"""FedSSI as its own ServerApp/ClientApp pair (``algorithm=fedssi``): Flower glue only.

The method (a personalised surrogate model, synaptic-intelligence importance Ω, training
with the SI penalty) is ``clients.fedssi``; this module keeps each node's Ω in its
``context.state`` between rounds (it never travels), takes the regularisation the server
sends each round (``ssi-c``, ``ssi-lambda``; :class:`strategies.fedssi.FedSSI`), and
replies with the trained adapter. Evaluation scores the global adapter (FedSSI has no
personalised model to evaluate).
"""

from __future__ import annotations

import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from clients.adapters import federated_state, load_federated_state
from clients.fedssi import ssi_round
from clients.train import evaluate as evaluate_model
from clients.train import local_metrics
from fedapps.algorithms import ServerPlan
from fedapps.baselines import plan_lora_server, prepare, round_seed
from fedapps.session import client_config, reply, session
from strategies import codec
from strategies.fedssi import FedSSI

OMEGA = "fedssi.omega"  # context.state: this node's accumulated SI importance Ω


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
    seed = round_seed(cfg, int(config["server-round"]), s.partition_id)
    if OMEGA in context.state.array_records:
        omega = {k: torch.from_numpy(v).to(device) for k, v in codec.decode(context.state.array_records[OMEGA]).items()}
    else:
        omega = {n: torch.zeros_like(reference[n]) for n in names}
    metrics = ssi_round(s.model, s.task, names, reference, omega, cfg.train, c=float(config.get("ssi-c", ssi.c)),
                        lam=float(config.get("ssi-lambda", ssi.lam)), xi=float(ssi.xi), psm_steps=int(ssi.psm_steps),
                        seed=seed)
    context.state[OMEGA] = codec.encode({k: v.cpu().numpy() for k, v in omega.items()}, "fp32")
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
