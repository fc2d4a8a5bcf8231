"""Wire formats shared by server and clients.

A payload is a ``dict[str, np.ndarray]`` of named tensors. On the wire it is one Flower
``ArrayRecord`` whose ``Array``s carry the raw little-endian bytes of each tensor (no
``.npy`` header), so that the bytes counted are exactly the bytes the method needs:
``nbytes`` for fp32, and for int4 the packed nibbles plus one fp32 scale and one fp32 zero
point per tensor (``strategies.int4``), for int4b one fp32 scale and zero point per 64
values instead (block-wise int4: one large value costs resolution in its block only). Compressed *updates* have two more stypes
(``strategies.compress``): ``postcard.topk`` (uint32 flat indices, strictly increasing,
then their fp32 values) and ``postcard.lowrank`` (fp32 factors ``P`` (m×r) then ``Q``
(n×r) of ``M ≈ P Qᵀ``, ``M`` the tensor as ``shape[0] × rest``); both decode to dense.

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
INT4B = "postcard.int4b"
TOPK = "postcard.topk"
LOWRANK = "postcard.lowrank"
FORMATS = {"fp32": FP32, "int4": INT4, "int4b": INT4B}
QUANTISED = ("int4", "int4b")  # the formats that round (stochastically, for updates)
DENSE = (FP32, INT4, INT4B)  # the stypes whose byte length follows from the shape
STYPES = (*DENSE, TOPK, LOWRANK)
MAX_NUMEL = 2**32 - 1  # the most values one tensor may declare (top-k indices are uint32)


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
    """Named float tensors -> ArrayRecord in wire format ``fmt`` ('fp32', 'int4' or 'int4b').

    With ``rng``, int4 and int4b use unbiased stochastic rounding (same bytes, see ``strategies.int4``).
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown payload format '{fmt}'; choose one of {sorted(FORMATS)}")
    record = ArrayRecord()
    for name, value in tensors.items():
        arr = _as_fp32(name, value)
        if fmt == "fp32":
            data = arr.astype("<f4", copy=False).tobytes()
        else:
            from strategies.int4 import pack_int4, pack_int4_blocks

            data = (pack_int4 if fmt == "int4" else pack_int4_blocks)(arr.reshape(-1), rng=rng)
        record[name] = Array(dtype="float32", shape=tuple(int(s) for s in arr.shape), stype=FORMATS[fmt], data=data)
    return record


def fp32_array(shape: tuple[int, ...], values: np.ndarray) -> Array:
    arr = _as_fp32("tensor", values).reshape(shape)
    return Array(dtype="float32", shape=tuple(int(s) for s in shape), stype=FP32, data=arr.astype("<f4").tobytes())


def topk_array(shape: tuple[int, ...], indices: np.ndarray, values: np.ndarray) -> Array:
    """A sparse tensor of dense shape ``shape``: ``values`` at flat ``indices`` (increasing)."""
    idx = np.asarray(indices, dtype="<u4")
    vals = _as_fp32("topk values", values).astype("<f4")
    if idx.shape != vals.shape or idx.ndim != 1:
        raise ValueError(f"top-k needs as many indices as values, got {idx.shape} and {vals.shape}")
    return Array(dtype="float32", shape=tuple(int(s) for s in shape), stype=TOPK, data=idx.tobytes() + vals.tobytes())


def lowrank_array(shape: tuple[int, ...], p: np.ndarray, q: np.ndarray) -> Array:
    """A tensor of shape ``shape`` as rank-r factors: ``reshape(P Qᵀ, shape)``."""
    m, n = shape[0], int(np.prod(shape[1:]))
    p = _as_fp32("lowrank P", p)
    q = _as_fp32("lowrank Q", q)
    if p.ndim != 2 or q.ndim != 2 or p.shape[0] != m or q.shape[0] != n or p.shape[1] != q.shape[1]:
        raise ValueError(f"factors {p.shape} and {q.shape} do not make a {m}x{n} matrix")
    return Array(dtype="float32", shape=tuple(int(s) for s in shape), stype=LOWRANK,
                 data=p.astype("<f4").tobytes() + q.astype("<f4").tobytes())


def declared_shape(name: str, array) -> tuple[tuple[int, ...], int]:
    """An Array's declared (shape, number of values), checked before anything is allocated.

    Dimensions must be non-negative integers and their product (computed with Python
    integers, so it cannot overflow) at most :data:`MAX_NUMEL`; PayloadError otherwise.
    """
    try:
        shape = tuple(int(s) for s in array.shape)
    except (TypeError, ValueError):
        raise PayloadError(f"tensor '{name}' declares a shape that is not a list of integers: {array.shape!r}") from None
    if any(s < 0 for s in shape):
        raise PayloadError(f"tensor '{name}' declares negative dimensions {shape}")
    numel = 1
    for s in shape:
        numel *= s
    if numel > MAX_NUMEL:
        raise PayloadError(f"tensor '{name}' declares {numel} values (shape {shape}), more than {MAX_NUMEL}")
    return shape, numel


def check_declared(name: str, array, stypes) -> tuple[int, ...]:
    """An Array's declared shape, dtype and wire format, checked before anything is decoded:
    float32 and one of ``stypes``. Returns the shape; PayloadError says what is wrong."""
    shape, _ = declared_shape(name, array)
    if array.dtype != "float32":
        raise PayloadError(f"tensor '{name}' has dtype {array.dtype}, expected float32")
    if array.stype not in STYPES:
        raise PayloadError(f"tensor '{name}' has an unknown array stype '{array.stype}'")
    if array.stype not in stypes:
        raise PayloadError(f"tensor '{name}' is in wire format {array.stype!r}; this run sends {sorted(stypes)}")
    return shape


def _decode_topk(name: str, data: bytes, shape: tuple[int, ...]) -> np.ndarray:
    numel = _numel(shape)
    if len(data) % 8 or not 0 < len(data) // 8 <= numel:
        raise PayloadError(f"tensor '{name}' carries {len(data)} bytes, not 8·k with 1 <= k <= {numel}")
    k = len(data) // 8
    idx = np.frombuffer(data[: 4 * k], dtype="<u4").astype(np.int64)
    vals = np.frombuffer(data[4 * k:], dtype="<f4")
    if idx[-1] >= numel or (k > 1 and np.any(np.diff(idx) <= 0)):
        raise PayloadError(f"tensor '{name}': top-k indices must be strictly increasing and below {numel}")
    out = np.zeros(numel, np.float32)
    out[idx] = vals
    return out.reshape(shape)


def _decode_lowrank(name: str, data: bytes, shape: tuple[int, ...]) -> np.ndarray:
    if len(shape) < 2:
        raise PayloadError(f"tensor '{name}' of shape {shape} cannot be low-rank (needs >= 2 dimensions)")
    m, n = shape[0], _numel(shape[1:])
    per_rank = 4 * (m + n)
    if per_rank == 0:
        raise PayloadError(f"tensor '{name}' of shape {shape} has no values to factorise")
    rank = len(data) // per_rank
    if len(data) % per_rank or not 1 <= rank <= min(m, n):
        raise PayloadError(f"tensor '{name}' carries {len(data)} bytes, not 4·r·({m}+{n}) with 1 <= r <= {min(m, n)}")
    p = np.frombuffer(data[: 4 * m * rank], dtype="<f4").reshape(m, rank)
    q = np.frombuffer(data[4 * m * rank:], dtype="<f4").reshape(n, rank)
    if not (np.all(np.isfinite(p)) and np.all(np.isfinite(q))):
        raise PayloadError(f"tensor '{name}' holds NaN or Inf")
    return (p @ q.T).reshape(shape).astype(np.float32)


def _numel(shape) -> int:
    numel = 1
    for s in shape:
        numel *= int(s)
    return numel


def expected_nbytes(shape: tuple[int, ...], stype: str) -> int:
    numel = _numel(shape)
    if stype == FP32:
        return 4 * numel
    if stype == INT4:
        return (numel + 1) // 2 + 8
    if stype == INT4B:
        from strategies.int4 import int4_blocks_nbytes

        return int4_blocks_nbytes(numel)
    raise PayloadError(f"unknown array stype '{stype}'")


def decode(record: ArrayRecord) -> dict[str, np.ndarray]:
    """ArrayRecord in a Postcard wire format -> named fp32 tensors (validated)."""
    if not isinstance(record, ArrayRecord):
        raise PayloadError(f"expected an ArrayRecord, got {type(record).__name__}")
    out: dict[str, np.ndarray] = {}
    for name, array in record.items():
        shape, numel = declared_shape(name, array)
        if array.dtype != "float32":
            raise PayloadError(f"tensor '{name}' has dtype {array.dtype}, expected float32")
        if array.stype in (TOPK, LOWRANK):
            decoder = _decode_topk if array.stype == TOPK else _decode_lowrank
            arr = decoder(name, array.data, shape)
            if not np.all(np.isfinite(arr)):
                raise PayloadError(f"tensor '{name}' holds NaN or Inf")
            out[name] = arr
            continue
        want = expected_nbytes(shape, array.stype)
        if len(array.data) != want:
            raise PayloadError(f"tensor '{name}' carries {len(array.data)} bytes, expected {want} for shape {shape}")
        if array.stype == FP32:
            arr = np.frombuffer(array.data, dtype="<f4").reshape(shape).astype(np.float32)
        else:
            from strategies.int4 import unpack_int4, unpack_int4_blocks

            try:
                arr = (unpack_int4 if array.stype == INT4 else unpack_int4_blocks)(array.data, numel).reshape(shape)
            except ValueError as err:
                raise PayloadError(f"tensor '{name}': {err}") from None
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


def wire_bytes(message) -> int:
    """Bytes of the protobuf requests that carry ``message`` over Flower's Fleet API (1.42):
    one ``PushMessagesRequest`` (metadata and the object tree: a 64-hex id per record, array
    and chunk) and one ``PushObjectRequest`` per object (its deflated bytes, its id, the
    node and run), as a SuperNode sends a reply. Not counted: gRPC/HTTP framing, TLS, and the
    session id of each object push (a few dozen bytes each)."""
    from flwr.app.message import remove_content_from_message
    from flwr.common.serde import message_to_proto
    from flwr.proto.fleet_pb2 import PushMessagesRequest
    from flwr.proto.message_pb2 import PushObjectRequest
    from flwr.proto.node_pb2 import Node
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree

    node = Node(node_id=int(message.metadata.src_node_id))
    run_id = int(message.metadata.run_id)
    head = message if not message.has_content() else remove_content_from_message(message)
    total = PushMessagesRequest(node=node, messages_list=[message_to_proto(head)],
                                message_object_trees=[get_object_tree(message)],
                                clientapp_runtime_list=[0.0]).ByteSize()
    for object_id, obj in get_all_nested_objects(message).items():
        total += PushObjectRequest(node=node, run_id=run_id, object_id=object_id,
                                   object_content=obj.deflate()).ByteSize()
    return int(total)
