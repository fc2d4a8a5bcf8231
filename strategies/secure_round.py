"""Secure aggregation as Flower messages: the stages of one round and their wire formats.

:mod:`strategies.secagg` is the protocol; this module puts it on Flower's Message API (both
ends: the server's :class:`SecureRound`, the client's ``client_*`` functions). A secure
round is five exchanges (six after a complaint), each a message type of its own
(``train.<action>``; the ClientApp registers one function per action):

* ``train.secagg_keys``: server → sampled nodes: round, n. Reply: the node's public keys (``c``,
  ``s``: X25519; ``g``: Ed25519).
* ``train.secagg_shares``: server → nodes that answered: everyone's keys, threshold t, bits,
  clip. Reply: a commitment to the node's self-mask seed, one encrypted share per other node,
  the digests of every share it dealt.
* ``train.secagg_deliver``: server → participants: the shares addressed to the node and their
  dealers' digests. Reply: its signed complaints about the bad ones (none: empty).
* ``train.secagg_open`` (only after a complaint): server → accused dealers: the complaints.
  Reply: each complained-about share's ephemeral key (:func:`strategies.secagg.judge` settles it).
* ``train``: the method's usual training message + the final participants' keys. Reply: the
  masked update (``postcard.secagg`` arrays: uint8, uint16 or uint32 residues mod 2^k, the
  update's keys and shapes).
* ``train.secagg_unmask``: server → uploaders: who uploaded, who did not. Reply: the node's
  shares of the uploaders' seeds and of the others' mask keys.

Node ids travel as comma-separated decimal strings (Flower's ids are unsigned 64-bit, a
ConfigRecord int is signed, and Flower's records refuse empty lists); fixed-size byte
strings (keys, encrypted shares) travel concatenated. Every reply is checked (its sender,
sizes, types) and a bad one drops that node from the round, as a reply that never came
would; below the threshold the round is abandoned with the reason and the global state
stays as it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from strategies import codec, secagg, secagg_primitives
from strategies.secagg import FixedPoint, SecAggError

RECORD = "secagg"  # the ConfigRecord of every secure-aggregation message and reply
STYPE = "postcard.secagg"
KEYS, SHARES, UNMASK = "train.secagg_keys", "train.secagg_shares", "train.secagg_unmask"
DELIVER, OPEN = "train.secagg_deliver", "train.secagg_open"
STAGES = (KEYS, SHARES, DELIVER, OPEN, UNMASK)


@dataclass(frozen=True)
class SecureSettings:
    """A run's secure-aggregation settings (the ``secure_aggregation`` config block)."""

    bits: int
    clip: float
    threshold: int | None = None  # None: a majority of each round's clients

    def fixed_point(self, n: int) -> FixedPoint:
        return FixedPoint(bits=int(self.bits), clip=float(self.clip), num_clients=int(n))

    def threshold_for(self, n: int) -> int:
        return secagg.check_threshold(self.threshold if self.threshold is not None else secagg_primitives.default_threshold(n), n)

    @classmethod
    def from_config(cls, block, payload: str, auto_clip: float | None = None) -> SecureSettings | None:
        """None when ``block.enabled`` is false; ``bits`` null = 4 for an int4 payload, else 16;
        ``clip`` 'auto' = ``auto_clip``."""
        if not block or not block.get("enabled"):
            return None
        bits = block.get("bits")
        bits = (4 if payload in codec.QUANTISED else 16) if bits is None else int(bits)
        clip = block.get("clip")
        if clip == "auto":
            if auto_clip is None:
                raise SecAggError("clip 'auto' needs the run's learning rates and steps")
            clip = auto_clip
        threshold = block.get("threshold")
        settings = cls(bits=bits, clip=float(clip), threshold=None if threshold is None else int(threshold))
        settings.fixed_point(2)  # bits and clip checked now
        return settings


def join_ids(nodes: Iterable[int]) -> str:
    return ",".join(str(int(v)) for v in nodes)


def secagg_record(msg: Message) -> ConfigRecord:
    records = msg.content.config_records
    if RECORD not in records:
        raise SecAggError(f"no ConfigRecord '{RECORD}'")
    return records[RECORD]


def to_config(values: dict) -> ConfigRecord:
    """A ConfigRecord of ``values`` without the empty ones (Flower's byte count refuses empty
    strings and lists): an absent key reads as empty."""
    return ConfigRecord({k: v for k, v in values.items() if not (isinstance(v, (str, bytes)) and not v)})


def node_list(record: ConfigRecord, key: str) -> list[int]:
    """A comma-separated list of node ids (Flower's records refuse empty lists, so lists travel joined)."""
    text = record.get(key, "")
    if not isinstance(text, str) or not all(part.isdigit() for part in text.split(",") if text):
        raise SecAggError(f"'{key}' must be a list of node ids")
    return [int(part) for part in text.split(",")] if text else []


def split_fixed(record: ConfigRecord, key: str, size: int) -> list[bytes]:
    """Fixed-size byte strings, concatenated."""
    blob = record.get(key, b"")
    if not isinstance(blob, bytes) or len(blob) % size:
        raise SecAggError(f"'{key}' must be {size}-byte values, concatenated")
    return [blob[i:i + size] for i in range(0, len(blob), size)]


# ---------------------------------------------------------------------- server
class SecureRound:
    """The server's side of one secure round (see the module docstring)."""

    def __init__(self, settings: SecureSettings, server_round: int, nodes: Iterable[int], layout: Mapping[str, tuple]):
        self.settings = settings
        self.round = int(server_round)
        self.sampled = sorted(int(v) for v in nodes)
        self.n = len(self.sampled)
        self.fixed = settings.fixed_point(self.n)
        self.threshold = settings.threshold_for(self.n)
        self.layout = {k: tuple(int(s) for s in v) for k, v in sorted(layout.items())}
        self.public: dict[int, tuple[bytes, bytes]] = {}
        self.signing: dict[int, bytes] = {}  # node -> its Ed25519 key (signs its complaints)
        self.commitments: dict[int, bytes] = {}
        self.delivered: set[int] = set()  # holders that checked their shares (the deliver stage)
        self.complaints: dict[int, list[tuple[int, bytes, bytes]]] = {}  # dealer -> [(holder, hash, signature)]
        self.convicted: dict[int, str] = {}  # node -> what it provably did (evidence: the settled complaint)
        self.evidence: list[dict] = []  # each settled complaint, as anyone can check it again (hex)
        self.final: list[int] | None = None  # the participants who mask: set once the complaints are settled
        self.outside = 0  # values of the unmasked sum no honest uploads give (FixedPoint.clamp_sum)
        self.mail: dict[int, dict[int, bytes]] = {}  # recipient -> {sender: encrypted share}
        self.masked: dict[int, np.ndarray] = {}
        self.dropped: dict[int, str] = {}  # node -> why it left the round
        self.digests: dict[int, dict[int, bytes]] = {}  # dealer -> {holder: digests of the two shares it dealt}
        self.dealt_to: list[int] = []  # the nodes the shares were dealt to, in share-index order

    def _header(self) -> dict:
        return {"round": self.round, "n": self.n}

    def _check_count(self, nodes, stage: str) -> None:
        if len(nodes) < self.threshold:
            raise SecAggError(f"{len(nodes)} clients completed the {stage} stage, fewer than the threshold "
                              f"{self.threshold}: the round is abandoned")

    def _drop(self, node: int, reason: str) -> None:
        self.dropped.setdefault(int(node), reason)

    def _keys_record(self, nodes: list[int]) -> dict:
        return {"nodes": join_ids(nodes), "c-keys": b"".join(self.public[v][0] for v in nodes),
                "s-keys": b"".join(self.public[v][1] for v in nodes),
                "g-keys": b"".join(self.signing[v] for v in nodes)}

    def keys_messages(self) -> list[Message]:
        return [Message(RecordDict({RECORD: to_config(self._header())}), dst_node_id=v, message_type=KEYS)
                for v in self.sampled]

    def take_keys(self, replies: Mapping[int, Message]) -> list[Message]:
        """Stage 1's replies -> stage 2's messages. SecAggError below the threshold."""
        for node, msg in replies.items():
            try:
                record = secagg_record(msg)
                keys = (record.get("c-key"), record.get("s-key"))
                for name, key in zip(("c", "s"), keys):  # a low-order key would break every honest agreement
                    secagg_primitives.check_public_key(key, f"its {name} key")
                signing = secagg_primitives.check_signing_key(record.get("g-key"), "its g key")
                if keys[1] in {k[1] for k in self.public.values()}:
                    raise SecAggError("it advertises another node's key")
                self.public[int(node)] = keys
                self.signing[int(node)] = signing
            except SecAggError as err:
                self._drop(node, f"keys: {err}")
        nodes = sorted(self.public)
        self._check_count(nodes, "keys")
        # from here on the round is the advertised participants: t is a majority of them, and the
        # messages say n = their number (a client checks both against the list it is given)
        self.n, self.dealt_to = len(nodes), nodes
        self.fixed = self.settings.fixed_point(self.n)
        self.threshold = self.settings.threshold_for(self.n)
        content = {**self._header(), **self._keys_record(nodes), "threshold": self.threshold,
                   "bits": int(self.fixed.bits), "clip": float(self.fixed.clip)}
        return [Message(RecordDict({RECORD: to_config(content)}), dst_node_id=v, message_type=SHARES)
                for v in nodes]

    def take_shares(self, replies: Mapping[int, Message]) -> None:
        """Stage 2's replies: commitments and encrypted shares, to relay with the training messages."""
        advertised = set(self.public)
        for node, msg in replies.items():
            try:
                record = secagg_record(msg)
                commitment = record.get("commitment")
                if not isinstance(commitment, bytes) or len(commitment) != 32:
                    raise SecAggError("its commitment must be 32 bytes")
                to, blobs = node_list(record, "to"), split_fixed(record, "shares", secagg.SHARE_BLOB)
                if sorted(to) != sorted(advertised - {node}) or len(blobs) != len(to):
                    raise SecAggError("it must send one share to every other participant")
                digests = split_fixed(record, "digests", secagg.DIGEST_BYTES)
                if len(digests) != len(self.dealt_to):
                    raise SecAggError("it must publish the digests of every share it dealt")
                self.digests[int(node)] = dict(zip(self.dealt_to, digests))
                self.commitments[int(node)] = commitment
                for recipient, blob in zip(to, blobs):
                    self.mail.setdefault(recipient, {})[int(node)] = blob
            except SecAggError as err:
                self._drop(node, f"shares: {err}")
        self._check_count(self.commitments, "shares")

    @property
    def participants(self) -> list[int]:
        """Nodes whose masks every uploader includes: those that completed stage 2, then (once the deliver
        stage's complaints are settled) those of them that checked their shares and were not caught."""
        return list(self.final) if self.final is not None else sorted(self.commitments)

    def deliver_messages(self) -> list[Message]:
        """Each participant's shares and their dealers' digests, to check before anyone masks."""
        nodes = sorted(self.commitments)
        out = []
        for node in nodes:
            mail = self.mail.get(node, {})
            senders = [v for v in nodes if v != node and v in mail]
            content = {**self._header(), **self._keys_record(nodes), "from": join_ids(senders),
                       "shares": b"".join(mail[v] for v in senders),
                       "digests": b"".join(self.digests[v][node] for v in senders)}
            out.append(Message(RecordDict({RECORD: to_config(content)}), dst_node_id=node, message_type=DELIVER))
        return out

    def take_deliver(self, replies: Mapping[int, Message]) -> list[Message]:
        """The holders' complaints -> the open stage's messages to the accused dealers (none: no complaint).
        A complaint must name a share this holder was sent (its hash) and carry the holder's signature; a
        holder that did not answer leaves the round before anyone masks with it."""
        participants = set(self.commitments)
        for node, msg in replies.items():
            node = int(node)
            if node not in participants:
                continue
            try:
                record = secagg_record(msg)
                accused = node_list(record, "accused")
                hashes = split_fixed(record, "hashes", secagg_primitives.HASH_BYTES)
                signatures = split_fixed(record, "signatures", secagg_primitives.SIGNATURE_BYTES)
                if not len(accused) == len(hashes) == len(signatures) or len(set(accused)) != len(accused):
                    raise SecAggError("accused, hashes and signatures must describe as many complaints")
                mail = self.mail.get(node, {})
                for dealer, blob_hash, signature in zip(accused, hashes, signatures):
                    if dealer not in mail or secagg_primitives.share_hash(mail[dealer]) != blob_hash:
                        raise SecAggError(f"it complained about a share of node {dealer} it was not sent")
                    if not secagg_primitives.verify_signature(self.signing[node], signature, secagg_primitives.complaint_message(
                            self.round, dealer, node, blob_hash)):
                        raise SecAggError(f"its complaint about node {dealer} does not carry its signature")
                for dealer, blob_hash, signature in zip(accused, hashes, signatures):
                    self.complaints.setdefault(dealer, []).append((node, blob_hash, signature))
                self.delivered.add(node)
            except SecAggError as err:
                self._drop(node, f"deliver: {err}")
        for node in sorted(participants - self.delivered):
            self._drop(node, "deliver: it did not check its shares")
        accused = sorted(d for d in self.complaints if d in self.delivered)
        out = []
        for dealer in accused:
            holders = [h for h, _, _ in self.complaints[dealer]]
            content = {**self._header(), "holders": join_ids(holders),
                       "hashes": b"".join(x for _, x, _ in self.complaints[dealer]),
                       "signatures": b"".join(g for _, _, g in self.complaints[dealer])}
            out.append(Message(RecordDict({RECORD: to_config(content)}), dst_node_id=dealer, message_type=OPEN))
        if not out:
            self._settle()
        return out

    def take_open(self, replies: Mapping[int, Message]) -> None:
        """The accused dealers' opened keys: each complaint settled (:func:`strategies.secagg.judge`) — the
        dealer or the holder convicted, with the evidence kept. A dealer that does not open a complaint it
        was shown leaves the round (no ban: silence is no evidence)."""
        for dealer in sorted(self.complaints):
            if dealer not in self.delivered:
                continue
            opened: dict[int, bytes] = {}
            msg = replies.get(dealer)
            try:
                if msg is None:
                    raise SecAggError("no answer")
                record = secagg_record(msg)
                holders, keys = node_list(record, "holders"), split_fixed(record, "ephemerals", secagg.KEY_BYTES)
                if len(holders) != len(keys):
                    raise SecAggError("holders and ephemerals must be as many")
                opened = dict(zip(holders, keys))
            except SecAggError as err:
                self._drop(dealer, f"open: {err}")
            for holder, blob_hash, signature in self.complaints[dealer]:
                if holder not in opened:
                    self._drop(dealer, f"open: it did not open its share to node {holder}, whose complaint "
                                       "carries that node's signature")
                    continue
                blob, digest = self.mail[holder][dealer], self.digests[dealer][holder]
                why = secagg.judge(dealer, holder, blob, opened[holder], self.public[holder][0], digest, self.round)
                culprit, what = (dealer, why) if why else (
                    holder, f"it signed a complaint about node {dealer}'s share, which is good")
                self.convicted.setdefault(culprit, what)
                self._drop(culprit, f"convicted: {what}")
                self.evidence.append({"dealer": dealer, "holder": holder, "convicted": culprit, "why": what,
                                      "share": bytes(blob).hex(), "opened_key": bytes(opened[holder]).hex(),
                                      "digest": bytes(digest).hex(), "complaint_signature": bytes(signature).hex(),
                                      "holder_signing_key": self.signing[holder].hex()})
        self._settle()

    def _settle(self) -> None:
        """The participants who mask: checked their shares, not dropped, not convicted. SecAggError below t."""
        self.final = sorted(v for v in self.delivered if v not in self.dropped)
        self._check_count(self.final, "deliver")

    def attach(self, message: Message) -> Message | None:
        """The training message of a final participant with the participants' keys (the nodes it masks
        with); None for a node that left the round."""
        node = int(message.metadata.dst_node_id)
        if self.final is None or node not in self.final:
            return None
        content = {**self._header(), **self._keys_record(self.final)}
        message.content[RECORD] = to_config(content)
        return message

    def check_upload(self, record: ArrayRecord) -> np.ndarray:
        """A masked upload's residues (uint64, the layout's keys in order), its declared layout,
        dtype and byte length checked before it is read."""
        if set(record) != set(self.layout):
            extra, missing = sorted(set(record) - set(self.layout))[:3], sorted(set(self.layout) - set(record))[:3]
            raise SecAggError(f"wrong key set (unexpected {extra}, missing {missing})")
        dtype = self.fixed.dtype
        parts = []
        for key, shape in self.layout.items():
            array = record[key]
            if array.stype != STYPE or array.dtype != dtype.name or tuple(array.shape) != shape:
                raise SecAggError(f"tensor '{key}' must be {STYPE} {dtype.name} of shape {shape}, got "
                                  f"{array.stype} {array.dtype} {tuple(array.shape)}")
            want = int(np.prod(shape)) * dtype.itemsize
            if len(array.data) != want:
                raise SecAggError(f"tensor '{key}' carries {len(array.data)} bytes, expected {want}")
            values = np.frombuffer(array.data, dtype=dtype).astype(np.uint64)
            if values.size and int(values.max()) >= self.fixed.modulus:
                raise SecAggError(f"tensor '{key}' holds values outside the modulus 2^{self.fixed.modulus_bits}")
            parts.append(values)
        return np.concatenate(parts) if parts else np.zeros(0, np.uint64)

    def upload(self, node: int, residues: np.ndarray) -> None:
        self.masked[int(node)] = residues

    def unmask_messages(self) -> list[Message]:
        """Stage 4's messages to the uploaders. SecAggError below the threshold."""
        uploaded = sorted(self.masked)
        self._check_count(uploaded, "upload")
        dropped = [v for v in self.participants if v not in self.masked]
        content = {**self._header(), "uploaded": join_ids(uploaded), "dropped": join_ids(dropped)}
        return [Message(RecordDict({RECORD: to_config(content)}), dst_node_id=v, message_type=UNMASK)
                for v in uploaded]

    def take_reveals(self, replies: Mapping[int, Message]) -> dict[str, np.ndarray]:
        """Stage 4's replies -> the sum of the uploaders' values per key (float64, decoded). A holder
        whose shares do not match their dealers' digests, or carry another holder's index, is dropped
        with the reason (:func:`strategies.secagg.unmask`); SecAggCheat names a dealer whose
        verified shares do not give its committed secret."""
        revealed = {}
        for node, msg in replies.items():
            if int(node) not in self.masked:
                continue
            try:
                record = secagg_record(msg)
                owners, kinds = node_list(record, "owners"), record.get("kinds", "")
                indices, blob = node_list(record, "indices"), record.get("shares", b"")
                if not (isinstance(kinds, str) and isinstance(blob, bytes)
                        and len(owners) == len(kinds) == len(indices)):
                    raise SecAggError("owners, kinds, indices and shares must describe as many shares")
                mine, start = {}, 0
                for owner, kind, index in zip(owners, kinds, indices):
                    wanted = "b" if owner in self.masked else "s"
                    size = secagg.SEED_BYTES if wanted == "b" else secagg.KEY_BYTES
                    if kind != wanted or len(blob) < start + size:
                        raise SecAggError(f"a malformed share of node {owner}")
                    mine[owner] = (kind, index, blob[start:start + size])
                    start += size
                if start != len(blob):
                    raise SecAggError("the shares carry extra bytes")
                revealed[int(node)] = mine
            except SecAggError as err:
                self._drop(node, f"unmask: {err}")
        liars: dict[int, str] = {}
        try:
            total = secagg.unmask(self.masked, {v: self.public[v] for v in self.participants}, self.commitments,
                                  revealed, self.fixed, self.threshold, self.round, self.digests,
                                  positions=self.dealt_to, liars=liars)
        finally:
            for node, why in sorted(liars.items()):
                self._drop(node, f"unmask: {why}")
        total, self.outside = self.fixed.clamp_sum(total, len(self.masked))
        values = self.fixed.decode_sum(total, len(self.masked))
        out, start = {}, 0
        for key, shape in self.layout.items():
            size = int(np.prod(shape))
            out[key] = values[start:start + size].reshape(shape)
            start += size
        return out
