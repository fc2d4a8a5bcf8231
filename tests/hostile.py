"""A catalogue of malformed and hostile replies, and a harness that drives each through every strategy.

Used by ``tests/test_hostile.py`` (every kind × every strategy it can be sent to,
:func:`applicable_cases`, in CI) and by ``bench/fuzz_table.py`` (the table in
docs/robustness.md). numpy level: no model.

One case = one strategy (:data:`SPECS`) and one kind (:data:`KINDS`):

1. round 1: four nodes reply honestly (the state moves away from its start);
2. round 2: the strategy's messages are pushed through a fake grid (ids, run id), nodes 1–3
   reply honestly and the kind decides what node 4 (or the whole round) sends;
3. a *reference* strategy, built the same way, sees the same round 1 and only the replies
   an honest-only run would have counted (for ``accepted`` kinds: a plain FedAvg strategy,
   ``robust=off``, sees the same replies).

Outcomes: ``refused`` (refused with a reason of the expected kind, global state bit-identical
to the reference), ``bounded`` (accepted; the state lies within the documented bound of
the honest-only mean, docs/robustness.md), ``accepted`` (harmless: nothing refused or
bounded, the state bit-identical to plain FedAvg of the same replies). In every case: no exception, and round 3's
downlink decodes to finite values.
"""

from __future__ import annotations

import copy
import functools
import struct
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict

from strategies import codec, packing, sparse
from strategies.base import PayloadFedAvg
from strategies.baselines import FedAvgFull, FedAvgLoRA, FedProx, FFALoRA
from strategies.compress import UpdateCompressor, topk_count
from strategies.eeqa import EEQA
from strategies.expert_state import ExpertState
from strategies.fedala import FedALA
from strategies.fednl import FedNL
from strategies.fedssi import FedSSI
from strategies.flite import FINGERPRINT_KEY, FINGERPRINT_RECORD, FliteStrategy
from strategies.smartfed import SmartFedStrategy
from strategies.server_opt import ServerOptimizer

NODES = (1, 2, 3, 4)
HOSTILE = 4
RUN_ID = 1
EXAMPLES = {1: 30, 2: 20, 3: 40, 4: 25}


# ------------------------------------------------------------------------------ strategies
LORA = {f"base_model.model.layers.{i}.self_attn.{p}.lora_{ab}.weight": (4, 12) if ab == "A" else (12, 4)
        for i in (0, 1) for p in ("q_proj", "v_proj") for ab in "AB"}
FULL = {"conv.weight": (6, 3, 3, 3), "conv.bias": (6,), "fc.weight": (10, 24), "fc.bias": (5,)}
FEDNL_MEMORY = {f"model.layers.{i}.self_attn.{n}": s for i in (0, 1)
                for n, s in (("fednl_gate", (2,)), ("fednl_beta.weight", (2, 12)), ("fednl_beta.bias", (2,)))}
FEDNL_LORA = {f"model.layers.{i}.self_attn.{p}.lora_{ab}.default.weight": (4, 12) if ab == "A" else (12, 4)
              for i in (0, 1) for p in ("q_proj", "k_proj", "v_proj") for ab in "AB"}


def _state(layout: dict, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in layout.items()}


def _common(**kw) -> dict:
    return dict(config_yaml="run: hostile\n", num_clients=len(NODES), **kw)


def _smartfed_state(mode: str) -> ExpertState:
    rng = np.random.default_rng(0)
    q, v = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"
    layout = sparse.ExpertLayout({q: sparse.MatrixLayout(6, 6, [f"a:{i}" for i in range(6)]),
                                  v: sparse.MatrixLayout(6, 4, [f"a:{i}" for i in range(4)])},
                                 train_experts=mode == "experts+router")
    experts = {m: (rng.standard_normal((ml.num_experts, ml.d_in)), rng.standard_normal((ml.d_out, ml.num_experts)))
               for m, ml in layout.matrices.items()}
    return ExpertState.initial(layout, experts, router_seed=0, router_std=0.1)


def _smartfed(mode: str, **kw) -> SmartFedStrategy:
    state = _smartfed_state(mode)
    return SmartFedStrategy(state=state, eeqa=EEQA(state.layout.num_experts, 6, min_per_matrix=1),
                            backbone_fingerprint="f" * 16, **_common(**kw))


@dataclass(frozen=True)
class Spec:
    """One strategy as a run builds it, and how an honest client of it replies."""

    name: str
    build: Callable[..., PayloadFedAvg]
    wire: str  # the uplink format: fp32 | int4 | topk | powersgd | sparse
    fraction: float | None = None
    rank: int | None = None
    method: str = ""  # the registered method it stands for (default: its name)

    @property
    def algorithm(self) -> str:
        return self.method or self.name

    @property
    def sparse(self) -> bool:
        return self.wire == "sparse"


SPECS = [
    Spec("fedavg-lora", lambda **kw: FedAvgLoRA(initial_state=_state(LORA), **_common(**kw)), "fp32"),
    Spec("fedprox", lambda **kw: FedProx(proximal_mu=0.01, initial_state=_state(LORA), **_common(**kw)), "fp32"),
    Spec("ffa-lora", lambda **kw: FFALoRA(initial_state=_state(LORA), **_common(**kw)), "fp32"),
    Spec("fedala", lambda **kw: FedALA(initial_state=_state(LORA), **_common(**kw)), "fp32"),
    Spec("fedssi", lambda **kw: FedSSI(c=0.1, lam=0.5, initial_state=_state(LORA), **_common(**kw)), "fp32"),
    Spec("fedavg-full", lambda **kw: FedAvgFull(initial_state=_state(FULL), uplink="delta", **_common(**kw)), "fp32"),
    Spec("fedavg-full-int4", lambda **kw: FedAvgFull(initial_state=_state(FULL), uplink="delta", uplink_format="int4",
                                                     **_common(**kw)), "int4", method="fedavg-full"),
    Spec("topk-ef", lambda **kw: FedAvgFull(initial_state=_state(FULL), uplink="delta", uplink_format="topk",
                                            topk_fraction=0.25, **_common(**kw)), "topk", fraction=0.25),
    Spec("powersgd", lambda **kw: FedAvgFull(initial_state=_state(FULL), uplink="delta", uplink_format="powersgd",
                                             powersgd_rank=2, **_common(**kw)), "powersgd", rank=2),
    Spec("flite", lambda **kw: FliteStrategy(fingerprint="abcd" * 4, initial_state={"z": np.zeros(1280, np.float32)},
                                             uplink_format="int4", downlink_format="fp32", **_common(**kw)), "int4"),
    # FLITE with an adaptive server optimiser: the moments are the state a hostile reply could steer
    Spec("flite-fedadam", lambda **kw: FliteStrategy(
        fingerprint="abcd" * 4, initial_state={"z": np.zeros(1280, np.float32)}, uplink_format="int4",
        downlink_format="fp32", server_optimizer=ServerOptimizer(name="fedadam", lr=0.01), **_common(**kw)), "int4",
        method="flite"),
    Spec("fednl-meta-rules", lambda **kw: FedNL(mode="meta-rules", initial_state=_state({**FEDNL_LORA, **FEDNL_MEMORY}),
                                                **_common(**kw)), "fp32", method="fednl"),
    Spec("fednl-gate", lambda **kw: FedNL(mode="gate", initial_state=_state(FEDNL_MEMORY), **_common(**kw)), "fp32",
         method="fednl"),
    Spec("smartfed", lambda **kw: _smartfed("experts+router", **kw), "sparse"),
    Spec("smartfed-router-only", lambda **kw: _smartfed("router-only", **kw), "sparse", method="smartfed"),
]


def _generated(methods) -> list[Spec]:
    """A spec for every registered method the list above does not cover (one added tomorrow): its strategy
    class (``Method.strategy``) over the LoRA layout, as the generic constructor builds it, fp32 replies. A
    strategy that cannot be built so needs a spec of its own above (``tests/test_hostile.py`` says which)."""
    covered = {s.algorithm for s in SPECS}
    return [Spec(name, functools.partial(lambda cls, **kw: cls(initial_state=_state(LORA), **_common(**kw)),
                                         method.strategy), "fp32")
            for name, method in sorted(methods.items()) if name not in covered]


def _registered() -> dict:
    from fedapps import registry

    return registry.METHODS


SPECS += _generated(_registered())
SPEC_BY_NAME = {s.name: s for s in SPECS}


# ------------------------------------------------------------------------------ honest clients
class FakeGrid:
    def get_node_ids(self):
        return list(NODES)


def push(messages: list[Message]) -> dict[int, Message]:
    """What a grid does when it sends messages: give each an id. -> {node: message}."""
    out = {}
    for msg in messages:
        msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
        out[int(msg.metadata.dst_node_id)] = msg
    return out


def honest_payload(spec: Spec, strategy: PayloadFedAvg, node: int, server_round: int, scale: float = 1.0):
    """The ArrayRecord an honest client of ``spec`` sends (deterministic per node and round)."""
    rng = np.random.default_rng([node, server_round])
    if spec.sparse:
        tensors = {}
        for m, ids in strategy.allocation.active.items():
            ml, k = strategy.expert_layout[m], len(ids)
            tensors[f"{m}/ids"] = np.asarray(ids, np.float32)
            tensors[f"{m}/router"] = (scale * 0.01 * rng.standard_normal((k, ml.d_in))).astype(np.float32)
            if strategy.expert_layout.train_experts:
                tensors[f"{m}/A"] = (scale * 0.01 * rng.standard_normal((k, ml.d_in))).astype(np.float32)
                tensors[f"{m}/B"] = (scale * 0.01 * rng.standard_normal((k, ml.d_out))).astype(np.float32)
            tensors[f"{m}/importance"] = sparse.importance_report(ids, rng.uniform(0.1, 1.0, k))
        return sparse.encode(tensors, "fp32")
    update = {k: (scale * 0.01 * rng.standard_normal(strategy.global_state[k].shape)).astype(np.float32)
              for k in strategy.uplink_keys}
    if strategy.uplink == "absolute":
        return codec.encode({k: strategy.global_state[k] + v for k, v in update.items()}, "fp32")
    compressor = UpdateCompressor(spec.wire, fraction=spec.fraction, rank=spec.rank, error_feedback=False)
    record, _ = compressor.compress(update, rng=np.random.default_rng([node, server_round, 1]))
    return record


def reply_to(request: Message, arrays: ArrayRecord | None, *, num_examples=None, metrics=None, extra=None) -> Message:
    node = int(request.metadata.dst_node_id)
    values = {"num-examples": EXAMPLES.get(node, 10) if num_examples is None else num_examples,
              "loss": 1.0 + 0.1 * node, "partition-id": node - 1}
    values.update(metrics or {})
    content = RecordDict({"metrics": MetricRecord({k: v for k, v in values.items() if v is not None})})
    if arrays is not None:
        content["arrays"] = arrays
    if isinstance(request.content.config_records.get("config"), ConfigRecord) and \
            FINGERPRINT_KEY in request.content["config"]:
        content[FINGERPRINT_RECORD] = ConfigRecord({"fingerprint": request.content["config"][FINGERPRINT_KEY]})
    for name, record in (extra or {}).items():
        content[name] = record
    return Message(content, reply_to=request)


def configured_round(strategy: PayloadFedAvg, server_round: int) -> dict[int, Message]:
    return push(strategy.configure_train(server_round, strategy.downlink_arrays(), ConfigRecord(), FakeGrid()))


# ------------------------------------------------------------------------------ the kinds
@dataclass
class Ctx:
    """What a kind may use to build round 2's replies."""

    spec: Spec
    strategy: PayloadFedAvg
    requests: dict[int, Message]
    honest: dict[int, Message]
    round1: dict[int, Message]

    def key(self) -> str:
        """The tensor a mutation targets (a value tensor for SmartFed)."""
        record = self.honest[HOSTILE].content["arrays"]
        if self.spec.sparse:
            return sorted(k for k in record if k.endswith("/router"))[0]
        lora = sorted(k for k in record if "lora" in k)
        return lora[0] if lora else sorted(record)[0]

    def others(self) -> list[Message]:
        return [self.honest[n] for n in NODES if n != HOSTILE]

    def hostile(self, arrays=None, **kw) -> list[Message]:
        """Honest replies of nodes 1-3, and node 4's reply built from ``arrays`` (default: its honest ones)."""
        if arrays is None:
            arrays = copy.deepcopy(self.honest[HOSTILE].content["arrays"])
        return [*self.others(), reply_to(self.requests[HOSTILE], arrays, **kw)]

    def with_array(self, array: Array, key: str | None = None) -> list[Message]:
        arrays = copy.deepcopy(self.honest[HOSTILE].content["arrays"])
        arrays[key or self.key()] = array
        return self.hostile(arrays)

    def stype(self) -> str:
        return self.honest[HOSTILE].content["arrays"][self.key()].stype

    def shape(self) -> tuple[int, ...]:
        return tuple(self.honest[HOSTILE].content["arrays"][self.key()].shape)


@dataclass(frozen=True)
class Kind:
    name: str
    group: str
    expect: str  # refused | bounded | accepted
    make: Callable[[Ctx], list[Message]]
    refusal: str = "payload"  # the refusal kind recorded
    reference: tuple[int, ...] = (1, 2, 3)  # the honest-only run's counted nodes
    applies: Callable[[Spec, PayloadFedAvg], bool] = lambda spec, strategy: True
    refused_for: tuple[str, ...] = ()  # specs whose own bounds refuse what others accept with a bound

    def expected(self, spec: Spec) -> str:
        return "refused" if spec.name in self.refused_for else self.expect


def constant_array(ctx: Ctx, value: float, shape=None) -> Array:
    """A tensor of one value, in the target tensor's own wire format, bytes written by hand
    (so NaN, Inf and any magnitude can be sent in any format)."""
    shape = tuple(shape or ctx.shape())
    numel = int(np.prod(shape))
    stype = ctx.stype()
    if stype == codec.FP32:
        data = np.full(numel, value, "<f4").tobytes()
    elif stype == codec.INT4:  # scale 0, zero point = the value: every entry decodes to it
        data = bytes((numel + 1) // 2) + struct.pack("<ff", 0.0, value)
    elif stype == codec.TOPK:
        k = topk_count(numel, ctx.spec.fraction)
        data = np.arange(k, dtype="<u4").tobytes() + np.full(k, value, "<f4").tobytes()
    else:  # low-rank factors whose product is the value everywhere
        m, n, r = shape[0], int(np.prod(shape[1:])), ctx.spec.rank
        p = np.zeros((m, r), "<f4")
        p[:, 0] = 1.0
        q = np.zeros((n, r), "<f4")
        q[:, 0] = value
        data = p.tobytes() + q.tobytes()
    return Array(dtype="float32", shape=shape, stype=stype, data=data)


def raw(ctx: Ctx, *, shape=None, stype=None, data=None, dtype="float32") -> list[Message]:
    base = ctx.honest[HOSTILE].content["arrays"][ctx.key()]
    return ctx.with_array(Array(dtype=dtype, shape=tuple(base.shape if shape is None else shape),
                                stype=base.stype if stype is None else stype,
                                data=base.data if data is None else data))


def scaled(ctx: Ctx, factor: float) -> list[Message]:
    arrays = honest_payload(ctx.spec, ctx.strategy, HOSTILE, 2, scale=factor)
    return ctx.hostile(arrays)


def _int4(spec, strategy) -> bool:
    return spec.wire == "int4"


def _odd_int4(spec, strategy) -> bool:
    return spec.wire == "int4" and any(int(np.prod(s)) % 2 for s in strategy.layout().values())


def _dense(spec, strategy) -> bool:
    return not spec.sparse


def _with_key_value(ctx: Ctx, key_filter: Callable[[str], bool], value: float) -> list[Message]:
    key = sorted(k for k in ctx.honest[HOSTILE].content["arrays"] if key_filter(k))[0]
    shape = tuple(ctx.honest[HOSTILE].content["arrays"][key].shape)
    return ctx.with_array(Array(dtype="float32", shape=shape, stype=codec.FP32,
                                data=np.full(int(np.prod(shape)), value, "<f4").tobytes()), key)


def _sparse_tensors(ctx: Ctx) -> dict[str, np.ndarray]:
    return codec.decode(ctx.honest[HOSTILE].content["arrays"])


def _sparse_change(change: Callable[[dict], None]) -> Callable[[Ctx], list[Message]]:
    def make(ctx: Ctx) -> list[Message]:
        tensors = _sparse_tensors(ctx)
        change(tensors)
        return ctx.hostile(_raw_record(tensors))
    return make


def _raw_record(tensors: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(dtype="float32", shape=tuple(v.shape), stype=codec.FP32,
                                 data=np.asarray(v, "<f4").tobytes()) for k, v in tensors.items()})


def _first(tensors: dict, field: str) -> str:
    return sorted(k for k in tensors if k.endswith(f"/{field}"))[0]


def _set_ids(tensors: dict, ids) -> None:
    key = _first(tensors, "ids")
    tensors[key] = np.asarray(ids, np.float32)


def _error_reply(ctx: Ctx) -> list[Message]:
    return [*ctx.others(), Message(Error(code=0, reason="boom: CUDA out of memory"), reply_to=ctx.requests[HOSTILE])]


def _with_metadata(ctx: Ctx, **fields) -> list[Message]:
    msg = reply_to(ctx.requests[HOSTILE], copy.deepcopy(ctx.honest[HOSTILE].content["arrays"]))
    for name, value in fields.items():
        msg.metadata.__dict__[f"_{name}"] = value
    return [*ctx.others(), msg]


def _unsolicited(ctx: Ctx) -> list[Message]:
    fake = Message(RecordDict({}), dst_node_id=9, message_type="train")
    fake.metadata.__dict__["_message_id"] = uuid.uuid4().hex
    return [*ctx.honest.values(), reply_to(fake, copy.deepcopy(ctx.honest[HOSTILE].content["arrays"]))]


def _all_nan(ctx: Ctx) -> list[Message]:
    return [reply_to(ctx.requests[n], _replace_all(ctx, n, float("nan"))) for n in NODES]


def _replace_all(ctx: Ctx, node: int, value: float) -> ArrayRecord:
    arrays = copy.deepcopy(ctx.honest[node].content["arrays"])
    sub = Ctx(ctx.spec, ctx.strategy, ctx.requests, {HOSTILE: ctx.honest[node]}, ctx.round1)
    arrays[sub.key()] = constant_array(sub, value)
    return arrays


def _reset(ctx: Ctx) -> list[Message]:
    """Absolute uplinks: every value zero (a 'reset' of the model); deltas: minus the global state."""
    s = ctx.strategy
    values = {k: np.zeros_like(s.global_state[k]) for k in s.uplink_keys}
    if s.uplink == "delta":
        values = {k: -s.global_state[k] for k in s.uplink_keys}
    compressor = UpdateCompressor(ctx.spec.wire if ctx.spec.wire != "sparse" else "fp32", fraction=ctx.spec.fraction,
                                  rank=ctx.spec.rank, error_feedback=False)
    record, _ = compressor.compress(values, rng=np.random.default_rng(0))
    return ctx.hostile(record)


def _zero_update(ctx: Ctx) -> list[Message]:
    s = ctx.strategy
    if s.uplink == "absolute":
        return ctx.hostile(codec.encode({k: s.global_state[k] for k in s.uplink_keys}, "fp32"))
    compressor = UpdateCompressor(ctx.spec.wire, fraction=ctx.spec.fraction, rank=ctx.spec.rank, error_feedback=False)
    record, _ = compressor.compress({k: np.zeros_like(s.global_state[k]) for k in s.uplink_keys})
    return ctx.hostile(record)


def _topk_data(ctx: Ctx, idx, vals) -> bytes:
    return np.asarray(idx, "<u4").tobytes() + np.asarray(vals, "<f4").tobytes()


def _topk_k(ctx: Ctx) -> int:
    return topk_count(int(np.prod(ctx.shape())), ctx.spec.fraction)


def _lowrank(ctx: Ctx) -> bool:
    return ctx.stype() == codec.LOWRANK


def _packed(ctx: Ctx, reply: Message | None = None, cut: int = 0) -> list[Message]:
    """Node 4's reply (default: its honest one) with its arrays packed as a client packs them,
    the packed bytes' last ``cut`` bytes cut off (a record the server cannot unpack)."""
    reply = copy.deepcopy(reply or ctx.honest[HOSTILE])
    content = packing.pack(reply.content, min_arrays=1)
    if cut:
        array = content[packing.RECORD]["data"]
        data = bytes(array.data)[:-cut]
        content[packing.RECORD]["data"] = Array(dtype="uint8", shape=(len(data),), stype=packing.PACKED, data=data)
    return [*ctx.others(), Message(content, reply_to=ctx.requests[HOSTILE])]


K = Kind
FOREIGN_STYPE = {codec.FP32: codec.INT4, codec.INT4: codec.FP32, codec.TOPK: codec.FP32, codec.LOWRANK: codec.TOPK}

KINDS: list[Kind] = [
    # --- identity and replay (class 6)
    K("duplicate-reply", "identity", "refused", lambda c: [*c.honest.values(), copy.deepcopy(c.honest[HOSTILE])],
      "identity", reference=(1, 2, 3, 4)),
    K("replayed-earlier-round", "identity", "refused", lambda c: [*c.others(), c.round1[HOSTILE]], "identity"),
    K("foreign-run-id", "identity", "refused", lambda c: _with_metadata(c, run_id=999), "identity"),
    K("spoofed-sender", "identity", "refused", lambda c: _with_metadata(c, src_node_id=2), "identity"),
    K("stale-message-id", "identity", "refused", lambda c: _with_metadata(c, reply_to_message_id=uuid.uuid4().hex),
      "identity"),
    K("unsolicited-node", "identity", "refused", _unsolicited, "identity", reference=(1, 2, 3, 4)),
    K("client-error-reply", "identity", "refused", _error_reply, "client-error"),
    # --- metrics and example counts (classes 3, 4)
    K("no-metric-record", "metrics", "refused",
      lambda c: [*c.others(), Message(RecordDict({"arrays": copy.deepcopy(c.honest[HOSTILE].content["arrays"])}),
                                      reply_to=c.requests[HOSTILE])], "metrics"),
    K("no-num-examples", "metrics", "refused", lambda c: c.hostile(metrics={"num-examples": None}), "metrics"),
    K("num-examples-zero", "metrics", "refused", lambda c: c.hostile(num_examples=0), "metrics"),
    K("num-examples-negative", "metrics", "refused", lambda c: c.hostile(num_examples=-5), "metrics"),
    K("num-examples-float", "metrics", "refused", lambda c: c.hostile(num_examples=12.5), "metrics"),
    K("num-examples-1e18", "metrics", "bounded", lambda c: c.hostile(num_examples=10**18)),
    K("loss-nan", "metrics", "refused", lambda c: c.hostile(metrics={"loss": float("nan")}), "metrics"),
    K("loss-inf", "metrics", "refused", lambda c: c.hostile(metrics={"loss": float("inf")}), "metrics"),
    K("loss-minus-inf", "metrics", "refused", lambda c: c.hostile(metrics={"loss": float("-inf")}), "metrics"),
    K("metric-list-with-nan", "metrics", "refused", lambda c: c.hostile(metrics={"alpha": [0.1, float("nan")]}),
      "metrics"),
    K("metric-list-too-long", "metrics", "refused", lambda c: c.hostile(metrics={"alpha": [0.0] * 5000}), "metrics"),
    K("metric-list-where-others-send-a-number", "metrics", "accepted", lambda c: c.hostile(metrics={"loss": [1.0, 2.0]}),
      reference=(1, 2, 3, 4)),
    K("metric-missing-key", "metrics", "accepted", lambda c: c.hostile(metrics={"loss": None}), reference=(1, 2, 3, 4)),
    K("extra-metric-record", "metrics", "refused",
      lambda c: c.hostile(extra={"aaa": MetricRecord({"num-examples": 10**9})}), "metrics"),
    K("extra-array-record", "layout", "refused",
      lambda c: c.hostile(extra={"more": ArrayRecord({"x": Array(np.zeros(3, np.float32))})})),
    K("no-array-record", "layout", "refused",
      lambda c: [*c.others(), reply_to(c.requests[HOSTILE], None)]),
    # --- declared layout and wire format (classes 1, 2)
    K("missing-tensor", "layout", "refused",
      lambda c: c.hostile(ArrayRecord({k: v for k, v in c.honest[HOSTILE].content["arrays"].items() if k != c.key()}))),
    K("extra-tensor", "layout", "refused",
      lambda c: c.hostile(ArrayRecord({**dict(c.honest[HOSTILE].content["arrays"].items()),
                                       "zz.extra/router": Array(np.zeros(2, np.float32))}))),
    K("wrong-shape", "layout", "refused", lambda c: raw(c, shape=tuple(reversed(c.shape())) + (1,))),
    K("negative-dimension", "layout", "refused", lambda c: raw(c, shape=(-1, *c.shape()[1:]))),
    K("dimensions-overflow-int64", "layout", "refused", lambda c: raw(c, shape=(2**62, 4, *c.shape()[1:]))),
    K("zero-size", "layout", "refused", lambda c: raw(c, shape=(0,), data=b"")),
    K("dtype-float64", "layout", "refused", lambda c: raw(c, dtype="float64")),
    K("dtype-int32", "layout", "refused", lambda c: raw(c, dtype="int32")),
    K("unknown-stype", "layout", "refused", lambda c: raw(c, stype="numpy.ndarray")),
    K("another-runs-wire-format", "layout", "refused", lambda c: raw(c, stype=FOREIGN_STYPE[c.stype()])),
    K("topk-decompression-bomb", "layout", "refused",
      lambda c: raw(c, shape=(2**31,), stype=codec.TOPK, data=_topk_data(c, [2**31 - 1], [1.0]))),
    K("lowrank-decompression-bomb", "layout", "refused",
      lambda c: raw(c, shape=(2**20, 2**20), stype=codec.LOWRANK, data=np.ones(2, "<f4").tobytes())),
    K("lowrank-empty-matrix", "layout", "refused", lambda c: raw(c, shape=(0, 0), stype=codec.LOWRANK, data=b"")),
    K("truncated-bytes", "layout", "refused", lambda c: raw(c, data=c.honest[HOSTILE].content["arrays"][c.key()].data[:-3])),
    K("extra-bytes", "layout", "refused",
      lambda c: raw(c, data=c.honest[HOSTILE].content["arrays"][c.key()].data + b"\0" * 8)),
    K("empty-bytes", "layout", "refused", lambda c: raw(c, data=b"")),
    # --- transport packing (strategies.packing): what the server unpacks gets the same checks
    K("packed-garbage", "layout", "refused", lambda c: _packed(c, cut=5)),
    K("packed-nan-values", "values", "refused",
      lambda c: _packed(c, c.with_array(constant_array(c, float("nan")))[-1])),
    # --- values and magnitudes (class 5)
    K("nan-values", "values", "refused", lambda c: c.with_array(constant_array(c, float("nan")))),
    K("inf-values", "values", "refused", lambda c: c.with_array(constant_array(c, float("inf")))),
    K("minus-inf-values", "values", "refused", lambda c: c.with_array(constant_array(c, float("-inf")))),
    K("values-1e30", "values", "refused", lambda c: c.with_array(constant_array(c, 1e30))),
    K("values-3e38", "values", "refused", lambda c: c.with_array(constant_array(c, 3e38))),
    K("values-1e5", "values", "bounded", lambda c: c.with_array(constant_array(c, 1e5)), refused_for=("fednl-gate",)),
    K("update-x100", "values", "bounded", lambda c: scaled(c, 100.0)),
    K("update-x1e4", "values", "bounded", lambda c: scaled(c, 1e4), refused_for=("fednl-gate", "fednl-meta-rules")),
    K("sign-flipped-x10", "values", "bounded", lambda c: scaled(c, -10.0)),
    K("reset-to-zero", "values", "bounded", _reset, applies=_dense),
    K("zero-update", "values", "accepted", _zero_update, reference=(1, 2, 3, 4), applies=_dense),
    K("every-client-nan", "values", "refused", _all_nan, reference=()),
    # --- int4 trailers
    K("int4-nan-scale", "int4", "refused",
      lambda c: raw(c, data=c.honest[HOSTILE].content["arrays"][c.key()].data[:-8] + struct.pack("<ff", float("nan"), 0)),
      applies=_int4),
    K("int4-inf-zero-point", "int4", "refused",
      lambda c: raw(c, data=c.honest[HOSTILE].content["arrays"][c.key()].data[:-8] + struct.pack("<ff", 0.1, float("inf"))),
      applies=_int4),
    K("int4-negative-scale", "int4", "refused",
      lambda c: raw(c, data=c.honest[HOSTILE].content["arrays"][c.key()].data[:-8] + struct.pack("<ff", -0.1, 0.0)),
      applies=_int4),
    K("int4-scale-2.3e37", "int4", "refused",
      lambda c: raw(c, data=c.honest[HOSTILE].content["arrays"][c.key()].data[:-8] + struct.pack("<ff", 2.3e37, 0.0)),
      applies=_int4),
    K("int4-padding-nibble", "int4", "refused",
      lambda c: _padding(c), applies=_odd_int4),
    # --- top-k and low-rank bodies
    K("topk-unsorted-indices", "compressed", "refused",
      lambda c: raw(c, data=_topk_data(c, np.arange(_topk_k(c))[::-1], np.ones(_topk_k(c)))),
      applies=lambda s, st: s.wire == "topk"),
    K("topk-index-out-of-range", "compressed", "refused",
      lambda c: raw(c, data=_topk_data(c, np.arange(_topk_k(c)) + 10**6, np.ones(_topk_k(c)))),
      applies=lambda s, st: s.wire == "topk"),
    K("topk-duplicate-index", "compressed", "refused",
      lambda c: raw(c, data=_topk_data(c, np.zeros(_topk_k(c)), np.ones(_topk_k(c)))),
      applies=lambda s, st: s.wire == "topk"),
    K("topk-more-entries-than-the-budget", "compressed", "refused",
      lambda c: raw(c, data=_topk_data(c, np.arange(int(np.prod(c.shape()))), np.zeros(int(np.prod(c.shape()))))),
      applies=lambda s, st: s.wire == "topk"),
    K("lowrank-ragged-bytes", "compressed", "refused", lambda c: _lowrank_ragged(c),
      applies=lambda s, st: s.wire == "powersgd"),
    K("lowrank-nan-factors", "compressed", "refused", lambda c: _lowrank_nan(c),
      applies=lambda s, st: s.wire == "powersgd"),
    # --- method-specific bounds and contracts
    K("flite-fingerprint-mismatch", "method", "refused",
      lambda c: c.hostile(extra={FINGERPRINT_RECORD: ConfigRecord({"fingerprint": "0" * 16})}),
      applies=lambda s, st: s.name.startswith("flite")),
    K("flite-fingerprint-missing", "method", "refused", lambda c: _without_fingerprint(c),
      applies=lambda s, st: s.name.startswith("flite")),
    K("fednl-gate-logit-1e3", "method", "refused", lambda c: _with_key_value(c, lambda k: k.endswith("fednl_gate"), 1e3),
      applies=lambda s, st: s.name.startswith("fednl")),
    K("fednl-gate-logit-minus-1e30", "method", "refused",
      lambda c: _with_key_value(c, lambda k: k.endswith("fednl_gate"), -1e30),
      applies=lambda s, st: s.name.startswith("fednl")),
    K("fednl-beta-bias-1e6", "method", "refused",
      lambda c: _with_key_value(c, lambda k: k.endswith("fednl_beta.bias"), 1e6),
      applies=lambda s, st: s.name.startswith("fednl")),
    K("smartfed-unknown-expert-id", "method", "refused", _sparse_change(lambda t: _set_ids(t, _ids_plus(t, 1000))),
      applies=lambda s, st: s.sparse),
    K("smartfed-inactive-expert-id", "method", "refused", lambda c: _inactive(c), applies=lambda s, st: s.sparse),
    K("smartfed-duplicated-ids", "method", "refused",
      _sparse_change(lambda t: _set_ids(t, [t[_first(t, "ids")][0]] * len(t[_first(t, "ids")]))),
      applies=lambda s, st: s.sparse),
    K("smartfed-fractional-ids", "method", "refused", _sparse_change(lambda t: _set_ids(t, _ids_plus(t, 0.5))),
      applies=lambda s, st: s.sparse),
    K("smartfed-negative-importance", "method", "refused",
      _sparse_change(lambda t: t[_first(t, "importance")].__setitem__((1, 0), -1.0)), applies=lambda s, st: s.sparse),
    K("smartfed-nan-importance", "method", "refused",
      _sparse_change(lambda t: t[_first(t, "importance")].__setitem__((1, 0), np.nan)), applies=lambda s, st: s.sparse),
    K("smartfed-huge-importance", "method", "accepted",
      _sparse_change(lambda t: t[_first(t, "importance")].__setitem__(1, 1e30)), reference=(1, 2, 3, 4),
      applies=lambda s, st: s.sparse),
    K("smartfed-unknown-matrix", "method", "refused",
      _sparse_change(lambda t: t.update({"model.layers.9.mlp.up_proj/ids": np.zeros(1, np.float32),
                                         "model.layers.9.mlp.up_proj/router": np.zeros((1, 6), np.float32)})),
      applies=lambda s, st: s.sparse),
    K("smartfed-router-only-carries-experts", "method", "refused",
      _sparse_change(lambda t: t.update({_first(t, "router")[:-len("router")] + "A": t[_first(t, "router")].copy()})),
      applies=lambda s, st: s.name == "smartfed-router-only"),
]
KIND_BY_NAME = {k.name: k for k in KINDS}


def _padding(c: Ctx) -> list[Message]:
    s = c.strategy
    key = sorted(k for k, shape in s.layout().items() if int(np.prod(shape)) % 2)[0]
    array = c.honest[HOSTILE].content["arrays"][key]
    data = bytearray(array.data)
    data[-9] |= 0xF0  # the high nibble of the last packed byte
    return c.with_array(Array(dtype="float32", shape=tuple(array.shape), stype=array.stype, data=bytes(data)), key)


def _lowrank_key(c: Ctx) -> str:
    return sorted(k for k, a in c.honest[HOSTILE].content["arrays"].items() if a.stype == codec.LOWRANK)[0]


def _lowrank_ragged(c: Ctx) -> list[Message]:
    key = _lowrank_key(c)
    array = c.honest[HOSTILE].content["arrays"][key]
    return c.with_array(Array(dtype="float32", shape=tuple(array.shape), stype=codec.LOWRANK, data=array.data[:-4]), key)


def _lowrank_nan(c: Ctx) -> list[Message]:
    key = _lowrank_key(c)
    array = c.honest[HOSTILE].content["arrays"][key]
    data = np.frombuffer(array.data, "<f4").copy()
    data[0] = np.nan
    return c.with_array(Array(dtype="float32", shape=tuple(array.shape), stype=codec.LOWRANK, data=data.tobytes()), key)


def _without_fingerprint(c: Ctx) -> list[Message]:
    msg = reply_to(c.requests[HOSTILE], copy.deepcopy(c.honest[HOSTILE].content["arrays"]))
    del msg.content[FINGERPRINT_RECORD]
    return [*c.others(), msg]


def _ids_plus(t: dict, offset: float) -> np.ndarray:
    return t[_first(t, "ids")] + offset


def _inactive(c: Ctx) -> list[Message]:
    tensors = _sparse_tensors(c)
    key = _first(tensors, "ids")
    matrix = key[: -len("/ids")]
    active = set(int(i) for i in c.strategy.allocation.active[matrix])
    outside = [i for i in range(c.strategy.expert_layout[matrix].num_experts) if i not in active]
    ids = tensors[key].copy()
    ids[0] = outside[0]
    tensors[key] = np.sort(ids).astype(np.float32) if len(set(ids.tolist())) == len(ids) else ids
    return c.hostile(sparse.encode(tensors))


# ------------------------------------------------------------------------------ the harness
@dataclass
class Result:
    outcome: str  # refused | bounded | accepted | n/a
    detail: str = ""
    distance: float = 0.0
    bound: float = 0.0


def _round_one(spec: Spec, robustness=None):
    """Round 1 (all honest) on the strategy under test, the honest-only reference and a probe
    (which measures round 2's replies as the strategy saw them)."""
    kw = {} if robustness is None else {"robustness": robustness}
    strategy, reference, probe = spec.build(**kw), spec.build(**kw), spec.build(**kw)
    requests = configured_round(strategy, 1)
    round1 = {n: reply_to(requests[n], honest_payload(spec, strategy, n, 1)) for n in NODES}
    sent = copy.deepcopy(round1)  # as sent (an aggregated message holds memoryviews: no deep copy)
    for s in (strategy, reference, probe):
        s.aggregate_train(1, list(round1.values()))
    return strategy, reference, probe, sent


@functools.cache
def _round_one_of(spec_name: str):
    return _round_one(SPEC_BY_NAME[spec_name])


def _run_rounds(spec: Spec, robustness=None):
    """:func:`_round_one`, then round 2's messages pushed. Round 1 is the same for every kind (honest,
    deterministic): with the default robustness it runs once per strategy and each case gets a
    deep copy of its outcome (two thirds of a case's time before)."""
    if robustness is None:
        strategy, reference, probe, round1 = copy.deepcopy(_round_one_of(spec.name))
    else:
        strategy, reference, probe, round1 = _round_one(spec, robustness)
    requests = configured_round(strategy, 2)
    honest = {n: reply_to(requests[n], honest_payload(spec, strategy, n, 2)) for n in NODES}
    return strategy, reference, probe, Ctx(spec, strategy, requests, honest, round1)


@functools.cache
def _built(spec_name: str) -> PayloadFedAvg:
    return SPEC_BY_NAME[spec_name].build()


def applies(spec: Spec, kind: Kind) -> bool:
    """Whether ``kind`` can be sent to ``spec``'s strategy at all (its wire format, layout, method),
    decided on a freshly built strategy: no round is run (a kind's ``applies`` reads only what
    the strategy is built with)."""
    return kind.applies(spec, _built(spec.name))


def applicable_cases() -> list[tuple[Spec, Kind]]:
    """Every (strategy, kind) pair that can happen, kind-major: the cases tests/test_hostile.py runs."""
    return [(spec, kind) for kind in KINDS for spec in SPECS if applies(spec, kind)]


def run_case(spec: Spec, kind: Kind, robustness=None) -> Result:
    """Drive one kind through one strategy; raises AssertionError where the outcome is wrong.
    ``n/a`` (nothing built, no round run) where the kind cannot be sent to the strategy."""
    if not applies(spec, kind):
        return Result("n/a")
    strategy, reference, probe, ctx = _run_rounds(spec, robustness)
    replies = kind.make(ctx)
    for reply in replies:  # as fedapps.runner.collect_replies receives them: packed arrays unpacked
        packing.receive(reply)
    strategy.aggregate_train(2, replies)  # must not raise, whatever the replies hold
    counted = [ctx.honest[n] for n in kind.reference]
    if counted:
        reference.aggregate_train(2, counted)
    expected = kind.expected(spec)
    hostile = strategy.round_record()["refused"]
    if expected == "refused":
        refusal = "payload" if spec.name in kind.refused_for else kind.refusal
        result = _refused(kind, refusal, strategy, reference, hostile)
    elif expected == "accepted":
        # harmless: counted as it is, and what it holds beside its payload changes nothing — the same
        # strategy (the same robust settings) fed the same payloads with honest metrics reaches the same state
        assert not [r for r in strategy.round_record()["refused"] if r["node_id"] == HOSTILE], strategy.round_record()["refused"]
        plain = spec.build(**({} if robustness is None else {"robustness": robustness}))
        plain.aggregate_train(1, list(ctx.round1.values()))
        plain.aggregate_train(2, [_with_honest_metrics(r, ctx) for r in replies])
        assert _same_state(strategy, plain), f"{kind.name}: the state differs from the same replies with honest metrics"
        result = Result("accepted")
    else:
        assert not [r for r in strategy.round_record()["refused"] if r["node_id"] == HOSTILE], strategy.round_record()["refused"]
        distance, bound = _distance_and_bound(strategy, reference, probe, replies)
        assert distance <= bound * (1 + 1e-5) + 1e-6, f"{kind.name}: moved {distance} from the honest mean, bound {bound}"
        bounded = sorted({b["kind"] for b in strategy.round_record()["bounded"] if b["node_id"] == HOSTILE})
        result = Result("bounded", ", ".join(bounded) or "within the bound, unclipped", distance, bound)
    _next_downlink_works(strategy)
    return result


def _with_honest_metrics(msg: Message, ctx: Ctx) -> Message:
    """``msg`` with its node's honest metrics (a hostile reply's own metrics swapped out)."""
    node = int(msg.metadata.src_node_id)
    if node != HOSTILE or "metrics" not in ctx.honest[node].content.metric_records:
        return msg
    content = RecordDict({name: record for name, record in msg.content.items()
                          if name not in msg.content.metric_records})
    content["metrics"] = ctx.honest[node].content["metrics"]
    return Message(content, reply_to=ctx.requests[node])


def _refused(kind: Kind, refusal: str, strategy, reference, refused: list[dict]) -> Result:
    assert refused, f"{kind.name}: nothing refused; round record {strategy.round_record()}"
    kinds = {r["kind"] for r in refused}
    assert refusal in kinds, f"{kind.name}: refused as {kinds}, expected {refusal}: {refused}"
    assert all(r["reason"] for r in refused)
    assert _same_state(strategy, reference), f"{kind.name}: the state differs from the honest-only aggregate"
    return Result("refused", next(r["reason"] for r in refused if r["kind"] == refusal))


def _same_state(a: PayloadFedAvg, b: PayloadFedAvg) -> bool:
    return set(a.global_state) == set(b.global_state) and all(
        np.array_equal(a.global_state[k], b.global_state[k]) for k in a.global_state)


def _distance_and_bound(strategy, reference, probe, replies: list[Message]) -> tuple[float, float]:
    """‖new − honest-only mean‖ and its documented bound ``s·(‖u_h‖ + max honest ‖u_i‖)``, with
    s the hostile reply's weight share after the example cap and ‖u_h‖ its norm after the
    clip (at most norm_multiple × the lower median of the round's norms). With an adaptive server
    optimiser the step replaces the mean update: two steps differ by at most twice its per-coordinate
    bound in every coordinate (``ServerOptimizer.step_bound``)."""
    from strategies import robust

    if not strategy.server_opt.plain:
        diff = robust.norm({key: strategy.global_state[key].astype(np.float64) - reference.global_state[key]
                            for key in strategy.global_state})
        size = sum(strategy.global_state[k].size for k in strategy.uplink_keys)
        return diff, 2.0 * strategy.server_opt.step_bound() * float(np.sqrt(size))

    settings = strategy.robustness
    probe._start_round(2)
    norms, weights = {}, {}
    for msg in replies:
        node = int(msg.metadata.src_node_id)
        payload, n = probe.validate_reply(msg)
        norms[node], weights[node] = probe.update_norm(payload), n
    order = sorted(norms)
    capped = dict(zip(order, robust.cap_weights([weights[n] for n in order], settings)))
    limit = robust.clip_bound([norms[n] for n in order], settings)
    effective = {n: norms[n] if limit is None else min(norms[n], limit) for n in order}
    share = capped[HOSTILE] / float(sum(capped.values()))
    bound = share * (effective[HOSTILE] + max(v for n, v in effective.items() if n != HOSTILE))
    diff = robust.norm({key: strategy.global_state[key].astype(np.float64) - reference.global_state[key]
                        for key in strategy.global_state})
    return diff, bound


def _next_downlink_works(strategy: PayloadFedAvg) -> None:
    messages = strategy.configure_train(3, strategy.downlink_arrays(), ConfigRecord(), FakeGrid())
    assert messages, "no round-3 messages"
    decoded = codec.decode(messages[0].content["arrays"])
    assert all(np.all(np.isfinite(v)) for v in decoded.values())
    assert all(np.all(np.isfinite(v)) for v in strategy.global_state.values())
