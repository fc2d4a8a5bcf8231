"""FedSSI as a Postcard method (``algorithm=fedssi``): Flower glue only.

The method (a personalised surrogate model, synaptic-intelligence importance Ω, training
with the SI penalty) is ``clients.fedssi``; this module keeps each node's Ω in its
``context.state`` between rounds (it never travels), takes the regularisation the server
sends each round (``ssi-c``, ``ssi-lambda``; :class:`strategies.fedssi.FedSSI`), and
replies with the trained adapter. Evaluation scores the global adapter (FedSSI has no
personalised model to evaluate).
"""

from __future__ import annotations


from fedapps.baselines import plan_lora_server, prepare, restore
from fedapps.method import ClientCall, Method, ServerPlan, Update
from strategies import codec
from strategies.fedssi import FedSSI

OMEGA = "fedssi.omega"  # context.state: this node's accumulated SI importance Ω


# ---------------------------------------------------------------------------- client
def train(call: ClientCall) -> Update:
    import torch

    from clients.adapters import federated_state, load_federated_state
    from clients.fedssi import ssi_round
    from clients.train import local_metrics

    cfg, s, context = call.cfg, call.session, call.context
    names = s.extra["names"]
    device = next(s.model.parameters()).device
    reference = {k: torch.from_numpy(v).to(device) for k, v in codec.decode(call.arrays).items()}
    load_federated_state(s.model, reference)
    ssi = cfg.algorithm.ssi
    if OMEGA in context.state.array_records:
        omega = {k: torch.from_numpy(v).to(device) for k, v in codec.decode(context.state.array_records[OMEGA]).items()}
    else:
        omega = {n: torch.zeros_like(reference[n]) for n in names}
    metrics = ssi_round(s.model, s.task, names, reference, omega, cfg.train, c=float(call.config.get("ssi-c", ssi.c)),
                        lam=float(call.config.get("ssi-lambda", ssi.lam)), xi=float(ssi.xi),
                        psm_steps=int(ssi.psm_steps), seed=call.seed)
    context.state[OMEGA] = codec.encode({k: v.cpu().numpy() for k, v in omega.items()}, "fp32")
    if call.scores_local:
        metrics.update(local_metrics(s.model, s.task, cfg.eval))
    state = federated_state(s.model, names)
    return Update(metrics, codec.encode({k: v.numpy() for k, v in state.items()}, str(cfg.algorithm.payload)))


def evaluate(call: ClientCall) -> dict:
    import torch

    from clients.adapters import load_federated_state
    from clients.train import evaluate as evaluate_model

    s = call.session
    load_federated_state(s.model, {k: torch.from_numpy(v) for k, v in codec.decode(call.arrays).items()})
    return evaluate_model(s.model, s.task, call.cfg.eval)


# ---------------------------------------------------------------------------- server
def plan_server(cfg, *, on_round_end, config_yaml: str) -> ServerPlan:
    ssi = cfg.algorithm.ssi
    return plan_lora_server(cfg, FedSSI, on_round_end=on_round_end, config_yaml=config_yaml,
                            c=float(ssi.c), lam=float(ssi.lam))


METHOD = Method("fedssi", prepare, train, evaluate, plan_server, restore, strategy=FedSSI)  # the global adapter
