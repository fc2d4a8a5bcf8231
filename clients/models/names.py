"""A causal LM's own name (torch-free: ``fedapps.config`` names a run with it when the config is composed)."""

from __future__ import annotations

import os
import re
from pathlib import Path

_GENERIC = {"", ".", "model", "models", "checkpoint", "checkpoints", "hf", "weights", "final", "merged", "export",
            "main", "latest", "snapshot", "base_model", "adapter"}


def _clean(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", str(text)).strip("-.")


def checkpoint_label(path) -> str:
    """A causal LM checkpoint's own name, for run folders, logs, ``summary.json`` and SmartFed's default
    pool: its config's ``_name_or_path`` when that names something (a hub id's last part), the
    repository of a hub cache snapshot (``models--org--name/snapshots/<hash>``), else the folder's name
    (a generic one such as ``checkpoint`` or ``model`` with its parent's: ``run-7-checkpoint``), with a
    fingerprint of its config when nothing names it."""
    import hashlib
    import json

    text = str(path)
    folder = Path(os.path.expanduser(text))
    config_file = folder / "config.json"
    config = {}
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except (OSError, ValueError):
            config = {}
    named = str(config.get("_name_or_path") or "")
    if named and not named.startswith(("/", ".", "~")) and not os.path.isabs(named):
        label = _clean(named.rstrip("/").rsplit("/", 1)[-1])
        if label:
            return label
    if not folder.is_dir():  # a hub id
        return _clean(text.rstrip("/").rsplit("/", 1)[-1]) or "hf"
    folder = folder.resolve()
    parts = folder.parts
    for i, part in enumerate(parts):
        if part.startswith("models--") and i + 1 < len(parts) and parts[i + 1] == "snapshots":
            return _clean(part.split("--")[-1])
    label = _clean(folder.name)
    if label.lower() in _GENERIC and folder.parent != folder:
        parent = _clean(folder.parent.name)
        label = f"{parent}-{label}" if parent and label else parent or label
    if not label or label.lower() in _GENERIC:
        blob = config_file.read_bytes() if config_file.is_file() else text.encode()
        label = f"{config.get('model_type', 'hf')}-{hashlib.sha256(blob).hexdigest()[:8]}"
    return label


def gguf_label(path) -> str:
    """A GGUF file's name for labels: its file name without ``.gguf``."""
    name = Path(str(path)).name
    return _clean(name[: -len(".gguf")] if name.lower().endswith(".gguf") else name) or "gguf"
