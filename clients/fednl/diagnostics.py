"""Long-context diagnostics: streaming cross-entropy per 1K-token bin, carried-state bytes.

FedNL's streaming diagnostic (the paper's Fig. 5) feeds one long prompt through a model
block by block and bins the next-token negative log-likelihood per 1K tokens; each bin
is reported relative to the first one (``mean_nll(bin) / mean_nll(bin 0)``): a model
that keeps using what it has read gets *lower* relative CE further in (the paper: FedNL
-2.1 %, FedAvg-LoRA +3.1 % at 16K).

Two block-by-block streamers give the same interface (``step(ids) -> logits``,
``state_bytes()``, ``position``) so one loop measures both:

* :class:`~clients.fednl.attention.FedNLStreamer` (FedNL: delta memory + window cache,
  constant state), and
* :class:`KVCacheStreamer` (any HF causal LM with its growing KV cache: the backbone,
  a LoRA model).

:class:`PeakMemory` measures the peak memory of a block of inference: on CUDA the
allocator's peak; on CPU (Linux) the process's peak resident set above its level at the
start. glibc is told to map tensors with mmap (unmapped when freed) and to return its
free heap pages first; else freed memory lingers in malloc's cache, where new tensors
reuse it unseen.
"""

from __future__ import annotations

import ctypes
import gc
import re
import sys
from collections.abc import Callable

import torch
from torch import nn

Tensor = torch.Tensor


class KVCacheStreamer:
    """A plain HF causal LM over a long stream, block by block, with its KV cache.

    The cache grows with every token (that is what it is measured against); the
    logits of a block are exactly those of one full forward over the whole prefix.
    """

    def __init__(self, model: nn.Module, block: int = 256):
        if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
            raise ValueError(f"block must be a positive int, got {block!r}")
        self.model = model
        self.block = block
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

    @torch.no_grad()
    def step(self, input_ids: Tensor) -> Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, T), got {tuple(input_ids.shape)}")
        batch, length = input_ids.shape
        positions = torch.arange(self.position, self.position + length, device=input_ids.device)
        if self.cache is None:
            from transformers import DynamicCache

            self.cache = DynamicCache()
        out = self.model(
            input_ids=input_ids,
            position_ids=positions.expand(batch, -1),
            past_key_values=self.cache,
            use_cache=True,
        )
        self.cache = out.past_key_values
        self.position += length
        return out.logits

    def blocks(self, input_ids: Tensor):
        for start in range(0, input_ids.shape[1], self.block):
            yield start, self.step(input_ids[:, start : start + self.block])


def streamed_nll(
    streamer,
    input_ids: Tensor,
    on_block: Callable[[int], None] | None = None,
) -> Tensor:
    """Next-token NLL ``(batch, T - 1)`` of a stream fed through ``streamer`` block by block.

    ``streamer`` is a :class:`~clients.fednl.attention.FedNLStreamer` or a
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


def binned_nll(nll: Tensor, bin_size: int = 1024) -> list[float]:
    """Mean NLL of each complete ``bin_size``-token bin (averaged over the batch).

    ``nll`` is ``(T,)`` or ``(batch, T)``; a trailing partial bin is dropped, so every
    bin averages the same number of tokens.
    """
    if isinstance(bin_size, bool) or not isinstance(bin_size, int) or bin_size <= 0:
        raise ValueError(f"bin_size must be a positive int, got {bin_size!r}")
    if nll.dim() == 1:
        nll = nll[None]
    if nll.dim() != 2:
        raise ValueError(f"nll must be (T,) or (batch, T), got {tuple(nll.shape)}")
    bins = nll.shape[1] // bin_size
    if bins == 0:
        raise ValueError(f"a stream of {nll.shape[1]} scored tokens has no complete bin of {bin_size}")
    return nll[:, : bins * bin_size].float().reshape(nll.shape[0], bins, bin_size).mean(dim=(0, 2)).tolist()


def relative_ce(nll: Tensor, bin_size: int = 1024) -> list[float]:
    """Normalised CE per bin relative to the first bin: ``bin_mean / first_bin_mean``.

    The first entry is 1.0; ``(value - 1) * 100`` is the paper's "% change".
    """
    bins = binned_nll(nll, bin_size)
    if bins[0] <= 0:
        raise ValueError(f"the first bin's mean NLL is {bins[0]}; cannot normalise by it")
    return [b / bins[0] for b in bins]


# --------------------------------------------------------------------------- peak memory
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as handle:
        match = re.search(rf"^{key}:\s+(\d+) kB", handle.read(), flags=re.M)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {key}")
    return int(match.group(1)) * 1024


class PeakMemory:
    """``with PeakMemory(device) as peak: ...`` then ``peak.bytes``: the peak above the start.

    CUDA: ``torch.cuda.max_memory_allocated`` after a reset (tensors only). CPU: the
    peak RSS (``VmHWM``, reset through ``/proc/self/clear_refs``) minus the RSS at the
    start, Linux only; :meth:`sample` reads the running peak inside the block.
    """

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.start = 0
        self.bytes = 0
        if self.device.type == "cpu":
            if not sys.platform.startswith("linux"):
                raise RuntimeError("CPU peak memory is measured from /proc (Linux only); use a CUDA device")
            self._libc = ctypes.CDLL("libc.so.6")

    def _reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
        else:
            # Free heap pages would be reused without raising the RSS: give them back first.
            self._libc.malloc_trim(0)
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")  # resets VmHWM to the current RSS
            self.start = _status_bytes("VmRSS")

    def sample(self) -> int:
        """The peak so far, above the start (bytes)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.start
        return _status_bytes("VmHWM") - self.start

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cpu":  # inside the block: tensors mmap'd, unmapped when freed
            self._libc.mallopt(_M_MMAP_THRESHOLD, 16 * 1024)
            self._libc.mallopt(_M_TRIM_THRESHOLD, 128 * 1024)
        gc.collect()
        self._reset()
        return self

    def __exit__(self, *exc) -> None:
        self.bytes = self.sample()
        if self.device.type == "cpu":  # back to glibc's default thresholds (128 KiB)
            self._libc.mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
            self._libc.mallopt(_M_TRIM_THRESHOLD, 128 * 1024)
