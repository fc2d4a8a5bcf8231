"""FLITE as a Postcard method: clients train and send only the latent vector z.

Clients regenerate FLITE's factors from the shared seed (``clients.flite``), load the
global z, train z alone, and reply with z (int4 or fp32) and the fingerprint of their
parametrisation; ``strategies.flite.FliteStrategy`` refuses mismatches and averages z.
With ``algorithm.reply=compact`` the reply is z's bytes and ``num-examples`` alone; a client
then trains only under a server whose fingerprint is its own (it always checks).
"""

from __future__ import annotations

import functools
import json

import numpy as np
from flwr.app import ConfigRecord, Message
from omegaconf import OmegaConf

from clients.flite.config import FliteConfig
from fedapps.method import (ClientCall, ConfigError, FinalStateError, Method, ServerPlan, Update, final_file,
                            strategy_settings, uplink_kwargs)
from fedapps.resolved import to_yaml
from fedapps.session import ClientSetupError, uplink_record
from strategies import codec
from strategies.flite import (FINGERPRINT_KEY, FINGERPRINT_RECORD, LATENT_KEY, FliteStrategy,
                              compact_content)


def flite_config(cfg, *, measure: bool = True) -> FliteConfig:
    """``algorithm.flite`` as a FliteConfig; ``split=sensitivity`` takes θ_pre's layer sensitivities
    (measured once per θ_pre, cached: ``clients.pretrain.base_sensitivity``) unless ``measure`` is
    false (a config check)."""
    values = OmegaConf.to_container(cfg.algorithm.flite, resolve=True)
    if values.get("split") == "sensitivity" and measure:
        from clients.pretrain import base_sensitivity

        values["sensitivity"] = base_sensitivity(cfg)
    return FliteConfig.from_dict(values)


# ---------------------------------------------------------------------------- config check
def check(cfg) -> None:
    """FLITE's settings when the config is composed: ``algorithm.reply``, ``algorithm.flite`` as its
    clients will build it, and its latent budget against a causal LM's layers."""
    _check_reply(cfg)
    _check_settings(cfg)
    _check_budget(cfg)


def _check_reply(cfg) -> None:
    """``algorithm.reply``: full, or compact (not in a private run): the strategy's own rule."""
    private = str(cfg.privacy.get("mode", "off")) != "off" or bool(cfg.secure_aggregation.get("enabled"))
    try:
        FliteStrategy.check_reply(str(cfg.algorithm.get("reply", "full")), private)
    except ValueError as err:
        raise ConfigError(f"algorithm.{err}") from None


def _check_settings(cfg) -> None:
    """FLITE's ``algorithm.flite`` as its clients will build it (``fedapps.flite.flite_config``): a bad
    split, rank or budget fails here, not after the simulation has started."""
    try:
        config = flite_config(cfg, measure=False).validate()
    except (TypeError, ValueError) as err:
        raise ConfigError(f"invalid algorithm.flite: {err}") from None
    if config.split == "sensitivity" and (cfg.base.name != "public" or cfg.model.kind != "vision"):
        raise ConfigError("algorithm.flite.split=sensitivity shares the latents by θ_pre's gradient norms on the "
                          "public split: it needs base=public (a vision task with task.public_fraction > 0)")
    if config.sensitivity is not None:
        raise ConfigError("algorithm.flite.sensitivity is measured (split=sensitivity with base=public), not set")


@functools.lru_cache(maxsize=16)
def _layers(model_yaml: str, flite_json: str) -> tuple[list[tuple[str, int]], str | None]:
    """``([(kind, parameters)] of the layers FLITE adapts, plan error or None)`` for a causal LM built on
    the meta device (its config only: no weights are read; torch is imported)."""
    import torch
    from transformers import AutoModelForCausalLM

    from clients.flite.model import _candidates, _matrix_shape, _norm_params, plan
    from clients.models.llm import causal_lm_config

    config, _ = causal_lm_config(OmegaConf.create(model_yaml))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    flite = FliteConfig.from_dict(json.loads(flite_json))
    layers = []
    for _, module, kind in _candidates(model, flite):
        m, n = _matrix_shape(module, kind, _norm_params(module) if kind == "norm" else ("weight",))
        layers.append((kind, m * n))
    try:
        plan(model, flite)
    except ValueError as err:
        return layers, str(err)
    return layers, None


def _check_budget(cfg) -> None:
    """FLITE's latent budget against the causal LM's layers, at compose time: each norm layer takes
    ``algorithm.flite.norm_latents`` from ``algorithm.flite.latent_budget`` first and every weight
    layer needs at least one of the rest, so a deep model (Gemma-3: 6 norms a layer) can exceed the
    default 1,280 — refused here with the settings that fit, not by every client after the start."""
    if cfg.model.kind != "causal_lm":
        return
    flite = flite_config(cfg, measure=False)
    if flite.latents is not None:
        return
    from clients.models.llm import ModelError  # the one check that imports torch: the model's layers, on meta

    try:
        layers, error = _layers(to_yaml(cfg.model), json.dumps(flite.to_dict(), sort_keys=True, default=str))
    except (ModelError, OSError, ValueError):
        return  # a model this process cannot describe (a hub id offline): its clients will say
    norms = [size for kind, size in layers if kind == "norm"]
    weights = len(layers) - len(norms)
    taken = sum(min(flite.norm_latents, size) for size in norms)
    if weights and flite.latent_budget - taken < weights:
        need = taken + weights
        fit = max(0, (flite.latent_budget - weights) // max(1, len(norms)))
        raise ConfigError(
            f"FLITE's algorithm.flite.latent_budget={flite.latent_budget} is too small for model "
            f"'{cfg.model.name}': its {len(norms)} norm layers take {taken} latents "
            f"(algorithm.flite.norm_latents={flite.norm_latents} each) and its {weights} weight layers need at "
            f"least one each; set algorithm.flite.latent_budget >= {need}"
            + (f", or algorithm.flite.norm_latents <= {fit}" if fit >= 1 else "")
            + ", or algorithm.flite.include_norms=false")
    if error:
        raise ConfigError(f"invalid algorithm.flite for model '{cfg.model.name}': {error}")


def prepare(cfg):
    """Backbone (+ frozen orthogonal head for vision, unless the checkpoint carried one) with FLITE injected; z = 0."""
    from clients.flite import apply_flite, fingerprint, num_latents
    from clients.models.heads import frozen_head_
    from clients.models import build_model

    model, tokenizer = build_model(cfg)
    if cfg.model.kind == "vision":  # a checkpoint's own head (θ_pre's) is kept, never re-drawn
        frozen_head_(model, seed=int(cfg.seed), gain=float(cfg.algorithm.head_gain))
    config = flite_config(cfg)
    apply_flite(model, config)
    return model, tokenizer, {"fingerprint": fingerprint(config, model), "latents": num_latents(model)}


def _load(s, msg: Message, *, require_fingerprint: bool = False) -> np.ndarray:
    """Load the downlink's z, after checking the server's fingerprint against this client's (a
    compact reply carries none, so then the server must have sent one)."""
    from clients.flite import set_latents

    expected = s.extra["fingerprint"]
    sent = msg.content["config"].get(FINGERPRINT_KEY)
    if (sent is not None or require_fingerprint) and sent != expected:
        raise ClientSetupError(f"the server's FLITE fingerprint {sent} differs from this client's {expected}")
    z = codec.decode(msg.content["arrays"])[LATENT_KEY]
    set_latents(s.model, z)
    return z


# ---------------------------------------------------------------------------- client
def train(call: ClientCall) -> Update:
    from clients.flite import get_latents
    from clients.train import local_train

    s = call.session
    compact = str(call.cfg.algorithm.get("reply", "full")) == "compact"
    received = _load(s, call.msg, require_fingerprint=compact)
    metrics = local_train(s.model, s.task, call.cfg.train, seed=call.seed)
    arrays = uplink_record(call.cfg, call.context, {LATENT_KEY: get_latents(s.model)}, {LATENT_KEY: received},
                           call.seed)
    if compact:  # z's bytes and num-examples, nothing else
        return Update(metrics, arrays, content=compact_content(arrays, metrics["num-examples"]))
    return Update(metrics, arrays, {FINGERPRINT_RECORD: ConfigRecord({"fingerprint": s.extra["fingerprint"]})})


def evaluate(call: ClientCall) -> dict:
    from clients.train import evaluate as evaluate_model

    _load(call.session, call.msg)
    return evaluate_model(call.session.model, call.session.task, call.cfg.eval)


# ---------------------------------------------------------------------------- server
def plan_server(cfg, *, on_round_end, config_yaml: str) -> ServerPlan:
    from flwr.common.logger import log
    from logging import INFO

    model, _, extra = prepare(cfg)
    log(INFO, "FLITE: %d latents (%s uplink: %d bytes per client per round), fingerprint %s",
        extra["latents"], cfg.algorithm.payload,
        codec.expected_nbytes((extra["latents"],), codec.FORMATS[str(cfg.algorithm.payload)]), extra["fingerprint"])
    strategy = FliteStrategy(
        fingerprint=extra["fingerprint"],
        initial_state={LATENT_KEY: np.zeros(extra["latents"], np.float32)},
        **strategy_settings(cfg, config_yaml=config_yaml, on_round_end=on_round_end),
        reply=str(cfg.algorithm.get("reply", "full")),
        **uplink_kwargs(cfg.algorithm),
    )

    def save_final(global_state: dict[str, np.ndarray], run_dir) -> dict:
        # z: the global latents as every client holds them (the decoded downlink: what the final metric
        # measured); z_server: the server's own average (they differ with an int4 downlink)
        target = run_dir / "latents.npz"
        held = codec.decode(strategy.downlink_arrays())[LATENT_KEY]
        np.savez(target, z=held, z_server=global_state[LATENT_KEY], fingerprint=extra["fingerprint"])
        return {"final_state": str(target), "latents": extra["latents"], "fingerprint": extra["fingerprint"]}

    return ServerPlan(strategy=strategy, save_final=save_final)


def restore(cfg, run_dir):
    """The final global model: :func:`prepare` (factors regenerated from the seed) + the saved z,
    after checking that this parametrisation is the run's (its fingerprint)."""
    from clients.flite import set_latents

    model, tokenizer, extra = prepare(cfg)
    with np.load(final_file(run_dir, "latents.npz")) as saved:
        z, saved_fingerprint = saved["z"], str(saved["fingerprint"])
    if saved_fingerprint != extra["fingerprint"]:
        raise FinalStateError(f"{run_dir}/latents.npz belongs to FLITE parametrisation {saved_fingerprint}, but this "
                              f"configuration (and base weights) give {extra['fingerprint']}")
    set_latents(model, z)
    return model, tokenizer


def merge(model):
    """The final model with ``θ_pre + U Vᵀ z`` merged into its weights (``clients.flite.merge_and_unload``)."""
    from clients.flite import merge_and_unload

    return merge_and_unload(model)


METHOD = Method("flite", prepare, train, evaluate, plan_server, restore, check=check, export=merge,
                strategy=FliteStrategy)
