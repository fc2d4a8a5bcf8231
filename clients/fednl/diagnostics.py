"""Long-context diagnostics: streaming cross-entropy per 1K-token bin, peak memory.

FedNL's streaming diagnostic (the paper's Fig. 5) feeds one long prompt through a model
block by block and bins the next-token negative log-likelihood per 1K tokens; each bin
is reported relative to the first one (``mean_nll(bin) / mean_nll(bin 0)``): a model
that keeps using what it has read gets *lower* relative CE further in (the paper: FedNL
-2.1 %, FedAvg-LoRA +3.1 % at 16K).

The streamers and the stream's NLL are :mod:`clients.fednl.stream`
(:class:`~clients.fednl.stream.FedNLStreamer`, :class:`~clients.fednl.stream.KVCacheStreamer`,
:func:`~clients.fednl.stream.streamed_nll`).

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

import torch

Tensor = torch.Tensor


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
