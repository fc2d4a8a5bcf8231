"""FLITE — federated lightweight fine-tuning through seed-regenerated latent maps.

Per adapted layer ``θ_l = θ_pre,l + U_l V_lᵀ z_l``: the factors come from a shared 64-bit
seed (regenerated on the CPU, never stored or sent), only the latents ``z`` train and
travel, and because the map is linear, averaging latents is averaging weights.

``config.py`` (what), ``layer.py`` (the maths and the wrapper modules), ``model.py``
(injection, latents, layout, fingerprint); the frozen orthogonal head is ``clients.models.heads``.
"""

from clients.lazy import lazy_names

# each name's submodule, imported when the name is first used (clients.lazy)
_WHERE = {
    "FliteConfig": "config",
    "FliteConv": "layer",
    "FliteLayer": "layer",
    "FliteLinear": "layer",
    "FliteNorm": "layer",
    "LayerSpec": "layer",
    "generate_raw_factors": "layer",
    "layer_seed": "layer",
    "apply_flite": "model",
    "factor_checksum": "model",
    "fingerprint": "model",
    "flite_layers": "model",
    "get_latents": "model",
    "latents_by_layer": "model",
    "layout": "model",
    "merge_and_unload": "model",
    "num_latents": "model",
    "plan": "model",
    "set_latents": "model",
    "split_budget": "model",
    "trainable_parameters": "model",
}


__getattr__ = lazy_names(__name__, _WHERE)


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
    "generate_raw_factors",
    "get_latents",
    "latents_by_layer",
    "layer_seed",
    "layout",
    "merge_and_unload",
    "num_latents",
    "plan",
    "set_latents",
    "split_budget",
    "trainable_parameters",
]
