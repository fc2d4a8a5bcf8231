"""What a FLITE reply costs on the wire, object by object: Postcard's share and Flower's framing.

    .venv/bin/python bench/wire_bytes.py            # prints the table (a second), writes docs/bench/wire_bytes.md

The reply answers a train message with the metadata of a deployed run (64-bit run id, a
64-hex message id): a simulation's 36-character ids give about 28 bytes less.

A FLITE training reply is built as the ClientApp builds one (1,280 latents as int4; full
form: the metrics ``clients.train.local_train`` returns plus ``partition-id`` and
``client-seconds``, and the fingerprint record; compact form, ``algorithm.reply=compact``:
``strategies.flite.compact_content``), then measured three ways: the payload (the int4
bytes), Flower's ``count_bytes`` of the records, and the protobuf requests a SuperNode sends
(``strategies.codec.wire_bytes``: a ``PushMessagesRequest`` with the metadata and the object
tree, one ``PushObjectRequest`` per object). Rows per object show where the bytes go;
variants show what each of Postcard's extras costs, and the last row the floor of Flower's
framing (z's bytes alone in one ConfigRecord: a reply without even ``num-examples``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _latents_and_request():
    """The int4 record of 1,280 latents and the train message a reply answers, with the metadata
    a deployed run gives it: a 64-bit run id, the round as group id, and the message id a
    SuperLink's grid sets (the message's object id, 64 hex characters; a simulation's grid sets a
    36-character uuid4, 28 bytes less on every reply)."""
    import numpy as np
    from flwr.app import Message, RecordDict

    from strategies import codec

    z = np.random.default_rng(0).normal(0, 0.01, 1280).astype(np.float32)
    request = Message(RecordDict({}), dst_node_id=2**62 + 12345, message_type="train", group_id="3")
    request.metadata.__dict__["_run_id"] = 2**63 - 12345
    request.metadata.__dict__["_message_id"] = request.object_id  # as flwr's http_grid.push_messages does
    return codec.encode({"z": z}, "int4"), request


def flite_reply(metrics: dict, fingerprint: bool):
    from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

    latents, request = _latents_and_request()
    content = {"arrays": latents, "metrics": MetricRecord(metrics)}
    if fingerprint:
        content["flite"] = ConfigRecord({"fingerprint": "0123456789abcdef"})
    return Message(RecordDict(content), reply_to=request)


def compact_reply(num_examples: int | None):
    """The compact reply (``algorithm.reply=compact``: z's bytes and num-examples in one ConfigRecord,
    the fewest objects a Flower 1.42 reply can have); ``None``: without num-examples (Flower's floor)."""
    from flwr.app import Message

    from strategies.flite import COMPACT_RECORD, compact_content

    latents, request = _latents_and_request()
    content = compact_content(latents, num_examples or 1)
    if num_examples is None:
        del content[COMPACT_RECORD]["num-examples"]
    return Message(content, reply_to=request)


def objects(message) -> list[tuple[str, int]]:
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    return [(type(obj).__name__, len(obj.deflate())) for obj in get_all_nested_objects(message).values()]


def main() -> int:
    from flwr.supercore.task_identity import TaskIdentity

    from strategies import codec
    from strategies.flite import COMPACT_RECORD

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    full_metrics = {"loss": 0.51, "first-loss": 0.62, "last-loss": 0.47, "seconds": 12.3, "num-examples": 1600,
                    "partition-id": 3, "client-seconds": 14.1}
    lean_metrics = {"loss": 0.51, "num-examples": 1600}
    full = "full (`algorithm.reply=full`, the default: fingerprint record, 7 metrics)"
    variants = {
        full: flite_reply(full_metrics, True),
        "full form without the fingerprint record": flite_reply(full_metrics, False),
        "full form without it, 2 metrics (loss, num-examples)": flite_reply(lean_metrics, False),
        "**compact** (`algorithm.reply=compact`: z's bytes and num-examples in one ConfigRecord)": compact_reply(1600),
        "Flower's floor: z's bytes alone in one ConfigRecord": compact_reply(None),
    }
    lines = ["# A FLITE reply on the wire (1,280 int4 latents)", "",
             f"Made by `bench/wire_bytes.py`, {time.strftime('%Y-%m-%d')}, flwr 1.42.", "",
             "| object (full reply) | deflated bytes |", "|---|---:|"]
    lines += [f"| {name} | {size:,} |" for name, size in objects(variants[full])]
    lines += ["", "| reply | payload | count_bytes | objects | wire (protobuf requests) |", "|---|---:|---:|---:|---:|"]
    for label, message in variants.items():
        payload = (codec.payload_bytes(message.content["arrays"]) if "arrays" in message.content
                   else len(message.content[COMPACT_RECORD]["z"]))
        lines.append(f"| {label} | {payload:,} | {codec.message_bytes(message.content):,} | {len(objects(message))} | "
                     f"{codec.wire_bytes(message):,} |")
    text = "\n".join(lines) + "\n"
    out = ROOT / "docs" / "bench" / "wire_bytes.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
