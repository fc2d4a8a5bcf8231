"""Secure aggregation's parameters and primitives (:mod:`strategies.secagg` is the protocol that uses them).

The fixed-point encoding of values (:class:`FixedPoint`), the threshold rule, and every cryptographic
primitive, each a maintained library's: X25519 key agreement and key checks, HKDF-SHA256, ChaCha20 as
the mask generator (:func:`prg`), SHA-256 commitments and digests, Ed25519 signatures (``cryptography``).
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

KEY_BYTES = 32  # an X25519 key, either half
SEED_BYTES = 16  # a self-mask seed: one Shamir secret
MAX_CLIENTS = 255  # Shamir share indices are one byte
MAX_MODULUS_BITS = 32
SHARE_STRUCT = struct.Struct("<QQIH16s16s16s")  # owner, holder, round, index, b share, s_sk share (2 halves)
NONCE_BYTES = 12
# an encrypted share: the dealer's ephemeral X25519 key for this holder, nonce, ciphertext, Poly1305 tag
SHARE_BLOB = KEY_BYTES + NONCE_BYTES + SHARE_STRUCT.size + 16
HASH_BYTES = 32  # SHA-256 of an encrypted share, as a complaint names it
SIGNATURE_BYTES = 64  # Ed25519


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

    def clamp_sum(self, total: np.ndarray, count: int) -> tuple[np.ndarray, int]:
        """(the sum of ``count`` uploads' levels brought into what ``count`` honest clients can send,
        ``[0, count·levels]``; how many values lay outside it). A residue outside can only come from a
        client that masked levels outside ``[0, levels]`` (it wraps around the modulus: issue #62
        measured 13.8x the honest step that way); it goes to the nearer end of the range, mod ``2^k``."""
        total = np.asarray(total, np.uint64)
        top = np.uint64(int(count) * self.levels)
        outside = total > top
        if not np.any(outside):
            return total, 0
        above = total - top  # how far past the top, against how far below 0 (= 2^k − residue) once wrapped
        below = np.uint64(self.modulus) - total
        return np.where(outside, np.where(above <= below, top, np.uint64(0)), total), int(np.count_nonzero(outside))

    def mean_bound(self, count: int) -> float:
        """The largest |mean| any ``count`` replies decode to, hostile ones included, once the sum is
        :meth:`clamp_sum`'s: ``clip``, the honest range (without the clamp a wrapped residue reached
        ``(2^k − 1)·step/count − clip``, up to 2.4x ``clip``)."""
        return float(self.clip)


def default_threshold(n: int) -> int:
    """A majority of the round's clients (Bonawitz et al.'s honest-majority setting)."""
    return n // 2 + 1


def check_threshold(threshold: int, n: int) -> int:
    """A threshold for ``n`` clients: at least 2, at most ``n``, and a majority (``2t > n``): two
    disjoint groups of ``t`` cannot exist, so no server can collect both kinds of share of one client."""
    threshold = int(threshold)
    if not 2 <= threshold <= n or 2 * threshold <= n:
        raise SecAggError(f"the threshold must be a majority of the round's {n} clients and at least 2 "
                          f"({max(2, n // 2 + 1)}..{n}), got {threshold}")
    return threshold


# ---------------------------------------------------------------------- primitives
def _kdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def _agree(private_raw: bytes, public_raw: bytes) -> bytes:
    return X25519PrivateKey.from_private_bytes(private_raw).exchange(X25519PublicKey.from_public_bytes(public_raw))


def raw_private(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())


def _raw_public(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


_PROBE_KEY = bytes(range(1, 33))  # any private key: agreement with a low-order point is all zeros whatever it is


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


def share_key(private_raw: bytes, public_raw: bytes, round_id: int) -> bytes:
    return _kdf(_agree(private_raw, public_raw), b"postcard-secagg shares %d" % round_id)


def ephemeral_of(eph: bytes, round_id: int, holder: int) -> bytes:
    """The dealer's ephemeral X25519 private key for ``holder``'s share (from its round secret ``eph``): the
    share is encrypted under its agreement with the holder's ``c`` key, so opening it to a judge reveals
    that one share and nothing else of the dealer's."""
    return _kdf(eph, b"postcard-secagg ephemeral %d %d" % (round_id, holder))


def share_hash(blob: bytes) -> bytes:
    return hashlib.sha256(b"postcard-secagg blob" + bytes(blob)).digest()


def complaint_message(round_id: int, dealer: int, holder: int, blob_hash: bytes) -> bytes:
    """What a holder signs to say the share ``dealer`` sent it (``blob_hash``) is bad."""
    return b"postcard-secagg complaint %d %d %d " % (round_id, dealer, holder) + bytes(blob_hash)


def check_signing_key(raw, what: str) -> bytes:
    """An Ed25519 public key: 32 bytes that decode."""
    if not isinstance(raw, (bytes, bytearray)) or len(raw) != KEY_BYTES:
        raise SecAggError(f"{what} must be {KEY_BYTES} bytes")
    try:
        Ed25519PublicKey.from_public_bytes(bytes(raw))
    except ValueError:
        raise SecAggError(f"{what} is not an Ed25519 key") from None
    return bytes(raw)


def verify_signature(public_raw: bytes, signature: bytes, message: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(bytes(public_raw)).verify(bytes(signature), message)
    except (InvalidSignature, ValueError):
        return False
    return True


def commitment(seed: bytes) -> bytes:
    return hashlib.sha256(b"postcard-secagg seed" + seed).digest()


_P25519 = 2**255 - 19


def check_key(raw, what: str) -> bytes:
    """A public X25519 key any honest client could have made: 32 bytes, canonical (u < 2^255 − 19,
    top bit clear) and not of low order (a low-order key makes every key agreement with it fail,
    or yield a secret its sender knows without a private key)."""
    if not isinstance(raw, (bytes, bytearray)) or len(raw) != KEY_BYTES:
        raise SecAggError(f"{what} must be {KEY_BYTES} bytes")
    raw = bytes(raw)
    if int.from_bytes(raw, "little") >= _P25519:
        raise SecAggError(f"{what} is not a canonical X25519 key")
    try:
        _agree(_PROBE_KEY, raw)
    except ValueError:  # cryptography refuses an all-zero shared secret: a low-order point
        raise SecAggError(f"{what} is a low-order X25519 key") from None
    return raw


check_public_key = check_key
