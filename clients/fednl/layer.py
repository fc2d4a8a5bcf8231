"""Dual-path attention for a frozen HF causal LM: softmax attention + a delta-rule memory.

FedNL (after TPTT's LiZAttention) turns every self-attention layer of a frozen Llama-
family backbone (Llama, Qwen2, SmolLM2, Gemma3: modules with ``q_proj``/``k_proj``/
``v_proj``/``o_proj``; Gemma3's per-head ``q_norm``/``k_norm`` are applied as its own
forward does) into::

    out = o_proj((1 - alpha) * softmax_attention + alpha * delta_rule_attention)

Both paths read the SAME q/k/v projections (so LoRA on q/k/v trains both) and share
``o_proj``; mixing before ``o_proj`` equals mixing after it, since ``o_proj`` is affine
and the weights sum to one. Choices, where the papers leave room:

* The memory path works on the projections *before* RoPE, as TPTT does: the memory is
  content-addressed, and rotating keys by their absolute position would make a key
  written at token 100 miss the same key asked at token 10,000. As in DeltaNet and
  TPTT, q and k go through SiLU (``qk_activation``) and are L2-normalised. With GQA,
  ``memory_heads="query"`` repeats the key/value heads to the query heads, as the softmax
  path does (one memory per query head); ``memory_heads="kv"`` keeps one memory (and one
  beta) per key/value head, written once and read by each of its query heads (SmolLM2:
  3 memories for 9 query heads, a third of the write work). The readout is
  ``o_t = S_t q_t``: with unit keys the memory returns values on the scale of v, the
  same scale as softmax attention's convex mix of values, so no rescaling is needed.
* ``key_centering``: the memory's keys minus their causal running mean (:func:`centre_keys`) before
  the activation's L2 norm. A pretrained model's keys share one large direction (SmolLM2: mean cosine
  0.8 between the keys of one prompt), so with raw keys every write overwrites every other; the running
  sum and count ride on the stream and the HF cache like the memory itself.
* ``layers``: the layers that carry a memory (None: all); the others keep the (windowed) softmax
  path alone, with no gate or β.
* ``beta_t = sigmoid(w_h . x_t + b_h)`` per memory head from the layer input (``beta="input"``)
  or a learnable per-head constant (``beta="constant"``). Padding tokens get beta = 0 and
  never write to the memory.
* ``alpha = sigmoid(fednl_gate)``, one scalar per layer (``gate="scalar"``) or one per
  attention channel (``gate="channel"``, heads x head_dim values), initialised at
  ``sigmoid(gate_init_logit)`` (-4 -> 0.018). With alpha = 0 exactly (logit -inf, or
  -90 or below in float32) the layer returns the backbone's output bit for bit.
* ``window``: None keeps the backbone's own (full causal) attention for the softmax path.
  An int restricts it to the last ``window`` tokens (token i sees i-window+1 .. i) plus
  the first ``sink`` tokens of the sequence (attention sinks, as StreamingLLM: a
  pretrained model parks much of its attention on the first tokens, and a plain sliding
  window that drops them wrecks the softmax path: SmolLM2's held-out Shakespeare loss,
  3.89 nats with full attention, is 7.07 with a 32-token window and 4.23 with the same
  window and 4 sinks: ``python -m bench.fednl --sections lm``, docs/fednl.md); the memory carries
  everything else. That bounds the streaming KV cache at ``sink + window`` tokens, so
  :class:`~clients.fednl.stream.FedNLStreamer` runs any context length in constant memory.

Training uses the chunked delta rule over the whole sequence (BPTT through the memory);
:class:`~clients.fednl.stream.FedNLStreamer` uses the recurrent form block by block with an O(1) state per
layer. ``model.generate`` also works (greedy or sampling; not beam search): the memory
state rides on the HF cache object, whose KV cache then grows as usual.

This module is the layer: :class:`BetaProjection` and the dual-path forward
(:func:`dual_path_attention_forward`). :mod:`clients.fednl.model` installs it on a model,
:mod:`clients.fednl.stream` runs it block by block, :mod:`clients.fednl.deltarule` holds
the delta rule's kernels (ops), :mod:`clients.fednl.config` the settings. The new
parameters are named ``...self_attn.fednl_gate`` and ``...self_attn.fednl_beta.*``.
Typical use (the order matters: PEFT freezes everything that is not LoRA)::

    model = add_delta_memory(model, FedNLConfig(window=None))
    model = peft.get_peft_model(model, LoraConfig(target_modules=["q_proj", "k_proj", "v_proj"]))
    mark_trainable(model)                      # LoRA q/k/v + gate + beta, nothing else
    payload = meta_rule_names(model, "meta-rules")   # or "gate"
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from clients.fednl.config import BETA_MODES, FedNLConfig
from clients.fednl.deltarule import delta_rule_chunked, delta_rule_recurrent, fla_usable, l2_normalize

Tensor = torch.Tensor


class BetaProjection(nn.Module):
    """Per-head write strength ``beta_t`` in (0, 1): ``sigmoid(W x_t + b)`` or ``sigmoid(b)``.

    ``W`` starts at zero, so every mode starts at the constant ``sigmoid(init_logit)``.
    """

    def __init__(self, hidden_size: int, num_heads: int, mode: str = "input", init_logit: float = 0.0):
        super().__init__()
        if mode not in BETA_MODES:
            raise ValueError(f"beta mode must be one of {BETA_MODES}, got {mode!r}")
        self.mode = mode
        self.bias = nn.Parameter(torch.full((num_heads,), float(init_logit)))
        if mode == "input":
            self.weight = nn.Parameter(torch.zeros(num_heads, hidden_size))
        else:
            self.register_parameter("weight", None)

    def forward(self, hidden_states: Tensor) -> Tensor:
        """``(batch, T, hidden)`` -> ``(batch, heads, T)`` in float32."""
        if self.weight is None:
            logits = self.bias.expand(*hidden_states.shape[:-1], -1)
        else:
            logits = F.linear(hidden_states.to(self.weight.dtype), self.weight, self.bias)
        return torch.sigmoid(logits.float()).transpose(1, 2)


def _model_function(attn: nn.Module, name: str) -> Callable:
    """``apply_rotary_pos_emb`` / ``eager_attention_forward`` of the attention's own model
    file (Qwen2's are its own), falling back to Llama's."""
    function = getattr(sys.modules.get(type(attn).__module__), name, None)
    if function is None:
        from transformers.models.llama import modeling_llama

        function = getattr(modeling_llama, name)
    return function


def _repeat_kv(x: Tensor, groups: int) -> Tensor:
    """(batch, kv_heads, T, d) -> (batch, kv_heads * groups, T, d), as HF's repeat_kv."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _allowed(mask: Tensor) -> Tensor:
    """An HF 4-D mask (bool: True = attend; float: 0 = attend, very negative = masked) -> bool."""
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def _valid_tokens(attention_mask, batch: int, length: int, past: int) -> Tensor | None:
    """(batch, 1, T) bool: which of the current tokens are real (not padding), or None if all.

    A token is real when it may attend to itself: HF masks exclude padding positions
    entirely. 2-D masks (flash-attention) mark real keys with 1.
    """
    if not isinstance(attention_mask, Tensor):
        return None
    if attention_mask.dim() == 2:
        return attention_mask[:, -length:].bool().reshape(batch, 1, length)
    if attention_mask.dim() == 4:
        allowed = _allowed(attention_mask[:, :1]).expand(batch, 1, length, -1)
        index = torch.arange(length, device=allowed.device)
        return allowed[:, :, index, past + index]
    return None


def _softmax_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scaling: float, dropout: float, groups: int):
    """Plain masked softmax attention; q (B, H, Tq, d), k/v (B, KV, Tk, d) -> (B, Tq, H, d)."""
    out = F.scaled_dot_product_attention(
        q, _repeat_kv(k, groups), _repeat_kv(v, groups), attn_mask=allowed, dropout_p=dropout, scale=scaling
    )
    return out.transpose(1, 2)


def _band(q_pos: Tensor, k_pos: Tensor, window: int | None, sink: int = 0) -> Tensor:
    """Causal (and sliding-window) mask from absolute positions: (Tq, Tk) bool. With a window,
    the keys at positions below ``sink`` stay visible (attention sinks)."""
    offset = q_pos[:, None] - k_pos[None, :]
    allowed = offset >= 0
    if window is not None:
        allowed &= (offset < window) | (k_pos[None, :] < sink)
    return allowed


def layer_sink(attn: nn.Module) -> int:
    """The sink tokens a layer's windowed softmax path keeps: FedNL's ``sink`` when FedNL sets a
    window, none on a layer with a sliding window of its own (Gemma3's local layers, Qwen2 with
    ``use_sliding_window``), which the backbone was trained without sinks."""
    config = attn.fednl_config
    return int(config.sink) if config.window is not None and not getattr(attn, "sliding_window", None) else 0


def _windowed_mask(attention_mask, batch: int, length: int, total: int, window: int, device, sink: int = 0) -> Tensor:
    """The HF mask (causal + padding) restricted to the sliding window and the sinks: (B, 1, T, Tk) bool."""
    q_pos = torch.arange(total - length, total, device=device)
    allowed = _band(q_pos, torch.arange(total, device=device), window, sink)[None, None]
    if isinstance(attention_mask, Tensor) and attention_mask.dim() == 4:
        allowed = allowed & _allowed(attention_mask[..., -total:])
    elif isinstance(attention_mask, Tensor) and attention_mask.dim() == 2:
        allowed = allowed & attention_mask[:, None, None, -total:].bool()
    elif attention_mask is not None:
        raise ValueError(
            f"window needs a tensor attention mask; got {type(attention_mask).__name__}. "
            "Load the model with attn_implementation='sdpa' or 'eager'."
        )
    # A padding query may not attend to anything; let it see itself so no row is empty.
    diagonal = (q_pos[:, None] == torch.arange(total, device=device)[None, :])[None, None]
    return (allowed | diagonal).expand(batch, 1, length, total)


def centre_keys(key: Tensor, valid: Tensor | None, earlier: tuple[Tensor, Tensor] | None = None
                ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """Keys minus their causal running mean (``key_centering``): token t's key less the mean of the real
    keys 0..t, those of earlier blocks included.

    ``key`` is (B, heads, T, d); ``valid`` (B, 1, T) bool marks real tokens (None: all), padding neither
    counts nor moves the mean; ``earlier`` is the ``(sum, count)`` returned for the tokens before, or None.
    Returns the centred keys and the new ``(sum (B, heads, d), count (B, 1, 1))``, both float32. The first
    token's key becomes 0, so it writes nothing; the mean is over keys before the activation's L2 norm.
    """
    weight = torch.ones_like(key[..., :1]) if valid is None else valid[..., None].to(key.dtype)
    sums = torch.cumsum(key.float() * weight, dim=2)
    counts = torch.cumsum(weight.float(), dim=2)
    if earlier is not None:
        sums = sums + earlier[0][:, :, None]
        counts = counts + earlier[1][:, :, None]
    centred = key - (sums / counts.clamp_min(1.0)).to(key.dtype)
    return centred, (sums[:, :, -1], counts[:, :, -1])


class LayerStream:
    """One layer's carried state while streaming: delta memory + the softmax path's KV cache
    (with a window: the sink tokens and the last ``window`` tokens)."""

    def __init__(self, window: int | None, form: str, sink: int = 0):
        self.window = window
        self.sink = sink if window is not None else 0
        self.form = form
        self.memory: Tensor | None = None  # (B, memory heads, d_v, d_k) float32: query or KV heads (memory_heads)
        self.keys: Tensor | None = None  # (B, KV, <= sink + window, d), after RoPE
        self.values: Tensor | None = None
        self.positions: Tensor | None = None  # the cached keys' absolute positions
        self.seen = 0  # tokens processed so far
        self.key_stats: tuple[Tensor, Tensor] | None = None  # key_centering: the keys' running (sum, count)

    def softmax_path(self, attn: nn.Module, q: Tensor, k: Tensor, v: Tensor, dropout: float) -> Tensor:
        length = q.shape[2]
        q_pos = torch.arange(self.seen, self.seen + length, device=q.device)
        k_pos = q_pos
        if self.keys is not None:
            k = torch.cat([self.keys, k], dim=2)
            v = torch.cat([self.values, v], dim=2)
            k_pos = torch.cat([self.positions, q_pos])
        allowed = _band(q_pos, k_pos, self.window, self.sink)
        out = _softmax_attention(q, k, v, allowed, attn.scaling, dropout, attn.num_key_value_groups)
        if self.window is not None:  # what a later token can still see: the sinks and the last `window`
            keep = (k_pos < self.sink) | (k_pos >= self.seen + length - self.window)
            k, v, k_pos = k[:, :, keep], v[:, :, keep], k_pos[keep]
        self.keys, self.values, self.positions = k.detach(), v.detach(), k_pos
        return out

    def nbytes(self) -> int:
        stats = self.key_stats or ()
        return sum(t.numel() * t.element_size() for t in (self.memory, self.keys, self.values, *stats) if t is not None)


def _carried(past_key_values, slot: str, layer: int, past: int, what: str):
    """What a FedNL layer keeps on the HF cache between calls (``slot``: its dict there, by layer): that
    dict (None without a cache) and this layer's entry from the tokens before (None at the start)."""
    if past_key_values is None:
        return None, None
    states = past_key_values.__dict__.setdefault(slot, {})
    earlier = states.get(layer) if past > 0 else None
    if past > 0 and earlier is None:
        raise ValueError(f"layer {layer}: the cache holds {past} tokens but no {what}; "
                         "continue only caches produced by this FedNL model")
    return states, earlier


def dual_path_attention_forward(
    self: nn.Module,
    hidden_states: Tensor,
    position_embeddings: tuple[Tensor, Tensor] | None = None,
    attention_mask: Tensor | None = None,
    past_key_values=None,
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    """Replacement ``forward`` of a Llama-family attention module (bound to it).

    Same signature and return value as ``LlamaAttention.forward`` in transformers 5.x:
    ``(attn_output, attn_weights)``.
    """
    config: FedNLConfig = self.fednl_config
    stream: LayerStream | None = self.fednl_stream
    batch, length = hidden_states.shape[:2]
    hidden_shape = (batch, length, -1, self.head_dim)

    # Shared projections (possibly PEFT LoRA-wrapped), before RoPE: (B, heads, T, d).
    query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    if getattr(self, "q_norm", None) is not None:  # Gemma3 / Qwen3: per-head RMSNorm before RoPE
        query = self.q_norm(query)
    if getattr(self, "k_norm", None) is not None:
        key = self.k_norm(key)
    dropout = self.attention_dropout if self.training else 0.0

    # ---- softmax path: RoPE, then the backbone's attention (optionally windowed)
    if position_embeddings is None:
        raise ValueError("the attention layer needs position_embeddings (cos, sin) from the model")
    cos, sin = position_embeddings
    q_rot, k_rot = _model_function(self, "apply_rotary_pos_emb")(query, key, cos, sin)
    past = 0
    attn_weights = None
    if stream is not None:
        soft = stream.softmax_path(self, q_rot, k_rot, value, dropout)
    else:
        k_all, v_all = k_rot, value
        if past_key_values is not None:
            past = past_key_values.get_seq_length(self.layer_idx)
            k_all, v_all = past_key_values.update(k_rot, value, self.layer_idx)
        if config.window is None:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            interface = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, _model_function(self, "eager_attention_forward")
            )
            extra = {"sliding_window": self.sliding_window} if hasattr(self, "sliding_window") else {}
            soft, attn_weights = interface(
                self, q_rot, k_all, v_all, attention_mask, dropout=dropout, scaling=self.scaling, **extra, **kwargs
            )
        else:
            total = k_all.shape[2]
            allowed = _windowed_mask(attention_mask, batch, length, total, config.window, q_rot.device, layer_sink(self))
            soft = _softmax_attention(q_rot, k_all, v_all, allowed, self.scaling, dropout, self.num_key_value_groups)

    if self.fednl_gate is None:  # a layer without a memory (FedNLConfig.layers): the softmax path alone
        if stream is not None:
            stream.seen += length
        return self.o_proj(soft.reshape(batch, length, -1)), attn_weights

    # ---- memory path: delta rule on the pre-RoPE projections
    linear_dtype = query.dtype if fla_usable(query) and config.use_fla is not False else torch.float32
    if config.qk_activation == "silu":
        query, key = F.silu(query), F.silu(key)
    q_mem = l2_normalize(query.to(linear_dtype))
    valid = None if stream is not None else _valid_tokens(attention_mask, batch, length, past)
    key = key.to(linear_dtype)
    if config.key_centering:
        if stream is not None:
            key, stream.key_stats = centre_keys(key, None, stream.key_stats)
        else:
            stats, earlier = _carried(past_key_values, "fednl_key_stats", self.layer_idx, past, "key statistics")
            key, final_stats = centre_keys(key, valid, earlier)
            if stats is not None:
                stats[self.layer_idx] = final_stats
    # normalised once per key/value head; memory_heads="query": then repeated to the query heads (as the
    # softmax path does), one memory per query head; "kv": one memory per key/value head, which the delta
    # rule writes once and lets its query heads read
    groups = self.num_key_value_groups if config.memory_heads == "query" else 1
    k_mem = _repeat_kv(l2_normalize(key), groups)
    v_mem = _repeat_kv(value.to(linear_dtype), groups)
    beta = self.fednl_beta(hidden_states)
    if valid is not None and not bool(valid.all()):  # padding writes nothing (no padding: nothing to mask)
        beta = beta * valid
        k_mem = torch.where(valid[..., None], k_mem, torch.zeros_like(k_mem))
        v_mem = torch.where(valid[..., None], v_mem, torch.zeros_like(v_mem))

    if stream is not None:
        rule = delta_rule_recurrent if stream.form == "recurrent" else delta_rule_chunked
        extra = {} if stream.form == "recurrent" else {"chunk_size": config.chunk_size, "use_fla": config.use_fla}
        memory_out, stream.memory = rule(
            q_mem, k_mem, v_mem, beta.to(linear_dtype), initial_state=stream.memory, **extra
        )
        stream.seen += length
    else:
        states, initial = _carried(past_key_values, "fednl_states", self.layer_idx, past, "delta-memory state")
        memory_out, final = delta_rule_chunked(
            q_mem, k_mem, v_mem, beta.to(linear_dtype), config.chunk_size, initial, use_fla=config.use_fla
        )
        if states is not None:
            states[self.layer_idx] = final

    # ---- memory as gate: mix per channel, then the shared output projection
    soft = soft.reshape(batch, length, -1)
    memory_out = memory_out.transpose(1, 2).reshape(batch, length, -1)
    alpha = torch.sigmoid(self.fednl_gate)
    mixed = torch.lerp(soft, memory_out.to(soft.dtype), alpha.to(soft.dtype))  # (1 - alpha) soft + alpha memory
    return self.o_proj(mixed), attn_weights
