"""Secure aggregation as Flower messages, a node's side: one function per stage (``fedapps.secure``
answers each message type with it). The server's side and the wire formats are
:mod:`strategies.secure_round`; the protocol is :mod:`strategies.secagg`.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

from strategies import secagg, secagg_primitives
from strategies.secagg import ClientSecrets, FixedPoint, SecAggError
from strategies.secure_round import (RECORD, STYPE, SecureSettings, join_ids, node_list, secagg_record, split_fixed,
                                     to_config)

_STATE = "postcard.secagg"  # context.state ConfigRecord: this node's secrets of the current round


def _secrets(state: RecordDict, server_round: int) -> tuple[ClientSecrets, ConfigRecord]:
    if _STATE not in state.config_records or state.config_records[_STATE].get("round") != server_round:
        raise SecAggError(f"this node holds no secure-aggregation secrets for round {server_round} "
                          "(it missed an earlier stage)")
    kept = state.config_records[_STATE]
    return ClientSecrets(kept["c"], kept["s"], kept.get("seed", b""), kept.get("g", b""), kept.get("eph", b"")), kept


def _keys_of(record: ConfigRecord) -> dict[int, tuple[bytes, bytes]]:
    nodes = node_list(record, "nodes")
    c_keys = split_fixed(record, "c-keys", secagg.KEY_BYTES)
    s_keys = split_fixed(record, "s-keys", secagg.KEY_BYTES)
    if not len(nodes) == len(c_keys) == len(s_keys) or len(set(nodes)) != len(nodes):
        raise SecAggError("the participants' list is malformed")
    return {v: (c, s) for v, c, s in zip(nodes, c_keys, s_keys)}


def _signing_of(record: ConfigRecord) -> dict[int, bytes]:
    nodes, keys = node_list(record, "nodes"), split_fixed(record, "g-keys", secagg.KEY_BYTES)
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
    server_round, _, _ = _round_of(secagg_record(msg), settings)
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
    record = secagg_record(msg)
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
    kept["threshold"], kept["dealt"] = threshold, join_ids(sorted(public))
    kept["dealt-keys"] = b"".join(public[v][0] + public[v][1] for v in sorted(public))
    kept["dealt-g"] = b"".join(signing[v] for v in sorted(public))
    kept["sent"] = b"".join(secagg_primitives.share_hash(out[v]) if v in out else bytes(secagg_primitives.HASH_BYTES) for v in sorted(public))
    to = sorted(out)
    return RecordDict({RECORD: to_config({"commitment": commitment, "to": join_ids(to),
                                             "shares": b"".join(out[v] for v in to),
                                             "digests": b"".join(digests[v] for v in sorted(public))})})


def _dealt(kept: ConfigRecord) -> tuple[int, dict[int, tuple[bytes, bytes]]]:
    """The threshold and the participants' keys this node dealt its shares under (stage 2)."""
    if "threshold" not in kept:
        raise SecAggError("this node dealt no shares in this round")
    nodes = node_list(kept, "dealt")
    pairs = split_fixed(kept, "dealt-keys", 2 * secagg.KEY_BYTES)
    return int(kept["threshold"]), {v: (p[:secagg.KEY_BYTES], p[secagg.KEY_BYTES:]) for v, p in zip(nodes, pairs)}


def _dealt_signing(kept: ConfigRecord) -> dict[int, bytes]:
    return dict(zip(node_list(kept, "dealt"), split_fixed(kept, "dealt-g", secagg.KEY_BYTES)))


def client_deliver(me: int, msg: Message, state: RecordDict, settings: SecureSettings) -> RecordDict:
    """The deliver stage on a node: the shares dealt to it checked against their dealers' digests before
    anyone masks; each bad one a complaint signed with this node's key (the share's hash, so only a share
    this node was really sent can be named). The shares are kept for the unmask stage."""
    record = secagg_record(msg)
    server_round, _, _ = _round_of(record, settings)
    secrets, kept = _secrets(state, server_round)
    _, dealt = _dealt(kept)
    public = _keys_of(record)
    if public != dealt:
        raise SecAggError("the participants' keys are not those this node dealt its shares to")
    senders, blobs = node_list(record, "from"), split_fixed(record, "shares", secagg.SHARE_BLOB)
    digests = split_fixed(record, "digests", secagg.DIGEST_BYTES)
    if not len(senders) == len(blobs) == len(digests) or not set(senders) <= set(public) - {me}:
        raise SecAggError("the relayed shares are malformed")
    accused, hashes, signatures = [], [], []
    for sender, blob, digest in zip(senders, blobs, digests):
        if secagg.share_problem(me, secrets, sender, public, blob, server_round, digest) is not None:
            blob_hash = secagg_primitives.share_hash(blob)
            accused.append(sender)
            hashes.append(blob_hash)
            signatures.append(secrets.sign(secagg_primitives.complaint_message(server_round, sender, me, blob_hash)))
    for key in ("from", "shares", "digests"):  # kept for the unmask stage
        if key in record:
            kept[key] = record[key]
    return RecordDict({RECORD: to_config({"accused": join_ids(accused), "hashes": b"".join(hashes),
                                        "signatures": b"".join(signatures)})})


def client_open(me: int, msg: Message, state: RecordDict, settings: SecureSettings) -> RecordDict:
    """The open stage on an accused dealer: for each complaint signed by its holder about a share this node
    really sent (its hash), the ephemeral key of that one share — what a judge needs to settle it, which
    reveals that share only (its holder has it already). A complaint it cannot verify is not opened."""
    record = secagg_record(msg)
    server_round, _, _ = _round_of(record, settings)
    secrets, kept = _secrets(state, server_round)
    signing = _dealt_signing(kept)
    sent = dict(zip(node_list(kept, "dealt"), split_fixed(kept, "sent", secagg_primitives.HASH_BYTES)))
    holders = node_list(record, "holders")
    hashes = split_fixed(record, "hashes", secagg_primitives.HASH_BYTES)
    signatures = split_fixed(record, "signatures", secagg_primitives.SIGNATURE_BYTES)
    if not len(holders) == len(hashes) == len(signatures):
        raise SecAggError("the complaints are malformed")
    opened, keys = [], []
    for holder, blob_hash, signature in zip(holders, hashes, signatures):
        if holder == me or sent.get(holder) != blob_hash or holder not in signing:
            continue  # not a share this node sent that holder
        if not secagg_primitives.verify_signature(signing[holder], signature, secagg_primitives.complaint_message(
                server_round, me, holder, blob_hash)):
            continue  # not that holder's complaint: opening would hand its share to whoever forged it
        opened.append(holder)
        keys.append(secagg.ephemeral_of(secrets.eph, server_round, holder))
    return RecordDict({RECORD: to_config({"holders": join_ids(opened), "ephemerals": b"".join(keys)})})


def client_mask(me: int, msg: Message, state: RecordDict, settings: SecureSettings,
                values: Mapping[str, np.ndarray], rng: np.random.Generator) -> tuple[ArrayRecord, float]:
    """Stage 3 on a node: its values (any keys; sorted order) masked with the final participants' pair
    masks, as ``postcard.secagg`` arrays, and the fraction of values clipped to ±clip."""
    record = secagg_record(msg)
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
    record = secagg_record(msg)
    server_round, _, _ = _round_of(record, settings)
    secrets, kept = _secrets(state, server_round)
    if not kept.get("uploaded"):
        raise SecAggError("this node did not upload in this round")
    threshold, _ = _dealt(kept)
    public = _keys_of(kept)
    senders = node_list(kept, "from")
    shares = dict(zip(senders, split_fixed(kept, "shares", secagg.SHARE_BLOB)))
    digests = dict(zip(senders, split_fixed(kept, "digests", secagg.DIGEST_BYTES)))
    shares[me] = kept["own-share"]
    revealed = secagg.reveal(me, secrets, shares, public, node_list(record, "uploaded"), node_list(record, "dropped"),
                             threshold, server_round, digests)
    del state[_STATE]  # the round's secrets are spent
    owners = sorted(revealed)
    return RecordDict({RECORD: to_config({"owners": join_ids(owners), "kinds": "".join(revealed[v][0] for v in owners),
                                             "indices": join_ids(revealed[v][1] for v in owners),
                                             "shares": b"".join(revealed[v][2] for v in owners)})})


