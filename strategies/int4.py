"""Asymmetric per-tensor int4: FLITE's latent wire format (NumPy only; the server uses it).

A tensor of ``n`` float32 values becomes ``(n + 1) // 2 + 8`` bytes::

    nibbles: q[0] | q[1] << 4, q[2] | q[3] << 4, ...   (low nibble first; an odd tail's
             high nibble is 0)
    scale  : float32, little-endian   (the step between levels: (max - min) / 15)
    zero   : float32, little-endian   (the value of level 0: min)

Each value is quantised to the nearest of the 16 levels ``zero + q·scale``, ``q = 0..15``
(round to nearest, ties to even), so the round-trip error is at most half a step
(``scale / 2``, plus the rounding of the fp32 result); ``pack_int4(x, rng)`` rounds
stochastically instead (unbiased, error below one step). A constant tensor has scale 0 and
decodes exactly. 1,280 latents -> 640 + 8 = 648 bytes.

Block-wise int4 (``pack_int4_blocks``, the ``int4b`` wire format): the same nibbles, then one
fp32 scale and one fp32 zero point for every :data:`BLOCK` consecutive values (the last
block may be shorter), so one large value costs resolution only in its own block::

    nibbles | (scale, zero) of block 0 | (scale, zero) of block 1 | ...

``(n + 1) // 2 + 8 * ceil(n / BLOCK)`` bytes: 1,280 latents -> 640 + 160 = 800 bytes.
"""

from __future__ import annotations

import struct

import numpy as np

LEVELS = 16
BLOCK = 64  # values per (scale, zero) pair of the block-wise format
_TRAILER = struct.Struct("<ff")
_F32_MAX = float(np.finfo(np.float32).max)


def int4_nbytes(numel: int) -> int:
    """Bytes of an int4-packed tensor of ``numel`` values."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return (numel + 1) // 2 + _TRAILER.size


def int4_blocks_nbytes(numel: int) -> int:
    """Bytes of a block-wise int4 tensor of ``numel`` values."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return (numel + 1) // 2 + _TRAILER.size * (-(-numel // BLOCK))


def _sized(data: bytes, numel, nbytes, label: str) -> tuple[bytes, int]:
    """``(data, numel)`` once ``numel`` is a count and ``data`` has ``nbytes(numel)`` bytes; ValueError else."""
    if isinstance(numel, bool) or not isinstance(numel, (int, np.integer)) or numel < 0:
        raise ValueError(f"numel must be an integer >= 0, got {numel!r}")
    data, numel = bytes(data), int(numel)
    want = nbytes(numel)
    if len(data) != want:
        raise ValueError(f"{label} data for {numel} values must be {want} bytes, got {len(data)}")
    return data, numel


def _check_input(x) -> np.ndarray:
    arr = np.asarray(x)
    if arr.ndim != 1:
        raise ValueError(f"int4 packs 1-D vectors, got shape {arr.shape}")
    if arr.dtype.kind not in "fiu":
        raise ValueError(f"int4 packs numbers, got dtype {arr.dtype}")
    arr = arr.astype(np.float32, copy=False)
    if not np.all(np.isfinite(arr)):
        raise ValueError("cannot int4-encode NaN or Inf")
    return arr


def int4_step(x) -> float:
    """The quantisation step (fp32 ``scale``) :func:`pack_int4` uses for ``x``: the
    round-trip error bound is half of it."""
    arr = _check_input(x)
    return float(_block_scales(arr, arr.size)[1][0]) if arr.size else 0.0


def pack_int4(x, rng: np.random.Generator | None = None) -> bytes:
    """1-D float32 vector -> packed nibbles + fp32 scale + fp32 zero point (little-endian).

    Round to nearest by default (error <= half a step). With ``rng``, stochastic rounding
    instead: each value goes to one of its two neighbouring levels with probabilities
    that make the decoded value unbiased (error < one step) — useful when many quantised
    updates are averaged, e.g. latent *updates* over clients and rounds. The bytes have
    the same format either way.

    Raises ``ValueError`` for NaN/Inf, non-numeric or non-1-D input.
    """
    arr = _check_input(x)
    if not arr.size:
        return _TRAILER.pack(0.0, 0.0)
    rows, scale, zero = _block_scales(arr, arr.size)  # one block: the whole vector
    return _pack_nibbles(_quantise_rows(rows, scale, zero, rng)[0]) + _TRAILER.pack(float(scale[0]), float(zero[0]))


def unpack_int4(data: bytes, numel: int) -> np.ndarray:
    """Inverse of :func:`pack_int4`: ``numel`` float32 values.

    Raises ``ValueError`` when ``data`` does not have exactly ``(numel + 1) // 2 + 8`` bytes,
    when the scale or zero point is not finite or the scale is negative, or when the
    padding nibble of an odd-length tensor is not zero.
    """
    data, numel = _sized(data, numel, int4_nbytes, "int4")
    scale, zero = _TRAILER.unpack(data[-_TRAILER.size:])
    if not (np.isfinite(scale) and np.isfinite(zero)):
        raise ValueError(f"int4 scale/zero point must be finite, got scale={scale}, zero={zero}")
    if scale < 0:
        raise ValueError(f"int4 scale must be >= 0, got {scale}")
    q = _unpack_nibbles(data[: -_TRAILER.size], numel)
    return _dequantise_rows(q[None, :], np.float32([scale]), np.float32([zero]))[0]


def _pack_nibbles(q: np.ndarray) -> bytes:
    if q.size % 2:
        q = np.concatenate([q, np.zeros(1, dtype=np.uint8)])
    return (q[0::2] | (q[1::2] << 4)).astype(np.uint8).tobytes()


def _unpack_nibbles(data: bytes, numel: int) -> np.ndarray:
    packed = np.frombuffer(data, dtype=np.uint8)
    q = np.empty(packed.size * 2, dtype=np.uint8)
    q[0::2] = packed & 0x0F
    q[1::2] = packed >> 4
    if numel % 2 and q[-1] != 0:
        raise ValueError("int4 data has a non-zero padding nibble (corrupt or mis-sized payload)")
    return q[:numel]


def _block_scales(arr: np.ndarray, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values padded to whole blocks of ``block`` as rows, each block's fp32 scale, its fp32 zero);
    the padding repeats the last value, so it changes no block's range."""
    pad = -arr.size % block
    rows = np.concatenate([arr, np.full(pad, arr[-1], dtype=arr.dtype)]).reshape(-1, block) if arr.size else \
        np.zeros((0, block), np.float32)
    lo, hi = rows.min(axis=1, initial=np.inf), rows.max(axis=1, initial=-np.inf)
    scale = ((hi.astype(np.float64) - lo) / (LEVELS - 1)).astype(np.float32)
    return rows, scale, lo.astype(np.float32)


def _quantise_rows(rows: np.ndarray, scale: np.ndarray, zero: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
    safe = np.where(scale > 0, scale, 1).astype(np.float64)[:, None]
    t = (rows.astype(np.float64) - zero.astype(np.float64)[:, None]) / safe
    q = np.rint(t) if rng is None else np.floor(t + rng.random(t.shape))
    q = np.where(scale[:, None] > 0, q, 0)
    return np.clip(q, 0, LEVELS - 1).astype(np.uint8)


def _dequantise_rows(q: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    out = zero.astype(np.float64)[:, None] + q.astype(np.float64) * scale.astype(np.float64)[:, None]
    return np.clip(out, -_F32_MAX, _F32_MAX).astype(np.float32)


def pack_int4_blocks(x, rng: np.random.Generator | None = None) -> bytes:
    """1-D float32 vector -> nibbles + one fp32 (scale, zero) per :data:`BLOCK` values.

    Rounding as :func:`pack_int4` (nearest, or stochastic and unbiased with ``rng``); the
    error bound is half (or one) of the value's *own block's* step. ``ValueError`` for
    NaN/Inf, non-numeric or non-1-D input.
    """
    arr = _check_input(x)
    rows, scale, zero = _block_scales(arr)
    q = _quantise_rows(rows, scale, zero, rng).reshape(-1)[: arr.size]
    trailer = np.stack([scale, zero], axis=1).astype("<f4").tobytes()
    return _pack_nibbles(q) + trailer


def unpack_int4_blocks(data: bytes, numel: int) -> np.ndarray:
    """Inverse of :func:`pack_int4_blocks`; ``ValueError`` for a wrong length, a scale or zero
    point that is not finite, a negative scale, or a non-zero padding nibble."""
    data, numel = _sized(data, numel, int4_blocks_nbytes, "block-wise int4")
    nibbles = (numel + 1) // 2
    pairs = np.frombuffer(data[nibbles:], dtype="<f4").reshape(-1, 2)
    scale, zero = pairs[:, 0].astype(np.float32), pairs[:, 1].astype(np.float32)
    if not (np.all(np.isfinite(scale)) and np.all(np.isfinite(zero))):
        raise ValueError("block-wise int4 scales/zero points must be finite")
    if np.any(scale < 0):
        raise ValueError("block-wise int4 scales must be >= 0")
    q = _unpack_nibbles(data[:nibbles], numel)
    q = np.concatenate([q, np.zeros(-numel % BLOCK, np.uint8)]).reshape(-1, BLOCK)
    return _dequantise_rows(q, scale, zero).reshape(-1)[:numel]


def int4_roundtrip(x) -> np.ndarray:
    """``unpack_int4(pack_int4(x))`` without the bytes: what the receiver will see
    (e.g. for a client to keep its own state in sync with a quantised upload)."""
    arr = _check_input(x)
    if not arr.size:
        return arr.copy()
    rows, scale, zero = _block_scales(arr, arr.size)
    return _dequantise_rows(_quantise_rows(rows, scale, zero, None), scale, zero)[0]
