"""A vision model's frozen orthogonal classifier: FLITE's (it never trains nor travels), and the head every
method that adapts only a vision backbone keeps (the LoRA baselines, ``base=public`` pretraining).
"""

from __future__ import annotations

import torch
import torch.nn as nn


def orthogonal_head_(linear: nn.Linear, seed: int = 0, gain: float = 1.0) -> nn.Linear:
    """A frozen orthogonal classifier, in place: orthonormal rows (columns when
    ``out_features > in_features``) times ``gain``, zero bias, ``requires_grad=False``.

    Drawn with ``torch.nn.init.orthogonal_`` from its own seeded CPU generator (the global
    RNG is neither used nor advanced), so every client builds the same head; it is never
    trained nor sent. ``gain`` sets the logit scale the backbone has to work with.
    """
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"orthogonal_head_ expects an nn.Linear, got {type(linear).__name__}")
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int(seed) % 2**64)
    weight = torch.empty(linear.weight.shape, dtype=torch.float32)
    torch.nn.init.orthogonal_(weight, gain=gain, generator=generator)
    with torch.no_grad():
        linear.weight.copy_(weight.to(linear.weight.device, linear.weight.dtype))
        if linear.bias is not None:
            linear.bias.zero_()
    linear.weight.requires_grad_(False)
    if linear.bias is not None:
        linear.bias.requires_grad_(False)
    return linear


def frozen_head_(model: nn.Module, seed: int = 0, gain: float = 1.0) -> nn.Module:
    """``model.head`` as a frozen classifier: the orthogonal draw of :func:`orthogonal_head_`,
    unless the checkpoint the model came from carried its head (``model.head_loaded``, e.g.
    θ_pre of ``base=public``, trained under that very head): then it is kept, only frozen."""
    if getattr(model, "head_loaded", False):
        model.head.requires_grad_(False)
    else:
        orthogonal_head_(model.head, seed=seed, gain=gain)
    return model
