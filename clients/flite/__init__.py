"""FLITE — federated lightweight fine-tuning through seed-regenerated latent maps.

Per adapted layer ``θ_l = θ_pre,l + U_l V_lᵀ z_l``: the factors come from a shared 64-bit
seed (regenerated on the CPU, never stored or sent), only the latents ``z`` train and
travel, and because the map is linear, averaging latents is averaging weights.

``config.py`` (what), ``layer.py`` (the maths and the wrapper modules), ``model.py``
(injection, latents, layout, fingerprint, frozen orthogonal head).
"""

from clients.flite.config import FliteConfig
from clients.flite.layer import (
    FliteConv,
    FliteLayer,
    FliteLinear,
    FliteNorm,
    LayerSpec,
    generate_raw_factors,
    layer_seed,
)
from clients.flite.model import (
    apply_flite,
    factor_checksum,
    fingerprint,
    flite_layers,
    frozen_head_,
    get_latents,
    latents_by_layer,
    layout,
    merge_and_unload,
    num_latents,
    orthogonal_head_,
    plan,
    set_latents,
    split_budget,
    trainable_parameters,
)

__all__ = [
    "FliteConfig",
    "FliteConv",
    "FliteLayer",
    "FliteLinear",
    "FliteNorm",
    "LayerSpec",
    "apply_flite",
    "factor_checksum",
    "fingerprint",
    "flite_layers",
    "frozen_head_",
    "generate_raw_factors",
    "get_latents",
    "latents_by_layer",
    "layer_seed",
    "layout",
    "merge_and_unload",
    "num_latents",
    "orthogonal_head_",
    "plan",
    "set_latents",
    "split_budget",
    "trainable_parameters",
]
