"""SmartFed as one ServerApp/ClientApp pair (``algorithm=smartfed``).

**Server.** :func:`plan_server` opens the LoRA knowledge pool (``algorithm.pool``, default
``$POSTCARD_CACHE/pool/<model name>``, filled by ``postcard pool build``), checks that it
was built for this run's backbone, splits the chosen adapters into rank-1 experts
(``clients.smartfed.pool``), and builds :class:`strategies.smartfed.SmartFedStrategy`
with the global :class:`~strategies.sparse.ExpertState` and an
:class:`~strategies.eeqa.EEQA` allocator for the global budget of active experts.

**Client.** Each message carries the round's mixture: the active experts only (packed
ids, router rows, A rows, B columns). The client rebuilds its MoRE layers from it on the
frozen backbone (:func:`load_mixture`): it never holds the whole pool, so the trainable
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
import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.common.logger import log
from safetensors.numpy import load_file, save_file

from clients.models import build_model
from clients.smartfed.more import (
    ExpertSet,
    MoREConfig,
    active_state,
    apply_more,
    importance_state,
    more_modules,
    remove_more,
)
from clients.smartfed.pool import POOL_FILE, Pool, PoolError, backbone_fingerprint
from clients.train import evaluate as evaluate_model
from clients.train import local_train
from fedapps.algorithms import ServerPlan, strategy_settings
from fedapps.baselines import round_seed
from fedapps.pool_cli import backbone_descriptor, default_pool_dir
from fedapps.session import ClientSetupError, client_config, reply, session
from strategies import codec, sparse
from strategies.eeqa import EEQA
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
    )


def prepare(cfg):
    """The frozen backbone; MoRE layers come with each message (:func:`load_mixture`)."""
    if cfg.model.kind != "causal_lm":
        raise SmartFedError(f"SmartFed mixes LoRA experts into a causal LM; model '{cfg.model.name}' is {cfg.model.kind}")
    model, tokenizer = build_model(cfg)
    return model, tokenizer, {"backbone_fingerprint": backbone_fingerprint(model)}


def load_mixture(model, tensors: dict[str, np.ndarray], config: MoREConfig) -> dict[str, np.ndarray]:
    """Rebuild the model's MoRE layers from a packed state of active experts (a downlink).

    Every matrix of ``tensors`` gets a MoRE layer holding exactly the experts sent
    (``ids``, ``router``, ``A``, ``B``); matrices not sent stay plain backbone layers.
    Returns ``{matrix: the experts' layout indices}`` (layer expert ``j`` is layout expert
    ``ids[j]``), to translate the reply back with :func:`to_layout_ids`.
    """
    remove_more(model)
    experts, routers, ids = {}, {}, {}
    for matrix, fields in sparse.group(tensors).items():
        missing = [f for f in ("ids", "router", "A", "B") if f not in fields]
        if missing:
            raise ClientSetupError(f"the downlink of '{matrix}' lacks {missing}")
        raw = np.asarray(fields["ids"], np.float64)
        if raw.ndim != 1 or np.any(raw != np.round(raw)) or np.any(raw < 0) or np.unique(raw).size != raw.size:
            raise ClientSetupError(f"the downlink of '{matrix}' has invalid expert ids")
        ids[matrix] = raw.astype(np.int64)
        experts[matrix] = ExpertSet(tuple(str(i) for i in ids[matrix]), fields["A"], np.asarray(fields["B"]).T)
        routers[matrix] = np.asarray(fields["router"], np.float32)
    if not experts:
        raise ClientSetupError("the downlink holds no expert: the server's budget is 0?")
    apply_more(model, experts, config)
    with torch.no_grad():
        for matrix, layer in more_modules(model).items():
            router = torch.from_numpy(routers[matrix])
            if tuple(router.shape) != tuple(layer.router.shape):
                raise ClientSetupError(
                    f"router of '{matrix}' has shape {tuple(router.shape)}, expected {tuple(layer.router.shape)}"
                )
            layer.router.copy_(router)
    return ids


def to_layout_ids(update: dict[str, np.ndarray], ids: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A packed update with layer-local expert indices -> the server's layout indices."""
    out = {}
    for key, value in update.items():
        matrix, field = key.rsplit("/", 1)
        if field == "ids":
            value = ids[matrix][np.asarray(value, np.int64)]
        elif field == "importance":
            value = np.array(value, np.float32)
            value[0] = ids[matrix][value[0].astype(np.int64)]
        out[key] = value
    return out


def _receive(msg: Message, context: Context):
    """Config, session, backbone check and the round's mixture loaded into the model."""
    cfg = client_config(msg, context)
    s = session(cfg, context, prepare)
    config = msg.content["config"]
    expected = config.get(BACKBONE_KEY)
    if expected is not None and str(expected) != s.extra["backbone_fingerprint"]:
        raise ClientSetupError(
            f"this client's backbone ({cfg.model.name}, fingerprint {s.extra['backbone_fingerprint']}) is not the "
            f"one the server's knowledge pool was built for ({expected})"
        )
    ids = load_mixture(s.model, codec.decode(msg.content["arrays"]), more_config(cfg))
    return cfg, s, config, ids


# ---------------------------------------------------------------------------- client
clientapp = ClientApp()


@clientapp.train()
def train(msg: Message, context: Context) -> Message:
    cfg, s, config, ids = _receive(msg, context)
    model = s.model
    before = active_state(model)
    metrics = local_train(
        model, s.task, cfg.train, seed=round_seed(cfg, int(config["server-round"]), s.partition_id)
    )
    update = sparse.delta(active_state(model), before) | importance_state(model)
    update = to_layout_ids(update, ids)
    metrics.update(
        {
            "partition-id": s.partition_id,
            "active-experts": int(sum(len(v) for v in ids.values())),
            "uplink-experts": int(sum(v.size for k, v in update.items() if k.endswith("/ids"))),
            "trainable-values": int(sum(p.numel() for p in model.parameters() if p.requires_grad)),
        }
    )
    return reply(msg, metrics, sparse.encode(update, str(cfg.algorithm.payload)))


@clientapp.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    cfg, s, _, _ = _receive(msg, context)
    metrics = evaluate_model(s.model, s.task, cfg.eval)
    metrics["partition-id"] = s.partition_id
    return reply(msg, metrics)


# ---------------------------------------------------------------------------- server
def pool_dir(cfg) -> Path:
    """The run's knowledge pool folder: ``algorithm.pool`` or the model's default pool."""
    path = cfg.algorithm.get("pool")
    return Path(str(path)).expanduser().resolve() if path else default_pool_dir(str(cfg.model.name))


def open_pool(cfg, fingerprint: str) -> tuple[Pool, list[str], dict[str, ExpertSet]]:
    """(pool, adapter names used, experts per target matrix) for this run, or a clear error."""
    path = pool_dir(cfg)
    build = "postcard pool build" + (f" --pool {path}" if cfg.algorithm.get("pool") else "")
    build += f" model={cfg.model.name}" + (f" seed={cfg.seed}" if cfg.model.get("random_init") else "")
    if not (path / POOL_FILE).is_file():
        raise SmartFedError(
            f"no knowledge pool at {path}: fill it first with `{build}` "
            "(or point algorithm.pool=DIR at an existing pool)"
        )
    try:
        pool = Pool(path)
    except PoolError as err:
        raise SmartFedError(str(err)) from None
    names = pool.names()
    if not names:
        raise SmartFedError(f"the knowledge pool {path} holds no adapter: fill it with `{build}` or `postcard pool add RUN_DIR`")
    if pool.fingerprint != fingerprint:
        raise SmartFedError(
            f"the knowledge pool {path} was built for backbone {pool.fingerprint} "
            f"({pool.signature['model_type']}, hidden {pool.signature['hidden_size']}, "
            f"{pool.signature['num_hidden_layers']} layers), but model '{cfg.model.name}' has fingerprint {fingerprint}"
        )
    wanted = cfg.algorithm.get("adapters")
    if wanted:
        missing = sorted(set(map(str, wanted)) - set(names))
        if missing:
            raise SmartFedError(f"algorithm.adapters names {missing}, which the pool {path} lacks (it has {names})")
        names = sorted(set(map(str, wanted)))
    ours = backbone_descriptor(cfg)
    for name in names:
        theirs = pool.provenance(name).get("backbone")
        if theirs and theirs != ours:
            message = (
                f"pooled adapter '{name}' was trained on {theirs}, this run's backbone is {ours} "
                "(same shapes, so the fingerprint agrees, but the weights may differ)"
            )
            if cfg.model.get("random_init"):
                raise SmartFedError(message + f"; a random-init model differs per seed: rebuild the pool with `{build}`")
            log(logging.WARNING, "SmartFed: %s", message)
    targets = pool.targets(names)
    kinds = cfg.algorithm.get("targets")
    if kinds:
        kinds = {str(k) for k in kinds}
        targets = [m for m in targets if m.rsplit(".", 1)[-1] in kinds]
        if not targets:
            available = sorted({m.rsplit(".", 1)[-1] for m in pool.targets(names)})
            raise SmartFedError(f"algorithm.targets {sorted(kinds)} match no pooled matrix; the pool targets {available}")
    return pool, names, pool.load_experts(fingerprint, targets, adapters=names)


def budget_of(cfg, num_matrices: int) -> int:
    a = cfg.algorithm
    if a.get("budget") is not None:
        return int(a.budget)
    return int(round(float(a.budget_per_matrix) * num_matrices))


def plan_server(cfg, *, on_round_end, config_yaml: str) -> ServerPlan:
    a = cfg.algorithm
    if float(cfg.train.get("weight_decay", 0.0) or 0.0) != 0.0:
        raise SmartFedError(
            "SmartFed trains with train.weight_decay=0: decay would move active experts no token was "
            "routed to, and their deltas would be sent"
        )
    config = more_config(cfg)  # validates top_k, mode, gate_mode early
    model, _, extra = prepare(cfg)
    fingerprint = extra["backbone_fingerprint"]
    del model
    pool, names, experts = open_pool(cfg, fingerprint)
    layout = sparse.ExpertLayout(
        {m: sparse.MatrixLayout(e.d_in, e.d_out, e.ids) for m, e in experts.items()},
        train_experts=config.train_experts,
    )
    state = sparse.ExpertState.initial(
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
        uplink_format=str(a.payload),
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
    folder = Path(run_dir) / "smartfed"
    layout = sparse.ExpertLayout.from_json((folder / "layout.json").read_text())
    state = sparse.ExpertState.from_tensors(layout, load_file(str(folder / "experts.safetensors")))
    active = json.loads((folder / "state.json").read_text())["active"]
    return load_mixture(model, state.gather(active), more_config(cfg))


__all__ = [
    "SmartFedError",
    "clientapp",
    "load_mixture",
    "load_run_mixture",
    "more_config",
    "open_pool",
    "plan_server",
    "prepare",
    "to_layout_ids",
]
