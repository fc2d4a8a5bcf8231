"""The channel a method's updates travel through (the ``channel`` config group).

The channel is orthogonal to the method: the method decides what is trained and federated
(its tensors θ_fed), the channel how an update of θ_fed travels. ``channel=method`` (the
default) keeps the method's own wire format; the others set it at compose time
(:func:`apply`, called by ``fedapps.config.finalize``):

==========  ==============================================================================
fp32        every federated value as fp32 (``algorithm.payload=fp32``)
int4        the update (trained − received), 4 bits a value with stochastic rounding
topk        the update's top-k entries per tensor, with error feedback
powersgd    the update as rank-r PowerSGD factors, with error feedback
latent      FLITE's seed-regenerated subspace on θ_fed: the client trains only the latents
            ``z`` of ``θ_fed = θ_fed,global + ΔW(z)`` and sends ``z`` (fp32 or int4)
==========  ==============================================================================

A method lists the channels it carries in its ``conf/algorithm/<name>.yaml``
(``channels:``); any other choice is refused when the config is composed.

The latent channel, both sides: :func:`allocate` shares ``channel.latents`` among the
federated tensors (in proportion to the square root of their sizes, at most
``channel.rank`` and the tensor's size each); :func:`round_factors` regenerates each tensor's
factors for a round from ``channel.seed`` (``clients.flite.layer``: bit-identical on every
machine, drawn afresh each round); :func:`server_channel` gives the strategy its
``strategies.channel.LatentChannel``; ``fedapps.latent.latent_training`` attaches the latents to
the client's model for the length of local training and encodes ``z``.

Composing a config imports this module: it imports no torch (the factors are made by
``clients.factors``, imported when a round's factors are first needed).
"""

from __future__ import annotations

import collections
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from strategies import codec
from strategies.channel import DOWNLINKS, LatentChannel, history_rounds, matrix_shape, replay

CHANNELS = ("method", "fp32", "int4", "topk", "powersgd", "latent")


class ChannelError(ValueError):
    """A channel setting that cannot work; the message says why."""


@dataclass(frozen=True)
class LatentSettings:
    latents: int
    rank: int
    seed: int
    scale: float
    split: str
    downlink: str = "dense"
    downlink_format: str | None = None

    @classmethod
    def of(cls, cfg) -> LatentSettings | None:
        block = cfg.get("channel")
        if not block or block.get("name") != "latent":
            return None
        try:
            settings = cls(latents=int(block.latents), rank=int(block.rank), seed=int(block.seed),
                           scale=float(block.scale), split=str(block.split),
                           downlink=str(block.get("downlink", "dense")),
                           downlink_format=None if block.get("downlink_format") is None
                           else str(block.downlink_format))
        except (TypeError, ValueError) as err:
            raise ChannelError(f"channel: {err}") from None
        if settings.latents < 1 or settings.rank < 1 or not settings.scale > 0:
            raise ChannelError("channel.latents and channel.rank must be >= 1 and channel.scale > 0")
        if not 0 <= settings.seed < 2**64:
            raise ChannelError(f"channel.seed must be an unsigned 64-bit integer, got {settings.seed}")
        if settings.split not in ("sqrt", "numel", "equal"):
            raise ChannelError(f"channel.split must be sqrt, numel or equal, got {settings.split!r}")
        if settings.downlink not in DOWNLINKS:
            raise ChannelError(f"channel.downlink must be {' or '.join(DOWNLINKS)}, got {settings.downlink!r}")
        if settings.downlink_format not in (None, "fp32", "int4", "int4b"):
            raise ChannelError(f"channel.downlink_format must be fp32, int4, int4b or null (= channel.format), "
                               f"got {settings.downlink_format!r}")
        return settings


settings_of = LatentSettings.of


# ---------------------------------------------------------------------------- compose time
def apply(cfg, replaying: Sequence[str] = ()) -> None:
    """Write the chosen channel into the algorithm's wire settings (``payload``, ``uplink``,
    ``compression``), or raise ChannelError when the method cannot carry it. ``cfg`` must be
    writable (``finalize`` calls this before the config is frozen); ``replaying``: the methods whose
    clients replay a latent downlink (those whose record says ``latent_downlink``)."""
    block = cfg.get("channel")
    name = str(block.get("name", "method")) if block else "method"
    if name not in CHANNELS:
        raise ChannelError(f"unknown channel '{name}'; valid: {', '.join(CHANNELS)}")
    if name == "method":
        return
    algorithm = cfg.algorithm
    carried = [str(c) for c in (algorithm.get("channels") or [])]
    if name not in carried:
        why = algorithm.get("channel_note") or "its updates have a form of their own"
        raise ChannelError(f"algorithm '{algorithm.name}' cannot travel through channel '{name}': {why} "
                           f"(it carries: method{''.join(', ' + c for c in carried)})")
    if name == "latent":
        settings = settings_of(cfg)  # its settings are checked here, not on the first client
        if settings.downlink == "latent" and str(algorithm.name) not in replaying:
            raise ChannelError(f"channel.downlink=latent: algorithm '{algorithm.name}' loads its downlink in a form "
                               f"of its own; the clients that replay latents: {', '.join(replaying)}")
        fmt = str(block.get("format", "int4"))
        if fmt not in ("fp32", "int4", "int4b"):
            raise ChannelError(f"channel.format must be fp32, int4 or int4b, got {fmt!r}")
        algorithm.payload = fmt
    else:
        algorithm.payload = name
    if name == "fp32" or "uplink" not in algorithm:  # (SmartFed's expert updates have no uplink setting: deltas)
        return
    algorithm.uplink = "delta"
    if name in ("topk", "powersgd"):
        algorithm.compression = {"topk_fraction": block.get("topk_fraction"),
                                 "powersgd_rank": block.get("powersgd_rank"),
                                 "error_feedback": bool(block.get("error_feedback", True))}


# ---------------------------------------------------------------------------- the latent subspace
def allocate(shapes: dict[str, tuple[int, ...]], settings: LatentSettings) -> dict[str, int]:
    """Each federated tensor's latents: ``settings.latents`` split (``sqrt``: by the square root of
    its size, ``numel``: by its size, ``equal``), at least 1 and at most ``min(rank, size)`` each."""
    from clients.factors import split_budget

    keys = sorted(shapes)
    sizes = [math.prod(matrix_shape(shapes[k])) for k in keys]
    weights = {"sqrt": [math.sqrt(s) for s in sizes], "numel": [float(s) for s in sizes],
               "equal": [1.0] * len(sizes)}[settings.split]
    caps = [min(settings.rank, s) for s in sizes]
    try:
        return dict(zip(keys, split_budget(settings.latents, weights, caps)))
    except ValueError as err:
        raise ChannelError(f"channel.latents={settings.latents} over {len(keys)} federated tensors: {err} "
                           "(lower channel.latents or raise channel.rank)") from None


REDRAWS = 8  # draws of one round's factors for a tensor before its directions are called dependent


def round_factors(settings: LatentSettings, shapes: dict[str, tuple[int, ...]], latents: dict[str, int],
                  server_round: int) -> dict[str, tuple]:
    """Each tensor's ``(A, B, V)`` of round ``server_round`` (CPU fp32 torch tensors; ``V`` orthonormalised
    and scaled so that a latent vector of unit-RMS coordinates moves the tensor by ``scale`` in RMS)."""
    from clients.factors import LayerSpec, build_factors

    out = {}
    for key in sorted(shapes):
        m, n = matrix_shape(shapes[key])
        k = latents[key]
        for attempt in range(REDRAWS):
            # a draw whose directions are numerically dependent (a small tensor given as many latents as
            # values: rare, but it stopped a run at round 45 of 50) is drawn again under a derived name,
            # the same on the server and every client; the first draw is the one it always was
            name = f"channel/round-{int(server_round)}/{key}" + (f"/redraw-{attempt}" if attempt else "")
            spec = LayerSpec(name=name, kind="linear", matrix_shape=(m, n), latents=k,
                             rank=max(k, min(settings.rank, m * n)), param_names=("weight",))
            try:
                factors = build_factors(settings.seed, spec, [], settings.scale, "unit")
                break
            except ValueError:
                if attempt == REDRAWS - 1:
                    raise
        out[key] = (factors.A, factors.B, factors.basis)
    return out


FACTOR_CACHE_BYTES = 256 * 2**20  # the rounds' factors a process keeps (newest first) for replays
_FACTORS: collections.OrderedDict = collections.OrderedDict()  # (settings, shapes, round) -> (factors, bytes)


def cached_factors(settings: LatentSettings, shapes: tuple, server_round: int):
    """:func:`round_factors` of ``shapes`` (sorted ``(name, shape)`` pairs), made once per process and
    round and kept while they fit in :data:`FACTOR_CACHE_BYTES`: one Ray actor trains several nodes in a
    round, and each node that replays a latent downlink needs the factors of every round it missed — at
    1,000 clients, 10% a round, about ten; a cache of two rounds made every such message draw them all
    again (67 s a round by round 8, bench/thousand.py). Read-only: parametrizations hold them as buffers."""
    key = (settings, shapes, int(server_round))
    if key in _FACTORS:
        _FACTORS.move_to_end(key)
        return _FACTORS[key][0]
    plain = dict(shapes)
    made = round_factors(settings, plain, allocate(plain, settings), server_round)
    size = sum(int(t.numel()) * t.element_size() for f in made.values() for t in f)
    _FACTORS[key] = (made, size)
    total = sum(s for _, s in _FACTORS.values())
    while total > FACTOR_CACHE_BYTES and len(_FACTORS) > 1:
        _, (_, dropped) = _FACTORS.popitem(last=False)
        total -= dropped
    return made


def channel_factory(cfg):
    """``shapes -> LatentChannel`` for this run's latent channel (None when off): a strategy whose
    federated tensors change from round to round (SmartFed's active experts) builds one per round."""
    settings = settings_of(cfg)
    if settings is None:
        return None

    def build(shapes: dict[str, tuple[int, ...]]) -> LatentChannel:
        shapes = {k: tuple(int(s) for s in v) for k, v in shapes.items()}
        latents = allocate(shapes, settings)

        def factors(server_round: int):
            made = cached_factors(settings, tuple(sorted(shapes.items())), server_round)
            return {k: tuple(t.numpy() for t in f) for k, f in made.items()}

        return LatentChannel(shapes, latents, factors, downlink=settings.downlink,
                             downlink_format=settings.downlink_format)

    return build


def server_channel(cfg, initial_state: dict[str, np.ndarray]) -> LatentChannel | None:
    """The strategy's view of the latent channel over ``initial_state``'s tensors (None when off)."""
    build = channel_factory(cfg)
    return None if build is None else build({k: tuple(np.shape(v)) for k, v in initial_state.items()})


# ---------------------------------------------------------------------------- the client
_REPLAYED: dict = {}  # (settings, shapes) -> (the history replayed so far, θ_fed after it): one per process


STORE, STORE_SYNCED = "postcard.latent-history", "postcard.latent-synced"  # a node's context.state records
STORE_BASE = "postcard.latent-base"  # ... and the dense snapshot its rounds replay from, once it was sent one


def _take_snapshot(arrays, initial: dict[str, np.ndarray], store, through: int) -> dict[str, np.ndarray]:
    """A latent downlink that is the federated tensors themselves after round ``through`` (the server sends
    that when it is smaller than the rounds the node missed): checked against the layout, kept in ``store``
    as the base later rounds replay from (the rounds kept before it dropped)."""
    from flwr.app import ArrayRecord, ConfigRecord

    values = codec.decode(arrays)
    if sorted(values) != sorted(initial) or any(values[k].shape != np.shape(initial[k]) for k in initial):
        raise codec.PayloadError("latent downlink: a snapshot whose tensors are not the federated ones")
    if store is not None:
        store[STORE_BASE] = arrays
        store[STORE] = ArrayRecord()
        store[STORE_SYNCED] = ConfigRecord({"through": int(through), "base": int(through)})
    return {k: np.asarray(v, np.float32).copy() for k, v in values.items()}


def _base_of(store, initial: dict[str, np.ndarray], since: int) -> tuple[dict[str, np.ndarray], int]:
    """(the state a node's rounds replay from, its round): its kept snapshot, or ``initial`` (round 0) —
    also when the server sends the whole history again (``since`` 0: it holds nothing of this node)."""
    if store is None or STORE_BASE not in store.array_records:
        return initial, 0
    if not since:
        del store.array_records[STORE_BASE]
        return initial, 0
    return codec.decode(store.array_records[STORE_BASE]), int(store.config_records[STORE_SYNCED].get("base", 0))


def _merged_history(arrays, store, since: int):
    """A latent downlink's rounds (only those after ``since``, the node's last confirmed round, when
    ``since`` > 0) joined to the rounds the node kept in ``store`` (its ``context.state``), which then keeps
    them all: the node's whole history, as an ArrayRecord."""
    from flwr.app import ArrayRecord, ConfigRecord

    if store is None:
        if since:
            raise codec.PayloadError(f"latent downlink: the rounds after {since} only, and this node keeps none")
        return arrays
    kept = store.array_records.get(STORE) if STORE in store.array_records else None
    held = int(store.config_records[STORE_SYNCED]["through"]) if STORE_SYNCED in store.config_records else 0
    if since and (kept is None or held < since):
        raise codec.PayloadError(f"latent downlink: the rounds after {since} only, but this node holds rounds up to "
                                 f"{held} (it lost its state): the server sends them all next time")
    merged = ArrayRecord()
    if since:
        for key in kept.keys():
            if history_rounds([key])[0][0] <= since:
                merged[key] = kept[key]
    for key in arrays.keys():
        merged[key] = arrays[key]
    rounds = history_rounds(list(merged.keys()))
    base = int(store.config_records[STORE_SYNCED].get("base", 0)) if since and STORE_SYNCED in store.config_records \
        else 0
    store[STORE] = merged
    store[STORE_SYNCED] = ConfigRecord({"through": rounds[-1][0] if rounds else base, "base": base})
    return merged


def received_state(cfg, arrays, initial: dict[str, np.ndarray], store=None, since: int = 0,
                   snapshot: int = 0) -> dict[str, np.ndarray]:
    """The federated tensors a downlink carries: decoded (the method's own downlink), or, with
    ``channel.downlink=latent``, replayed from ``initial`` (θ_fed,0, which the client builds as the
    server did) through every round's combined latents, as the server added them: those it was sent
    (the rounds after ``since``, its last confirmed one) and those it kept in ``store`` (its node's
    ``context.state``). ``snapshot`` > 0: the downlink is the tensors after that round, dense (fewer
    bytes than the rounds missed); the node keeps it and replays later rounds from it. A process keeps
    its last replay and adds only the rounds that are new (an actor serves many messages)."""
    settings = settings_of(cfg)
    if settings is None or settings.downlink != "latent":
        return codec.decode(arrays)
    if snapshot:
        return _take_snapshot(arrays, initial, store, int(snapshot))
    try:
        history_rounds(list(arrays.keys()))
        initial, _ = _base_of(store, initial, int(since or 0))
        arrays = _merged_history(arrays, store, int(since or 0))
        rounds = history_rounds(list(arrays.keys()))
    except ValueError as err:
        raise codec.PayloadError(f"latent downlink: {err}") from None
    decoded = codec.decode(arrays)
    history = [(t, decoded[key]) for t, key in rounds]
    shapes = tuple((k, tuple(int(s) for s in np.shape(v))) for k, v in sorted(initial.items()))
    channel = channel_factory(cfg)(dict(shapes))
    for _, z in history:
        if z.shape != (channel.size,):
            raise codec.PayloadError(f"latent downlink: a round of {z.size} latents, the channel has {channel.size}")
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(initial[k], np.float32).tobytes() for k, _ in shapes))
    cache_key = (settings, shapes, digest.hexdigest())
    start, state = 0, initial
    cached = _REPLAYED.get(cache_key)
    if cached is not None and len(cached[0]) <= len(history) and all(
            t == done_t and np.array_equal(z, done_z) for (t, z), (done_t, done_z) in zip(history, cached[0])):
        start, state = len(cached[0]), cached[1]
    state = replay(channel, state, history[start:])
    _REPLAYED.clear()  # one replay kept: the latest
    _REPLAYED[cache_key] = (history, state)
    return {k: v.copy() for k, v in state.items()}
