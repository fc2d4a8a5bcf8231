"""Both ends of a secure round in one process, no Flower runtime: the same messages and checks as a
run (tests and benchmarks: ``tests/test_secure_round.py``, ``bench/secagg.py``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict

from strategies.secure_client import (client_deliver, client_keys, client_mask, client_open, client_shares,
                                      client_unmask)
from strategies.secure_round import DELIVER, KEYS, OPEN, SHARES, UNMASK

def local_round(strategy, updates: Mapping[int, Mapping[str, np.ndarray]], *, server_round: int = 1,
                skip_upload: Iterable[int] = (), skip_unmask: Iterable[int] = (), records: Mapping | None = None,
                tamper=None, timings: dict | None = None, hostile: Mapping | None = None,
                skip_deliver: Iterable[int] = (), skip_open: Iterable[int] = ()) -> dict:
    """One secure round of ``strategy`` (a PayloadFedAvg with ``secure`` settings) with in-process
    clients, no Flower runtime: the same messages and checks as a run (tests and benchmarks).

    ``updates``: {node: {key: update}}; nodes in ``skip_deliver`` vanish after the shares stage, in
    ``skip_open`` do not answer the open stage, in ``skip_upload`` vanish before uploading, those in
    ``skip_unmask`` after uploading. ``records``: extra records in every training reply;
    ``tamper(replies)`` may change the training replies before the server sees them, and
    ``hostile[stage](replies)`` any stage's (``KEYS``, ``SHARES``, ``DELIVER``, ``OPEN``, ``"train"``, ``UNMASK``). ``timings``
    collects seconds per (stage, 'server' | 'client', summed over clients). Returns the round's record so far
    (per-client bytes, the secure-aggregation summary, refusals)."""
    import time

    from flwr.app import MetricRecord

    clock = timings if timings is not None else {}
    states = {int(v): RecordDict() for v in updates}
    skip_upload, skip_unmask = set(skip_upload), set(skip_unmask)

    def timed(stage, side, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        clock[(stage, side)] = clock.get((stage, side), 0.0) + time.perf_counter() - start
        return out

    def answer(stage, msgs, fn, skip=()):
        replies = [Message(timed(stage, "client", fn, m), reply_to=m) for m in msgs
                   if m.metadata.dst_node_id not in skip]
        stage_type = {"keys": KEYS, "shares": SHARES, "deliver": DELIVER, "open": OPEN, "upload": "train",
                      "unmask": UNMASK}[stage]
        if hostile and stage_type in hostile:
            hostile[stage_type](replies)
        return replies

    def node(m):
        return int(m.metadata.dst_node_id)

    settings = strategy.secure
    train = [Message(RecordDict({"arrays": strategy.downlink_arrays(), "config": ConfigRecord({})}), dst_node_id=v,
                     message_type="train") for v in sorted(states)]
    msgs = timed("keys", "server", strategy.secure_stages.begin, server_round, train)
    replies = answer("keys", msgs, lambda m: client_keys(m, states[node(m)], settings))
    msgs = timed("shares", "server", strategy.secure_stages.keys, server_round, replies)
    replies = answer("shares", msgs, lambda m: client_shares(node(m), m, states[node(m)], settings))
    msgs = timed("deliver", "server", strategy.secure_stages.shares, server_round, replies)
    replies = answer("deliver", msgs, lambda m: client_deliver(node(m), m, states[node(m)], settings), skip_deliver)
    msgs = timed("open", "server", strategy.secure_stages.deliver, server_round, replies)
    if msgs and msgs[0].metadata.message_type == OPEN:  # a holder complained: the accused dealers open
        replies = answer("open", msgs, lambda m: client_open(node(m), m, states[node(m)], settings), skip_open)
        msgs = timed("upload", "server", strategy.secure_stages.open, server_round, replies)

    def upload(m):
        arrays, _ = client_mask(node(m), m, states[node(m)], settings, updates[node(m)],
                                np.random.default_rng(node(m)))
        content = RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 1})})
        for name, record in (records or {}).items():
            content[name] = record
        return content

    replies = answer("upload", msgs, upload, skip_upload)
    if tamper is not None:
        tamper(replies)
    msgs = timed("unmask", "server", strategy.secure_stages.upload, server_round, replies)
    replies = answer("unmask", msgs, lambda m: client_unmask(node(m), m, states[node(m)], settings), skip_unmask)
    timed("finish", "server", strategy.secure_stages.finish, server_round, replies)
    return strategy.round_record()
