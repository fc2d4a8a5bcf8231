"""θ_pre's file for ``base=public``: the settings that shape it, its key, its folder in the cache and
:func:`base_checkpoint` (the file a run loads, ``clients.models.build_model``). ``clients.pretrain``
trains it (``ensure_base``); this module only names it, so the model builder and the trainer do not
import each other.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from omegaconf import OmegaConf

from clients.assets import AssetMissing, cache_dir

FILE = "base.safetensors"
REPORT = "report.json"
FORMAT = "postcard-base-v1"  # bump when the pretraining changes, so old bases are rebuilt


def base_settings(cfg) -> dict:
    """Everything that shapes θ_pre (and nothing else: the runs' own seeds and rounds do not)."""
    model = OmegaConf.to_container(cfg.model, resolve=True)
    task = cfg.task
    return {
        "format": FORMAT,
        "model": {k: v for k, v in model.items() if k not in ("lora_targets",)},
        "task": {"dataset": str(task.dataset), "num_classes": int(task.num_classes),
                 "image_size": int(task.image_size), "public_fraction": float(task.public_fraction),
                 "public_seed": int(task.get("public_seed", 0))},
        "base": {k: v for k, v in OmegaConf.to_container(cfg.base, resolve=True).items()
                 if k not in ("name", "threads")},
    }


def base_key(cfg) -> str:
    blob = json.dumps(base_settings(cfg), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def base_folder_name(cfg) -> str:
    return f"pretrained-{cfg.model.name}-{cfg.task.dataset}-{base_key(cfg)}"


def base_checkpoint(cfg) -> Path:
    """θ_pre's file for this configuration; AssetMissing (with the command) when not built yet."""
    path = cache_dir() / base_folder_name(cfg) / FILE
    if not path.is_file():
        raise AssetMissing(f"θ_pre for base=public ({cfg.model.name} on {cfg.task.dataset}'s public split, key "
                           f"{base_key(cfg)}) is not built on this machine: run `postcard pretrain` with the run's "
                           f"overrides (a base=public run on the server builds it too), or copy {path.parent} "
                           f"from the server into {cache_dir()}")
    return path
