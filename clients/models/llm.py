"""Causal language models: the embedded SmolLM2, any local HF checkpoint or GGUF file, tiny random inits.

``load_causal_lm(model_cfg, seed)`` returns a fresh ``(model, tokenizer)``. Client
processes keep their prepared model between rounds (``fedapps.session``), so a Ray actor
that trains many rounds loads the backbone once.
"""

from __future__ import annotations

import functools
import os

import torch

from clients import assets
from clients.models.names import checkpoint_label, gguf_label  # noqa: F401 - torch-free, re-exported


class ModelError(ValueError):
    pass


def checkpoint_path(model_cfg) -> str:
    """Where the weights come from: the embedded checkpoint, a local folder, a GGUF file converted
    once (``model.gguf``), or a hub id."""
    path = model_cfg.get("path")
    if not path and model_cfg.get("gguf"):
        return str(assets.gguf_checkpoint(os.path.expanduser(str(model_cfg.gguf))))
    if path:
        if os.path.isdir(os.path.expanduser(str(path))):
            return os.path.expanduser(str(path))
        if os.environ.get("HF_HUB_OFFLINE") == "1" or str(path).startswith(("/", ".", "~")):
            raise ModelError(
                f"model.path '{path}' is not a local checkpoint folder and this process is offline; "
                "give a folder holding config.json and the weights, or drop model.path to use the "
                "embedded SmolLM2-135M (model=smollm2)"
            )
        return str(path)  # a hub id, for users with internet
    return str(assets.smollm2_checkpoint())


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def causal_lm_config(model_cfg):
    """``(HF config, tokenizer)`` of the model ``model_cfg`` names, without its weights."""
    from transformers import AutoConfig, LlamaConfig

    assets.force_offline()
    random_init = model_cfg.get("random_init")
    if random_init:
        # a tiny Llama (or model.random_init.model_type's architecture) with the embedded tokenizer: same
        # data path as SmolLM2, seconds to train
        tok = _tokenizer(str(assets.smollm2_checkpoint()) if not model_cfg.get("path") else checkpoint_path(model_cfg))
        settings = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
        from omegaconf import OmegaConf

        plain = OmegaConf.to_container(random_init, resolve=True) if OmegaConf.is_config(random_init) else dict(random_init)
        settings.update({k: v for k, v in plain.items() if k != "model_type"})
        model_type = random_init.get("model_type")  # null = Llama; e.g. gemma3_text (conf/model/tiny-gemma3.yaml)
        config = AutoConfig.for_model(str(model_type), **settings) if model_type else LlamaConfig(**settings)
        return config, tok
    path = checkpoint_path(model_cfg)
    try:
        return AutoConfig.from_pretrained(path), _tokenizer(path)
    except OSError as err:
        raise ModelError(f"cannot load a causal LM from '{path}': {err}") from None


def load_causal_lm(model_cfg, seed: int = 0):
    """A new causal LM (frozen, eval mode, fp32 on CPU) and its tokenizer."""
    from transformers import AutoModelForCausalLM

    config, tok = causal_lm_config(model_cfg)
    if model_cfg.get("random_init"):
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        torch.random.set_rng_state(generator_state)
    else:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a "Loading weights" bar per client process, for a 1 s load
        path = checkpoint_path(model_cfg)
        try:  # ~1 s from the converted safetensors checkpoint
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        except OSError as err:
            raise ModelError(f"cannot load a causal LM from '{path}': {err}") from None
    model.requires_grad_(False)
    model.eval()
    return model, tok


def model_fingerprint(model) -> str:
    """Short hash of a backbone's architecture (names and shapes of its weights)."""
    import hashlib

    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(f"{name}:{tuple(tensor.shape)};".encode())
    return h.hexdigest()[:16]


def describe(model) -> str:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f"{type(model).__name__}: {total / 1e6:.1f}M parameters, {trainable:,} trainable"



# --------------------------------------------------------------------------- the output layer, in pieces
# A causal LM's 49,152-way logits are the largest tensor of a client's step: [batch, tokens,
# vocab] in fp32 (100 MB for 4 x 128 tokens of SmolLM2) and as much again for their gradient.
# These helpers run the decoder, then the output layer only where it is needed: at chosen
# positions (MMLU/NIAH score one token per prompt), or token chunk by token chunk with the
# chunk's logits recomputed in backward (torch.utils.checkpoint), so at most one chunk of
# logits exists at a time. Same values and gradients as the full logits (tested).


def decoder_and_head(model):
    """``(decoder, output layer)`` of a HF causal LM, through a PEFT wrapper; the decoder's
    ``last_hidden_state`` fed to the output layer gives the model's logits. Every method's
    adapters (LoRA, FLITE, FedNL's memory, SmartFed's experts) live inside the two."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if decoder is None or head is None or getattr(base.config, "final_logit_softcapping", None):
        return None, None  # not a plain decoder + linear head: callers use the full logits
    return decoder, head


def position_logits(model, input_ids, attention_mask, positions) -> torch.Tensor:
    """Logits ``[batch, vocab]`` at ``positions[b]`` of each row (the output layer runs on
    those positions only)."""
    decoder, head = decoder_and_head(model)
    rows = torch.arange(len(positions), device=input_ids.device)
    if decoder is None:
        return model(input_ids=input_ids, attention_mask=attention_mask).logits[rows, positions]
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    return head(hidden[rows, positions])


def _chunk_loss(head, hidden, labels, reduction="sum"):
    return torch.nn.functional.cross_entropy(head(hidden).float(), labels, reduction=reduction)


def token_loss(model, input_ids, labels, *, chunk_tokens: int = 256, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy of ``labels`` (``[batch, tokens]``) over the full vocabulary,
    ``mean``, ``sum`` or ``none`` (each token's, shaped like ``labels``); labels of -100 (padding, a
    prompt masked out of the loss) are not scored (0 under ``none``, out of the mean's count); with
    ``chunk_tokens > 0`` the output layer and the loss run on that many tokens at a time (their
    logits recomputed in backward), else on all logits at once."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be mean, sum or none, got {reduction!r}")
    decoder, head = decoder_and_head(model) if chunk_tokens > 0 else (None, None)
    if decoder is None:
        logits = model(input_ids=input_ids).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction=reduction)
        return loss.view(labels.shape) if reduction == "none" else loss
    from torch.utils.checkpoint import checkpoint

    hidden = decoder(input_ids=input_ids).last_hidden_state.flatten(0, 1)
    flat = labels.flatten()
    parts = []
    for start in range(0, flat.numel(), int(chunk_tokens)):
        piece = (head, hidden[start : start + chunk_tokens], flat[start : start + chunk_tokens],
                 "none" if reduction == "none" else "sum")
        parts.append(checkpoint(_chunk_loss, *piece, use_reentrant=False) if torch.is_grad_enabled()
                     else _chunk_loss(*piece))
    if reduction == "none":
        return torch.cat(parts).view(labels.shape)
    total = torch.stack(parts).sum()
    if reduction == "sum":
        return total
    scored = flat.numel() if bool((flat >= 0).all()) else int((flat != -100).sum())  # labels -100: unscored
    return total / max(1, scored)
