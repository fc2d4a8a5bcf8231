"""Secure aggregation for Postcard's payloads: the server learns only the sum of the clients' values.

Pairwise masking with dropout recovery, as in Bonawitz et al. (CCS 2017), over the complete
graph of a round's clients (SecAgg+'s sparser graph is not needed at Postcard's client
counts). Every primitive is a maintained library's: X25519 key agreement, HKDF-SHA256,
ChaCha20 as the mask generator and ChaCha20-Poly1305 for the shares in transit
(``cryptography``), Shamir's secret sharing of 16-byte secrets over GF(2^128)
(``pycryptodome``). NumPy and these two only; no model code.

One round, with ``n`` clients and threshold ``t``:

1. *keys*: each client makes two X25519 key pairs, ``c`` (its shares' holders' key) and ``s`` (to
   agree on masks), and an Ed25519 key ``g`` (signs its complaints), and sends the public keys;
   the server relays the list to everyone.
2. *shares*: each client draws a self-mask seed ``b`` (16 bytes), splits ``b`` and its ``s``
   private key (2 × 16 bytes) into ``n`` Shamir shares with threshold ``t``, and sends share
   ``i`` to the client of index ``i``, encrypted under a fresh ephemeral X25519 key of its own for
   that holder (:func:`ephemeral_of`; the public half travels with the share) agreed with the
   holder's ``c`` key; the server only relays ciphertexts (it also keeps a SHA-256 commitment to
   ``b``, to check a reconstruction, and the SHA-256 digest of every share dealt,
   :func:`share_digest`, relayed to each holder with its shares). Every public key is checked
   first: canonical and not of low order.
3. *deliver*: the server relays each holder's shares and digests; the holder checks every one
   (:func:`share_problem`) before anyone masks, and signs a complaint (:func:`complaint_message`)
   about each bad one; an accused dealer opens that share's ephemeral key — only for a complaint
   its holder signed about a share it really sent, so that it reveals nothing its holder does not
   have — and :func:`judge` convicts the dealer or the lying holder, with evidence anyone can
   check. The participants left are the only ones anyone masks with.
4. *masked input*: each client quantises its values to ``bits``-bit integers over a
   server-announced range (:class:`FixedPoint`, stochastic rounding: unbiased) and adds, mod
   ``2^k``, the self mask ``PRG(b)`` and, for every other final participant ``v``, ``±PRG(s_uv)``
   (``+`` when ``u < v``): pairwise masks cancel in the sum.
5. *unmask*: the server names who uploaded (``U3``) and who did not; each surviving client
   returns its shares of ``b`` of the uploaders and of the ``s`` key of the others (never
   both of one client), only shares that open and match their dealer's digest. The server reads
   each share at its holder's own index and checks it against the digest: a holder that lies is
   named and set aside, and any ``t`` verified shares give the secret (no search). With them it
   removes the self masks and the dropped clients' pairwise masks: what is left is the sum, mod
   ``2^k``. A dealer whose verified shares do not give what it committed to is named
   (:class:`SecAggCheat`): its round cannot be unmasked, and the strategy excludes it from the run.
   ``t`` is a majority of the advertised participants (``2t > n``).

``k = bits + ⌈log2 n⌉``, so the sum of ``n`` honest values never wraps: int4 values sum in one
byte for up to 16 clients. Whatever a client sends, its contribution is one value mod ``2^k``
per coordinate, and the server brings the sum into what the uploaders could honestly send
(:meth:`FixedPoint.clamp_sum`): the decoded mean stays inside ``[-clip, clip]``. Within that, one
client can still move a coordinate across the whole range (by wrapping its residue around the
modulus), not only by its ``1/m`` share: bounding that needs a per-client range proof (RoFL, EIFFeL),
which this protocol does not have (docs/secure-aggregation.md, "The bound").
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from Crypto.Protocol.SecretSharing import Shamir
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from strategies.secagg_primitives import (FixedPoint, KEY_BYTES, NONCE_BYTES, SEED_BYTES, SHARE_BLOB, SHARE_STRUCT, SecAggError, check_key, check_threshold, commitment, ephemeral_of, pair_mask_key, prg, public_of, raw_private, self_mask_key, share_key)


# ---------------------------------------------------------------------- client side
@dataclass
class ClientSecrets:
    """What a client keeps between the stages of one round (never sent)."""

    c_private: bytes
    s_private: bytes
    seed: bytes = b""
    g_private: bytes = b""  # Ed25519: signs this client's complaints about a dealer's share
    eph: bytes = b""  # the round secret its shares' ephemeral keys derive from (ephemeral_of)

    @classmethod
    def new(cls) -> ClientSecrets:
        g = Ed25519PrivateKey.generate().private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                                       serialization.NoEncryption())
        return cls(raw_private(X25519PrivateKey.generate()), raw_private(X25519PrivateKey.generate()), g_private=g)

    def public_keys(self) -> tuple[bytes, bytes]:
        return public_of(self.c_private), public_of(self.s_private)

    def signing_key(self) -> bytes:
        return Ed25519PrivateKey.from_private_bytes(self.g_private).public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    def sign(self, message: bytes) -> bytes:
        return Ed25519PrivateKey.from_private_bytes(self.g_private).sign(message)


def participants_of(public_keys: Mapping[int, tuple[bytes, bytes]]) -> list[int]:
    """The round's clients in share-index order (index = position + 1)."""
    return sorted(int(v) for v in public_keys)


def share_digest(kind: str, owner: int, holder: int, round_id: int, share: bytes) -> bytes:
    """What a dealer publishes of each share it deals (through the server): the server checks a
    revealed share against it, so a holder that lies about its share is caught exactly, and a
    holder checks the share it received, so a dealer cannot frame an honest holder. A share is
    16 or 32 uniformly random bytes: its hash reveals nothing usable of it."""
    return hashlib.sha256(b"postcard-secagg share %s %d %d %d " % (kind.encode(), owner, holder, round_id)
                          + bytes(share)).digest()


DIGEST_BYTES = 2 * 32  # per (dealer, holder): the digest of the seed share, then of the mask-key share


def make_shares(me: int, secrets: ClientSecrets, public_keys: Mapping[int, tuple[bytes, bytes]], threshold: int,
                round_id: int) -> tuple[bytes, dict[int, bytes], dict[int, bytes]]:
    """Stage 2 on a client: (commitment to its new self-mask seed, {other client: encrypted share},
    {every client: the digests of its two shares}). Every relayed key is checked first: a key no
    honest client could hold (low order, non-canonical) is the server's fault, and this client
    refuses the round rather than agree on a known secret."""
    nodes = participants_of(public_keys)
    if me not in nodes:
        raise SecAggError(f"node {me} is not among the round's participants")
    threshold = check_threshold(threshold, len(nodes))
    for node in nodes:
        check_key(public_keys[node][0], f"node {node}'s c key")
        check_key(public_keys[node][1], f"node {node}'s s key")
    if public_keys[me] != secrets.public_keys():
        raise SecAggError("the relayed public keys of this node are not its own")
    if len({public_keys[v][1] for v in nodes}) != len(nodes):
        raise SecAggError("two participants advertise the same key")
    secrets.seed = os.urandom(SEED_BYTES)
    secrets.eph = os.urandom(KEY_BYTES)
    n = len(nodes)
    b_shares = Shamir.split(threshold, n, secrets.seed)
    s_low = Shamir.split(threshold, n, secrets.s_private[:16])
    s_high = Shamir.split(threshold, n, secrets.s_private[16:])
    out, digests = {}, {}
    for position, node in enumerate(nodes):
        index = position + 1
        b_share, s_share = b_shares[position][1], s_low[position][1] + s_high[position][1]
        digests[node] = (share_digest("b", me, node, round_id, b_share)
                         + share_digest("s", me, node, round_id, s_share))
        plain = SHARE_STRUCT.pack(me, node, round_id, index, b_share, s_low[position][1], s_high[position][1])
        if node == me:
            out[node] = plain  # kept by its owner, unencrypted (it never leaves the client)
            continue
        nonce, e_raw = os.urandom(NONCE_BYTES), ephemeral_of(secrets.eph, round_id, node)
        e_public = public_of(e_raw)
        aad = struct.pack("<QQI", me, node, round_id) + e_public
        out[node] = e_public + nonce + ChaCha20Poly1305(share_key(e_raw, public_keys[node][0], round_id)).encrypt(
            nonce, plain, aad)
    return commitment(secrets.seed), out, digests


def mask(me: int, secrets: ClientSecrets, public_keys: Mapping[int, tuple[bytes, bytes]], levels: np.ndarray,
         fixed: FixedPoint, round_id: int) -> np.ndarray:
    """Stage 3 on a client: its levels plus its self mask and pairwise masks, mod ``2^k`` (wire dtype)."""
    if not secrets.seed:
        raise SecAggError("no self-mask seed: the shares stage did not run on this node")
    k, count = fixed.modulus_bits, int(np.size(levels))
    total = np.asarray(levels, np.uint64).ravel() + prg(self_mask_key(secrets.seed, round_id), count, k)
    for node in participants_of(public_keys):
        if node == me:
            continue
        pair = prg(pair_mask_key(secrets.s_private, public_keys[node][1], round_id), count, k)
        total = total + pair if me < node else total - pair  # uint64 wraps mod 2^64, a multiple of 2^k
    return (total & np.uint64(fixed.modulus - 1)).astype(fixed.dtype)


def open_share(me: int, secrets: ClientSecrets, owner: int, public_keys: Mapping[int, tuple[bytes, bytes]],
               blob: bytes, round_id: int) -> tuple[int, bytes, bytes]:
    """Decrypt the share ``owner`` sent this client: (index, b share, s key share (32 bytes))."""
    if owner == me:
        plain = bytes(blob)
    else:
        blob = bytes(blob)
        if len(blob) != SHARE_BLOB:
            raise SecAggError(f"the share from node {owner} has {len(blob)} bytes")
        e_public = check_key(blob[:KEY_BYTES], f"the ephemeral key of node {owner}'s share")
        plain = _decrypt(share_key(secrets.c_private, e_public, round_id), blob, owner, me, round_id)
        if plain is None:
            raise SecAggError(f"the share from node {owner} does not authenticate")
    return _read_plain(plain, owner, me, round_id)


def _decrypt(key: bytes, blob: bytes, owner: int, holder: int, round_id: int) -> bytes | None:
    """A share blob's plaintext under ``key``, or None when it does not authenticate."""
    e_public, rest = blob[:KEY_BYTES], blob[KEY_BYTES:]
    try:
        return ChaCha20Poly1305(key).decrypt(rest[:NONCE_BYTES], rest[NONCE_BYTES:],
                                             struct.pack("<QQI", owner, holder, round_id) + e_public)
    except InvalidTag:
        return None


def _read_plain(plain: bytes, owner: int, me: int, round_id: int) -> tuple[int, bytes, bytes]:
    if len(plain) != SHARE_STRUCT.size:
        raise SecAggError(f"the share from node {owner} has the wrong size")
    got_owner, holder, got_round, index, b_share, s_low, s_high = SHARE_STRUCT.unpack(plain)
    if (got_owner, holder, got_round) != (owner, me, round_id):
        raise SecAggError(f"the share from node {owner} is addressed to another node or round")
    return index, b_share, s_low + s_high


def reveal(me: int, secrets: ClientSecrets, shares: Mapping[int, bytes], public_keys, uploaded: Iterable[int],
           dropped: Iterable[int], threshold: int, round_id: int,
           digests: Mapping[int, bytes] | None = None) -> dict[int, tuple[str, int, bytes]]:
    """Stage 4 on a client: {owner: ("b" | "s", index, share)} — its share of each uploader's self-mask
    seed and of each dropped client's mask key, never both of one client.

    A share that does not open (forged, addressed elsewhere) or does not match the digest its
    dealer published (``digests``: {owner: :data:`DIGEST_BYTES`}) is left out: that dealer
    cheated this holder, and the server needs only ``threshold`` good shares."""
    uploaded, dropped = {int(v) for v in uploaded}, {int(v) for v in dropped}
    nodes = set(participants_of(public_keys))
    if uploaded & dropped:
        raise SecAggError(f"nodes {sorted(uploaded & dropped)[:5]} are named both uploaded and dropped")
    if not uploaded | dropped <= nodes:
        raise SecAggError("the unmask request names nodes outside the round")
    if me not in uploaded:
        raise SecAggError("this node is not among the uploaders")
    if len(uploaded) < threshold:
        raise SecAggError(f"only {len(uploaded)} clients uploaded, fewer than the threshold {threshold}")
    out = {}
    for owner in sorted(uploaded | dropped):
        if owner not in shares:
            continue  # a share that never arrived: the server needs only t of them
        try:
            index, b_share, s_share = open_share(me, secrets, owner, public_keys, shares[owner], round_id)
        except SecAggError:
            continue  # the dealer sent this holder garbage: it has no share of it to give
        kind, share = ("b", b_share) if owner in uploaded else ("s", s_share)
        if digests is not None and owner != me:
            digest = digests.get(owner, b"")
            at = 0 if kind == "b" else 32
            if digest[at:at + 32] != share_digest(kind, owner, me, round_id, share):
                continue  # not the share its dealer published: revealing it would only get this holder blamed
        out[owner] = (kind, index, share)
    return out


def share_problem(me: int, secrets: ClientSecrets, owner: int, public_keys, blob: bytes, round_id: int,
                  digest: bytes) -> str | None:
    """Why the share ``owner`` dealt this client is bad (it does not open, is addressed elsewhere, or either
    half is not what the dealer's published ``digest`` says), or None: what a holder checks as its shares
    arrive, before anyone masks (a bad one is a signed complaint, :func:`complaint_message`)."""
    try:
        _, b_share, s_share = open_share(me, secrets, owner, public_keys, blob, round_id)
    except SecAggError as err:
        return str(err)
    digest = bytes(digest or b"")
    if digest != share_digest("b", owner, me, round_id, b_share) + share_digest("s", owner, me, round_id, s_share):
        return f"the share from node {owner} is not the one its digest names"
    return None


def judge(dealer: int, holder: int, blob: bytes, e_private: bytes, holder_c_key: bytes, digest: bytes,
          round_id: int) -> str | None:
    """A complaint settled from what the dealer sent and opened: why the *dealer* cheated (its opened
    ephemeral key is not the one its share names, or under it the share does not open, is addressed
    elsewhere or does not match its digest), or None when the share is good — then the complaining
    holder lied. Anyone holding the relayed share, the dealer's digest and its opened key can check it."""
    blob = bytes(blob)
    if len(blob) != SHARE_BLOB or len(bytes(e_private)) != KEY_BYTES:
        return "its share or its opened key has the wrong size"
    if public_of(bytes(e_private)) != blob[:KEY_BYTES]:
        return "the key it opened is not the one its share was encrypted to"
    plain = _decrypt(share_key(bytes(e_private), holder_c_key, round_id), blob, dealer, holder, round_id)
    if plain is None:
        return f"its share to node {holder} does not open under the key it opened"
    try:
        _, b_share, s_share = _read_plain(plain, dealer, holder, round_id)
    except SecAggError as err:
        return str(err)
    if bytes(digest or b"") != (share_digest("b", dealer, holder, round_id, b_share)
                                + share_digest("s", dealer, holder, round_id, s_share)):
        return f"its share to node {holder} is not the one its published digest names"
    return None


# ---------------------------------------------------------------------- server side
class SecAggCheat(SecAggError):
    """A round that cannot be finished because of what named clients provably did (``culprits``:
    {node: why}); the evidence is the digests and shares the server holds."""

    def __init__(self, message: str, culprits: Mapping[int, str]):
        super().__init__(message)
        self.culprits = dict(culprits)


def _combine(pieces: list[tuple[int, bytes]], threshold: int) -> bytes:
    """A secret from the first ``threshold`` of verified shares. A secret longer than 16 bytes (a
    mask key) was shared 16 bytes at a time: each block is combined alone."""
    subset = sorted(pieces)[:threshold]
    size = len(subset[0][1])
    return b"".join(Shamir.combine([(i, share[at:at + 16]) for i, share in subset]) for at in range(0, size, 16))


def _consistent(pieces: list[tuple[int, bytes]], threshold: int, secret: bytes) -> bool:
    """Whether the last ``threshold`` verified shares give the same secret as the first: more than
    ``threshold`` shares of one dealer all lie on one polynomial only if it dealt honestly."""
    pieces = sorted(pieces)
    return len(pieces) <= threshold or _combine(pieces[-threshold:], threshold) == secret


def unmask(masked: Mapping[int, np.ndarray], public_keys: Mapping[int, tuple[bytes, bytes]],
           commitments: Mapping[int, bytes], revealed: Mapping[int, Mapping[int, tuple[str, int, bytes]]],
           fixed: FixedPoint, threshold: int, round_id: int, digests: Mapping[int, Mapping[int, bytes]], *,
           positions: Sequence[int] | None = None, liars: dict[int, str] | None = None) -> np.ndarray:
    """The sum of the uploaders' levels mod ``2^k`` (uint64), from their masked inputs and the
    survivors' revealed shares.

    Each revealed share is read at its holder's own index (its place in ``positions``, the nodes
    the shares were dealt to; default: ``public_keys``' order), whatever index the reply names (never
    checked: the dealer wrote it and the digest does not cover it),
    and checked against the digest its dealer published (``digests``: {dealer: {holder: 64
    bytes}}). A holder with any share that does not match is a liar: all its shares are set
    aside and it is added to ``liars`` ({node: why}). No search over subsets: any ``threshold``
    verified shares give the secret. SecAggError when fewer than ``threshold`` clients revealed
    or a secret has fewer than ``threshold`` verified shares; :class:`SecAggCheat` naming the
    dealer when its verified shares disagree or do not give the secret it committed to (evidence: its
    digests, its commitment and the shares). Too few verified shares of a secret is a SecAggError naming
    the holders that withheld theirs, never a ban."""
    uploaded = sorted(int(v) for v in masked)
    dropped = sorted(set(participants_of(public_keys)) - set(uploaded))
    order = list(positions) if positions is not None else participants_of(public_keys)
    index_of = {int(v): i + 1 for i, v in enumerate(order)}
    liars = liars if liars is not None else {}
    good: dict[int, dict[int, tuple[str, bytes]]] = {}
    for holder, shares in revealed.items():
        holder = int(holder)
        if holder not in index_of:
            liars[holder] = "it revealed shares but was dealt none"
            continue
        mine, bad = {}, None
        for owner, (kind, _index, share) in shares.items():
            # the index a reply names is not read: the dealer wrote it, and the digest does not cover it, so a
            # dealer could write a wrong one into authentic shares and have their honest holders called liars
            # (#62 finding 2); every share is read at its holder's own position
            digest = digests.get(int(owner), {}).get(holder, b"")
            at = 0 if kind == "b" else 32
            if digest[at:at + 32] != share_digest(kind, int(owner), holder, round_id, share):
                bad = f"its share of node {owner} is not the one node {owner} dealt it"
            if bad:
                break
            mine[int(owner)] = (kind, share)
        if bad:
            liars[holder] = bad
            continue
        good[holder] = mine
    if len(good) < threshold:
        raise SecAggError(f"{len(good)} clients revealed verified shares, fewer than the threshold {threshold}")
    k, modulus = fixed.modulus_bits, np.uint64(fixed.modulus - 1)
    count = int(np.size(next(iter(masked.values()))))
    total = np.zeros(count, np.uint64)
    for node in uploaded:
        total = total + np.asarray(masked[node], np.uint64).ravel()

    def secret_of(owner: int, kind: str, what: str, check) -> bytes:
        pieces = [(index_of[h], mine[owner][1]) for h, mine in good.items()
                  if owner in mine and mine[owner][0] == kind]
        if len(pieces) < threshold:
            # never a ban: a count of missing shares is no evidence (two colluders withholding their shares of an
            # honest node once got it banned, #62 finding 3); a dealer's bad shares are caught, with evidence,
            # when they arrive (share_problem, judge), before anyone masks
            withheld = sorted(h for h, mine in good.items() if owner not in mine)
            raise SecAggError(f"the {what} of node {owner} cannot be reconstructed: {len(pieces)} verified shares, "
                              f"fewer than the threshold {threshold}"
                              + (f" (withheld by nodes {', '.join(map(str, withheld[:8]))})" if withheld else ""))
        secret = _combine(pieces, threshold)
        if not (_consistent(pieces, threshold, secret) and check(secret)):
            why = f"its {len(pieces)} verified shares do not give the {what} it committed to"
            raise SecAggCheat(f"node {owner} cheated: {why}", {owner: why})
        return secret

    for owner in uploaded:
        seed = secret_of(owner, "b", "self-mask seed", lambda s, owner=owner: commitment(s) == commitments[owner])
        total = total - prg(self_mask_key(seed, round_id), count, k)
    for owner in dropped:
        key = secret_of(owner, "s", "mask key", lambda s, owner=owner: public_of(s) == public_keys[owner][1])
        for node in uploaded:  # node added +PRG(s_node,owner) when node < owner, else subtracted it
            pair = prg(pair_mask_key(key, public_keys[node][1], round_id), count, k)
            total = total - pair if node < owner else total + pair
    return total & modulus
