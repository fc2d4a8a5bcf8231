"""strategies.packing: a message's arrays travel as one and come back the same, byte for byte;
a malformed packed record is refused with a reason; the server and the ClientApp pack and unpack."""

import json
import struct

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from strategies import codec, packing
from strategies.codec import PayloadError

RNG = np.random.default_rng(0)


def content(n=12, fmt="fp32"):
    tensors = {f"layer{i}.lora_A": RNG.standard_normal((4, i + 1)).astype(np.float32) for i in range(n)}
    return RecordDict({"arrays": codec.encode(tensors, fmt), "extra": codec.encode({"z": np.ones(3)}, "int4"),
                       "metrics": MetricRecord({"loss": 1.5}), "config": ConfigRecord({"server-round": 2})})


def same(a: RecordDict, b: RecordDict) -> bool:
    if set(a.keys()) != set(b.keys()):
        return False
    for name, record in a.array_records.items():
        other = b.array_records[name]
        if list(record.keys()) != list(other.keys()):
            return False
        for key, x in record.items():
            y = other[key]
            if (x.dtype, list(x.shape), x.stype, bytes(x.data)) != (y.dtype, list(y.shape), y.stype, bytes(y.data)):
                return False
    return all(dict(a[k]) == dict(b[k]) for k in a if k not in a.array_records)


@pytest.mark.parametrize("fmt", ["fp32", "int4"])
def test_packing_gives_back_every_array_byte_for_byte_and_leaves_small_contents_alone(fmt):
    original = content(fmt=fmt)
    packed = packing.pack(original)
    assert packing.is_packed(packed) and list(packed.array_records) == [packing.RECORD]
    assert len(packed[packing.RECORD]) == 1  # one array: a few objects on Flower's wire, not 2 per tensor
    assert packed["metrics"] is original["metrics"] and packed["config"] is original["config"]
    assert same(packing.unpack(packed), original)
    assert codec.decode(packing.unpack(packed)["arrays"]).keys() == codec.decode(original["arrays"]).keys()
    small = content(n=2)  # 3 arrays in all
    assert packing.pack(small) is small and packing.unpack(small) is small
    assert packing.pack(packed) is packed


def packed_bytes(manifest, body=b"", magic=packing.MAGIC, version=packing.VERSION, size=None):
    text = json.dumps(manifest).encode()
    return struct.pack("<4sIQ", magic, version, len(text) if size is None else size) + text + body


def with_data(data: bytes, stype=packing.PACKED, key="data") -> RecordDict:
    return RecordDict({packing.RECORD: ArrayRecord({key: Array(dtype="uint8", shape=(len(data),), stype=stype,
                                                                data=data)}),
                       "metrics": MetricRecord({"loss": 1.0})})


GOOD = [["arrays", [["w", "float32", [2], codec.FP32, 8]]]]


@pytest.mark.parametrize("data, reason", [
    (b"PC", "shorter than"),
    (packed_bytes(GOOD, b"\0" * 8, magic=b"XXXX"), "unknown header"),
    (packed_bytes(GOOD, b"\0" * 8, version=9), "unknown header"),
    (packed_bytes(GOOD, b"\0" * 8, size=10**9), "manifest in"),
    (struct.pack("<4sIQ", packing.MAGIC, 1, 3) + b"{x}", "not JSON"),
    (packed_bytes({"arrays": 1}), "not a list"),
    (packed_bytes([["arrays", [["w", "float32", [-2], codec.FP32, 8]]]], b"\0" * 8), "malformed array entry"),
    (packed_bytes([["arrays", [["w", "float32", [2], codec.FP32, True]]]], b"\0" * 8), "malformed array entry"),
    (packed_bytes([["arrays", [["w", "float32", [2], codec.FP32, 8]] * 2]], b"\0" * 16), "twice"),
    (packed_bytes([["metrics", [["w", "float32", [2], codec.FP32, 8]]]], b"\0" * 8), "named twice"),
    (packed_bytes(GOOD, b"\0" * 9), "declares 8 bytes"),
    (packed_bytes(GOOD, b"\0" * 7), "declares 8 bytes"),
])
def test_a_malformed_packed_record_is_refused_with_a_reason(data, reason):
    with pytest.raises(PayloadError, match=reason):
        packing.unpack(with_data(data))


def test_a_hostile_manifest_is_refused_cheaply_and_never_escapes_the_server():
    """#62 finding 4: a 20 KB manifest nested 10,000 deep raised RecursionError out of unpack and
    collect_replies (the run failed); 10^6 entries (then the limit) cost 83 s and ~2 GB before refusal."""
    from flwr.app import Message

    nested = struct.pack("<4sIQ", packing.MAGIC, 1, 20_000) + b"[" * 10_000 + b"]" * 10_000
    with pytest.raises(PayloadError, match="nested deeper"):
        packing.unpack(with_data(nested))
    reply = Message(content=with_data(nested), dst_node_id=1, message_type="train")
    assert "nested deeper" in packing.receive(reply)  # a reason, not an exception
    many = [["arrays", [[f"a{i}", "float32", [1], codec.FP32, 4] for i in range(packing.MAX_ARRAYS + 1)]]]
    with pytest.raises(PayloadError, match=f"more than {packing.MAX_ARRAYS} arrays"):  # before any array is built
        packing.unpack(with_data(packed_bytes(many, b"\0" * 4 * (packing.MAX_ARRAYS + 1))))


def test_a_packed_record_of_the_wrong_shape_is_refused():
    with pytest.raises(PayloadError, match="stype"):
        packing.unpack(with_data(packed_bytes(GOOD, b"\0" * 8), stype="postcard.fp32"))
    with pytest.raises(PayloadError, match="one array 'data'"):
        packing.unpack(with_data(packed_bytes(GOOD, b"\0" * 8), key="other"))


def test_collect_replies_packs_what_it_sends_and_unpacks_what_comes_back():
    """Through fedapps.runner.collect_replies and Postcard's ClientApp mod: the client's method sees
    the server's arrays as they were made, the strategy the client's; the strategy's own message
    carries the id its reply answers (screening matches replies against it)."""
    from flwr.app import Context, Message

    from fedapps.client_app import transport_packing
    from fedapps.runner import collect_replies

    seen = {}

    def method(msg, ctx):  # what a Postcard handler gets and returns
        seen["in"] = msg.content
        seen["out"] = content()
        return Message(content=seen["out"], reply_to=msg)

    class Grid:
        def __init__(self):
            self.replies = {}

        def push_messages(self, messages):
            ids = []
            for i, msg in enumerate(messages):
                assert packing.is_packed(msg.content)  # what travels
                msg.metadata.__dict__["_message_id"] = f"m{i}"
                ctx = Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})
                reply = transport_packing(msg, ctx, method)
                assert packing.is_packed(reply.content)
                reply.metadata.__dict__["_src_node_id"] = 7
                self.replies[f"m{i}"] = reply
                ids.append(f"m{i}")
            return ids

        def pull_messages(self, ids):
            return [self.replies.pop(i) for i in list(ids) if i in self.replies]

    sent = Message(content=content(), dst_node_id=7, message_type="train")
    replies, missing = collect_replies(Grid(), [sent], timeout=10, poll=0.01)
    assert not missing and len(replies) == 1
    assert same(seen["in"], sent.content) and not packing.is_packed(seen["in"])
    assert same(replies[0].content, seen["out"]) and not packing.is_packed(replies[0].content)
    assert sent.metadata.message_id == "m0" and str(replies[0].metadata.reply_to_message_id) == "m0"


def test_packing_cuts_flowers_objects_and_overhead_for_a_lora_payload():
    """SmolLM2's LoRA shape (420 random 8x576 tensors): 843 objects (one request each, per hop)
    become 6, and the bytes beside the data on the wire fall from 277,822 to 45,174."""
    from flwr.app import Message
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
    from flwr.supercore.task_identity import TaskIdentity

    for key, value in (("run_id", 1), ("node_id", 1), ("task_id", 1)):
        if getattr(TaskIdentity, f"_{key}", None) is None:
            setattr(TaskIdentity, key, value)
    tensors = {f"base_model.model.model.layers.{i // 14}.self_attn.m{i % 7}.lora_{'AB'[i % 2]}.weight": RNG.standard_normal((8, 576))
               for i in range(420)}
    message = Message(RecordDict({"arrays": codec.encode(tensors)}), dst_node_id=3, message_type="train")
    data = 420 * 8 * 576 * 4
    packed = Message(RecordDict(packing.pack(message.content)), dst_node_id=3, message_type="train")
    assert len(get_all_nested_objects(message)) == 843 and len(get_all_nested_objects(packed)) == 6
    assert codec.wire_bytes(message) - data == 277_822 and packing.wire_bytes(message) - data == 45_174
