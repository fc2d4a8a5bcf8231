"""Transport packing: a message's many arrays travel as one.

Flower 1.42 moves a message as a tree of objects — the message, each record, each ``Array``
and each of its ``ArrayChunk``s — and each object is one request (two at a time, at most one
per CPU core: ``get_num_workers`` in ``flwr/supercore/inflatable/inflatable_utils.py``) on
every hop: ServerApp → SuperLink → SuperNode → ClientApp and back. FedAvg-LoRA's payload on
SmolLM2 is 420 tensors, so 843 objects a message; on a loopback deployment of 2 cores their
round trips cost 10-26 s per message (docs/deploy.md, section 9), more than the training.

:func:`pack` puts every ``ArrayRecord`` of a message's content into one record with one
``Array`` (stype :data:`PACKED`): a header naming each array (record, name, dtype, shape,
stype, byte length) followed by their bytes, unchanged. :func:`unpack` gives back the same
records, array by array, byte for byte. What the methods send and what the strategies check
is therefore unchanged; only the number of objects on the way is (a few per message).
``fedapps.runner.collect_replies`` packs what the server sends and unpacks the replies;
``fedapps.client_app``'s mod does the same on the client. A content with fewer than
:data:`MIN_ARRAYS` arrays travels as it is (FLITE's one latent array among others).

``codec.message_bytes`` (Flower's count of the records) is that of the unpacked content, the
message as its method built it; :func:`wire_bytes` counts the requests of the packed message, as
it travels. Packing also removes most of Flower's per-array overhead from the wire: for 420
random 8×576 fp32 tensors (SmolLM2's LoRA shape), 277,822 bytes beside the data unpacked,
45,174 packed, and 843 objects become 6 (tests/test_packing.py).

:func:`unpack` reads what a client sent: it checks the header (magic, version, sizes, types,
names) before it builds anything and raises :class:`~strategies.codec.PayloadError` with a
reason; the arrays it gives back are then checked by the method's own decoding as any
client's arrays are.

numpy and flwr only: strategies never import clients or torch.
"""

from __future__ import annotations

import copy
import json
import struct

from flwr.app import Array, ArrayRecord, RecordDict

from strategies import codec
from strategies.codec import PayloadError

RECORD = "postcard.packed"  # the one ArrayRecord of a packed content
PACKED = "postcard.packed"  # its one Array's stype
MAGIC = b"PCPK"
VERSION = 1
HEAD = struct.Struct("<4sIQ")  # magic, version, manifest length
MIN_ARRAYS = 8  # fewer arrays than this: sent as they are
# the most arrays a packed record may declare, and bytes of header text: the largest honest reply is a few
# hundred arrays (LoRA on every projection of a 32-layer model: 448); a hostile manifest at these limits
# costs the server ~0.6 s to read and refuse (at the former 10^6 arrays: 83 s and ~2 GB, issue #62)
MAX_ARRAYS = 65_536
MAX_MANIFEST = 8 * 2**20


def is_packed(content: RecordDict) -> bool:
    return RECORD in content.array_records


def array_count(content: RecordDict) -> int:
    return sum(len(record) for record in content.array_records.values())


def pack(content: RecordDict, min_arrays: int = MIN_ARRAYS) -> RecordDict:
    """``content`` with its ArrayRecords in one packed record (metrics and configs as they
    are); ``content`` itself when it has fewer than ``min_arrays`` arrays or is packed already."""
    if is_packed(content) or array_count(content) < min_arrays:
        return content
    manifest, blobs = [], []
    for record_name, record in content.array_records.items():
        entries = []
        for name, array in record.items():
            data = bytes(array.data)
            entries.append([name, str(array.dtype), [int(s) for s in array.shape], str(array.stype), len(data)])
            blobs.append(data)
        manifest.append([record_name, entries])
    text = json.dumps(manifest, separators=(",", ":")).encode()
    data = HEAD.pack(MAGIC, VERSION, len(text)) + text + b"".join(blobs)
    out = RecordDict({RECORD: ArrayRecord({"data": Array(dtype="uint8", shape=(len(data),), stype=PACKED, data=data)})})
    for name, record in content.items():
        if name not in content.array_records:
            out[name] = record
    return out


def unpack(content: RecordDict) -> RecordDict:
    """The content :func:`pack` was given (the same records, arrays and bytes); ``content``
    itself when it is not packed. PayloadError (with a reason) for a packed record that is
    malformed."""
    if not is_packed(content):
        return content
    record = content.array_records[RECORD]
    if list(record.keys()) != ["data"]:
        raise PayloadError(f"packed record: expected one array 'data', got {sorted(record.keys())[:5]}")
    array = record["data"]
    if array.stype != PACKED:
        raise PayloadError(f"packed record: its array has stype {array.stype!r}, expected {PACKED!r}")
    data = memoryview(bytes(array.data))
    if len(data) < HEAD.size:
        raise PayloadError(f"packed record: {len(data)} bytes, shorter than its {HEAD.size}-byte header")
    magic, version, size = HEAD.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise PayloadError(f"packed record: unknown header {magic!r} version {version}")
    if size > min(MAX_MANIFEST, len(data) - HEAD.size):
        raise PayloadError(f"packed record: a {size}-byte manifest in {len(data)} bytes")
    try:
        manifest = json.loads(bytes(data[HEAD.size:HEAD.size + size]))
    except (ValueError, UnicodeDecodeError) as err:
        raise PayloadError(f"packed record: its manifest is not JSON ({err})") from None
    except RecursionError:  # a manifest nested thousands deep (20 KB does it); a real one is 4 deep
        raise PayloadError("packed record: its manifest is nested deeper than a manifest is") from None
    entries = _checked(manifest, content)
    body = data[HEAD.size + size:]
    if sum(e[-1] for _, e in entries) != len(body):
        raise PayloadError(f"packed record: the manifest declares {sum(e[-1] for _, e in entries)} bytes of arrays, "
                           f"the record holds {len(body)}")
    records: dict[str, ArrayRecord] = {name: ArrayRecord() for name, _ in manifest}
    at = 0
    for record_name, (name, dtype, shape, stype, nbytes) in entries:
        records[record_name][name] = Array(dtype=dtype, shape=tuple(shape), stype=stype, data=bytes(body[at:at + nbytes]))
        at += nbytes
    out = RecordDict(dict(records))
    for name, other in content.items():
        if name != RECORD:
            out[name] = other
    return out


def _checked(manifest, content: RecordDict) -> list[tuple[str, list]]:
    """The manifest's entries as (record name, [name, dtype, shape, stype, nbytes]), every field
    of the right type, no name twice, no record name taken by the content's other records."""
    if not isinstance(manifest, list):
        raise PayloadError("packed record: its manifest is not a list of records")
    out, names, count = [], set(), 0
    for item in manifest:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], list)):
            raise PayloadError("packed record: a manifest entry is not [record name, [arrays]]")
        record_name, arrays = item
        if record_name in names or (record_name != RECORD and record_name in content):
            raise PayloadError(f"packed record: record '{record_name}' named twice")
        names.add(record_name)
        seen = set()
        for entry in arrays:
            count += 1
            if count > MAX_ARRAYS:
                raise PayloadError(f"packed record: more than {MAX_ARRAYS} arrays")
            if not (isinstance(entry, list) and len(entry) == 5 and isinstance(entry[0], str)
                    and isinstance(entry[1], str) and isinstance(entry[2], list) and isinstance(entry[3], str)
                    and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in entry[2])
                    and isinstance(entry[4], int) and not isinstance(entry[4], bool) and entry[4] >= 0):
                raise PayloadError(f"packed record: a malformed array entry in record '{record_name}'")
            if entry[0] in seen:
                raise PayloadError(f"packed record: array '{entry[0]}' twice in record '{record_name}'")
            seen.add(entry[0])
            out.append((record_name, entry))
    return out


def receive(message) -> str | None:
    """What the server does with a reply as it arrives: its packed arrays unpacked in place;
    returns why a packed record could not be read (the reply is then left as it came, and the
    strategy finds none of the records it expects and refuses it), or None."""
    try:
        if message.has_content():
            message.content = unpack(message.content)
    except PayloadError as err:
        return str(err)
    except Exception as err:  # noqa: BLE001 - whatever a client sent, the run goes on without this reply
        return f"packed record: cannot be read ({type(err).__name__})"
    return None


def wire_bytes(message) -> int:
    """:func:`strategies.codec.wire_bytes` of ``message`` as it travels: its content packed when
    it has :data:`MIN_ARRAYS` arrays or more (Postcard's ClientApp packs every reply so)."""
    from flwr.app import Message

    if message.has_content():
        packed = pack(message.content)
        if packed is not message.content:
            message = Message(metadata=copy.copy(message.metadata), content=packed)
    return codec.wire_bytes(message)
