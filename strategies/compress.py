"""Compressed weight updates: top-k sparsification and PowerSGD, both with error feedback.

The update-compression baselines FLITE is measured against. A client sends its *update*
``Δ = w_local − w_received`` rather than its weights, compressed:

``topk``
    Per tensor, the ``k = ceil(fraction · numel)`` entries of largest magnitude
    (Stich et al., 2018; Aji & Heafield, 2017). Wire: an ``Array`` of stype
    ``postcard.topk`` whose data is ``k`` little-endian uint32 flat indices (strictly
    increasing) followed by their ``k`` float32 values: ``8·k`` bytes.
``powersgd``
    Per weight matrix (a conv kernel reshaped to ``out × in·kh·kw``), one step of subspace
    iteration warm-started from the previous round's ``Q`` (Vogels et al., 2019):
    ``P = M Q``, ``P ← orth(P)``, ``Q = Mᵀ P``, so ``M ≈ P Qᵀ``. Wire: stype
    ``postcard.lowrank``, data ``P`` (m×r) then ``Q`` (n×r) as float32: ``4·r·(m+n)``
    bytes. Vectors (biases, norms) and matrices too small to gain are sent as fp32, as
    PowerSGD does.

With error feedback (Karimireddy et al., 2019) the client adds what compression dropped
last round to this round's update before compressing: ``c = C(Δ + e)``, ``e ← Δ + e − c``.
The residuals ``e`` and PowerSGD's ``Q`` are client memory (:class:`UpdateCompressor`
returns them; the ClientApp keeps them in ``context.state``); they never travel.

``fp32`` and ``int4`` updates go through :func:`strategies.codec.encode` as usual (int4 with
unbiased stochastic rounding). :func:`strategies.codec.decode` turns every format back
into dense tensors, validating indices, factor shapes and finiteness; :func:`max_nbytes`
is the uplink budget a strategy enforces, so a client cannot send more than its format
allows. numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
from flwr.app import ArrayRecord

from strategies import codec

UPDATE_FORMATS = ("fp32", "int4", "int4b", "topk", "powersgd")


def check_format(fmt: str, fraction: float | None = None, rank: int | None = None) -> None:
    if fmt not in UPDATE_FORMATS:
        raise ValueError(f"unknown update format '{fmt}'; choose one of {list(UPDATE_FORMATS)}")
    if fmt == "topk" and not (fraction is not None and 0.0 < float(fraction) <= 1.0):
        raise ValueError(f"top-k needs a fraction in (0, 1], got {fraction!r}")
    if fmt == "powersgd" and not (rank is not None and int(rank) >= 1):
        raise ValueError(f"PowerSGD needs a rank >= 1, got {rank!r}")


def topk_count(numel: int, fraction: float) -> int:
    return max(1, min(numel, math.ceil(float(fraction) * numel)))


def as_matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """A tensor as the matrix PowerSGD compresses: ``out × (everything else)``."""
    m = int(shape[0])
    return m, int(np.prod(shape[1:])) if len(shape) > 1 else 1


def lowrank_applies(shape: tuple[int, ...], rank: int) -> bool:
    """Whether rank-``rank`` factors are smaller than the dense tensor (else send fp32)."""
    if len(shape) < 2:
        return False
    m, n = as_matrix_shape(shape)
    return rank * (m + n) < m * n


def max_nbytes(layout: Mapping[str, tuple[int, ...]], fmt: str, *, fraction: float | None = None,
               rank: int | None = None) -> int:
    """The most payload bytes an update of ``layout`` may take in format ``fmt``."""
    check_format(fmt, fraction, rank)
    total = 0
    for shape in layout.values():
        numel = int(np.prod(shape)) if shape else 1
        if fmt == "fp32":
            total += 4 * numel
        elif fmt in codec.QUANTISED:
            total += codec.expected_nbytes(tuple(shape), codec.FORMATS[fmt])
        elif fmt == "topk":
            total += 8 * topk_count(numel, fraction)
        elif lowrank_applies(tuple(shape), int(rank)):
            m, n = as_matrix_shape(tuple(shape))
            total += 4 * int(rank) * (m + n)
        else:
            total += 4 * numel
    return total


def expected_stypes(layout: Mapping[str, tuple[int, ...]], fmt: str, *, rank: int | None = None) -> dict[str, set[str]]:
    """The wire format(s) each tensor of ``layout`` may arrive in under uplink format ``fmt``:
    a reply in any other (int4 or top-k in an fp32 run, say) is refused before it is decoded."""
    out = {}
    for key, shape in layout.items():
        if fmt == "powersgd":
            out[key] = {codec.LOWRANK} if lowrank_applies(tuple(shape), int(rank)) else {codec.FP32}
        else:
            out[key] = {{**codec.FORMATS, "topk": codec.TOPK}[fmt]}
    return out


def topk(values: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(sorted flat indices, their values) of the ``k`` entries of largest magnitude."""
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    if k >= flat.size:
        idx = np.arange(flat.size)
    else:
        idx = np.sort(np.argpartition(np.abs(flat), flat.size - k)[flat.size - k:])
    return idx.astype(np.uint32), flat[idx]


def orthonormalise(p: np.ndarray) -> np.ndarray:
    """Orthonormal columns spanning ``p``'s (reduced QR; zero columns stay zero)."""
    q, r = np.linalg.qr(p.astype(np.float64))
    signs = np.sign(np.diag(r))
    signs[signs == 0] = 0.0
    return (q * signs).astype(np.float32)


def powersgd(matrix: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One warm-started power step: ``matrix ≈ P Qᵀ`` with ``P`` orthonormal."""
    m64 = matrix.astype(np.float64)
    p = orthonormalise(m64 @ q.astype(np.float64))
    q_new = (m64.T @ p.astype(np.float64)).astype(np.float32)
    return p, q_new


def initial_q(name: str, n: int, rank: int, seed: int) -> np.ndarray:
    """PowerSGD's first ``Q`` for a tensor: Gaussian from (seed, name), the same on every run."""
    digest = int.from_bytes(name.encode()[:32].ljust(32, b"\0"), "little") % (2**32)
    rng = np.random.default_rng([int(seed) % (2**63), digest, len(name)])
    return rng.standard_normal((n, rank)).astype(np.float32)


class UpdateCompressor:
    """Client side: compress one round's update; keeps nothing itself.

    ``compress(update, memory) -> (record, memory)``: ``memory`` holds the residuals
    (``ef/<name>``) and PowerSGD's warm starts (``q/<name>``) from the last round (empty
    at first); store the returned one for the next round.
    """

    def __init__(self, fmt: str, *, fraction: float | None = None, rank: int | None = None,
                 error_feedback: bool = True, seed: int = 0) -> None:
        check_format(fmt, fraction, rank)
        self.fmt = fmt
        self.fraction = None if fraction is None else float(fraction)
        self.rank = None if rank is None else int(rank)
        self.error_feedback = bool(error_feedback) and fmt in ("topk", "powersgd")
        self.seed = int(seed)

    def compress(self, update: Mapping[str, np.ndarray], memory: Mapping[str, np.ndarray] | None = None,
                 rng: np.random.Generator | None = None) -> tuple[ArrayRecord, dict[str, np.ndarray]]:
        memory = dict(memory or {})
        if self.fmt in codec.FORMATS:
            return codec.encode(update, self.fmt, rng=rng if self.fmt in codec.QUANTISED else None), memory
        record = ArrayRecord()
        for name, value in update.items():
            target = np.asarray(value, dtype=np.float32)
            if self.error_feedback and f"ef/{name}" in memory:
                target = target + memory[f"ef/{name}"].reshape(target.shape)
            shape = tuple(int(s) for s in target.shape)
            if self.fmt == "topk":
                idx, vals = topk(target, topk_count(target.size, self.fraction))
                record[name] = codec.topk_array(shape, idx, vals)
                sent = np.zeros(target.size, np.float32)
                sent[idx] = vals
                sent = sent.reshape(shape)
            elif lowrank_applies(shape, self.rank):
                m, n = as_matrix_shape(shape)
                q = memory.get(f"q/{name}")
                if q is None or q.shape != (n, self.rank):
                    q = initial_q(name, n, self.rank, self.seed)
                p, q = powersgd(target.reshape(m, n), q)
                memory[f"q/{name}"] = q
                record[name] = codec.lowrank_array(shape, p, q)
                sent = (p @ q.T).reshape(shape)
            else:
                record[name] = codec.fp32_array(shape, target)
                sent = target
            if self.error_feedback:
                memory[f"ef/{name}"] = (target - sent).astype(np.float32)
        return record, memory
