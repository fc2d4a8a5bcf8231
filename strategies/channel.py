"""The latent channel, server side: any method's federated tensors updated through latents.

FLITE's subspace (``clients.flite.layer``) applied to a method's own federated tensors θ_fed
(LoRA factors, FedNL's gate and β, full weights): in round ``t`` a client trains only

    θ_k = θ_k,global + ΔW_k(z_k),   ΔW_k(z) = A_k · diag(V_kᵀ z) · B_k   (reshaped to θ_k's shape)

with ``A_k (m×r)``, ``B_k (r×n)`` and the orthonormalised ``V_k (k×r)`` regenerated from the
channel's shared seed, the round and the tensor's name, and sends only ``z`` (every
tensor's latents, concatenated in sorted key order: one vector, fp32 or int4). The factors
are drawn afresh every round, so the global model is not confined to one subspace: after
``R`` rounds it has moved along ``R`` different ones.

The server keeps θ_fed dense and everything
it does to a reply — clipping, robust aggregators, differential privacy's noise, secure
aggregation's masked sum — happens in latent space, on ``z``; :meth:`LatentChannel.expand`
maps the round's combined ``z`` to the dense update of θ_fed at the end. ``expand`` is
linear, so the mean of the clients' latents expands to the mean of their updates (the
averaging identity). Because each tensor's directions are orthonormal times its
coefficient ``c_k``, ``‖ΔW_k(z_k)‖ = c_k ‖z_k‖`` exactly: an update clipped to norm ``C`` in
latent space moves θ_fed by at most ``max_k c_k · C`` (:meth:`LatentChannel.gain`).

The downlink is the method's own (θ_fed dense), or, with ``downlink="latent"``, every round's
combined latents so far (one array per round, :func:`history_key`, in ``downlink_format``
or the uplink's: 648 bytes a round of 1,280 int4 latents; each node is sent the rounds it has not
confirmed, :class:`LatentSync`, and keeps the rest): a client replays them
from its own θ_fed,0 (:func:`replay`) with the same arithmetic the server used
(:func:`apply_update`), so both hold the same θ_fed bit for bit.

This module is numpy only: the factors come from a callable the ServerApp builds
(``fedapps.channel``), the same generator the clients use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
from flwr.app import Array, ArrayRecord

LATENT_KEY = "latent"  # the one tensor a latent-channel reply carries
HISTORY_PREFIX = f"{LATENT_KEY}/round-"  # + the round (5 digits): one combined z of a latent downlink
DOWNLINKS = ("dense", "latent")

Factors = Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray]]  # key -> (A, B, V) of one round


class LatentChannel:
    """A round's latents ↔ dense updates of the federated tensors ``shapes``.

    ``latents`` gives each tensor's share of the budget; ``factors(round)`` returns every
    tensor's ``(A, B, V)`` for that round (fp32 numpy; ``V`` already orthonormalised and
    scaled). The last round's factors are kept (a round expands every reply with them).
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], latents: Mapping[str, int],
                 factors: Callable[[int], Factors], downlink: str = "dense",
                 downlink_format: str | None = None) -> None:
        if downlink not in DOWNLINKS:
            raise ValueError(f"downlink must be one of {list(DOWNLINKS)}, got {downlink!r}")
        self.downlink = downlink
        self.downlink_format = downlink_format  # a latent downlink's rows: fp32 | int4 | int4b (None: the uplink's)
        if set(shapes) != set(latents):
            raise ValueError("the channel needs a latent count for every federated tensor")
        self.keys = sorted(shapes)
        self.shapes = {k: tuple(int(s) for s in shapes[k]) for k in self.keys}
        self.latents = {k: int(latents[k]) for k in self.keys}
        if any(v < 1 for v in self.latents.values()):
            raise ValueError("every federated tensor needs at least one latent")
        self.size = sum(self.latents.values())
        self._factors = factors
        self._cached: tuple[int, Factors] | None = None

    def layout(self) -> dict[str, tuple[int, ...]]:
        """What a reply carries: one vector of every tensor's latents."""
        return {LATENT_KEY: (self.size,)}

    def factors(self, server_round: int) -> Factors:
        if self._cached is None or self._cached[0] != server_round:
            factors = self._factors(int(server_round))
            for key in self.keys:
                A, B, V = factors[key]
                m, n = matrix_shape(self.shapes[key])
                if A.shape[0] != m or B.shape[1] != n or V.shape != (self.latents[key], A.shape[1]) \
                        or B.shape[0] != A.shape[1]:
                    raise ValueError(f"factors of '{key}' do not fit its shape {self.shapes[key]}")  # programming error
            self._cached = (int(server_round), factors)
        return self._cached[1]

    def split(self, z: np.ndarray) -> dict[str, np.ndarray]:
        """The latent vector cut into each tensor's share (sorted key order)."""
        z = np.asarray(z).reshape(-1)
        if z.size != self.size:
            raise ValueError(f"a latent vector of {z.size} values, the channel has {self.size}")
        out, start = {}, 0
        for key in self.keys:
            out[key] = z[start:start + self.latents[key]]
            start += self.latents[key]
        return out

    def expand(self, server_round: int, payload: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``{LATENT_KEY: z}`` -> each federated tensor's ``ΔW(z)`` (float64) in round ``server_round``."""
        factors = self.factors(server_round)
        out = {}
        for key, zk in self.split(payload[LATENT_KEY]).items():
            A, B, V = (f.astype(np.float64) for f in factors[key])
            s = zk.astype(np.float64) @ V  # (r,) = Vᵀ z
            out[key] = ((A * s) @ B).reshape(self.shapes[key])
        return out

    def gain(self, server_round: int) -> float:
        """``max_k c_k``: an update of latent norm ``C`` moves θ_fed by at most ``gain · C`` (L2)."""
        factors = self.factors(server_round)
        gains = []
        for key in self.keys:
            A, B, V = (f.astype(np.float64) for f in factors[key])
            gram = V @ ((A.T @ A) * (B @ B.T)) @ V.T  # c² I for orthonormalised directions
            gains.append(float(np.sqrt(np.max(np.linalg.eigvalsh(0.5 * (gram + gram.T))))))
        return max(gains)


def apply_update(state: Mapping[str, np.ndarray], update: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``state + update`` per tensor, in float64, stored as float32: the one way the server (every
    round) and a replaying client (every round of the history) add a round's update."""
    return {k: (np.asarray(state[k]).astype(np.float64) + v).astype(np.float32) for k, v in update.items()}


def history_key(server_round: int) -> str:
    return f"{HISTORY_PREFIX}{int(server_round):05d}"


def history_rounds(keys) -> list[tuple[int, str]]:
    """The (round, key) pairs of a latent downlink's keys, in round order; ValueError for any other key."""
    out = []
    for key in keys:
        digits = key[len(HISTORY_PREFIX):] if key.startswith(HISTORY_PREFIX) else ""
        if len(digits) != 5 or not digits.isdigit() or int(digits) < 1:
            raise ValueError(f"'{key}' is not a round of a latent downlink ({HISTORY_PREFIX}NNNNN)")
        out.append((int(digits), key))
    return sorted(out)


def replay(channel: LatentChannel, initial: Mapping[str, np.ndarray],
           history: list[tuple[int, np.ndarray]]) -> dict[str, np.ndarray]:
    """θ_fed after the rounds of ``history`` ((round, combined z) in round order), from ``initial``."""
    state = {k: np.asarray(initial[k], dtype=np.float32) for k in channel.keys}
    for server_round, z in history:
        state.update(apply_update(state, channel.expand(server_round, {LATENT_KEY: z})))
    return state


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """How the channel views a tensor: ``(shape[0], rest)`` for matrices and kernels, ``(1, d)``
    for vectors, ``(1, 1)`` for scalars."""
    shape = tuple(int(s) for s in shape)
    if len(shape) >= 2:
        return shape[0], int(np.prod(shape[1:]))
    return 1, int(np.prod(shape)) if shape else 1


class LatentSync:
    """Which rounds of a latent downlink each node holds, so that a node is sent only the rounds it has
    not confirmed (#63: every message once carried the whole history, r × 648 B after r rounds).

    A node confirms the rounds of a message by answering it (any accepted reply: training or evaluation);
    an error reply (a restarted node, a node that lost its store) forgets it, so its next message carries
    the whole history again. Server memory: one int per node that ever answered (a resumed run, a new
    Flower run whose nodes hold nothing, starts empty)."""

    SINCE = "latent-since"  # the config key of a message: its history holds the rounds after this one
    SNAPSHOT = "latent-snapshot"  # the config key of a message whose arrays are θ_fed after this round, dense
    snapshot_below = 1.0  # a snapshot is sent when its bytes are below this × the missed rounds' (tests: larger)

    def __init__(self) -> None:
        self.synced: dict[int, int] = {}  # node -> the last round it holds
        self.sending: dict[int, int] = {}  # node -> the last round of the message in flight to it

    def since(self, node: int) -> int:
        return self.synced.get(int(node), 0)

    def record_for(self, node: int, history: list[tuple[int, Array]], full: ArrayRecord,
                   snapshot: Callable[[], ArrayRecord] | None = None) -> tuple[ArrayRecord, bool]:
        """(the rounds of ``history`` after the node's last confirmed one — ``full`` when that is all of
        them —, False), or (``snapshot()``, True): the federated tensors after the last round, dense, when
        those bytes are fewer than the missed rounds' (a node that missed many rounds, or joins late)."""
        since = self.since(node)
        self.sending[int(node)] = history[-1][0] if history else 0
        missed = [(t, array) for t, array in history if t > since]
        if snapshot is not None and missed:
            dense = snapshot()
            if _record_bytes(dense) < self.snapshot_below * sum(len(array.data) for _, array in missed):
                return dense, True
        if since == 0:
            return full, False
        record = ArrayRecord()
        for t, array in missed:
            record[history_key(t)] = array
        return record, False

    def confirmed(self, node: int) -> None:
        node = int(node)
        if node in self.sending:
            self.synced[node] = max(self.synced.get(node, 0), self.sending[node])

    def lost(self, node: int) -> None:
        self.synced.pop(int(node), None)


def _record_bytes(record: ArrayRecord) -> int:
    return sum(len(record[key].data) for key in record.keys())
