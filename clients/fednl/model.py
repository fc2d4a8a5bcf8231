"""FedNL on a model: install the dual-path attention on every self-attention layer of a HF
causal LM, and name what is trained and federated (the meta-rules θ).

The names and modes of θ are the wire contract of :mod:`strategies.fednl`, imported here
so both sides classify parameters by the same rule.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from clients.fednl.config import FedNLConfig
from clients.fednl.layer import BetaProjection, dual_path_attention_forward
from strategies.fednl import MODES as PAYLOAD_MODES  # the wire contract: the server's names and modes
from strategies.fednl import theta_kind

# What a Llama-family attention module has (LlamaAttention, Qwen2Attention, ...).
_ATTENTION_ATTRIBUTES = (
    "q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "num_key_value_groups", "scaling", "layer_idx", "config",
)  # fmt: skip


def _is_attention(module: nn.Module) -> bool:
    return all(hasattr(module, name) for name in _ATTENTION_ATTRIBUTES)


def dual_path_attentions(model: nn.Module) -> list[nn.Module]:
    """Every attention module FedNL rewired (a memory or, outside ``FedNLConfig.layers``, the windowed
    softmax path alone), in layer order."""
    return [m for m in model.modules() if getattr(m, "fednl_config", None) is not None]


def memory_attentions(model: nn.Module) -> list[nn.Module]:
    """The attention modules that carry a delta memory (a gate and β), in layer order."""
    return [m for m in dual_path_attentions(model) if getattr(m, "fednl_gate", None) is not None]


def add_delta_memory(model: nn.Module, config: FedNLConfig | None = None) -> nn.Module:
    """Make every self-attention layer dual-path (in place) and freeze the backbone.

    Each attention module keeps its own projections and parameter names; it gains
    ``fednl_gate`` (the memory gate's logit) and ``fednl_beta`` (a :class:`BetaProjection`),
    both trainable float32, and its ``forward`` is replaced by the dual-path one. With
    ``config.layers``, only those layers (``layer_idx``) get a memory; the others run the
    (windowed) softmax path alone, their ``fednl_gate`` and ``fednl_beta`` None. Every
    parameter that existed before is frozen. Returns ``model``.
    """
    config = config or FedNLConfig()
    if not isinstance(config, FedNLConfig):
        raise TypeError(f"config must be a FedNLConfig, got {type(config).__name__}")
    if dual_path_attentions(model):
        raise ValueError("this model already has a FedNL delta memory")
    attentions = [m for m in model.modules() if _is_attention(m)]
    if not attentions:
        raise ValueError(
            f"no self-attention module with q_proj/k_proj/v_proj/o_proj found in {type(model).__name__}; "
            "FedNL supports Llama-family decoders (Llama, Qwen2, SmolLM2, ...)"
        )
    indices = [getattr(attn, "layer_idx", None) for attn in attentions]
    indices = indices if all(isinstance(i, int) for i in indices) else list(range(len(attentions)))
    unknown = sorted(set(config.layers or ()) - set(indices))
    if unknown:
        raise ValueError(f"layers {unknown} are not among the model's attention layers 0..{len(attentions) - 1}")
    model.requires_grad_(False)
    for index, attn in zip(indices, attentions):
        attn.fednl_config = config
        attn.fednl_stream = None  # set only while a FedNLStreamer runs a block
        attn.forward = types.MethodType(dual_path_attention_forward, attn)
        if config.layers is not None and index not in config.layers:  # the softmax path alone
            attn.fednl_gate = attn.fednl_beta = None
            continue
        num_heads = attn.config.num_attention_heads
        channels = num_heads * attn.head_dim
        # one memory, and one beta, per query head or per key/value head (memory_heads)
        memories = num_heads if config.memory_heads == "query" else num_heads // attn.num_key_value_groups
        device = next(attn.o_proj.parameters()).device
        shape = (1,) if config.gate == "scalar" else (channels,)
        attn.fednl_gate = nn.Parameter(torch.full(shape, float(config.gate_init_logit), device=device))
        attn.fednl_beta = BetaProjection(attn.config.hidden_size, memories, config.beta, config.beta_init_logit).to(
            device
        )
    return model


def is_memory_param(name: str) -> bool:
    """Whether a parameter name belongs to the memory rule (gate or beta)."""
    return theta_kind(name) == "memory"


def is_qkv_lora_param(name: str) -> bool:
    """Whether a parameter name is a PEFT LoRA weight on q_proj, k_proj or v_proj."""
    return theta_kind(name) == "lora"


def meta_rule_names(model: nn.Module, mode: str = "meta-rules") -> list[str]:
    """Names (as ``model.named_parameters()`` gives them) of the payload theta.

    ``"meta-rules"``: LoRA on q/k/v + gate + beta (the seed's theta; needs PEFT LoRA).
    ``"gate"``: gate + beta only (LoRA, if any, stays on the client).
    """
    if mode not in PAYLOAD_MODES:
        raise ValueError(f"mode must be one of {PAYLOAD_MODES}, got {mode!r}")
    names = [name for name, _ in model.named_parameters()]
    memory = [n for n in names if is_memory_param(n)]
    if not memory:
        raise ValueError("the model has no FedNL memory parameters; call add_delta_memory(model, config) first")
    if mode == "gate":
        return memory
    lora = [n for n in names if is_qkv_lora_param(n)]
    if not lora:
        raise ValueError(
            "payload mode 'meta-rules' needs LoRA on q_proj/k_proj/v_proj; wrap the model with "
            "peft.get_peft_model(model, LoraConfig(target_modules=['q_proj', 'k_proj', 'v_proj']))"
        )
    chosen = set(memory) | set(lora)
    return [n for n in names if n in chosen]


def mark_trainable(model: nn.Module) -> list[str]:
    """Train LoRA on q/k/v (if present) + gate + beta; freeze everything else.

    Call it after ``peft.get_peft_model`` (which freezes every non-LoRA parameter,
    the gate and beta included). Returns the names of the trainable parameters.
    """
    trainable = []
    for name, param in model.named_parameters():
        train = is_memory_param(name) or is_qkv_lora_param(name)
        param.requires_grad_(train)
        if train:
            trainable.append(name)
    if not any(is_memory_param(n) for n in trainable):
        raise ValueError("the model has no FedNL memory parameters; call add_delta_memory(model, config) first")
    return trainable


@torch.no_grad()
def memory_gate_values(model: nn.Module) -> list[float]:
    """Mean alpha = sigmoid(gate) of each layer (for logging)."""
    return [torch.sigmoid(attn.fednl_gate.float()).mean().item() for attn in memory_attentions(model)]
