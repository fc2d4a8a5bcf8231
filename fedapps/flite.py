"""FLITE as a Postcard method: clients train and send only the latent vector z.

Clients regenerate FLITE's factors from the shared seed (``clients.flite``), load the
global z, train z alone, and reply with z (int4 or fp32) and the fingerprint of their
parametrisation; ``strategies.flite.FliteStrategy`` refuses mismatches and averages z.
With ``algorithm.reply=compact`` the reply is z's bytes and ``num-examples`` alone; a client
then trains only under a server whose fingerprint is its own (it always checks).
"""

from __future__ import annotations

import numpy as np
from flwr.app import ConfigRecord, Message
from omegaconf import OmegaConf

from clients.flite import FliteConfig, apply_flite, fingerprint, frozen_head_, get_latents, num_latents, set_latents
from clients.models import build_model
from clients.train import evaluate as evaluate_model
from clients.train import local_train
from fedapps.method import (ClientCall, FinalStateError, Method, ServerPlan, Update, final_file, strategy_settings,
                            uplink_kwargs)
from fedapps.session import ClientSetupError, uplink_record
from strategies import codec
from strategies.flite import FINGERPRINT_KEY, FINGERPRINT_RECORD, LATENT_KEY, FliteStrategy, compact_content


def flite_config(cfg, *, measure: bool = True) -> FliteConfig:
    """``algorithm.flite`` as a FliteConfig; ``split=sensitivity`` takes θ_pre's layer sensitivities
    (measured once per θ_pre, cached: ``clients.pretrain.base_sensitivity``) unless ``measure`` is
    false (a config check)."""
    values = OmegaConf.to_container(cfg.algorithm.flite, resolve=True)
    if values.get("split") == "sensitivity" and measure:
        from clients.pretrain import base_sensitivity

        values["sensitivity"] = base_sensitivity(cfg)
    return FliteConfig.from_dict(values)


def prepare(cfg):
    """Backbone (+ frozen orthogonal head for vision, unless the checkpoint carried one) with FLITE injected; z = 0."""
    model, tokenizer = build_model(cfg)
    if cfg.model.kind == "vision":  # a checkpoint's own head (θ_pre's) is kept, never re-drawn
        frozen_head_(model, seed=int(cfg.seed), gain=float(cfg.algorithm.head_gain))
    config = flite_config(cfg)
    apply_flite(model, config)
    return model, tokenizer, {"fingerprint": fingerprint(config, model), "latents": num_latents(model)}


def _load(s, msg: Message, *, require_fingerprint: bool = False) -> np.ndarray:
    """Load the downlink's z, after checking the server's fingerprint against this client's (a
    compact reply carries none, so then the server must have sent one)."""
    expected = s.extra["fingerprint"]
    sent = msg.content["config"].get(FINGERPRINT_KEY)
    if (sent is not None or require_fingerprint) and sent != expected:
        raise ClientSetupError(f"the server's FLITE fingerprint {sent} differs from this client's {expected}")
    z = codec.decode(msg.content["arrays"])[LATENT_KEY]
    set_latents(s.model, z)
    return z


# ---------------------------------------------------------------------------- client
def train(call: ClientCall) -> Update:
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
        downlink_format=str(cfg.algorithm.downlink),
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
    model, tokenizer, extra = prepare(cfg)
    with np.load(final_file(run_dir, "latents.npz")) as saved:
        z, saved_fingerprint = saved["z"], str(saved["fingerprint"])
    if saved_fingerprint != extra["fingerprint"]:
        raise FinalStateError(f"{run_dir}/latents.npz belongs to FLITE parametrisation {saved_fingerprint}, but this "
                              f"configuration (and base weights) give {extra['fingerprint']}")
    set_latents(model, z)
    return model, tokenizer


METHOD = Method("flite", prepare, train, evaluate, plan_server, restore)
