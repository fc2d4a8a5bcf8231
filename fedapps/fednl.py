"""FedNL as a Postcard method (``algorithm=fednl``).

Federated nested learning (SPEC.md, "FedNL"): the three loops map onto Flower as

* L2, inference on the client: each attention layer's delta-rule memory S, written token
  by token, restarting at zero for every sequence (``clients.fednl``). S is activation
  state, never a parameter: it is never stored, sent or aggregated.
* L1, training on the client: θ is trained by backpropagation through the memory (the
  chunked WY/UT form), ``train.local_steps`` AdamW steps per round (``clients.train``).
* L0, the server: example-weighted FedAvg of θ (:class:`strategies.fednl.FedNL`).

The model is built as ``add_delta_memory`` → PEFT LoRA on q/k/v → ``mark_trainable``
(PEFT freezes everything that is not LoRA, the gate and β included). What goes up:

* ``algorithm.mode=meta-rules`` (default): LoRA q/k/v + gate + β;
* ``algorithm.mode=gate``: gate + β only. LoRA is still trained, but stays on the client:
  each node keeps its own LoRA in ``context.state`` between rounds (one Ray actor serves
  several simulated nodes with one shared model, so the node's LoRA is loaded into the
  model at every message, and the shared seeded init is used until the node has one).

With ``algorithm.eval_local`` each client also scores its freshly trained model on its
test split before replying (``local-accuracy``): against the federated model's score of
the same round (the evaluation that follows aggregation) it gives the aggregation drop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from flwr.app import Context
from safetensors.numpy import load_file, save_file

from clients.fednl.config import FedNLConfig
from fedapps.channel import server_channel
from fedapps.method import (ClientCall, ConfigError, Method, ServerPlan, Update, final_file, learning_rates,
                            strategy_settings, uplink_kwargs)
from fedapps.session import uplink_record
from strategies import codec
from strategies.fednl import MODES as PAYLOAD_MODES
from strategies.fednl import FedNL, gate_alpha

if TYPE_CHECKING:  # annotations only
    import torch

LOCAL_LORA = "fednl.local-lora"  # context.state key of a node's own LoRA (payload mode 'gate')
QKV = ("q_proj", "k_proj", "v_proj")


class FedNLSetupError(ValueError):
    pass


# ---------------------------------------------------------------------------- model
def payload_mode(cfg) -> str:
    mode = str(cfg.algorithm.get("mode", "meta-rules"))
    if mode not in PAYLOAD_MODES:
        raise FedNLSetupError(f"algorithm.mode must be one of {PAYLOAD_MODES}, got '{mode}'")
    return mode


def memory_config(cfg) -> FedNLConfig:
    """``cfg.algorithm.memory`` -> :class:`FedNLConfig` (which validates every value)."""
    memory = cfg.algorithm.memory
    window, use_fla = memory.get("window"), memory.get("use_fla")
    try:
        return FedNLConfig(
            chunk_size=int(memory.chunk_size),
            window=None if window is None else int(window),
            sink=memory.get("sink", FedNLConfig.sink),
            gate=str(memory.gate),
            gate_init_logit=float(memory.gate_init_logit),
            beta=str(memory.beta),
            beta_init_logit=float(memory.beta_init_logit),
            qk_activation=str(memory.qk_activation),
            use_fla=use_fla if use_fla is None else bool(use_fla),
            memory_heads=str(memory.get("memory_heads", FedNLConfig.memory_heads)),
            key_centering=memory.get("key_centering", FedNLConfig.key_centering),
            layers=None if memory.get("layers") is None else [int(i) for i in memory.layers],
        )
    except (TypeError, ValueError) as err:
        raise FedNLSetupError(f"invalid algorithm.memory: {err}") from None


def check(cfg) -> None:
    """FedNL's ``algorithm.memory`` as its clients will build it (:func:`memory_config`), when the config is
    composed: a bad window, sink or gate fails there, not after the simulation has started."""
    try:
        memory_config(cfg)
    except FedNLSetupError as err:
        raise ConfigError(str(err)) from None


def prepare(cfg):
    """Backbone + delta memory + LoRA on q/k/v, with θ trainable.

    ``extra``: ``names`` (the payload θ, in model order), ``local_names`` (what stays on
    the client: the LoRA in mode 'gate', nothing otherwise), ``local_init`` (their
    shared seeded values) and ``mode``.
    """
    import torch

    from clients.adapters import apply_lora, federated_state
    from clients.fednl import add_delta_memory, mark_trainable, meta_rule_names
    from clients.models import build_model

    mode = payload_mode(cfg)
    if cfg.model.kind != "causal_lm":
        raise FedNLSetupError(f"FedNL adds a memory to a causal LM's attention; model '{cfg.model.name}' is not one")
    lora = cfg.algorithm.lora
    if lora.get("send", "all") != "all":
        raise FedNLSetupError("FedNL trains both LoRA factors: algorithm.lora.send must be 'all'")
    extra_targets = sorted(set(lora.target_modules) - set(QKV))
    if extra_targets:
        raise FedNLSetupError(
            f"FedNL's θ has LoRA on q_proj/k_proj/v_proj only; remove {extra_targets} from algorithm.lora.target_modules"
        )
    model, tokenizer = build_model(cfg)
    add_delta_memory(model, memory_config(cfg))
    model = apply_lora(model, lora, seed=int(cfg.seed))
    trainable = mark_trainable(model)  # after PEFT, which froze the gate and β
    names = meta_rule_names(model, mode)
    if cfg.algorithm.get("ablate_memory", False):  # α = 0 exactly: the backbone's attention (+ LoRA), bit for bit
        for name, param in model.named_parameters():
            if name.endswith("fednl_gate"):
                with torch.no_grad():
                    param.fill_(ABLATED_GATE_LOGIT)
                param.requires_grad_(False)
        # the fixed gate is neither trained nor federated: every side sets it here, a reply cannot move
        # it, and its logit (-100) lies beyond what the server accepts for a gate (strategies.fednl.MEMORY_BOUND)
        trainable = [n for n in trainable if not n.endswith("fednl_gate")]
        names = [n for n in names if not n.endswith("fednl_gate")]
    sent = set(names)
    local = [n for n in trainable if n not in sent]
    extra = {"names": names, "local_names": local, "local_init": federated_state(model, local), "mode": mode}
    return model, tokenizer, extra


ABLATED_GATE_LOGIT = -100.0  # sigmoid(-100) is 0 in float32: the memory path contributes nothing
LR_PATTERNS = {"gate": "fednl_gate", "beta": "fednl_beta", "lora": "lora_"}  # algorithm.lr key -> parameter names


def load_theta(model, arrays) -> dict[str, torch.Tensor]:
    """Decode a θ ArrayRecord (validated by the codec) into the model's parameters."""
    import torch

    from clients.adapters import load_federated_state

    state = {k: torch.from_numpy(v) for k, v in codec.decode(arrays).items()}
    load_federated_state(model, state)
    return state


def load_final(cfg, path):
    """The model of a finished run: ``prepare(cfg)`` + the saved global θ.

    In mode 'gate' the LoRA is the shared init (each client's own LoRA stayed with it).
    """
    import torch

    from clients.adapters import load_federated_state

    model, tokenizer, extra = prepare(cfg)
    state = load_file(str(path))
    missing = sorted(set(extra["names"]) - set(state))
    if missing:
        raise FedNLSetupError(f"{path} lacks θ tensors {missing[:3]}; was it written with this configuration?")
    load_federated_state(model, {k: torch.from_numpy(v) for k, v in state.items()})
    return model, tokenizer


# ---------------------------------------------------------------------------- client helpers
def restore_local(s, context: Context) -> None:
    """Load this node's own LoRA (mode 'gate'), or the shared init before it has one."""
    import torch

    from clients.adapters import load_federated_state

    if not s.extra["local_names"]:
        return
    if LOCAL_LORA in context.state.array_records:
        state = {k: torch.from_numpy(v) for k, v in codec.decode(context.state.array_records[LOCAL_LORA]).items()}
    else:
        state = s.extra["local_init"]
    load_federated_state(s.model, state)


def keep_local(s, context: Context) -> None:
    from clients.adapters import federated_state

    if s.extra["local_names"]:
        state = federated_state(s.model, s.extra["local_names"])
        context.state[LOCAL_LORA] = codec.encode({k: v.numpy() for k, v in state.items()}, "fp32")


def gate_metrics(model) -> dict[str, float]:
    from clients.fednl import memory_gate_values

    alphas = memory_gate_values(model)
    return {"gate-alpha-mean": float(np.mean(alphas)), "gate-alpha-max": float(np.max(alphas))}


# ---------------------------------------------------------------------------- client
def train(call: ClientCall) -> Update:
    from clients.adapters import federated_state
    from clients.train import local_metrics, local_train
    from fedapps.latent import latent_training

    cfg, s = call.cfg, call.session
    received = load_theta(s.model, call.arrays)
    restore_local(s, call.context)
    with latent_training(call, s.model, s.extra["names"]) as latent:  # None unless channel=latent
        metrics = local_train(s.model, s.task, cfg.train, seed=call.seed, lr_by_name=learning_rates(cfg, LR_PATTERNS))
    metrics.update(gate_metrics(s.model))
    if call.scores_local:
        metrics.update(local_metrics(s.model, s.task, cfg.eval))
    keep_local(s, call.context)
    if latent is not None:
        return Update(metrics, latent.record(cfg, call.context, call.seed))
    theta = federated_state(s.model, s.extra["names"])
    return Update(metrics, uplink_record(cfg, call.context, {k: v.numpy() for k, v in theta.items()},
                                         {k: v.numpy() for k, v in received.items()}, call.seed))


def evaluate(call: ClientCall) -> dict:
    from clients.train import evaluate as evaluate_model

    s = call.session
    load_theta(s.model, call.arrays)
    restore_local(s, call.context)
    metrics = evaluate_model(s.model, s.task, call.cfg.eval)
    metrics.update(gate_metrics(s.model))
    return metrics


# ---------------------------------------------------------------------------- server
def plan_server(cfg, *, on_round_end, config_yaml: str) -> ServerPlan:
    from clients.adapters import federated_state

    model, _, extra = prepare(cfg)
    initial = {k: v.numpy() for k, v in federated_state(model, extra["names"]).items()}
    del model  # the server needs θ's layout and initial values, not the model
    mode = extra["mode"]
    strategy = FedNL(
        mode=mode,
        initial_state=initial,
        **strategy_settings(cfg, config_yaml=config_yaml, on_round_end=on_round_end),
        **uplink_kwargs(cfg.algorithm),
        channel=server_channel(cfg, initial),
    )

    def save_final(global_state: dict[str, np.ndarray], run_dir) -> dict:
        target = run_dir / "fednl_theta.safetensors"  # fedapps.fednl.load_final(cfg, target) reloads it
        save_file({k: np.ascontiguousarray(v) for k, v in global_state.items()}, str(target),
                  metadata={"algorithm": "fednl", "mode": mode})
        return {"final_state": str(target), "payload_mode": mode, "final_gate_alpha": gate_alpha(global_state)}

    return ServerPlan(strategy=strategy, save_final=save_final)


def restore(cfg, run_dir):
    return load_final(cfg, final_file(run_dir, "fednl_theta.safetensors"))


METHOD = Method("fednl", prepare, train, evaluate, plan_server, restore, check=check, errors=(FedNLSetupError,),
                export="FedNL's delta-rule memory is part of no Hugging Face architecture", strategy=FedNL)
