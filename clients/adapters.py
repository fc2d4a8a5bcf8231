"""What a method trains and federates on a model: PEFT LoRA adapters or all weights.

A *federated state* is a ``dict[str, torch.Tensor]`` with stable names, read with
:func:`federated_state` and written back with :func:`load_federated_state`; the strategy
sees the same names as numpy arrays.
"""

from __future__ import annotations

import warnings

import torch


class AdapterError(ValueError):
    pass


def pointwise_convs(model) -> list[str]:
    """Full names of a vision backbone's 1×1 convolutions (groups=1): its channel mixers."""
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Conv2d) and module.kernel_size == (1, 1) and module.groups == 1]


def apply_lora(model, lora_cfg, seed: int):
    """Wrap ``model`` with PEFT LoRA; A is drawn from ``seed`` so every client starts alike.

    ``lora_cfg.target_modules``: module name suffixes (a causal LM's projections), or
    ``pointwise`` for every 1×1 convolution of a vision backbone (:func:`pointwise_convs`).
    ``lora_cfg.send == 'b'`` (FFA-LoRA) freezes A at that shared init.
    """
    from peft import LoraConfig, get_peft_model

    vision = not hasattr(model, "config")  # a HF causal LM has a config; the vision backbones do not
    if list(lora_cfg.target_modules) == ["pointwise"] or lora_cfg.target_modules == "pointwise":
        targets = pointwise_convs(model)
        if not targets:
            raise AdapterError(f"LoRA target 'pointwise': {type(model).__name__} has no 1x1 convolutions")
    else:
        targets = list(lora_cfg.target_modules)
        present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        missing = [t for t in targets if t not in present]
        if missing:
            hint = " (a vision backbone: use algorithm.lora.target_modules=[pointwise])" if vision else ""
            raise AdapterError(f"LoRA target modules {missing} do not exist in {type(model).__name__}{hint}")
    config = LoraConfig(
        r=int(lora_cfg.r),
        lora_alpha=int(lora_cfg.alpha),
        lora_dropout=float(lora_cfg.dropout),
        target_modules=targets,
        bias="none",
        task_type=None if vision else "CAUSAL_LM",
    )
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    with warnings.catch_warnings():  # PEFT reads transformers' deprecated is_gradient_checkpointing
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        peft_model = get_peft_model(model, config)
    torch.random.set_rng_state(state)
    if lora_cfg.get("send", "all") == "b":
        for name, param in peft_model.named_parameters():
            if "lora_A" in name:
                param.requires_grad_(False)
    return peft_model


def federated_names(model, algorithm_cfg) -> list[str]:
    """Names of the tensors a method federates (sorted)."""
    if algorithm_cfg.trainable == "lora":
        names = [n for n, _ in model.named_parameters() if "lora_A" in n or "lora_B" in n]
        if algorithm_cfg.lora.get("send", "all") == "b":
            names = [n for n in names if "lora_B" in n]
    elif algorithm_cfg.trainable == "full":
        names = [n for n, p in model.named_parameters() if p.requires_grad]
    else:
        raise AdapterError(f"unknown trainable kind '{algorithm_cfg.trainable}'")
    return sorted(names)


def federated_state(model, names: list[str]) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    return {name: params[name].detach().cpu().clone() for name in names}


def all_lora_state(model) -> dict[str, torch.Tensor]:
    """Every LoRA factor (A and B), e.g. to save an adapter whose A was never sent."""
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if "lora_A" in n or "lora_B" in n}


def load_federated_state(model, state: dict) -> None:
    """Copy a federated state into the model's parameters (shapes must match)."""
    params = dict(model.named_parameters())
    unknown = sorted(set(state) - set(params))
    if unknown:
        raise AdapterError(f"state holds tensors the model does not have: {unknown[:3]}")
    with torch.no_grad():
        for name, value in state.items():
            target = params[name]
            value = torch.as_tensor(value)
            if tuple(value.shape) != tuple(target.shape):
                raise AdapterError(f"tensor '{name}' has shape {tuple(value.shape)}, the model expects {tuple(target.shape)}")
            target.copy_(value.to(dtype=target.dtype, device=target.device))


def best_rank_fit(delta, rank: int, scaling: float):
    """LoRA factors ``(A: r×d_in, B: d_out×r)`` with ``scaling · B @ A`` the best rank-``rank`` fit of
    ``delta`` in the Frobenius norm (its truncated SVD, the singular values split evenly)."""
    delta = torch.as_tensor(delta, dtype=torch.float32)
    U, S, Vh = torch.linalg.svd(delta, full_matrices=False)
    root = (S[:rank] / float(scaling)).sqrt()
    return root[:, None] * Vh[:rank], U[:, :rank] * root[None, :]


def warm_start_lora(model, deltas: dict, *, adapter: str = "default") -> list[str]:
    """Start each LoRA layer whose base module (``model.layers.0.self_attn.q_proj``) is in ``deltas``
    from :func:`best_rank_fit` of that ΔW (``(d_out, d_in)``) instead of PEFT's init (B = 0); layers
    without a ΔW keep PEFT's. Returns the base module names set. Used by ``algorithm.lora.init=pool``
    (FedAvg-LoRA from the knowledge pool's adapters: ``fedapps.baselines``)."""
    from peft.tuners.lora import LoraLayer

    done = []
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
                continue
            base = name.removeprefix("base_model.model.")
            if base not in deltas:
                continue
            A, B = module.lora_A[adapter].weight, module.lora_B[adapter].weight
            delta = torch.as_tensor(deltas[base], dtype=torch.float32)
            if tuple(delta.shape) != (B.shape[0], A.shape[1]):
                raise AdapterError(f"the pool's ΔW of {base} has shape {tuple(delta.shape)}, the model's "
                                   f"{(B.shape[0], A.shape[1])}: another backbone")
            new_A, new_B = best_rank_fit(delta, A.shape[0], module.scaling[adapter])
            A.copy_(new_A.to(A.dtype))
            B.copy_(new_B.to(B.dtype))
            done.append(base)
    return sorted(done)
