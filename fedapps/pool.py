"""A run's knowledge pool: the folder its config names, opened and checked, and the experts of the adapters
it takes (``clients.pool`` is the pool itself).

SmartFed mixes the pool's adapters as rank-1 experts (``fedapps.smartfed``); the LoRA baselines can start from
them (``algorithm.lora.init=pool``, ``fedapps.baselines.pool_deltas``); ``postcard pool`` fills it. Every
problem is a :class:`~clients.pool.PoolError` in one line naming the fix (``postcard pool build``, ``postcard
pool add``, ``algorithm.pool``). Imports no torch.
"""

from __future__ import annotations

import logging
from pathlib import Path

from flwr.common.logger import log

from clients.pool import POOL_FILE, ExpertSet, Pool, PoolError, backbone_descriptor, default_pool_dir


def pool_dir(cfg) -> Path:
    """The run's knowledge pool folder: ``algorithm.pool`` or the model's default pool."""
    path = cfg.algorithm.get("pool")
    return Path(str(path)).expanduser().resolve() if path else default_pool_dir(str(cfg.model.name))


def model_overrides(cfg) -> str:
    """The overrides that name this run's backbone again (``postcard pool build ...``): its config group,
    the checkpoint or GGUF file, a random init's seed."""
    model = cfg.model
    parts = [f"model={model.get('group') or model.name}"]
    for key in ("path", "gguf"):
        if model.get(key):
            parts.append(f"model.{key}={model.get(key)}")
    if model.get("random_init"):
        parts.append(f"seed={cfg.seed}")
    return " ".join(parts)


def require_pool(cfg) -> tuple[Pool, list[str], str]:
    """The run's knowledge pool (:func:`pool_dir`), opened, the names of the adapters the run takes from it, and
    the command that builds it; PoolError in one line naming the fix (``postcard pool build``, ``postcard
    pool add``, ``algorithm.pool``) when the folder is no pool, holds no adapter or lacks one that
    ``algorithm.adapters`` names. Reads ``pool.json`` and the adapters' folder names only (no weights, no model):
    checked before a run is submitted (:func:`ready`, ``fedapps.config.finalize``) and again by the server
    (:func:`open_pool`), whose machine may be another."""
    path = pool_dir(cfg)
    build = "postcard pool build" + (f" --pool {path}" if cfg.algorithm.get("pool") else "")
    build += f" {model_overrides(cfg)}"
    add = "postcard pool add RUN_DIR" + (f" --pool {path}" if cfg.algorithm.get("pool") else "")
    if not (path / POOL_FILE).is_file():
        raise PoolError(
            f"no knowledge pool at {path}: fill it first with `{build}` (or `{add}` for a LoRA run of this model), "
            "or point algorithm.pool=DIR at an existing pool"
        )
    try:
        pool = Pool(path)
    except PoolError:
        raise
    except (OSError, ValueError) as err:  # pool.json unreadable: not JSON, not a file we may read
        raise PoolError(f"{path / POOL_FILE} does not read ({str(err).splitlines()[0]}): rebuild the pool with "
                            f"`{build}`, or point algorithm.pool=DIR at another pool") from None
    names = pool.names()
    if not names:
        raise PoolError(f"the knowledge pool {path} holds no adapter: fill it with `{build}` or `{add}`")
    wanted = cfg.algorithm.get("adapters")
    if wanted:
        missing = sorted(set(map(str, wanted)) - set(names))
        if missing:
            raise PoolError(f"algorithm.adapters names {missing}, which the pool {path} lacks (it has {names})")
        names = sorted(set(map(str, wanted)))
    return pool, names, build


def open_pool(cfg, fingerprint: str) -> tuple[Pool, list[str], dict[str, ExpertSet]]:
    """(pool, adapter names used, experts per target matrix) for this run, or a clear error."""
    pool, names, build = require_pool(cfg)  # as checked before submitting (ready), again on the server's machine
    path = pool.path
    if pool.fingerprint != fingerprint:
        fresh = path.parent / f"{path.name}-{fingerprint[:8]}"  # beside this pool, named by the backbone
        raise PoolError(
            f"the knowledge pool {path} was built for backbone {pool.fingerprint} "
            f"({pool.signature['model_type']}, hidden {pool.signature['hidden_size']}, "
            f"{pool.signature['num_hidden_layers']} layers), but model '{cfg.model.name}' has fingerprint "
            f"{fingerprint}: point algorithm.pool=DIR at a pool built for this model, or build one with "
            f"`postcard pool build --pool {fresh} {model_overrides(cfg)}` and run with algorithm.pool={fresh}"
        )
    ours = backbone_descriptor(cfg)
    for name in names:
        theirs = pool.provenance(name).get("backbone")
        if theirs and theirs != ours:
            message = (
                f"pooled adapter '{name}' was trained on {theirs}, this run's backbone is {ours} "
                "(same shapes, so the fingerprint agrees, but the weights may differ)"
            )
            if cfg.model.get("random_init"):
                raise PoolError(message + f"; a random-init model differs per seed: rebuild the pool with `{build}`")
            log(logging.WARNING, "knowledge pool: %s", message)
    targets = pool.targets(names)
    kinds = cfg.algorithm.get("targets")
    if kinds:
        kinds = {str(k) for k in kinds}
        targets = [m for m in targets if m.rsplit(".", 1)[-1] in kinds]
        if not targets:
            available = sorted({m.rsplit(".", 1)[-1] for m in pool.targets(names)})
            raise PoolError(f"algorithm.targets {sorted(kinds)} match no pooled matrix; the pool targets {available}")
    return pool, names, pool.load_experts(fingerprint, targets, adapters=names)
