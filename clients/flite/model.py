"""FLITE on a whole model: target selection, injection, latents, layout and fingerprint.

Typical client use::

    model = build_backbone()                       # pretrained, e.g. MobileNetV2
    frozen_head_(model, seed=cfg.seed)             # the frozen orthogonal classifier (clients.models.heads)
    apply_flite(model, cfg)                        # in place; only the latents train
    fp = fingerprint(cfg, model)                   # travels with every payload
    set_latents(model, z_global)                   # from the server (flat float32 vector)
    ... train the parameters returned by trainable_parameters(model) ...
    z_local = get_latents(model)                   # the payload: layout order, float32

The latent vector is flat: layer after layer in :func:`layout` order (the order of
``model.named_modules()``), so a whole model's payload is one tensor (1,280 latents ->
5,120 bytes in fp32, 648 bytes in int4).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping

import numpy as np
import torch
import torch.nn as nn

from clients.flite.config import PARAMETRISATION_VERSION, FliteConfig
from clients.flite.layer import (
    WRAPPERS,
    FliteLayer,
    LayerSpec,
    build_factors,
    generate_raw_factors,
)
from clients.factors import split_budget  # noqa: F401 - shared with the latent channel; re-exported

_NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.RMSNorm)
_NORM_SUFFIXES = ("RMSNorm", "LayerNorm", "GroupNorm", "BatchNorm")


# --------------------------------------------------------------------------------------
# Target selection and planning
# --------------------------------------------------------------------------------------


def _matches(name: str, patterns) -> bool:
    """PEFT's rule: a string is a full-match regex, a list matches names or name suffixes."""
    if patterns is None:
        return False
    if isinstance(patterns, str):
        return re.fullmatch(patterns, name) is not None
    return any(name == p or name.endswith("." + p) for p in patterns)


def _in_head(name: str, heads) -> bool:
    return any(name == h or name.startswith(h + ".") for h in heads)


def _norm_params(module: nn.Module) -> tuple[str, ...]:
    """Affine parameter names of a norm layer (weight first), or () if it has none / is not one."""
    is_norm = isinstance(module, _NORM_TYPES) or type(module).__name__.endswith(_NORM_SUFFIXES)
    if not is_norm:
        return ()
    names = tuple(
        n for n in ("weight", "bias") if isinstance(getattr(module, n, None), nn.Parameter)
    )
    if not names or names[0] != "weight":
        return ()
    if len({getattr(module, n).numel() for n in names}) != 1:
        return ()
    return names


def _kind(name: str, module: nn.Module, parent: nn.Module | None) -> str | None:
    if isinstance(module, FliteLayer):
        raise ValueError(f"module '{name}' is already a FLITE layer; apply_flite was called twice")
    if isinstance(module, nn.Linear):
        # nn.MultiheadAttention reads out_proj.weight directly instead of calling out_proj.
        if isinstance(parent, nn.MultiheadAttention):
            return None
        return "linear"
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return "conv"
    if _norm_params(module):
        return "norm"
    return None


def _candidates(model: nn.Module, config: FliteConfig) -> list[tuple[str, nn.Module, str]]:
    """(name, module, kind) of every layer the config adapts, in ``named_modules`` order."""
    parents = {}
    for pname, parent in model.named_modules():
        for cname, child in parent.named_children():
            parents[f"{pname}.{cname}" if pname else cname] = parent
    found = []
    for name, module in model.named_modules():
        if not name:
            continue
        kind = _kind(name, module, parents.get(name))
        if kind is None:
            continue
        if _matches(name, config.exclude_modules):
            continue
        if config.freeze_head and _in_head(name, config.head_modules):
            continue
        if kind == "norm":
            if not config.include_norms:
                continue
        elif config.target_modules is not None and not _matches(name, config.target_modules):
            continue
        found.append((name, module, kind))
    return found


def _matrix_shape(module: nn.Module, kind: str, param_names: tuple[str, ...]) -> tuple[int, int]:
    weight = module.weight
    if kind in ("linear", "conv"):
        return int(weight.shape[0]), int(weight[0].numel())
    return len(param_names), int(weight.numel())


def split_weights(split: str, numels: list[int], names: list[str] | None = None,
                  sensitivity: dict[str, float] | None = None) -> list[float]:
    """The weights :func:`split_budget` shares the budget by, per weight layer in model order
    (``FliteConfig.split``): equal, √size, size, √size × position (the last layers first), or the
    layer's ``sensitivity`` (by name; every layer must have one)."""
    if split == "sensitivity":
        missing = [n for n in names or [] if n not in (sensitivity or {})]
        if sensitivity is None or missing:
            raise ValueError("FLITE split='sensitivity' needs a sensitivity for every weight layer"
                             + (f"; none for {missing[:5]}" if sensitivity is not None else
                                " (FliteConfig.sensitivity; base=public measures them)"))
        return [float(sensitivity[n]) for n in names]
    if split == "uniform":
        return [1.0] * len(numels)
    if split == "size":
        return [float(n) for n in numels]
    if split == "late":
        return [math.sqrt(n) * (i + 1) for i, n in enumerate(numels)]
    return [math.sqrt(n) for n in numels]


def plan(model: nn.Module, config: FliteConfig) -> list[LayerSpec]:
    """The layer specs ``apply_flite`` would use, without touching the model.

    Works on a model on the ``meta`` device too (only names and shapes are read).
    """
    config.validate()
    candidates = _candidates(model, config)
    if not candidates:
        raise ValueError("FLITE found no layer to adapt (check target_modules, exclude_modules, include_norms)")
    shapes, params = [], []
    for name, module, kind in candidates:
        names = _norm_params(module) if kind == "norm" else ("weight",)
        params.append(names)
        shapes.append(_matrix_shape(module, kind, names))
    numels = [m * n for m, n in shapes]
    is_norm = [kind == "norm" for _, _, kind in candidates]
    latents = [0] * len(candidates)
    for i, norm in enumerate(is_norm):
        if norm:
            latents[i] = min(config.norm_latents, numels[i])
    weight_idx = [i for i, norm in enumerate(is_norm) if not norm]
    if config.latents is not None:
        for i in weight_idx:
            latents[i] = min(config.latents, numels[i])
    elif weight_idx:
        budget = config.latent_budget - sum(latents)
        if budget < len(weight_idx):
            raise ValueError(
                f"latent_budget={config.latent_budget} leaves {budget} latents for {len(weight_idx)} weight layers "
                f"after {sum(latents)} norm latents; raise the budget or lower norm_latents"
            )
        weights = split_weights(config.split, [numels[i] for i in weight_idx],
                                [candidates[i][0] for i in weight_idx], config.sensitivity)
        shares = split_budget(budget, weights, [numels[i] for i in weight_idx])
        for i, k in zip(weight_idx, shares):
            latents[i] = k
    return [
        LayerSpec(
            name=name,
            kind=kind,
            matrix_shape=shape,
            latents=k,
            rank=max(config.rank, k),
            param_names=names,
        )
        for (name, _, kind), shape, k, names in zip(candidates, shapes, latents, params)
    ]


# --------------------------------------------------------------------------------------
# Injection
# --------------------------------------------------------------------------------------


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def apply_flite(model: nn.Module, config: FliteConfig) -> nn.Module:
    """Inject FLITE into ``model`` in place and return it.

    Every selected layer is replaced by a wrapper (``FliteLinear``, ``FliteConv``,
    ``FliteNorm``) holding the original module as ``base_layer``; every parameter of the
    model is frozen except the latents (``flite_z``, zeros: the model still computes
    exactly what the backbone computes). The config is kept as ``model.flite_config``.
    """
    if hasattr(model, "flite_config") or flite_layers(model):
        raise ValueError("apply_flite was already called on this model")
    specs = plan(model, config)
    # Build every wrapper first, so that an error (meta weights, dependent directions)
    # leaves the model untouched.
    wrappers = []
    for spec in specs:
        base = model.get_submodule(spec.name)
        params = [getattr(base, n) for n in spec.param_names]
        if any(p.device.type == "meta" for p in params):
            raise ValueError(f"layer '{spec.name}' is on the meta device; load its weights before apply_flite")
        scale = config.effective_norm_scale if spec.kind == "norm" else config.scale
        factors = build_factors(config.seed, spec, params, scale, config.scale_mode)
        structured = spec.numel > config.structured_threshold
        wrappers.append(WRAPPERS[spec.kind](base, spec, factors, structured))
    for p in model.parameters():
        p.requires_grad_(False)
    for spec, wrapper in zip(specs, wrappers):
        wrapper.flite_z.requires_grad_(True)
        _set_submodule(model, spec.name, wrapper)
    model.flite_config = config
    return model


def merge_and_unload(model: nn.Module) -> nn.Module:
    """Bake ``θ_pre + ΔW(z)`` into the base layers, remove the wrappers, return the model.

    The result is a plain backbone (e.g. to export or evaluate the final global model);
    the base layers' parameters are overwritten.
    """
    layers = [(name, layer) for name, layer in model.named_modules() if isinstance(layer, FliteLayer)]
    if not layers:
        raise ValueError("model has no FLITE layers")
    with torch.no_grad():
        for name, layer in layers:
            for pname, value in layer.effective_parameters().items():
                getattr(layer.base_layer, pname).copy_(value)
            _set_submodule(model, name, layer.base_layer)
    del model.flite_config
    return model


# --------------------------------------------------------------------------------------
# Latents
# --------------------------------------------------------------------------------------


def flite_layers(model: nn.Module) -> list[FliteLayer]:
    """The model's FLITE layers in layout order."""
    return [m for m in model.modules() if isinstance(m, FliteLayer)]


def _require_layers(model: nn.Module) -> list[FliteLayer]:
    layers = flite_layers(model)
    if not layers:
        raise ValueError("model has no FLITE layers; call apply_flite(model, config) first")
    return layers


def layout(model: nn.Module) -> list[tuple[str, int]]:
    """``[(layer name, number of latents), ...]`` in the order of the flat latent vector."""
    return [(layer.flite_spec.name, layer.flite_spec.latents) for layer in _require_layers(model)]


def num_latents(model: nn.Module) -> int:
    return sum(k for _, k in layout(model))


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The latents, in layout order (what the optimiser gets)."""
    return [layer.flite_z for layer in _require_layers(model)]


def get_latents(model: nn.Module) -> np.ndarray:
    """The flat latent vector (float32 copy, layout order)."""
    layers = _require_layers(model)
    return np.concatenate([layer.flite_z.detach().to("cpu", torch.float32).numpy() for layer in layers]).astype(
        np.float32, copy=False
    )


def latents_by_layer(model: nn.Module) -> dict[str, np.ndarray]:
    """The latents per layer name (float32 copies)."""
    return {layer.flite_spec.name: layer.flite_z.detach().to("cpu", torch.float32).numpy().copy()
            for layer in _require_layers(model)}


def _as_vector(value, what: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().to("cpu", torch.float32).numpy()
    arr = np.asarray(value)
    if arr.dtype.kind not in "fiu":
        raise ValueError(f"{what} must be numeric, got dtype {arr.dtype}")
    arr = arr.astype(np.float32)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a 1-D vector, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{what} holds NaN or Inf")
    return arr


def set_latents(model: nn.Module, latents) -> None:
    """Load latents into the model.

    ``latents``: the flat vector (NumPy array, tensor or list; length = :func:`num_latents`)
    or a mapping ``{layer name: vector}`` covering exactly the layers of :func:`layout`.
    Raises ``ValueError`` (naming expected vs got) on a wrong length, a missing or unknown
    layer name, or non-finite values.
    """
    layers = _require_layers(model)
    if isinstance(latents, Mapping):
        names = [layer.flite_spec.name for layer in layers]
        missing = [n for n in names if n not in latents]
        unknown = [n for n in latents if n not in set(names)]
        if missing or unknown:
            raise ValueError(f"latent layers do not match the model: missing {missing[:5]}, unknown {unknown[:5]}")
        chunks = []
        for layer in layers:
            name, k = layer.flite_spec.name, layer.flite_spec.latents
            vec = _as_vector(latents[name], f"latents of layer '{name}'")
            if vec.size != k:
                raise ValueError(f"layer '{name}' expects {k} latents, got {vec.size}")
            chunks.append(vec)
    else:
        total = sum(layer.flite_spec.latents for layer in layers)
        flat = _as_vector(latents, "latent vector")
        if flat.size != total:
            raise ValueError(f"expected a latent vector of {total} values (the model's layout), got {flat.size}")
        chunks, start = [], 0
        for layer in layers:
            k = layer.flite_spec.latents
            chunks.append(flat[start:start + k])
            start += k
    with torch.no_grad():
        for layer, chunk in zip(layers, chunks):
            layer.flite_z.copy_(torch.from_numpy(np.ascontiguousarray(chunk)).to(layer.flite_z.device))


# --------------------------------------------------------------------------------------
# Fingerprint
# --------------------------------------------------------------------------------------


def _backbone_structure(model: nn.Module) -> list[list]:
    """Sorted ``[name, shape]`` of the backbone's parameters, as named before injection."""
    out = []
    for name, p in model.named_parameters():
        if name.endswith("flite_z"):
            continue
        out.append([name.replace(".base_layer", ""), list(p.shape)])
    return sorted(out)


def factor_checksum(config: FliteConfig, model: nn.Module) -> str:
    """sha256 over the raw factor digests of every adapted layer, in layout order.

    On a FLITE model the digests recorded when the factors were generated are used; on a
    plain model (even one on the meta device) the factors are regenerated from the plan.
    """
    layers = flite_layers(model)
    if layers:
        digests = [layer.flite_digest for layer in layers]
    else:
        digests = [generate_raw_factors(config.seed, spec).digest() for spec in plan(model, config)]
    return hashlib.sha256("".join(digests).encode()).hexdigest()


def fingerprint(config: FliteConfig, model: nn.Module) -> str:
    """16 hex characters identifying everything two parties must share to exchange latents:
    the parametrisation version, seed, scaling, the backbone's structure (names and shapes
    of all parameters), the latent layout (names, kinds, shapes, latents, ranks) and a
    checksum of the regenerated factors.

    ``model`` may be a FLITE model built with ``config`` (its recorded digests are used)
    or a plain backbone, even on the meta device (the layout is planned and the factors
    regenerated), so a server can compute the expected value without weights.
    A backbone loaded from a checkpoint file (``model.path``, θ_pre of ``base=public``) adds
    that file's sha256 (``model.checkpoint_digest``), so clients on another θ_pre are refused;
    the embedded ImageNet weights are pinned by their package version.
    """
    layers = flite_layers(model)
    if layers:
        applied = getattr(model, "flite_config", None)
        if applied is not None and applied.to_dict() != config.to_dict():
            raise ValueError("fingerprint: the model was built with a different FliteConfig than the one given")
        specs = [layer.flite_spec for layer in layers]
    else:
        specs = plan(model, config)
    record = {
        "version": PARAMETRISATION_VERSION,
        "seed": int(config.seed),
        "scale": float(config.scale),
        "norm_scale": config.effective_norm_scale,
        "scale_mode": config.scale_mode,
        "structure": _backbone_structure(model),
        "layout": [spec.as_list() for spec in specs],
        "factors": factor_checksum(config, model),
    }
    if getattr(model, "checkpoint_digest", None):  # the weights came from a file: pin its bytes too
        record["checkpoint"] = model.checkpoint_digest
    blob = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
