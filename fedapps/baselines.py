"""The baseline methods: fedavg-lora, fedprox, ffa-lora, fedavg-full, topk-ef, powersgd.

Clients train PEFT LoRA adapters (or every weight, for ``fedavg-full`` and its compressed
variants) of the backbone and send the federated tensors; the strategies live in
``strategies.baselines``. FedALA and FedSSI reuse the LoRA model (:func:`prepare`) and
server (:func:`plan_lora_server`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from safetensors.numpy import load_file, save_file

from fedapps.channel import received_state, server_channel, settings_of
from strategies.channel import LatentSync
from fedapps.filemodes import secure_tree
from fedapps.method import (ClientCall, FinalStateError, Method, ServerPlan, Update, final_file, strategy_settings,
                            uplink_kwargs)
from fedapps.session import uplink_record
from strategies.baselines import FedAvgFull, FedAvgLoRA, FedProx, FFALoRA

if TYPE_CHECKING:  # annotations only
    import torch


def prepare(cfg):
    """Backbone + what the algorithm trains; ``extra['names']`` = the federated tensors."""
    from clients.adapters import apply_lora, federated_names, federated_state
    from clients.models.heads import frozen_head_
    from clients.models import build_model

    model, tokenizer = build_model(cfg)
    if cfg.algorithm.trainable == "lora":
        if cfg.model.kind == "vision":  # LoRA adapts the features; the classifier is FLITE's frozen one
            frozen_head_(model, seed=int(cfg.seed))
        pooled = pool_deltas(cfg, model) if cfg.algorithm.lora.get("init", "random") == "pool" else None
        model = apply_lora(model, cfg.algorithm.lora, seed=int(cfg.seed))
        if pooled is not None:
            from clients.adapters import AdapterError, warm_start_lora

            if not warm_start_lora(model, pooled):
                raise AdapterError(f"algorithm.lora.init=pool: the pool's adapters target none of this run's LoRA "
                                   f"modules ({list(cfg.algorithm.lora.target_modules)})")
    else:
        model.requires_grad_(True)
    extra = {"names": federated_names(model, cfg.algorithm)}
    settings = settings_of(cfg)
    if settings is not None and settings.downlink == "latent":  # θ_fed,0: what the latent downlink replays from
        extra["initial"] = {k: v.numpy().copy() for k, v in federated_state(model, extra["names"]).items()}
    return model, tokenizer, extra


def pool_deltas(cfg, model) -> dict[str, np.ndarray]:
    """``algorithm.lora.init=pool``: per target matrix, the mean ΔW of the knowledge pool's adapters that
    adapt it (the pool SmartFed mixes: ``algorithm.pool``, ``algorithm.adapters``); the LoRA starts from
    its best rank-r fit (``clients.adapters.warm_start_lora``), so FedAvg-LoRA reuses the same knowledge
    at its own bytes. ``model``: the backbone before LoRA (its fingerprint must be the pool's)."""
    from clients.adapters import AdapterError
    from clients.pool import PoolError, backbone_fingerprint
    from fedapps.pool import open_pool

    try:
        _, _, experts = open_pool(cfg, backbone_fingerprint(model))
    except PoolError as err:
        raise AdapterError(f"algorithm.lora.init=pool: {err}") from None
    return {module: es.delta_weight() / len({es.source(i)[0] for i in range(len(es))})
            for module, es in experts.items()}


def check(cfg) -> None:
    """The LoRA baselines' own settings: ``algorithm.lora.init`` (random | pool)."""
    from fedapps.method import ConfigError

    lora = cfg.algorithm.get("lora")
    if lora is None:
        return
    init = lora.get("init", "random")
    if init not in ("random", "pool"):
        raise ConfigError(f"algorithm.lora.init must be random or pool, got {init!r}")
    if init == "pool" and cfg.model.kind != "causal_lm":
        raise ConfigError("algorithm.lora.init=pool starts from a knowledge pool of causal-LM adapters "
                          f"(postcard pool build); model '{cfg.model.name}' is {cfg.model.kind}")


def load_global(call: ClientCall) -> dict[str, torch.Tensor]:
    """The downlink (validated by the codec; a latent one replayed) into the model's federated tensors;
    returns them."""
    import torch

    from clients.adapters import load_federated_state

    s = call.session
    values = received_state(call.cfg, call.arrays, s.extra.get("initial", {}), store=call.context.state,
                            since=int(call.config.get(LatentSync.SINCE, 0) or 0),
                            snapshot=int(call.config.get(LatentSync.SNAPSHOT, 0) or 0))
    state = {k: torch.from_numpy(v) for k, v in values.items()}
    load_federated_state(s.model, state)
    return state


# ---------------------------------------------------------------------------- client
def train(call: ClientCall) -> Update:
    from clients.adapters import federated_state
    from clients.train import local_metrics, local_train
    from fedapps.latent import latent_training

    cfg, s = call.cfg, call.session
    received = load_global(call)
    mu = float(call.config.get("proximal-mu", 0.0))
    with latent_training(call, s.model, s.extra["names"]) as latent:  # None unless channel=latent
        metrics = local_train(
            s.model, s.task, cfg.train,
            seed=call.seed,
            proximal_mu=mu, reference=received if mu > 0 else None,
        )
    if call.scores_local:  # the aggregation drop: this model vs the federated one
        metrics.update(local_metrics(s.model, s.task, cfg.eval))
    if latent is not None:
        return Update(metrics, latent.record(cfg, call.context, call.seed))
    state = federated_state(s.model, s.extra["names"])
    arrays = uplink_record(cfg, call.context, {k: v.numpy() for k, v in state.items()},
                           {k: v.numpy() for k, v in received.items()}, call.seed)
    return Update(metrics, arrays)


def evaluate(call: ClientCall) -> dict:
    from clients.train import evaluate as evaluate_model

    load_global(call)
    return evaluate_model(call.session.model, call.session.task, call.cfg.eval)


# ---------------------------------------------------------------------------- server
STRATEGIES = {"fedavg-lora": FedAvgLoRA, "fedprox": FedProx, "ffa-lora": FFALoRA, "fedavg-full": FedAvgFull,
              "topk-ef": FedAvgFull, "powersgd": FedAvgFull}


def save_adapter(model, cfg, global_state: dict[str, np.ndarray], run_dir) -> dict:
    """The global LoRA adapter as a PEFT folder ``run_dir/adapter``
    (``PeftModel.from_pretrained(base, run_dir / "adapter")``). Its base model is named portably:
    ``model.path`` as the user gave it, else the embedded checkpoint's hub id (``model.hub_id``),
    never this machine's cache path; a random-init causal LM's own weights, saved in
    ``run_dir/base_model``."""
    import torch

    from clients.adapters import load_federated_state

    load_federated_state(model, {k: torch.from_numpy(v) for k, v in global_state.items()})
    base = cfg.model.get("path") or cfg.model.get("hub_id")
    if base is None and cfg.model.kind == "causal_lm" and cfg.model.get("random_init"):
        # a random-init model has no name anywhere: its weights (from the run's seed) go beside the
        # adapter, and the adapter names that folder (AutoPeftModel loads it offline, at once)
        from clients.models.llm import load_causal_lm

        base_model, tokenizer = load_causal_lm(cfg.model, seed=int(cfg.seed))
        base = str(run_dir / "base_model")
        base_model.save_pretrained(base)
        tokenizer.save_pretrained(base)
    for config in model.peft_config.values():
        config.base_model_name_or_path = base
    target = run_dir / "adapter"
    # the vocabulary is never resized here: PEFT's "auto" would look the base up on the hub (offline: a
    # warning that asks nothing of the user); embeddings are saved when LoRA targets them, as "auto" does
    from peft.utils.constants import EMBEDDING_LAYER_NAMES

    targets = [config.target_modules for config in model.peft_config.values()]  # names, or one regex string
    embeddings = any(name in (t if isinstance(t, str) else set(t or ())) for t in targets for name in EMBEDDING_LAYER_NAMES)
    model.save_pretrained(str(target), save_embedding_layers=embeddings)
    for folder in (target, run_dir / "base_model"):
        secure_tree(folder)  # fedapps.filemodes: the run folder's files are its user's
    return {"final_state": str(target)}


def plan_server(cfg, *, on_round_end, config_yaml: str) -> ServerPlan:
    from clients.adapters import all_lora_state, federated_state

    model, _, extra = prepare(cfg)
    if cfg.algorithm.trainable == "lora":
        initial = {k: v.numpy() for k, v in all_lora_state(model).items()}
    else:
        initial = {k: v.numpy() for k, v in federated_state(model, extra["names"]).items()}
    kwargs = dict(
        initial_state=initial,
        **strategy_settings(cfg, config_yaml=config_yaml, on_round_end=on_round_end),
        **uplink_kwargs(cfg.algorithm),
        channel=server_channel(cfg, {k: v.numpy() for k, v in federated_state(model, extra["names"]).items()}),
    )
    name = cfg.algorithm.name
    if name == "fedprox":
        kwargs["proximal_mu"] = float(cfg.algorithm.proximal_mu)
    strategy = STRATEGIES[name](**kwargs)

    def save_final(global_state: dict[str, np.ndarray], run_dir) -> dict:
        if cfg.algorithm.trainable == "lora":
            return save_adapter(model, cfg, global_state, run_dir)
        target = run_dir / "final_state.safetensors"
        save_file({k: np.ascontiguousarray(v) for k, v in global_state.items()}, str(target))
        return {"final_state": str(target)}

    return ServerPlan(strategy=strategy, save_final=save_final)


def plan_lora_server(cfg, strategy_cls, *, on_round_end, config_yaml: str, **strategy_kwargs) -> ServerPlan:
    """The server of a LoRA pair whose strategy is a FedAvgLoRA subclass with its own client method
    (FedALA, FedSSI): the initial adapter, the strategy, and the global adapter saved at the end."""
    from clients.adapters import all_lora_state

    if cfg.algorithm.trainable != "lora" or cfg.algorithm.lora.get("send", "all") != "all":
        raise ValueError(f"{cfg.algorithm.name} federates whole LoRA adapters: trainable=lora, lora.send=all")
    model, _, _ = prepare(cfg)
    strategy = strategy_cls(
        initial_state={k: v.numpy() for k, v in all_lora_state(model).items()},
        **strategy_settings(cfg, config_yaml=config_yaml, on_round_end=on_round_end),
        **uplink_kwargs(cfg.algorithm),
        **strategy_kwargs,
    )

    def save_final(global_state: dict[str, np.ndarray], run_dir) -> dict:
        return save_adapter(model, cfg, global_state, run_dir)  # the global one; personalised ones stay on clients

    return ServerPlan(strategy=strategy, save_final=save_final)


def restore(cfg, run_dir):
    """The final global model: :func:`prepare` + the saved adapter (``adapter/``, PEFT's format) or
    full weights (``final_state.safetensors``)."""
    import torch

    from clients.adapters import load_federated_state

    model, tokenizer, extra = prepare(cfg)
    if cfg.algorithm.trainable == "lora":
        from peft import set_peft_model_state_dict

        path = final_file(run_dir, "adapter/adapter_model.safetensors")
        result = set_peft_model_state_dict(model, {k: torch.from_numpy(v) for k, v in load_file(str(path)).items()})
        if result.unexpected_keys or any("lora_" in k for k in result.missing_keys):
            raise FinalStateError(f"{path} does not fit this configuration's LoRA (unexpected "
                                  f"{result.unexpected_keys[:3]}, missing {[k for k in result.missing_keys if 'lora_' in k][:3]})")
        return model, tokenizer
    state = load_file(str(final_file(run_dir, "final_state.safetensors")))
    missing = sorted(set(extra["names"]) - set(state))
    if missing:
        raise FinalStateError(f"{run_dir}/final_state.safetensors lacks {missing[:3]}")
    load_federated_state(model, {k: torch.from_numpy(v) for k, v in state.items()})
    return model, tokenizer


LATENT_DOWNLINK = ("fedavg-lora", "fedprox", "ffa-lora", "fedavg-full")  # their clients replay latents (load_global)
OWN_FORMAT = {"topk-ef": "topk", "powersgd": "powersgd"}  # a compressed update format that defines the method
METHODS = tuple(Method(name, prepare, train, evaluate, plan_server, restore, latent_downlink=name in LATENT_DOWNLINK,
                       own_format=OWN_FORMAT.get(name), check=check, strategy=cls, reference=name == "fedavg-lora")
                for name, cls in STRATEGIES.items())
