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
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

from strategies import codec, secagg
from strategies.secagg import ClientSecrets, FixedPoint, SecAggError

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
        return secagg.check_threshold(self.threshold if self.threshold is not None else secagg.default_threshold(n), n)

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


def _ids(nodes: Iterable[int]) -> str:
    return ",".join(str(int(v)) for v in nodes)


def _record(msg: Message) -> ConfigRecord:
    records = msg.content.config_records
    if RECORD not in records:
        raise SecAggError(f"no ConfigRecord '{RECORD}'")
    return records[RECORD]


def _config(values: dict) -> ConfigRecord:
    """A ConfigRecord of ``values`` without the empty ones (Flower's byte count refuses empty
    strings and lists): an absent key reads as empty."""
    return ConfigRecord({k: v for k, v in values.items() if not (isinstance(v, (str, bytes)) and not v)})


def _nodes(record: ConfigRecord, key: str) -> list[int]:
    """A comma-separated list of node ids (Flower's records refuse empty lists, so lists travel joined)."""
    text = record.get(key, "")
    if not isinstance(text, str) or not all(part.isdigit() for part in text.split(",") if text):
        raise SecAggError(f"'{key}' must be a list of node ids")
    return [int(part) for part in text.split(",")] if text else []


def _split(record: ConfigRecord, key: str, size: int) -> list[bytes]:
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
        return {"nodes": _ids(nodes), "c-keys": b"".join(self.public[v][0] for v in nodes),
                "s-keys": b"".join(self.public[v][1] for v in nodes),
                "g-keys": b"".join(self.signing[v] for v in nodes)}

    def keys_messages(self) -> list[Message]:
        return [Message(RecordDict({RECORD: _config(self._header())}), dst_node_id=v, message_type=KEYS)
                for v in self.sampled]

    def take_keys(self, replies: Mapping[int, Message]) -> list[Message]:
        """Stage 1's replies -> stage 2's messages. SecAggError below the threshold."""
        for node, msg in replies.items():
            try:
                record = _record(msg)
                keys = (record.get("c-key"), record.get("s-key"))
                for name, key in zip(("c", "s"), keys):  # a low-order key would break every honest agreement
                    secagg.check_public_key(key, f"its {name} key")
                signing = secagg.check_signing_key(record.get("g-key"), "its g key")
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
        return [Message(RecordDict({RECORD: _config(content)}), dst_node_id=v, message_type=SHARES)
                for v in nodes]

    def take_shares(self, replies: Mapping[int, Message]) -> None:
        """Stage 2's replies: commitments and encrypted shares, to relay with the training messages."""
        advertised = set(self.public)
        for node, msg in replies.items():
            try:
                record = _record(msg)
                commitment = record.get("commitment")
                if not isinstance(commitment, bytes) or len(commitment) != 32:
                    raise SecAggError("its commitment must be 32 bytes")
                to, blobs = _nodes(record, "to"), _split(record, "shares", secagg.SHARE_BLOB)
                if sorted(to) != sorted(advertised - {node}) or len(blobs) != len(to):
                    raise SecAggError("it must send one share to every other participant")
                digests = _split(record, "digests", secagg.DIGEST_BYTES)
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
            content = {**self._header(), **self._keys_record(nodes), "from": _ids(senders),
                       "shares": b"".join(mail[v] for v in senders),
                       "digests": b"".join(self.digests[v][node] for v in senders)}
            out.append(Message(RecordDict({RECORD: _config(content)}), dst_node_id=node, message_type=DELIVER))
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
                record = _record(msg)
                accused = _nodes(record, "accused")
                hashes = _split(record, "hashes", secagg.HASH_BYTES)
                signatures = _split(record, "signatures", secagg.SIGNATURE_BYTES)
                if not len(accused) == len(hashes) == len(signatures) or len(set(accused)) != len(accused):
                    raise SecAggError("accused, hashes and signatures must describe as many complaints")
                mail = self.mail.get(node, {})
                for dealer, blob_hash, signature in zip(accused, hashes, signatures):
                    if dealer not in mail or secagg.share_hash(mail[dealer]) != blob_hash:
                        raise SecAggError(f"it complained about a share of node {dealer} it was not sent")
                    if not secagg.verify_signature(self.signing[node], signature, secagg.complaint_message(
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
            content = {**self._header(), "holders": _ids(holders),
                       "hashes": b"".join(x for _, x, _ in self.complaints[dealer]),
                       "signatures": b"".join(g for _, _, g in self.complaints[dealer])}
            out.append(Message(RecordDict({RECORD: _config(content)}), dst_node_id=dealer, message_type=OPEN))
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
                record = _record(msg)
                holders, keys = _nodes(record, "holders"), _split(record, "ephemerals", secagg.KEY_BYTES)
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
        message.content[RECORD] = _config(content)
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
        content = {**self._header(), "uploaded": _ids(uploaded), "dropped": _ids(dropped)}
        return [Message(RecordDict({RECORD: _config(content)}), dst_node_id=v, message_type=UNMASK)
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
                record = _record(msg)
                owners, kinds = _nodes(record, "owners"), record.get("kinds", "")
                indices, blob = _nodes(record, "indices"), record.get("shares", b"")
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


# ---------------------------------------------------------------------- client
_STATE = "postcard.secagg"  # context.state ConfigRecord: this node's secrets of the current round


def _secrets(state: RecordDict, server_round: int) -> tuple[ClientSecrets, ConfigRecord]:
    if _STATE not in state.config_records or state.config_records[_STATE].get("round") != server_round:
        raise SecAggError(f"this node holds no secure-aggregation secrets for round {server_round} "
                          "(it missed an earlier stage)")
    kept = state.config_records[_STATE]
    return ClientSecrets(kept["c"], kept["s"], kept.get("seed", b""), kept.get("g", b""), kept.get("eph", b"")), kept


def _keys_of(record: ConfigRecord) -> dict[int, tuple[bytes, bytes]]:
    nodes = _nodes(record, "nodes")
    c_keys = _split(record, "c-keys", secagg.KEY_BYTES)
    s_keys = _split(record, "s-keys", secagg.KEY_BYTES)
    if not len(nodes) == len(c_keys) == len(s_keys) or len(set(nodes)) != len(nodes):
        raise SecAggError("the participants' list is malformed")
    return {v: (c, s) for v, c, s in zip(nodes, c_keys, s_keys)}


def _signing_of(record: ConfigRecord) -> dict[int, bytes]:
    nodes, keys = _nodes(record, "nodes"), _split(record, "g-keys", secagg.KEY_BYTES)
    if len(nodes) != len(keys):
        raise SecAggError("the participants' signing keys are malformed")
    return dict(zip(nodes, keys))


def _round_of(record: ConfigRecord, settings: SecureSettings) -> tuple[int, FixedPoint, int]:
    server_round, n = record.get("round"), record.get("n")
    if not isinstance(server_round, int) or not isinstance(n, int):
        raise SecAggError("the message names no round or client count")
    return server_round, settings.fixed_point(n), settings.threshold_for(n)


def client_keys(msg: Message, state: RecordDict, settings: SecureSettings) -> RecordDict:
    """Stage 1 on a node: new secrets for this round (kept in ``state``), the public keys as the reply."""
    server_round, _, _ = _round_of(_record(msg), settings)
    secrets = ClientSecrets.new()
    state[_STATE] = ConfigRecord({"round": server_round, "c": secrets.c_private, "s": secrets.s_private,
                                  "g": secrets.g_private})
    c_key, s_key = secrets.public_keys()
    return RecordDict({RECORD: ConfigRecord({"c-key": c_key, "s-key": s_key, "g-key": secrets.signing_key()})})


def client_shares(me: int, msg: Message, state: RecordDict, settings: SecureSettings) -> RecordDict:
    """Stage 2 on a node: its Shamir shares, encrypted to each other participant, and the digests
    of all of them. The node derives the threshold from the participants' list it is given (a
    majority of them, or the run's own threshold), checks that the message's ``n`` is that list's
    length, and that the server asks for the run's own settings (threshold, bits, clip), not weaker ones."""
    record = _record(msg)
    server_round, fixed, _ = _round_of(record, settings)
    public = _keys_of(record)
    if record.get("n") != len(public):
        raise SecAggError(f"the server says n = {record.get('n')} but advertises {len(public)} participants")
    threshold = settings.threshold_for(len(public))
    if (record.get("threshold"), record.get("bits"), record.get("clip")) != (threshold, fixed.bits, fixed.clip):
        raise SecAggError(f"the server asks for threshold {record.get('threshold')}, {record.get('bits')} bits, "
                          f"clip {record.get('clip')}; this run's settings give {threshold}, {fixed.bits}, "
                          f"{fixed.clip}")
    signing = _signing_of(record)
    if set(signing) != set(public):
        raise SecAggError("the participants' signing keys do not match their list")
    secrets, kept = _secrets(state, server_round)
    commitment, out, digests = secagg.make_shares(me, secrets, public, threshold, server_round)
    kept["seed"], kept["eph"] = secrets.seed, secrets.eph
    kept["own-share"] = out.pop(me)
    kept["threshold"], kept["dealt"] = threshold, _ids(sorted(public))
    kept["dealt-keys"] = b"".join(public[v][0] + public[v][1] for v in sorted(public))
    kept["dealt-g"] = b"".join(signing[v] for v in sorted(public))
    kept["sent"] = b"".join(secagg.share_hash(out[v]) if v in out else bytes(secagg.HASH_BYTES) for v in sorted(public))
    to = sorted(out)
    return RecordDict({RECORD: _config({"commitment": commitment, "to": _ids(to),
                                             "shares": b"".join(out[v] for v in to),
                                             "digests": b"".join(digests[v] for v in sorted(public))})})


def _dealt(kept: ConfigRecord) -> tuple[int, dict[int, tuple[bytes, bytes]]]:
    """The threshold and the participants' keys this node dealt its shares under (stage 2)."""
    if "threshold" not in kept:
        raise SecAggError("this node dealt no shares in this round")
    nodes = _nodes(kept, "dealt")
    pairs = _split(kept, "dealt-keys", 2 * secagg.KEY_BYTES)
    return int(kept["threshold"]), {v: (p[:secagg.KEY_BYTES], p[secagg.KEY_BYTES:]) for v, p in zip(nodes, pairs)}


def _dealt_signing(kept: ConfigRecord) -> dict[int, bytes]:
    return dict(zip(_nodes(kept, "dealt"), _split(kept, "dealt-g", secagg.KEY_BYTES)))


def client_deliver(me: int, msg: Message, state: RecordDict, settings: SecureSettings) -> RecordDict:
    """The deliver stage on a node: the shares dealt to it checked against their dealers' digests before
    anyone masks; each bad one a complaint signed with this node's key (the share's hash, so only a share
    this node was really sent can be named). The shares are kept for the unmask stage."""
    record = _record(msg)
    server_round, _, _ = _round_of(record, settings)
    secrets, kept = _secrets(state, server_round)
    _, dealt = _dealt(kept)
    public = _keys_of(record)
    if public != dealt:
        raise SecAggError("the participants' keys are not those this node dealt its shares to")
    senders, blobs = _nodes(record, "from"), _split(record, "shares", secagg.SHARE_BLOB)
    digests = _split(record, "digests", secagg.DIGEST_BYTES)
    if not len(senders) == len(blobs) == len(digests) or not set(senders) <= set(public) - {me}:
        raise SecAggError("the relayed shares are malformed")
    accused, hashes, signatures = [], [], []
    for sender, blob, digest in zip(senders, blobs, digests):
        if secagg.share_problem(me, secrets, sender, public, blob, server_round, digest) is not None:
            blob_hash = secagg.share_hash(blob)
            accused.append(sender)
            hashes.append(blob_hash)
            signatures.append(secrets.sign(secagg.complaint_message(server_round, sender, me, blob_hash)))
    for key in ("from", "shares", "digests"):  # kept for the unmask stage
        if key in record:
            kept[key] = record[key]
    return RecordDict({RECORD: _config({"accused": _ids(accused), "hashes": b"".join(hashes),
                                        "signatures": b"".join(signatures)})})


def client_open(me: int, msg: Message, state: RecordDict, settings: SecureSettings) -> RecordDict:
    """The open stage on an accused dealer: for each complaint signed by its holder about a share this node
    really sent (its hash), the ephemeral key of that one share — what a judge needs to settle it, which
    reveals that share only (its holder has it already). A complaint it cannot verify is not opened."""
    record = _record(msg)
    server_round, _, _ = _round_of(record, settings)
    secrets, kept = _secrets(state, server_round)
    signing = _dealt_signing(kept)
    sent = dict(zip(_nodes(kept, "dealt"), _split(kept, "sent", secagg.HASH_BYTES)))
    holders = _nodes(record, "holders")
    hashes = _split(record, "hashes", secagg.HASH_BYTES)
    signatures = _split(record, "signatures", secagg.SIGNATURE_BYTES)
    if not len(holders) == len(hashes) == len(signatures):
        raise SecAggError("the complaints are malformed")
    opened, keys = [], []
    for holder, blob_hash, signature in zip(holders, hashes, signatures):
        if holder == me or sent.get(holder) != blob_hash or holder not in signing:
            continue  # not a share this node sent that holder
        if not secagg.verify_signature(signing[holder], signature, secagg.complaint_message(
                server_round, me, holder, blob_hash)):
            continue  # not that holder's complaint: opening would hand its share to whoever forged it
        opened.append(holder)
        keys.append(secagg.ephemeral_of(secrets.eph, server_round, holder))
    return RecordDict({RECORD: _config({"holders": _ids(opened), "ephemerals": b"".join(keys)})})


def client_mask(me: int, msg: Message, state: RecordDict, settings: SecureSettings,
                values: Mapping[str, np.ndarray], rng: np.random.Generator) -> tuple[ArrayRecord, float]:
    """Stage 3 on a node: its values (any keys; sorted order) masked with the final participants' pair
    masks, as ``postcard.secagg`` arrays, and the fraction of values clipped to ±clip."""
    record = _record(msg)
    server_round, _, _ = _round_of(record, settings)
    secrets, kept = _secrets(state, server_round)
    threshold, dealt = _dealt(kept)
    fixed = settings.fixed_point(len(dealt))
    public = _keys_of(record)
    if me not in public or len(public) < threshold:
        raise SecAggError(f"the round's {len(public)} participants are fewer than the threshold {threshold}, "
                          "or this node is not among them")
    if any(dealt.get(v) != keys for v, keys in public.items()):
        raise SecAggError("the participants' keys are not those this node dealt its shares to")
    if "from" not in kept and len(dealt) > 1:
        raise SecAggError("this node checked no shares in this round (it missed the deliver stage)")
    kept["uploaded"] = True
    for key in ("nodes", "c-keys", "s-keys"):  # kept for stage 4
        if key in record:
            kept[key] = record[key]
    keys = sorted(values)
    flat = np.concatenate([np.asarray(values[k], np.float64).ravel() for k in keys]) if keys else np.zeros(0)
    levels, clipped = fixed.encode(flat, rng)
    masked = secagg.mask(me, secrets, public, levels, fixed, server_round)
    out, start = ArrayRecord(), 0
    for key in keys:
        shape = tuple(int(s) for s in np.shape(values[key]))
        size = int(np.prod(shape))
        out[key] = Array(dtype=fixed.dtype.name, shape=shape, stype=STYPE, data=masked[start:start + size].tobytes())
        start += size
    return out, clipped / max(1, flat.size)


def client_unmask(me: int, msg: Message, state: RecordDict, settings: SecureSettings) -> RecordDict:
    """Stage 4 on a node: its shares of the uploaders' seeds and of the dropped nodes' mask keys."""
    record = _record(msg)
    server_round, _, _ = _round_of(record, settings)
    secrets, kept = _secrets(state, server_round)
    if not kept.get("uploaded"):
        raise SecAggError("this node did not upload in this round")
    threshold, _ = _dealt(kept)
    public = _keys_of(kept)
    senders = _nodes(kept, "from")
    shares = dict(zip(senders, _split(kept, "shares", secagg.SHARE_BLOB)))
    digests = dict(zip(senders, _split(kept, "digests", secagg.DIGEST_BYTES)))
    shares[me] = kept["own-share"]
    revealed = secagg.reveal(me, secrets, shares, public, _nodes(record, "uploaded"), _nodes(record, "dropped"),
                             threshold, server_round, digests)
    del state[_STATE]  # the round's secrets are spent
    owners = sorted(revealed)
    return RecordDict({RECORD: _config({"owners": _ids(owners), "kinds": "".join(revealed[v][0] for v in owners),
                                             "indices": _ids(revealed[v][1] for v in owners),
                                             "shares": b"".join(revealed[v][2] for v in owners)})})


# ---------------------------------------------------------------------- both ends in one process
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
