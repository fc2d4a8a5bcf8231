"""Wire formats shared by server and clients.

A payload is a ``dict[str, np.ndarray]`` of named tensors. On the wire it is one Flower
``ArrayRecord`` whose ``Array``s carry the raw little-endian bytes of each tensor (no
``.npy`` header), so that the bytes counted are exactly the bytes the method needs:
``nbytes`` for fp32, and for int4 the packed nibbles plus one fp32 scale and one fp32 zero
point per tensor (``strategies.int4``).

Every decode validates what it reads (known stype, dtype, byte length matching the shape,
finite values) and raises :class:`PayloadError` with a reason; strategies turn that into a
refused reply, never into a corrupted global state.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord

FP32 = "postcard.fp32"
INT4 = "postcard.int4"
FORMATS = {"fp32": FP32, "int4": INT4}


class PayloadError(ValueError):
    """A payload that must be refused; the message says why."""


def _as_fp32(name: str, value) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype != np.float32:
        arr = arr.astype(np.float32)
    if not np.all(np.isfinite(arr)):
        raise PayloadError(f"tensor '{name}' holds NaN or Inf")
    return np.ascontiguousarray(arr)


def encode(tensors: Mapping[str, np.ndarray], fmt: str = "fp32", rng: np.random.Generator | None = None) -> ArrayRecord:
    """Named float tensors -> ArrayRecord in wire format ``fmt`` ('fp32' or 'int4').

    With ``rng``, int4 uses unbiased stochastic rounding (same bytes, see ``strategies.int4``).
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown payload format '{fmt}'; choose one of {sorted(FORMATS)}")
    record = ArrayRecord()
    for name, value in tensors.items():
        arr = _as_fp32(name, value)
        if fmt == "fp32":
            data = arr.astype("<f4", copy=False).tobytes()
        else:
            from strategies.int4 import pack_int4

            data = pack_int4(arr.reshape(-1), rng=rng)
        record[name] = Array(dtype="float32", shape=tuple(int(s) for s in arr.shape), stype=FORMATS[fmt], data=data)
    return record


def expected_nbytes(shape: tuple[int, ...], stype: str) -> int:
    numel = int(np.prod(shape)) if shape else 1
    if stype == FP32:
        return 4 * numel
    if stype == INT4:
        return (numel + 1) // 2 + 8
    raise PayloadError(f"unknown array stype '{stype}'")


def decode(record: ArrayRecord) -> dict[str, np.ndarray]:
    """ArrayRecord in a Postcard wire format -> named fp32 tensors (validated)."""
    if not isinstance(record, ArrayRecord):
        raise PayloadError(f"expected an ArrayRecord, got {type(record).__name__}")
    out: dict[str, np.ndarray] = {}
    for name, array in record.items():
        shape = tuple(int(s) for s in array.shape)
        if array.dtype != "float32":
            raise PayloadError(f"tensor '{name}' has dtype {array.dtype}, expected float32")
        want = expected_nbytes(shape, array.stype)
        if len(array.data) != want:
            raise PayloadError(f"tensor '{name}' carries {len(array.data)} bytes, expected {want} for shape {shape}")
        if array.stype == FP32:
            arr = np.frombuffer(array.data, dtype="<f4").reshape(shape).astype(np.float32)
        else:
            from strategies.int4 import unpack_int4

            numel = int(np.prod(shape)) if shape else 1
            arr = unpack_int4(array.data, numel).reshape(shape)
        if not np.all(np.isfinite(arr)):
            raise PayloadError(f"tensor '{name}' holds NaN or Inf")
        out[name] = arr
    return out


def payload_bytes(record: ArrayRecord) -> int:
    """Bytes of tensor data a record puts on the wire (the sum of its arrays' data)."""
    return sum(len(array.data) for array in record.values())


def message_bytes(content) -> int:
    """Flower's own byte count of a message's content (arrays, metrics, config, keys)."""
    return int(sum(record.count_bytes() for record in content.values()))
