"""The round ledger: what the server records of each round, and the finished rounds.

One open record per round, started by the first thing the server does in it (configuring
training, or a secure round's first stage) and closed once the round is evaluated:

* ``clients``: per node, the server's own accounting (bytes each way, the norm it measured)
  and, in a non-private run, the metrics the node reported (``<phase>_<name>``, never over a
  field the server wrote);
* ``refused``: each reply (or the whole round, ``node_id: None``) refused, with its kind and reason;
* ``missing``: each node sent a message that gave no reply;
* ``bounded``: each reply whose influence was bounded (count capped, norm clipped);
* ``excluded``: each node excluded from the rest of the run;
* whatever a strategy adds (``accepted``, ``privacy``, ``secure``, a method's own entries).

Every entry is logged as it is made, except ``bounded``: each is in the record, and the round's
bounded replies are logged in one summary line (:meth:`RoundLedger.log_bounded`, at INFO unless a
reply was far outside its bound); :meth:`RoundLedger.finish` appends the record to ``history`` and
hands it to ``on_round_end`` (the run folder's writer).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from logging import INFO, WARNING

import numpy as np
from flwr.common.logger import log

from strategies import codec, packing

RoundRecord = dict


class RoundLedger:
    """The open round's record (:attr:`current`) and the finished ones (:attr:`history`)."""

    def __init__(self, on_round_end: Callable[[RoundRecord], None] | None = None) -> None:
        self.on_round_end = on_round_end
        self.history: list[RoundRecord] = []
        self.current: RoundRecord = {}

    @property
    def round(self):
        """The open round's number (None between rounds)."""
        return self.current.get("round")

    def start(self, server_round: int) -> bool:
        """Open ``server_round``'s record unless it is the open one; True when a new one was opened."""
        if self.current.get("round") == server_round:
            return False
        self.current = {"round": server_round, "t_start": time.time(), "clients": {}, "refused": [],
                        "missing": [], "bounded": []}
        return True

    def client(self, node_id: int) -> dict:
        """The open round's record of one node."""
        return self.current["clients"].setdefault(str(node_id), {"node_id": int(node_id)})

    def refuse(self, node_id: int | None, reason: str, *, kind: str = "payload", phase: str = "train") -> None:
        """A refused reply (``node_id=None``: the whole round, ``kind='round'``)."""
        if node_id is None:
            log(WARNING, "round %s: %s and the global state is unchanged", self.round, reason)
        else:
            log(WARNING, "round %s: refused the %s reply of node %s: %s", self.round, phase, node_id, reason)
        self.current["refused"].append({"node_id": None if node_id is None else int(node_id), "round": self.round,
                                        "phase": phase, "kind": kind, "reason": reason})

    def bound(self, node_id: int, kind: str, detail: str) -> None:
        """A reply whose influence was bounded (``examples-capped``, ``norm-clipped``, ``dp-clipped``):
        recorded here, logged in the round's one line of :meth:`log_bounded`."""
        self.current["bounded"].append({"node_id": int(node_id), "round": self.round, "kind": kind,
                                        "detail": detail})

    def log_bounded(self, replies: int, effects: list[str], hostile: list[str]) -> None:
        """The round's one log line on the replies it bounded (none: no line), e.g. ``round 3: 4 of 10
        replies bounded: example counts capped at 214 (3), update norms clipped to 1.5x the lower
        median, 0.012 (1)``. ``effects``: each bound applied, with how many replies it bounded;
        ``hostile``: the details of the replies far outside their bound. INFO when there are none (the
        bounds acting on honest-looking replies, as they do every round); WARNING naming them otherwise."""
        if not effects:
            return
        bounded = len({entry["node_id"] for entry in self.current["bounded"]})
        line = f"round {self.round}: {bounded} of {replies} replies bounded: {', '.join(effects)}"
        if hostile:
            log(WARNING, "%s; far outside the bound (hostile-looking): %s", line, "; ".join(hostile))
        else:
            log(INFO, "%s", line)

    def missing(self, node_id: int, phase: str, reason: str) -> None:
        """A node that was sent a message and gave no reply."""
        log(WARNING, "round %s: no %s reply from node %s: %s", self.round, phase, node_id, reason)
        self.current["missing"].append({"node_id": int(node_id), "phase": phase, "reason": reason})

    def exclude(self, node_id: int, reason: str) -> None:
        """A node excluded from the rest of the run."""
        log(WARNING, "round %s: node %s is excluded from the rest of the run: %s", self.round, node_id, reason)
        self.current.setdefault("excluded", []).append({"node_id": int(node_id), "reason": reason})

    def add_bytes(self, node_id: int, key: str, nbytes: int) -> None:
        """Add to a node's byte count ``key`` (a secure round's stages add up)."""
        client = self.client(node_id)
        client[key] = client.get(key, 0) + int(nbytes)

    def uploaded(self, node_id: int, record, msg, metrics: Mapping | None) -> None:
        """An accepted training reply's bytes (payload, Flower's count, the wire) and, unless the run is private
        (``metrics=None``: only the aggregate of what clients report is kept), its metrics."""
        client = self.client(node_id)
        client["uplink_payload_bytes"] = codec.payload_bytes(record)
        client["uplink_message_bytes"] = codec.message_bytes(msg.content)
        try:  # a measurement: whatever a reply holds, it must not stop the round
            client["uplink_wire_bytes"] = packing.wire_bytes(msg)
        except Exception:  # noqa: BLE001
            pass
        if metrics is not None:
            self.store_metrics(node_id, "train", metrics)

    def store_metrics(self, node_id: int, phase: str, metrics: Mapping) -> None:
        """A reply's metrics in its node's record as ``<phase>_<name>``, never over a field the server
        wrote (its byte accounting)."""
        client = self.client(node_id)
        for key, value in metrics.items():
            name = f"{phase}_{key}"
            if name in client:
                log(WARNING, "round %s: node %s reported a metric '%s', a name the server's own record uses; "
                    "left out", self.round, node_id, key)
                continue
            client[name] = plain(value)

    def finish(self, aggregated: Mapping | None) -> RoundRecord:
        """Close the open round with its aggregated evaluation metrics: into :attr:`history`, to ``on_round_end``."""
        record = self.current
        record["seconds"] = round(time.time() - record.pop("t_start"), 3)
        record["eval"] = {k: plain(v) for k, v in (aggregated or {}).items()}
        record["clients"] = list(record["clients"].values())
        self.history.append(record)
        if self.on_round_end is not None:
            self.on_round_end(record)
        self.current = {}
        return record


def plain(value):
    """MetricRecord values -> JSON-friendly Python numbers."""
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, (np.floating, float)):
        return float(value)
    if isinstance(value, (np.integer, int)):
        return int(value)
    return value
