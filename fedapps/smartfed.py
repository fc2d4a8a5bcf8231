"""SmartFed as a Postcard method (``algorithm=smartfed``).

**Server.** :func:`plan_server` opens the LoRA knowledge pool (``algorithm.pool``, default
``$POSTCARD_CACHE/pool/<model name>``, filled by ``postcard pool build``), checks that it
was built for this run's backbone, splits the chosen adapters into rank-1 experts
(``clients.pool``), and builds :class:`strategies.smartfed.SmartFedStrategy`
with the global :class:`~strategies.ExpertState` and an
:class:`~strategies.eeqa.EEQA` allocator for the global budget of active experts.

**Client.** Each message carries the round's mixture: the active experts only (packed
ids, router rows, A rows, B columns). The client rebuilds its MoRE layers from it on the
frozen backbone (:func:`clients.smartfed.more.load_mixture`): it never holds the whole pool, so the trainable
state — and its gradients and AdamW moments — grows with the budget, not with the pool.
It trains the mixture (experts + routers, or routers only), then replies with the deltas
of the experts that changed, the router deltas and the importance of every active expert
(:func:`strategies.sparse.delta`, :func:`clients.smartfed.more.importance_state`), with
expert ids translated back to the server's layout indices.

**Run folder.** ``smartfed/`` holds ``experts.safetensors`` (every expert after the last
round, packed as in ``strategies.sparse``), ``state.json`` (EEQA state, final quotas and
active sets, allocation per round) and ``pool.json`` (the pool, the adapters used and
their provenance). :func:`load_run_mixture` puts that final mixture on a backbone.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
from flwr.common.logger import log
from safetensors.numpy import load_file, save_file

from clients.smartfed.config import MoREConfig
from clients.pool import PoolError, backbone_fingerprint
from fedapps.channel import channel_factory
from fedapps.method import (ClientCall, ConfigError, Method, ServerPlan, Update, final_file, learning_rates,
                            strategy_settings, uplink_kwargs)
from fedapps.pool import open_pool, require_pool
from fedapps.session import ClientSetupError
from strategies import codec, sparse
from strategies.eeqa import EEQA
from strategies.expert_state import ExpertState
from strategies.smartfed import BACKBONE_KEY, SmartFedStrategy


class SmartFedError(RuntimeError):
    """A SmartFed run that cannot start (no pool, wrong backbone, bad budget); says why."""


# ---------------------------------------------------------------------------- shared
def more_config(cfg) -> MoREConfig:
    """The MoRE layer settings of a run (validated by MoREConfig)."""
    a = cfg.algorithm
    return MoREConfig(
        top_k=int(a.top_k),
        mode=str(a.mode),
        gate_mode=str(a.gate_mode),
        router_std=float(a.router_std),
        importance_decay=float(a.importance_decay),
        importance=str(a.get("importance", "usage")),
    )


def check(cfg) -> None:
    """SmartFed's settings when the config is composed: the MoRE layer settings (``top_k``, ``mode``,
    ``gate_mode``, ``importance``, ...) as its clients will build them (:func:`more_config`),
    ``router_rounds``, and the robust aggregator and server optimiser its sparse expert updates allow."""
    from omegaconf import OmegaConf

    from strategies.robust import Robustness
    from strategies.server_opt import ServerOptimizer

    try:
        more_config(cfg)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"SmartFed's settings (algorithm.*): {err}") from None
    _check_router_rounds(cfg.algorithm)
    block = cfg.strategy.get("server_optimizer")
    try:
        SmartFedStrategy.check_settings(
            Robustness.from_mapping(OmegaConf.to_container(cfg.robust, resolve=True)),
            ServerOptimizer.from_mapping(None if block is None else OmegaConf.to_container(block, resolve=True)))
    except ValueError as err:
        raise ConfigError(f"algorithm 'smartfed': {err}") from None


def _check_router_rounds(algorithm) -> None:
    """``router_rounds``: null, or the rounds (>= 1) its routers train before they are frozen."""
    if algorithm.get("router_rounds") is None:
        return
    value = algorithm.router_rounds
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"algorithm.router_rounds must be null (train the routers every round) or an integer "
                          f">= 1, got {value!r}")
    if str(algorithm.get("mode")) == "router-only":
        raise ConfigError("algorithm.router_rounds freezes the routers, but mode=router-only trains nothing else; "
                          "use mode=experts+router")


def prepare(cfg):
    """The frozen backbone; MoRE layers come with each message (``load_mixture``)."""
    from clients.models import build_model

    if cfg.model.kind != "causal_lm":
        raise SmartFedError(f"SmartFed mixes LoRA experts into a causal LM; model '{cfg.model.name}' is {cfg.model.kind}")
    model, tokenizer = build_model(cfg)
    return model, tokenizer, {"backbone_fingerprint": backbone_fingerprint(model)}


def _receive(call: ClientCall) -> dict[str, np.ndarray]:
    """Backbone check, then the round's mixture loaded into the model; returns its layout ids."""
    from clients.smartfed.more import MixtureError, load_mixture

    s = call.session
    expected = call.config.get(BACKBONE_KEY)
    if expected is not None and str(expected) != s.extra["backbone_fingerprint"]:
        raise ClientSetupError(
            f"this client's backbone ({call.cfg.model.name}, fingerprint {s.extra['backbone_fingerprint']}) is not "
            f"the one the server's knowledge pool was built for ({expected})"
        )
    try:
        return load_mixture(s.model, codec.decode(call.arrays), more_config(call.cfg))
    except MixtureError as err:
        raise ClientSetupError(str(err)) from None


LR_PATTERNS = {"experts": "expert_", "router": "router"}  # algorithm.lr key -> MoRE parameter names


# ---------------------------------------------------------------------------- client
def _trained_state(model, routers_frozen: bool) -> dict[str, np.ndarray]:
    """The active experts' trained tensors, packed (without the router rows once those are frozen)."""
    from clients.smartfed.more import active_state

    state = active_state(model)
    return {k: v for k, v in state.items() if not (routers_frozen and k.endswith("/router"))}


def train(call: ClientCall) -> Update:
    from clients.smartfed.more import importance_state, more_modules, to_layout_ids
    from clients.train import local_train
    from fedapps.latent import latent_training

    ids = _receive(call)
    model = call.session.model
    frozen = bool(call.config.get("router-frozen", False))  # algorithm.router_rounds have passed
    if frozen:  # the routers keep what the server sent (each message builds the MoRE layers anew)
        for layer in more_modules(model).values():
            layer.router.requires_grad_(False)
    before = _trained_state(model, frozen)
    trained = sorted(n for n, p in model.named_parameters() if p.requires_grad)  # the MoRE layers' experts, routers
    with latent_training(call, model, trained) as latent:  # None unless channel=latent
        metrics = local_train(model, call.session.task, call.cfg.train, seed=call.seed,
                              lr_by_name=learning_rates(call.cfg, LR_PATTERNS))
    if latent is not None:  # the latents, and the importance of every active expert (fp32) beside them
        record = latent.record(call.cfg, call.context, call.seed)
        for key, array in sparse.encode(to_layout_ids(importance_state(model), ids), "fp32").items():
            record[key] = array
        metrics.update({"active-experts": int(sum(len(v) for v in ids.values())),
                        "trainable-values": int(sum(p.numel() for p in model.parameters() if p.requires_grad))})
        return Update(metrics, record)
    update = sparse.delta(_trained_state(model, frozen), before) | importance_state(model)
    update = to_layout_ids(update, ids)
    metrics.update(
        {
            "active-experts": int(sum(len(v) for v in ids.values())),
            "uplink-experts": int(sum(v.size for k, v in update.items() if k.endswith("/ids"))),
            "trainable-values": int(sum(p.numel() for p in model.parameters() if p.requires_grad)),
        }
    )
    return Update(metrics, sparse.encode(update, str(call.cfg.algorithm.payload)))


def evaluate(call: ClientCall) -> dict:
    from clients.train import evaluate as evaluate_model

    _receive(call)
    return evaluate_model(call.session.model, call.session.task, call.cfg.eval)


# ---------------------------------------------------------------------------- server
def ready(cfg) -> None:
    """What a SmartFed run needs besides its settings, before it is submitted: its knowledge pool
    (:func:`require_pool`: refused in one line at once, not by the server after the run has started)."""
    try:
        require_pool(cfg)
    except PoolError as err:
        raise ConfigError(str(err)) from None


def budget_of(cfg, num_matrices: int) -> int:
    a = cfg.algorithm
    if a.get("budget") is not None:
        return int(a.budget)
    return int(round(float(a.budget_per_matrix) * num_matrices))


def plan_server(cfg, *, on_round_end, config_yaml: str) -> ServerPlan:
    from clients.models.llm import causal_lm_config

    a = cfg.algorithm
    if float(cfg.train.get("weight_decay", 0.0) or 0.0) != 0.0:
        raise SmartFedError(
            "SmartFed trains with train.weight_decay=0: decay would move active experts no token was "
            "routed to, and their deltas would be sent"
        )
    config = more_config(cfg)  # validates top_k, mode, gate_mode early
    fingerprint = backbone_fingerprint(causal_lm_config(cfg.model)[0])  # shapes only: no weights loaded
    pool, names, experts = open_pool(cfg, fingerprint)
    layout = sparse.ExpertLayout(
        {m: sparse.MatrixLayout(e.d_in, e.d_out, e.ids) for m, e in experts.items()},
        train_experts=config.train_experts,
    )
    state = ExpertState.initial(
        layout, {m: (e.A, e.B) for m, e in experts.items()}, router_seed=int(cfg.seed), router_std=config.router_std
    )
    budget = budget_of(cfg, len(layout.matrices))
    try:
        eeqa = EEQA(
            layout.num_experts,
            budget,
            min_per_matrix=int(a.min_per_matrix),
            max_per_matrix=None if a.get("max_per_matrix") is None else int(a.max_per_matrix),
            prune_threshold=float(a.prune_threshold),
            prune_patience=int(a.prune_patience),
            unmeasured_weight=float(a.unmeasured_weight),
        )
    except ValueError as err:
        raise SmartFedError(
            f"EEQA cannot share a budget of {budget} active experts over {len(layout.matrices)} matrices: {err} "
            "(raise algorithm.budget / algorithm.budget_per_matrix or lower algorithm.min_per_matrix)"
        ) from None
    strategy = SmartFedStrategy(
        state=state,
        eeqa=eeqa,
        backbone_fingerprint=fingerprint,
        **strategy_settings(cfg, config_yaml=config_yaml, on_round_end=on_round_end),
        **uplink_kwargs(a),
        latent=channel_factory(cfg),
        router_rounds=a.get("router_rounds"),
    )
    log(logging.INFO, "SmartFed: pool %s, adapters %s: %d experts on %d matrices (%s); budget %d active experts",
        pool.path, names, layout.total_experts, len(layout.matrices), layout.mode, budget)

    def save_final(global_state, run_dir) -> dict:
        folder = Path(run_dir) / "smartfed"
        folder.mkdir(parents=True, exist_ok=True)
        tensors, meta = strategy.checkpoint()
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(folder / "experts.safetensors"))
        (folder / "layout.json").write_text(layout.to_json() + "\n")
        (folder / "state.json").write_text(json.dumps(meta, indent=1) + "\n")
        (folder / "pool.json").write_text(json.dumps(
            {"pool": str(pool.path), "backbone_fingerprint": pool.fingerprint, "adapters": names,
             "provenance": [pool.provenance(n) for n in names]}, indent=1) + "\n")
        return {
            "final_state": str(folder),
            "smartfed": {
                "mode": layout.mode,
                "pool": str(pool.path),
                "adapters": names,
                "matrices": len(layout.matrices),
                "pool_experts": layout.total_experts,
                "budget": budget,
                "active_experts": int(strategy.allocation.total),
                "pruned_experts": int(sum(int(v.sum()) for v in strategy.eeqa.pruned.values())),
            },
        }

    return ServerPlan(strategy=strategy, save_final=save_final)


def load_run_mixture(model, run_dir, cfg) -> dict[str, np.ndarray]:
    """Put a finished run's final mixture (its saved experts and active sets) on ``model``."""
    from clients.smartfed.more import load_mixture

    folder = Path(run_dir) / "smartfed"
    layout = sparse.ExpertLayout.from_json((folder / "layout.json").read_text())
    state = ExpertState.from_tensors(layout, load_file(str(folder / "experts.safetensors")))
    active = json.loads((folder / "state.json").read_text())["active"]
    return load_mixture(model, state.gather(active), more_config(cfg))


def restore(cfg, run_dir):
    """The backbone with the run's final mixture (its saved experts and active sets, ``smartfed/``)."""
    model, tokenizer, _ = prepare(cfg)
    final_file(run_dir, "smartfed/experts.safetensors")
    load_run_mixture(model, run_dir, cfg)
    return model, tokenizer


METHOD = Method("smartfed", prepare, train, evaluate, plan_server, restore, check=check, ready=ready,
                errors=(SmartFedError, PoolError), strategy=SmartFedStrategy,
                export="SmartFed routes every token to its own rank-1 experts, which no static weights reproduce")

__all__ = [
    "METHOD",
    "SmartFedError",
    "load_run_mixture",
    "more_config",
    "plan_server",
    "prepare",
    "ready",
]
