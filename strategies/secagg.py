"""Secure aggregation for Postcard's payloads: the server learns only the sum of the clients' values.

Pairwise masking with dropout recovery, as in Bonawitz et al. (CCS 2017), over the complete
graph of a round's clients (SecAgg+'s sparser graph is not needed at Postcard's client
counts). Every primitive is a maintained library's: X25519 key agreement, HKDF-SHA256,
ChaCha20 as the mask generator and ChaCha20-Poly1305 for the shares in transit
(``cryptography``), Shamir's secret sharing of 16-byte secrets over GF(2^128)
(``pycryptodome``). NumPy and these two only; no model code.

One round, with ``n`` clients and threshold ``t``:

1. *keys*: each client makes two X25519 key pairs, ``c`` (to encrypt shares) and ``s`` (to
   agree on masks), and sends both public keys; the server relays the list to everyone.
2. *shares*: each client draws a self-mask seed ``b`` (16 bytes), splits ``b`` and its ``s``
   private key (2 × 16 bytes) into ``n`` Shamir shares with threshold ``t``, and sends share
   ``i`` to the client of index ``i``, encrypted under their agreed ``c`` key; the server only
   relays ciphertexts (it also keeps a SHA-256 commitment to ``b``, to check a reconstruction).
3. *masked input*: each client quantises its values to ``bits``-bit integers over a
   server-announced range (:class:`FixedPoint`, stochastic rounding: unbiased) and adds, mod
   ``2^k``, the self mask ``PRG(b)`` and, for every other client ``v``, ``±PRG(s_uv)``
   (``+`` when ``u < v``): pairwise masks cancel in the sum.
4. *unmask*: the server names who uploaded (``U3``) and who did not; each surviving client
   returns its shares of ``b`` of the uploaders and of the ``s`` key of the others (never
   both of one client). With ``t`` shares each, the server removes the self masks and the
   dropped clients' pairwise masks: what is left is the sum, mod ``2^k``.

``k = bits + ⌈log2 n⌉``, so the sum of ``n`` honest values never wraps: int4 values sum in one
byte for up to 16 clients. Whatever a client sends, its contribution is one value mod ``2^k``
per coordinate: the decoded mean stays inside :meth:`FixedPoint.mean_bound`.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from Crypto.Protocol.SecretSharing import Shamir
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

KEY_BYTES = 32  # an X25519 key, either half
SEED_BYTES = 16  # a self-mask seed: one Shamir secret
MAX_CLIENTS = 255  # Shamir share indices are one byte
MAX_MODULUS_BITS = 32
_SHARE = struct.Struct("<QQIH16s16s16s")  # owner, holder, round, index, b share, s_sk share (2 halves)
_NONCE = 12
SHARE_BLOB = _NONCE + _SHARE.size + 16  # an encrypted share: nonce, ciphertext, Poly1305 tag


class SecAggError(ValueError):
    """A secure-aggregation message or round that cannot be used (says why)."""


# ---------------------------------------------------------------------- parameters and encoding
@dataclass(frozen=True)
class FixedPoint:
    """``bits``-bit integers over ``[-clip, clip]``: ``level = (x + clip) / step``, ``step = 2·clip /
    (2^bits − 1)``; sums of ``n`` levels live mod ``2^k``, ``k = bits + ⌈log2 n⌉``."""

    bits: int
    clip: float
    num_clients: int

    def __post_init__(self):
        if not 1 <= int(self.bits) <= 24:
            raise SecAggError(f"secure aggregation quantises to 1..24 bits per value, got {self.bits}")
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise SecAggError(f"the clipping range must be a positive number, got {self.clip}")
        if not 1 <= int(self.num_clients) <= MAX_CLIENTS:
            raise SecAggError(f"secure aggregation takes 1..{MAX_CLIENTS} clients a round, got {self.num_clients}")
        if self.modulus_bits > MAX_MODULUS_BITS:
            raise SecAggError(f"{self.bits} bits for {self.num_clients} clients need a {self.modulus_bits}-bit "
                              f"modulus, more than {MAX_MODULUS_BITS}")

    @property
    def levels(self) -> int:
        return (1 << int(self.bits)) - 1

    @property
    def step(self) -> float:
        return 2.0 * float(self.clip) / self.levels

    @property
    def modulus_bits(self) -> int:
        return int(self.bits) + max(0, math.ceil(math.log2(int(self.num_clients))))

    @property
    def modulus(self) -> int:
        return 1 << self.modulus_bits

    @property
    def dtype(self) -> np.dtype:
        """The narrowest unsigned integer that holds a value mod ``2^k`` (the wire's)."""
        return np.dtype("<u1" if self.modulus_bits <= 8 else "<u2" if self.modulus_bits <= 16 else "<u4")

    def encode(self, values: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, int]:
        """(levels as uint64, how many values were clipped): stochastic rounding, unbiased inside the range."""
        x = np.asarray(values, dtype=np.float64)
        if not np.all(np.isfinite(x)):
            raise SecAggError("cannot encode NaN or Inf")
        clipped = int(np.count_nonzero(np.abs(x) > self.clip))
        t = (np.clip(x, -self.clip, self.clip) + self.clip) / self.step
        q = np.floor(t + rng.random(t.shape))
        return np.clip(q, 0, self.levels).astype(np.uint64), clipped

    def decode_sum(self, total: np.ndarray, count: int) -> np.ndarray:
        """The sum of ``count`` clients' values from the sum of their levels (mod ``2^k``)."""
        return np.asarray(total, np.float64) * self.step - count * float(self.clip)

    def mean_bound(self, count: int) -> float:
        """The largest |mean| any ``count`` replies can decode to, hostile ones included: the sum is
        a residue in ``[0, 2^k)``."""
        return max(float(self.clip), (self.modulus - 1) * self.step / count - float(self.clip))


def default_threshold(n: int) -> int:
    """A majority of the round's clients (Bonawitz et al.'s honest-majority setting)."""
    return n // 2 + 1


def check_threshold(threshold: int, n: int) -> int:
    threshold = int(threshold)
    if not 2 <= threshold <= n:
        raise SecAggError(f"the threshold must be between 2 and the round's {n} clients, got {threshold}")
    return threshold


# ---------------------------------------------------------------------- primitives
def _kdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def _agree(private_raw: bytes, public_raw: bytes) -> bytes:
    return X25519PrivateKey.from_private_bytes(private_raw).exchange(X25519PublicKey.from_public_bytes(public_raw))


def _raw_private(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())


def _raw_public(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def public_of(private_raw: bytes) -> bytes:
    return _raw_public(X25519PrivateKey.from_private_bytes(private_raw))


def prg(key: bytes, count: int, modulus_bits: int) -> np.ndarray:
    """``count`` values uniform mod ``2^modulus_bits`` (uint64) from a 32-byte key: the ChaCha20
    keystream (zero nonce: each key is used for one mask) read as little-endian uint32."""
    stream = Cipher(algorithms.ChaCha20(key, b"\0" * 16), mode=None).encryptor().update(b"\0" * (4 * count))
    words = np.frombuffer(stream, dtype="<u4").astype(np.uint64)
    return words & np.uint64((1 << modulus_bits) - 1)


def self_mask_key(seed: bytes, round_id: int) -> bytes:
    return _kdf(seed, b"postcard-secagg self mask %d" % round_id)


def pair_mask_key(private_raw: bytes, public_raw: bytes, round_id: int) -> bytes:
    return _kdf(_agree(private_raw, public_raw), b"postcard-secagg pair mask %d" % round_id)


def _share_key(private_raw: bytes, public_raw: bytes, round_id: int) -> bytes:
    return _kdf(_agree(private_raw, public_raw), b"postcard-secagg shares %d" % round_id)


def commitment(seed: bytes) -> bytes:
    return hashlib.sha256(b"postcard-secagg seed" + seed).digest()


def _check_key(raw, what: str) -> bytes:
    if not isinstance(raw, (bytes, bytearray)) or len(raw) != KEY_BYTES:
        raise SecAggError(f"{what} must be {KEY_BYTES} bytes")
    return bytes(raw)


# ---------------------------------------------------------------------- client side
@dataclass
class ClientSecrets:
    """What a client keeps between the stages of one round (never sent)."""

    c_private: bytes
    s_private: bytes
    seed: bytes = b""

    @classmethod
    def new(cls) -> ClientSecrets:
        return cls(_raw_private(X25519PrivateKey.generate()), _raw_private(X25519PrivateKey.generate()))

    def public_keys(self) -> tuple[bytes, bytes]:
        return public_of(self.c_private), public_of(self.s_private)


def participants_of(public_keys: Mapping[int, tuple[bytes, bytes]]) -> list[int]:
    """The round's clients in share-index order (index = position + 1)."""
    return sorted(int(v) for v in public_keys)


def make_shares(me: int, secrets: ClientSecrets, public_keys: Mapping[int, tuple[bytes, bytes]], threshold: int,
                round_id: int) -> tuple[bytes, dict[int, bytes]]:
    """Stage 2 on a client: (commitment to its new self-mask seed, {other client: encrypted share})."""
    nodes = participants_of(public_keys)
    if me not in nodes:
        raise SecAggError(f"node {me} is not among the round's participants")
    threshold = check_threshold(threshold, len(nodes))
    for node in nodes:
        _check_key(public_keys[node][0], f"node {node}'s c key")
        _check_key(public_keys[node][1], f"node {node}'s s key")
    if public_keys[me] != secrets.public_keys():
        raise SecAggError("the relayed public keys of this node are not its own")
    if len({public_keys[v][1] for v in nodes}) != len(nodes):
        raise SecAggError("two participants advertise the same key")
    secrets.seed = os.urandom(SEED_BYTES)
    n = len(nodes)
    b_shares = Shamir.split(threshold, n, secrets.seed)
    s_low = Shamir.split(threshold, n, secrets.s_private[:16])
    s_high = Shamir.split(threshold, n, secrets.s_private[16:])
    out = {}
    for position, node in enumerate(nodes):
        index = position + 1
        plain = _SHARE.pack(me, node, round_id, index, b_shares[position][1], s_low[position][1],
                            s_high[position][1])
        if node == me:
            out[node] = plain  # kept by its owner, unencrypted (it never leaves the client)
            continue
        nonce = os.urandom(_NONCE)
        aad = struct.pack("<QQI", me, node, round_id)
        out[node] = nonce + ChaCha20Poly1305(_share_key(secrets.c_private, public_keys[node][0], round_id)).encrypt(
            nonce, plain, aad)
    return commitment(secrets.seed), out


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
        try:
            plain = ChaCha20Poly1305(_share_key(secrets.c_private, public_keys[owner][0], round_id)).decrypt(
                blob[:_NONCE], blob[_NONCE:], struct.pack("<QQI", owner, me, round_id))
        except InvalidTag as err:
            raise SecAggError(f"the share from node {owner} does not authenticate") from err
    if len(plain) != _SHARE.size:
        raise SecAggError(f"the share from node {owner} has the wrong size")
    got_owner, holder, got_round, index, b_share, s_low, s_high = _SHARE.unpack(plain)
    if (got_owner, holder, got_round) != (owner, me, round_id):
        raise SecAggError(f"the share from node {owner} is addressed to another node or round")
    return index, b_share, s_low + s_high


def reveal(me: int, secrets: ClientSecrets, shares: Mapping[int, bytes], public_keys, uploaded: Iterable[int],
           dropped: Iterable[int], threshold: int, round_id: int) -> dict[int, tuple[str, int, bytes]]:
    """Stage 4 on a client: {owner: ("b" | "s", index, share)} — its share of each uploader's self-mask
    seed and of each dropped client's mask key, never both of one client."""
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
        index, b_share, s_share = open_share(me, secrets, owner, public_keys, shares[owner], round_id)
        out[owner] = ("b", index, b_share) if owner in uploaded else ("s", index, s_share)
    return out


# ---------------------------------------------------------------------- server side
def _combine(pieces: list[tuple[int, bytes]], threshold: int, check, limit: int = 2000) -> bytes | None:
    """A secret from ``threshold`` of the shares that passes ``check``, trying other subsets when a
    share is bad (a hostile holder); None when none does within ``limit`` subsets. A secret longer
    than 16 bytes (a mask key) was shared 16 bytes at a time: each block is combined alone."""
    pieces = sorted({index: share for index, share in pieces}.items())
    for subset in itertools.islice(itertools.combinations(pieces, threshold), limit):
        size = len(subset[0][1])
        secret = b"".join(Shamir.combine([(i, share[at:at + 16]) for i, share in subset]) for at in range(0, size, 16))
        if check(secret):
            return secret
    return None


def unmask(masked: Mapping[int, np.ndarray], public_keys: Mapping[int, tuple[bytes, bytes]],
           commitments: Mapping[int, bytes], revealed: Mapping[int, Mapping[int, tuple[str, int, bytes]]],
           fixed: FixedPoint, threshold: int, round_id: int) -> np.ndarray:
    """The sum of the uploaders' levels mod ``2^k`` (uint64), from their masked inputs and the
    survivors' revealed shares. SecAggError when fewer than ``threshold`` clients revealed, or a
    secret cannot be reconstructed from the shares."""
    uploaded = sorted(int(v) for v in masked)
    dropped = sorted(set(participants_of(public_keys)) - set(uploaded))
    if len(revealed) < threshold:
        raise SecAggError(f"{len(revealed)} clients revealed shares, fewer than the threshold {threshold}")
    k, modulus = fixed.modulus_bits, np.uint64(fixed.modulus - 1)
    count = int(np.size(next(iter(masked.values()))))
    total = np.zeros(count, np.uint64)
    for node in uploaded:
        total = total + np.asarray(masked[node], np.uint64).ravel()
    for owner in uploaded:
        pieces = [(idx, share) for holder in revealed.values() if owner in holder
                  for kind, idx, share in [holder[owner]] if kind == "b"]
        seed = _combine(pieces, threshold, lambda s, owner=owner: commitment(s) == commitments[owner]) \
            if len(pieces) >= threshold else None
        if seed is None:
            raise SecAggError(f"the self-mask seed of node {owner} cannot be reconstructed from "
                              f"{len(pieces)} shares")
        total = total - prg(self_mask_key(seed, round_id), count, k)
    for owner in dropped:
        pieces = [(idx, share) for holder in revealed.values() if owner in holder
                  for kind, idx, share in [holder[owner]] if kind == "s"]
        key = _combine(pieces, threshold, lambda k, owner=owner: public_of(k) == public_keys[owner][1]) \
            if len(pieces) >= threshold else None
        if key is None:
            raise SecAggError(f"the mask key of dropped node {owner} cannot be reconstructed from "
                              f"{len(pieces)} shares")
        for node in uploaded:  # node added +PRG(s_node,owner) when node < owner, else subtracted it
            pair = prg(pair_mask_key(key, public_keys[node][1], round_id), count, k)
            total = total - pair if node < owner else total + pair
    return total & modulus
