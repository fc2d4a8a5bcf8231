"""Streaming inference: a model over an arbitrarily long token stream, block by block.

Two block-by-block streamers give the same interface (``step(ids) -> logits``,
``blocks(ids)``, ``state_bytes()``, ``position``), so one loop measures both:

* :class:`FedNLStreamer` (FedNL: each layer carries its delta memory and a KV cache of at
  most ``window`` tokens, constant state), and
* :class:`KVCacheStreamer` (any HF causal LM with its growing KV cache: the backbone,
  a LoRA model).

:func:`streamed_nll` gives a stream's next-token negative log-likelihood with either.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch import nn

from clients.fednl.layer import LayerStream, layer_sink
from clients.fednl.model import dual_path_attentions, memory_attentions

Tensor = torch.Tensor

STREAM_FORMS = ("recurrent", "chunked")


def _stream_window(attn: nn.Module) -> int | None:
    """The softmax window a streamed layer keeps: FedNL's ``window``, and also the
    backbone's own sliding window on layers that have one (Gemma3's local layers,
    Qwen2 with ``use_sliding_window``), whichever is smaller."""
    windows = [w for w in (attn.fednl_config.window, getattr(attn, "sliding_window", None)) if w]
    return min(int(w) for w in windows) if windows else None


class BlockStreamer(ABC):
    """A causal LM over a long stream, ``block`` tokens at a time, its state carried between
    blocks. Subclasses say what the state is (:meth:`reset`, :meth:`state_bytes`) and run one
    block's forward (:meth:`forward`); positions continue across blocks."""

    def __init__(self, model: nn.Module, block: int = 256):
        if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
            raise ValueError(f"block must be a positive int, got {block!r}")
        self.model = model
        self.block = block

    @abstractmethod
    def reset(self) -> None:
        """Forget the stream: the next block starts at position 0 with an empty state."""

    @abstractmethod
    def state_bytes(self) -> int:
        """Bytes carried between blocks."""

    @abstractmethod
    def forward(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        """One block's logits, reading and updating the carried state."""

    @torch.no_grad()
    def step(self, input_ids: Tensor) -> Tensor:
        """Feed the next tokens ``(batch, T)`` (any T); return their logits ``(batch, T, vocab)``."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, T), got {tuple(input_ids.shape)}")
        batch, length = input_ids.shape
        positions = torch.arange(self.position, self.position + length, device=input_ids.device)
        logits = self.forward(input_ids, positions.expand(batch, -1))
        self.position += length
        return logits

    def blocks(self, input_ids: Tensor):
        """Yield ``(start, logits)`` for consecutive blocks of ``input_ids``."""
        for start in range(0, input_ids.shape[1], self.block):
            yield start, self.step(input_ids[:, start : start + self.block])


class FedNLStreamer(BlockStreamer):
    """Runs a FedNL model over an arbitrarily long token stream, block by block.

    Each layer carries (a) its delta-memory state, ``(batch, memory heads, d_v, d_k)`` (the
    key/value heads with ``memory_heads="kv"``, the query heads with ``"query"``), and (b) a KV
    cache of at most ``sink + window`` tokens for the softmax path, so with a window the carried state, and the peak memory of a block, do not grow with the context.
    (``window=None`` keeps the whole KV cache: exact full attention, growing memory.)
    Sequences in a batch advance together; padding is not supported here.

    The state lives in the streamer; modules are switched into streaming mode only
    while :meth:`step` runs, so the model stays usable for ordinary forwards. Blocks run
    under ``torch.no_grad()`` in whatever mode the model is in: call ``model.eval()``.
    """

    def __init__(self, model: nn.Module, block: int = 256, form: str = "recurrent"):
        super().__init__(model, block)
        if form not in STREAM_FORMS:
            raise ValueError(f"form must be one of {STREAM_FORMS}, got {form!r}")
        self.form = form
        self.attentions = dual_path_attentions(model)  # (those without a memory stream their window alone)
        if not memory_attentions(model):
            raise ValueError("the model has no FedNL memory; call add_delta_memory(model, config) first")
        self.reset()

    def reset(self) -> None:
        """Forget everything: a new stream starts with S = 0 and an empty cache."""
        self.states = [LayerStream(_stream_window(attn), self.form, layer_sink(attn)) for attn in self.attentions]
        self.position = 0

    def state_bytes(self) -> int:
        """Bytes carried between blocks (memories + window caches, all layers)."""
        return sum(state.nbytes() for state in self.states)

    def forward(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        for attn, state in zip(self.attentions, self.states):
            attn.fednl_stream = state
        try:
            return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
        finally:
            for attn in self.attentions:
                attn.fednl_stream = None


def stream_logits(model: nn.Module, input_ids: Tensor, block: int = 256, form: str = "recurrent") -> Tensor:
    """All logits ``(batch, T, vocab)`` of a stream processed block by block (for short checks;
    use :func:`stream_token_nll` for long streams, whose logits would not fit)."""
    streamer = FedNLStreamer(model, block=block, form=form)
    return torch.cat([logits for _, logits in streamer.blocks(input_ids)], dim=1)


def stream_token_nll(model: nn.Module, input_ids: Tensor, block: int = 256, form: str = "recurrent") -> Tensor:
    """Next-token negative log-likelihood ``(batch, T - 1)`` of a FedNL model over a stream,
    block by block (:func:`streamed_nll` with a :class:`FedNLStreamer`).

    Memory stays bounded by one block's logits. Entry t is ``-log p(x_{t+1} | x_<=t)``
    (the streaming cross-entropy diagnostic bins these per 1K tokens).
    """
    return streamed_nll(FedNLStreamer(model, block=block, form=form), input_ids)


class KVCacheStreamer(BlockStreamer):
    """A plain HF causal LM over a long stream, block by block, with its KV cache.

    The cache grows with every token (that is what it is measured against); the
    logits of a block are exactly those of one full forward over the whole prefix.
    """

    def __init__(self, model: nn.Module, block: int = 256):
        super().__init__(model, block)
        self.reset()

    def reset(self) -> None:
        self.cache = None
        self.position = 0

    def state_bytes(self) -> int:
        """Bytes of the KV cache (all layers)."""
        if self.cache is None:
            return 0
        total = 0
        for layer in getattr(self.cache, "layers", []):
            for name in ("keys", "values"):
                tensor = getattr(layer, name, None)
                if isinstance(tensor, Tensor):
                    total += tensor.numel() * tensor.element_size()
        return total

    def forward(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        if self.cache is None:
            from transformers import DynamicCache

            self.cache = DynamicCache()
        out = self.model(input_ids=input_ids, position_ids=position_ids, past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        return out.logits


def streamed_nll(
    streamer,
    input_ids: Tensor,
    on_block: Callable[[int], None] | None = None,
) -> Tensor:
    """Next-token NLL ``(batch, T - 1)`` of a stream fed through ``streamer`` block by block.

    ``streamer`` is a :class:`FedNLStreamer` or a
    :class:`KVCacheStreamer` (anything with ``blocks(ids)``); ``on_block(tokens_done)``
    is called after each block (e.g. to sample memory use). Only one block's logits
    are alive at a time.
    """
    length = input_ids.shape[1]
    pieces = []
    for start, logits in streamer.blocks(input_ids):
        end = min(start + logits.shape[1], length - 1)  # the last token has no target
        if end > start:
            targets = input_ids[:, start + 1 : end + 1]
            log_probs = torch.log_softmax(logits[:, : end - start].float(), dim=-1)
            pieces.append(-log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1))
        del logits
        if on_block is not None:
            on_block(start + min(streamer.block, length - start))
    if not pieces:
        return input_ids.new_zeros(input_ids.shape[0], 0, dtype=torch.float32)
    return torch.cat(pieces, dim=1)
