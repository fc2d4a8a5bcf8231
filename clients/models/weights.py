"""Vision checkpoints: read a state dict from a file, load it into a backbone, head included
when it fits.

A checkpoint is a ``.pt``/``.pth`` file saved with ``torch.save`` (a state dict, or a dict
with one under ``state_dict``) or a ``.safetensors`` file. The body (every tensor outside
``model.head``) must match the backbone exactly; the head is loaded when the checkpoint
carries one of the right shape, and the model then says so (``model.head_loaded``) so that
no method re-draws it. θ_pre from ``base=public`` (``clients.pretrain``) carries its frozen
orthogonal head this way. ``model.checkpoint_digest`` (the file's sha256) lets FLITE's
fingerprint refuse a client that loaded another file.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.nn as nn


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says why."""


def read_state_dict(path: str | Path, what: str = "model") -> dict[str, torch.Tensor]:
    path = Path(path).expanduser()
    if not path.is_file():
        raise CheckpointError(f"{what} checkpoint {path} does not exist (model.path must name a state-dict file: "
                              ".pt/.pth or .safetensors)")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as err:  # a corrupt or foreign file: say which and why
        raise CheckpointError(f"cannot read the {what} checkpoint {path}: {err}") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path} does not hold a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in state.items()}


def file_digest(path: str | Path) -> str:
    """The first 16 hex digits of the file's sha256 (what FLITE's fingerprint pins)."""
    digest = hashlib.sha256()
    with open(Path(path).expanduser(), "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def head_prefix(model: nn.Module) -> str:
    """The state-dict prefix of ``model.head`` (e.g. ``classifier.1.``, ``fc.``, ``head.``)."""
    for name, module in model.named_modules():
        if module is model.head:
            return f"{name}."
    raise CheckpointError(f"{type(model).__name__}.head is not one of its modules")


def load_weights(model: nn.Module, path: str | Path, what: str = "model") -> nn.Module:
    """Load the checkpoint at ``path`` into ``model`` (body exactly; head when its shape fits)
    and set ``model.head_loaded``; CheckpointError names what does not match."""
    state = read_state_dict(path, what)
    prefix = head_prefix(model)
    ours = model.state_dict()
    head = {k: v for k, v in state.items() if k.startswith(prefix)}
    body = {k: v for k, v in state.items() if not k.startswith(prefix)}
    our_body = {k: v for k, v in ours.items() if not k.startswith(prefix)}
    missing, unexpected = sorted(set(our_body) - set(body)), sorted(set(body) - set(our_body))
    if missing or unexpected:
        raise CheckpointError(f"{path} is not a {what} in this layout (missing {missing[:3]}, unexpected "
                              f"{unexpected[:3]})")
    for key, value in body.items():
        if tuple(value.shape) != tuple(our_body[key].shape):
            raise CheckpointError(f"{path}: tensor '{key}' has shape {tuple(value.shape)}, expected "
                                  f"{tuple(our_body[key].shape)}")
    fits = set(head) == {k for k in ours if k.startswith(prefix)} and all(
        tuple(v.shape) == tuple(ours[k].shape) for k, v in head.items())
    model.load_state_dict({**body, **head} if fits else body, strict=fits)
    model.head_loaded = fits
    model.checkpoint_digest = file_digest(path)
    return model
