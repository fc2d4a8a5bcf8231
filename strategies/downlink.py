"""The downlink stage: what a round sends each node, encoded once per global state.

:class:`Downlink` turns Flower's sampled message templates into Postcard's messages: the
strategy's downlink (its wire format, or a latent channel's history of combined latents), the
per-node config (``train_config_for``), the run's YAML the first time a node is reached, and
the bytes of each, in the round's ledger. With a latent downlink each node is sent only the
rounds it has not confirmed (:class:`~strategies.channel.LatentSync`), or the dense tensors
themselves when those are fewer bytes.

It keeps what it needs between rounds: the encoded record (until :meth:`changed`), the latent
history as sent (:meth:`state` / :meth:`load` for checkpoints) and which nodes hold the run's
config. numpy and flwr only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

from strategies import codec
from strategies.channel import LatentSync, history_key
from strategies.screening import CONFIG_RECORD


class Downlink:
    """One run's downlink, on behalf of ``strategy`` (its ``encode_downlink`` hook, config, ledger)."""

    def __init__(self, strategy, *, latent: bool) -> None:
        self.strategy = strategy
        self.latent = latent  # the latent channel's history of combined latents, not θ_fed
        self.history: list[tuple[int, Array]] = []  # a latent downlink's combined z per round, as sent
        self.sync = LatentSync()  # the rounds each node holds (it is sent the rest)
        self.configured: set[int] = set()  # nodes sent the run's config
        self._encoded: ArrayRecord | None = None
        self._snapshot: ArrayRecord | None = None

    def changed(self) -> None:
        """The global state changed: encode again when next asked."""
        self._encoded = self._snapshot = None

    def arrays(self) -> ArrayRecord:
        """What every client receives, encoded once per global state: a latent downlink's history, or the
        strategy's ``encode_downlink``."""
        if self._encoded is None:
            self._encoded = self.latent_record() if self.latent else self.strategy.encode_downlink()
        return self._encoded

    def latent_record(self) -> ArrayRecord:
        """Every committed round's combined latents (``latent/round-NNNNN``)."""
        record = ArrayRecord()
        for t, array in self.history:
            record[history_key(t)] = array
        return record

    def snapshot(self, encode: Callable[[], ArrayRecord]) -> ArrayRecord:
        """A latent downlink's alternative for a node that missed many rounds (``encode()``, once per state)."""
        if self._snapshot is None:
            self._snapshot = encode()
        return self._snapshot

    def messages(self, templates: Iterable[Message], server_round: int, phase: str,
                 config: ConfigRecord) -> list[Message]:
        """Flower's sampled templates -> this round's messages of ``phase`` (``train`` or ``eval``)."""
        strategy = self.strategy
        shared = self.arrays()
        out = []
        for template in templates:
            node_id = template.metadata.dst_node_id
            node_cfg = ConfigRecord(dict(config))
            arrays = shared
            if self.latent:  # only the rounds this node has not confirmed (strategies.channel.LatentSync)
                node_cfg[LatentSync.SINCE] = self.sync.since(node_id)
                arrays, dense = self.sync.record_for(node_id, self.history, shared,
                                                     snapshot=strategy.federated_snapshot)
                if dense:  # fewer bytes than the rounds it missed: the tensors themselves
                    node_cfg[LatentSync.SNAPSHOT] = self.history[-1][0]
            if phase == "train":
                node_cfg = strategy.train_config_for(server_round, node_id, node_cfg)
            content = RecordDict({strategy.arrayrecord_key: arrays, strategy.configrecord_key: node_cfg})
            if node_id not in self.configured:
                content[CONFIG_RECORD] = ConfigRecord({"yaml": strategy.config_yaml})
                self.configured.add(node_id)
            client = strategy.ledger.client(node_id)
            client[f"{phase}_downlink_payload_bytes"] = codec.payload_bytes(arrays)
            client[f"{phase}_downlink_message_bytes"] = codec.message_bytes(content)
            out.append(Message(content=content, dst_node_id=node_id, message_type=template.metadata.message_type))
        return out

    def lost(self, node_id: int) -> None:
        """A node that may have lost its state: its next message carries the config and the whole history."""
        self.configured.discard(int(node_id))
        self.sync.lost(node_id)

    def state(self) -> dict:
        """JSON-able: the latent history as sent (a resumed run sends the clients the same bytes)."""
        if not self.latent:
            return {}
        return {"latent_history": [[t, a.stype, list(a.shape), a.data.hex()] for t, a in self.history]}

    def load(self, meta) -> None:
        """Restore :meth:`state`; a resumed run is a new Flower run: every node needs the config again and
        holds no latent round."""
        self.history = [(int(t), Array(dtype="float32", shape=tuple(shape), stype=str(stype),
                                       data=bytes.fromhex(data)))
                        for t, stype, shape, data in meta.get("latent_history", [])]
        self.configured = set()
        self.sync = LatentSync()
        self.changed()
