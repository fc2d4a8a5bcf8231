"""What a FLITE reply costs on the wire, object by object: Postcard's share and Flower's framing.

    .venv/bin/python bench/wire_bytes.py            # prints the table (a second), writes docs/bench/wire_bytes.md

A FLITE training reply is built exactly as the ClientApp builds one (1,280 latents as int4,
the metrics ``clients.train.local_train`` returns plus ``partition-id``, the fingerprint
record), then measured three ways: the payload (the int4 bytes), Flower's ``count_bytes``
of the records, and the protobuf requests a SuperNode sends (``strategies.codec.wire_bytes``:
a ``PushMessagesRequest`` with the metadata and the object tree, one ``PushObjectRequest``
per object). Rows per object show where the bytes go; variants show what dropping
Postcard's extras (the fingerprint record, the diagnostic metrics) would save, and the last
two rows the floor of Flower's framing: z as bytes in a single ConfigRecord (not built: the
strategies read payloads from ArrayRecords).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _latents_and_request():
    """The int4 record of 1,280 latents and the train message a reply answers."""
    import numpy as np
    from flwr.app import Message, RecordDict

    from strategies import codec

    z = np.random.default_rng(0).normal(0, 0.01, 1280).astype(np.float32)
    return codec.encode({"z": z}, "int4"), Message(RecordDict({}), dst_node_id=2**62 + 12345, message_type="train")


def flite_reply(metrics: dict, fingerprint: bool):
    from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

    latents, request = _latents_and_request()
    content = {"arrays": latents, "metrics": MetricRecord(metrics)}
    if fingerprint:
        content["flite"] = ConfigRecord({"fingerprint": "0123456789abcdef"})
    return Message(RecordDict(content), reply_to=request)


def bytes_reply(metrics: dict):
    """The same int4 latents as bytes in one ConfigRecord, with ``metrics`` beside them: the
    fewest objects a Flower 1.42 reply can have (message, record dict, one record)."""
    from flwr.app import ConfigRecord, Message, RecordDict

    latents, request = _latents_and_request()
    return Message(RecordDict({"p": ConfigRecord({"z": latents["z"].data, **metrics})}), reply_to=request)


def objects(message) -> list[tuple[str, int]]:
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    return [(type(obj).__name__, len(obj.deflate())) for obj in get_all_nested_objects(message).values()]


def main() -> int:
    from flwr.supercore.task_identity import TaskIdentity

    from strategies import codec

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    full_metrics = {"loss": 0.51, "first-loss": 0.62, "last-loss": 0.47, "seconds": 12.3, "num-examples": 1600,
                    "partition-id": 3}
    lean_metrics = {"loss": 0.51, "num-examples": 1600}
    variants = {
        "as sent today (fingerprint record, 6 metrics)": flite_reply(full_metrics, True),
        "without the fingerprint record": flite_reply(full_metrics, False),
        "without it, 2 metrics (loss, num-examples)": flite_reply(lean_metrics, False),
    }
    today = variants["as sent today (fingerprint record, 6 metrics)"]
    lines = ["# A FLITE reply on the wire (1,280 int4 latents)", "",
             f"Made by `bench/wire_bytes.py`, {time.strftime('%Y-%m-%d')}, flwr 1.42.", "",
             "| object (as sent today) | deflated bytes |", "|---|---:|"]
    lines += [f"| {name} | {size:,} |" for name, size in objects(today)]
    lines += ["", "| reply | payload | count_bytes | objects | wire (protobuf requests) |", "|---|---:|---:|---:|---:|"]
    variants["not built: z as bytes in one ConfigRecord, with num-examples"] = bytes_reply({"num-examples": 1600})
    variants["not built: z as bytes in one ConfigRecord, nothing else"] = bytes_reply({})
    for label, message in variants.items():
        payload = (codec.payload_bytes(message.content["arrays"]) if "arrays" in message.content
                   else len(message.content["p"]["z"]))
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
