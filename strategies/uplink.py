"""What a training reply carries and what it means: the uplink's settings, its declared layout, and
the arithmetic of an update.

A client sends either its values (``uplink='absolute'``) or its update, ``local − received``
(``uplink='delta'``). Every stage of the round that works on *what a client changes* (the norm
clip, the centered clip, differential privacy, secure aggregation, the value checks) goes
through the functions here, so the two forms are one thing to the rest of the server:

* :func:`update_of` — the update a payload makes (``payload − global`` or the delta itself);
* :func:`scaled` — the payload whose update is ``factor`` times this one's;
* :func:`payload_of` — the payload whose update is ``update``;
* :func:`proposed` — the values a payload proposes for the global state.

:class:`UplinkSpec` checks a reply's declared keys, shapes, wire formats and byte count before
anything is decoded (a reply cannot make the server allocate more than the run's layout).
numpy only.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord

from strategies import codec, compress
from strategies.codec import PayloadError

UPLINKS = ("absolute", "delta")  # what clients send: their values, or their update (local − received)


def uplink_of(algorithm) -> str:
    """A method's ``uplink`` setting (its config block, a mapping): the one default, ``absolute``."""
    return str(algorithm.get("uplink", "absolute") or "absolute")


def check_settings(*, uplink: str, uplink_format: str, downlink_format: str, topk_fraction: float | None,
                   powersgd_rank: int | None) -> None:
    """ValueError for an uplink/downlink combination no strategy can run."""
    if downlink_format not in codec.FORMATS:
        raise ValueError(f"unknown downlink format '{downlink_format}'; choose one of {sorted(codec.FORMATS)}")
    compress.check_format(uplink_format, topk_fraction, powersgd_rank)
    if uplink not in UPLINKS:
        raise ValueError(f"uplink must be one of {list(UPLINKS)}, got {uplink!r}")
    if uplink_format in ("topk", "powersgd") and uplink != "delta":
        raise ValueError(f"uplink format '{uplink_format}' compresses updates: it needs uplink='delta'")


@dataclass(frozen=True)
class Wire:
    """A run's wire settings — what clients send (``uplink``: values or updates) in which ``format``, the
    downlink's format, and a compressed format's parameters — with one default each, checked once when built
    (:func:`check_settings`): :meth:`of` reads them from a method's ``algorithm`` block, for the config check,
    the strategy (:meth:`strategy_kwargs`) and the clients alike."""

    uplink: str = "absolute"
    format: str = "fp32"
    downlink_format: str = "fp32"
    topk_fraction: float | None = None
    powersgd_rank: int | None = None

    def __post_init__(self) -> None:
        check_settings(uplink=self.uplink, uplink_format=self.format, downlink_format=self.downlink_format,
                       topk_fraction=self.topk_fraction, powersgd_rank=self.powersgd_rank)

    @classmethod
    def of(cls, algorithm) -> Wire:
        """From a method's config block: ``payload`` (fp32), ``downlink`` (fp32), ``uplink`` (absolute),
        ``compression.topk_fraction`` / ``powersgd_rank``."""
        comp = algorithm.get("compression") or {}
        return cls(uplink_of(algorithm), str(algorithm.get("payload") or "fp32"),
                   str(algorithm.get("downlink") or "fp32"), comp.get("topk_fraction"), comp.get("powersgd_rank"))

    def strategy_kwargs(self) -> dict:
        """The strategy's keyword arguments (``PayloadFedAvg``)."""
        return dict(uplink=self.uplink, uplink_format=self.format, downlink_format=self.downlink_format,
                    topk_fraction=self.topk_fraction, powersgd_rank=self.powersgd_rank)


def update_of(payload: Mapping[str, np.ndarray], uplink: str, state: Mapping[str, np.ndarray]) -> dict:
    """What a validated payload changes: ``payload − global`` (float64) or the delta itself."""
    if uplink == "delta":
        return payload
    return {k: v.astype(np.float64) - state[k] for k, v in payload.items()}


def scaled(payload: Mapping[str, np.ndarray], factor: float, uplink: str, state: Mapping[str, np.ndarray]) -> dict:
    """The payload whose update is ``factor`` times this one's (the norm clip)."""
    if uplink == "delta":
        return {k: (v.astype(np.float64) * factor).astype(np.float32) for k, v in payload.items()}
    return {k: (state[k] + factor * (v.astype(np.float64) - state[k])).astype(np.float32) for k, v in payload.items()}


def payload_of(update: Mapping[str, np.ndarray], uplink: str, state: Mapping[str, np.ndarray]) -> dict:
    """The payload (float32) whose :func:`update_of` is ``update``."""
    if uplink == "delta":
        return {k: np.asarray(v, np.float64).astype(np.float32) for k, v in update.items()}
    return {k: (state[k] + update[k]).astype(np.float32) for k in update}


def proposed(payload: Mapping[str, np.ndarray], uplink: str, state: Mapping[str, np.ndarray]) -> Iterator:
    """(key, values) a dense payload proposes for the global state."""
    for key, value in payload.items():
        yield key, (value if uplink == "absolute" else state[key] + value)


@dataclass(frozen=True)
class UplinkSpec:
    """What a training reply must declare: its keys and shapes (``layout``), each tensor's wire
    formats (``stypes``) and at most ``budget`` bytes of payload in ``format``."""

    layout: dict[str, tuple[int, ...]]
    format: str
    stypes: dict
    budget: int

    @classmethod
    def build(cls, layout: Mapping[str, tuple[int, ...]], fmt: str, *, topk_fraction: float | None = None,
              powersgd_rank: int | None = None) -> UplinkSpec:
        layout = {k: tuple(v) for k, v in layout.items()}
        return cls(layout, fmt, compress.expected_stypes(layout, fmt, rank=powersgd_rank),
                   compress.max_nbytes(layout, fmt, fraction=topk_fraction, rank=powersgd_rank))

    def check(self, record: ArrayRecord) -> None:
        """The declared keys, shapes, wire formats and bytes of ``record``; PayloadError says what is wrong."""
        if set(record) != set(self.layout):
            extra = sorted(set(record) - set(self.layout))[:3]
            missing = sorted(set(self.layout) - set(record))[:3]
            raise PayloadError(f"wrong key set (unexpected {extra}, missing {missing})")
        for key, shape in self.layout.items():
            array = record[key]
            declared = codec.check_declared(key, array, self.stypes[key])
            if declared != shape:
                raise PayloadError(f"tensor '{key}' has shape {declared}, expected {shape}")
            if array.stype in codec.DENSE and len(array.data) != codec.expected_nbytes(shape, array.stype):
                raise PayloadError(f"tensor '{key}' carries {len(array.data)} bytes, expected "
                                   f"{codec.expected_nbytes(shape, array.stype)} for shape {shape}")
        nbytes = codec.payload_bytes(record)
        if nbytes > self.budget:
            raise PayloadError(f"the payload carries {nbytes} bytes, more than the {self.budget} "
                               f"its format '{self.format}' allows")
