"""SmartFed's server strategy: sparse FedAvg of routed rank-1 experts under EEQA quotas.

The global model is an :class:`~strategies.ExpertState` — every expert of the
knowledge pool (its A row, B column and router row) — and an EEQA allocation saying which
experts are *active*. One round ``t`` (allocation ``alloc_t``):

1. **Downlink.** Every sampled client receives the same packed *state* of the active
   experts only (``ids``, ``router``, ``A``, ``B`` per matrix;
   :meth:`ExpertState.gather`). In router-only runs the frozen A/B travel too, so clients
   never need the pool. The train/evaluate ConfigRecord carries the backbone fingerprint
   of the pool (``backbone-fingerprint``): a client whose model differs refuses to train.
2. **Uplink.** A client replies with the deltas of the experts it updated (router rows,
   and A/B unless router-only) and the importance of every active expert it measured.
3. **Validation.** :func:`strategies.sparse.decode` checks each reply against the layout,
   the round's active sets and its budget (unknown expert ids, wrong shapes, NaN/Inf,
   A/B in a router-only run, budget overrun); a bad reply is refused with its reason in
   the round record and the round goes on with the others.
4. **Aggregation.** Each expert's delta is averaged over the clients that sent it,
   weighted by their ``num-examples`` (:func:`strategies.expert_state.aggregate`); experts
   nobody updated keep their values.
5. **Re-allocation.** The aggregated importance (each client's report first rescaled to a
   common total, so that no client steers the allocation beyond its example share) feeds
   :meth:`EEQA.step`, which prunes experts that stayed unimportant and shares the budget
   out again: ``alloc_{t+1}``. A round with no accepted reply keeps the allocation.
   The evaluation of round ``t`` (and the saved final model) use ``alloc_{t+1}``: the
   mixture exactly as it is sent next.

Round 1 has no measurement yet: EEQA shares the budget in proportion to the matrices'
expert counts, and within a matrix the experts with the largest pooled update
``‖A_i‖·‖B_i‖`` (the Frobenius norm of the rank-1 term) are active — rather than EEQA's
index tie-break, which would pick the first adapter's experts everywhere.

Byte accounting, refusal logging, round records and evaluation are
:class:`~strategies.base.PayloadFedAvg`'s; each round record gains a ``smartfed`` entry
(active experts, quotas per projection kind, pruning, experts updated) and each client
``uplink_experts``. numpy only: no model code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid

from strategies import codec, robust, sparse
from strategies.base import PayloadFedAvg
from strategies.channel import LATENT_KEY, LatentChannel
from strategies.codec import PayloadError
from strategies.eeqa import EEQA, Allocation, select_active
from strategies.expert_state import ExpertState, aggregate
from strategies.robust import Robustness
from strategies.server_opt import ServerOptimizer
from strategies.step import Combined, Step

BACKBONE_KEY = "backbone-fingerprint"  # ConfigRecord key: the pool's backbone fingerprint
LAYOUT_KEY = "layout-fingerprint"  # ConfigRecord key: the server's expert layout (for logs)


def matrix_kind(matrix: str) -> str:
    """``"model.layers.3.self_attn.q_proj"`` -> ``"q_proj"`` (for per-kind summaries)."""
    return matrix.rsplit(".", 1)[-1]


def normalise_importance(payloads: list[Mapping[str, sparse.MatrixPayload]]) -> list[dict[str, sparse.MatrixPayload]]:
    """Each client's importance report rescaled to the same total (the lower median of the
    clients' totals): a client's pull on the next allocation is its example share, however
    large the numbers it reports."""
    totals = [sum(float(np.sum(p.importance)) for p in parts.values() if p.importance is not None)
              for parts in payloads]
    positive = [t for t in totals if t > 0]
    if not positive:
        return [dict(parts) for parts in payloads]
    target = robust.lower_median(positive)
    out = []
    for parts, total in zip(payloads, totals):
        factor = target / total if total > 0 else 1.0
        out.append({m: replace(p, importance=None if p.importance is None else
                               (p.importance.astype(np.float64) * factor).astype(np.float32))
                    for m, p in parts.items()})
    return out


def prior_importance(state: ExpertState) -> dict[str, np.ndarray]:
    """Data-free importance of each pooled expert: ``‖A_i‖·‖B_i‖`` (its rank-1 term's norm)."""
    return {
        m: np.linalg.norm(state.A[m], axis=1).astype(np.float64) * np.linalg.norm(state.B[m], axis=1)
        for m in state.layout
    }


class SmartFedStrategy(PayloadFedAvg):
    """Sparse expert FedAvg with EEQA re-allocation each round (see the module docstring).

    Args:
        state: the initial global mixture (``ExpertState.initial`` from the pool's experts).
        eeqa: the quota allocator, built for ``state.layout.num_experts`` (fresh, not stepped).
        backbone_fingerprint: the pool's backbone fingerprint, sent to clients.
        **kwargs: :class:`PayloadFedAvg`'s (``config_yaml``, ``num_clients``, formats, ...).
    """

    def __init__(self, *, state: ExpertState, eeqa: EEQA, backbone_fingerprint: str,
                 latent: Callable[[dict[str, tuple[int, ...]]], LatentChannel] | None = None,
                 router_rounds: int | None = None, **kwargs) -> None:
        layout = state.layout
        if sorted(eeqa.num_experts.items()) != sorted(layout.num_experts.items()):
            raise ValueError("EEQA was built for other matrices or expert counts than the expert layout")
        if eeqa.rounds:
            raise ValueError("pass a fresh EEQA (it is stepped by the strategy)")
        self.check_settings(kwargs.get("robustness"), kwargs.get("server_optimizer"))
        initial = state.to_tensors()
        fields = ("router", "A", "B") if layout.train_experts else ("router",)
        keys = [f"{m}/{f}" for m in layout for f in fields]
        super().__init__(initial_state=initial, uplink_keys=keys, **kwargs)
        self.expert_layout = layout
        self.state = state
        self.eeqa = eeqa
        self.backbone_fingerprint = str(backbone_fingerprint)
        self.layout_fingerprint = layout.fingerprint()
        self.allocation = self._first_allocation()
        self.allocations: list[dict] = [self._describe(self.allocation, 0)]
        self._round_allocation: Allocation | None = None
        self._importance: dict[str, np.ndarray] | None = None
        if latent is not None and self.uplink_format not in codec.FORMATS:
            raise ValueError("the latent channel sends fp32 or int4 latents")
        self.latent = latent  # the latent channel: shapes -> LatentChannel over the round's active experts
        if router_rounds is not None and (isinstance(router_rounds, bool) or int(router_rounds) < 1):
            raise ValueError(f"router_rounds must be null or an integer >= 1, got {router_rounds!r}")
        if router_rounds is not None and not layout.train_experts:
            raise ValueError("router-only SmartFed trains only the routers: freezing them leaves nothing to train")
        self.router_rounds = None if router_rounds is None else int(router_rounds)
        self._latent: tuple[object, LatentChannel] | None = None

    @staticmethod
    def check_settings(robustness: Robustness | None, optimizer: ServerOptimizer | None) -> None:
        """The robust aggregator and server optimiser SmartFed's sparse expert updates allow; ValueError naming the
        fix. The config check (``fedapps.smartfed.check``) and the strategy both ask here."""
        if robustness is not None and robustness.aggregator != "mean":
            raise ValueError(f"SmartFed's sparse expert updates are combined by the weighted mean only; "
                             f"robust.aggregator={robustness.aggregator!r} is not supported (use robust=default "
                             "or robust=off)")
        if optimizer is not None and not optimizer.plain:
            raise ValueError(f"SmartFed applies its sparse expert updates as they are (the active experts change "
                             f"every round); strategy.server_optimizer.name={optimizer.name!r} is not supported "
                             "(use fedavg)")

    # ------------------------------------------------------------------ allocation
    def _first_allocation(self) -> Allocation:
        allocation = self.eeqa.step(None)
        prior = prior_importance(self.state)
        allocation.active = {m: select_active(prior[m], q) for m, q in allocation.quotas.items()}
        return allocation

    def _describe(self, allocation: Allocation, server_round: int) -> dict:
        by_kind: dict[str, int] = {}
        for m, q in allocation.quotas.items():
            by_kind[matrix_kind(m)] = by_kind.get(matrix_kind(m), 0) + int(q)
        return {
            "for_round": server_round + 1,
            "active_experts": int(allocation.total),
            "quotas_by_kind": dict(sorted(by_kind.items())),
            "pruned_now": int(sum(len(v) for v in allocation.pruned.values())),
            "pruned_total": int(sum(int(v.sum()) for v in self.eeqa.pruned.values())),
        }

    def active_sets(self) -> dict[str, list[int]]:
        """The current allocation's active expert indices per matrix (JSON-able)."""
        return {m: [int(i) for i in ids] for m, ids in self.allocation.active.items() if len(ids)}

    # ------------------------------------------------------------------ downlink
    @property
    def allocation(self) -> Allocation:
        """Which experts are active (EEQA's quotas); the downlink follows it."""
        return self._allocation

    @allocation.setter
    def allocation(self, value: Allocation) -> None:
        self._allocation = value
        self.downlink.changed()  # a new allocation sends other experts

    def encode_downlink(self) -> ArrayRecord:
        """The active experts' values (router rows, A rows, B columns) of the current allocation."""
        return sparse.encode(self.state.gather(self.allocation.active), self.downlink_format)

    def _tag(self, config: ConfigRecord) -> None:
        config[BACKBONE_KEY] = self.backbone_fingerprint
        config[LAYOUT_KEY] = self.layout_fingerprint

    def routers_frozen(self, server_round: int) -> bool:
        """Whether round ``server_round`` trains the routers (``router_rounds``: the first N rounds only)."""
        return self.router_rounds is not None and server_round > self.router_rounds

    def train_config_for(self, server_round: int, node_id: int, config: ConfigRecord) -> ConfigRecord:
        config = super().train_config_for(server_round, node_id, config)
        config["router-frozen"] = self.routers_frozen(server_round)
        return config

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        self._round_allocation = self.allocation  # replies are checked against what was sent
        self._tag(config)
        return super().configure_train(server_round, arrays, config, grid)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        self._tag(config)
        return super().configure_evaluate(server_round, arrays, config, grid)

    # ------------------------------------------------------------------ uplink
    def decode(self, record: ArrayRecord, node_id: int) -> dict[str, sparse.MatrixPayload]:
        """One training reply's record as validated sparse parts; PayloadError says why not."""
        allocation = self._round_allocation or self.allocation
        router = not self.routers_frozen(self.ledger.current.get("round", 0))
        if self.latent is not None:
            parts = self._from_latents(record, allocation, router)
        else:
            self.check_wire(record)
            parts = sparse.decode(
                record,
                self.expert_layout,
                kind="update",
                active=allocation.active,
                budget=allocation.total,
                router=router,
            )
        self.ledger.client(node_id)["uplink_experts"] = int(sum(p.ids.size for p in parts.values()))
        return parts

    # ------------------------------------------------------------------ the latent channel
    def latent_shapes(self, allocation: Allocation, router: bool = True) -> dict[str, tuple[int, ...]]:
        """The tensors a client trains this round, named as on its model: each active matrix's MoRE
        layer's ``router`` (k×d_in; unless frozen) and, unless router-only, ``expert_A`` (k×d_in),
        ``expert_B`` (d_out×k)."""
        shapes = {}
        for m, ids in allocation.active.items():
            k = len(ids)
            if not k:
                continue
            ml = self.expert_layout[m]
            if router:
                shapes[f"{m}.router"] = (k, ml.d_in)
            if self.expert_layout.train_experts:
                shapes[f"{m}.expert_A"] = (k, ml.d_in)
                shapes[f"{m}.expert_B"] = (ml.d_out, k)
        return shapes

    def _from_latents(self, record: ArrayRecord, allocation: Allocation, router: bool) -> dict[str, sparse.MatrixPayload]:
        """A latent-channel reply (``latent`` + importance reports) -> the deltas of every active expert."""
        if self._latent is None or self._latent[0] is not (allocation, router):
            self._latent = ((allocation, router), self.latent(self.latent_shapes(allocation, router)))
        channel = self._latent[1]
        if LATENT_KEY not in record:
            raise PayloadError(f"a latent-channel reply carries '{LATENT_KEY}'")
        array = record[LATENT_KEY]
        shape = codec.check_declared(LATENT_KEY, array, {codec.FORMATS[self.uplink_format]})
        if shape != (channel.size,) or len(array.data) != codec.expected_nbytes(shape, array.stype):
            raise PayloadError(f"'{LATENT_KEY}' has shape {shape} ({len(array.data)} bytes); this round sends "
                               f"{channel.size} latents")
        reports = ArrayRecord()
        for key, value in record.items():
            if key == LATENT_KEY:
                continue
            if sparse.split_key(key)[1] != "importance":
                raise PayloadError(f"'{key}': a latent-channel reply carries the latents and importance reports only")
            codec.check_declared(key, value, {codec.FP32})
            reports[key] = value
        parts = sparse.decode(reports, self.expert_layout, kind="update", active=allocation.active,
                              budget=allocation.total)
        deltas = channel.expand(self.ledger.current.get("round", 0), codec.decode(ArrayRecord({LATENT_KEY: array})))
        for m, ids in allocation.active.items():
            if not len(ids):
                continue
            part = parts.get(m) or sparse.MatrixPayload(ids=np.zeros(0, np.int64))
            part.ids = np.asarray(sorted(int(i) for i in ids), np.int64)  # the downlink's order
            if router:
                part.router = deltas[f"{m}.router"].astype(np.float32)
            if self.expert_layout.train_experts:
                part.A = deltas[f"{m}.expert_A"].astype(np.float32)
                part.B = deltas[f"{m}.expert_B"].T.astype(np.float32)
            parts[m] = part
        return parts

    def check_wire(self, record: ArrayRecord) -> None:
        """Declared shapes, dtypes and wire formats before decoding: ids and importance in fp32,
        values in this run's uplink format."""
        values = {codec.FORMATS[self.uplink_format]}
        for key, array in record.items():
            _, field = sparse.split_key(key)
            codec.check_declared(key, array, values if field in sparse.VALUE_FIELDS else {codec.FP32})

    # bounded influence over sparse deltas: the norm of what a client changes, and what it proposes; no
    # centered clipping (robust.center): a coordinate-wise median over clients' different expert rows is
    # no client's update
    dense_updates = False
    # importance-normalised sparse FedAvg over each client's active experts: not a mean of dense updates that
    # differential privacy or secure aggregation could release (both are refused)
    linear = False

    def update_norm(self, payload: Mapping[str, sparse.MatrixPayload]) -> float:
        return robust.norm({f"{m}/{n}": getattr(p, n) for m, p in payload.items() for n in sparse.VALUE_FIELDS
                            if getattr(p, n) is not None})

    def scale_update(self, payload: Mapping[str, sparse.MatrixPayload], factor: float):
        return {m: replace(p, **{n: (getattr(p, n).astype(np.float64) * factor).astype(np.float32)
                                 for n in sparse.VALUE_FIELDS if getattr(p, n) is not None})
                for m, p in payload.items()}

    def proposed_values(self, payload: Mapping[str, sparse.MatrixPayload]):
        for m, part in payload.items():
            for name in sparse.VALUE_FIELDS:
                value = getattr(part, name)
                if value is not None and part.ids.size:
                    yield f"{m}/{name}", getattr(self.state, name)[m][part.ids] + value

    def combine(self, payloads: list[Mapping[str, sparse.MatrixPayload]], weights: list[int]):
        """Sparse example-weighted FedAvg of the deltas, importance normalised per client: the update that
        moves the global tensors to the new expert state, handed to :meth:`commit` (``Combined.kept``, with the
        round's importance, for EEQA) and kept once the result is known to be finite."""
        payloads = normalise_importance(payloads)
        new_state, importance = aggregate(self.state, [(p, float(w)) for p, w in zip(payloads, weights)])
        updated = 0
        for m in self.expert_layout:
            touched = np.zeros(self.expert_layout[m].num_experts, bool)
            for payload in payloads:
                if m in payload and payload[m].ids.size:
                    touched[payload[m].ids] = True
            updated += int(touched.sum())
        return Combined({k: v.astype(np.float64) - self.global_state[k] for k, v in new_state.to_tensors().items()},
                        kept=(new_state, importance, updated))

    def commit(self, step: Step) -> None:
        super().commit(step)
        self.state, self._importance, self.ledger.current["experts_updated"] = step.kept

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        self._importance = None
        result = super().aggregate_train(server_round, replies)
        if result[0] is None:  # nothing accepted (or the round refused): the allocation stands
            self.ledger.current["smartfed"] = {"for_round": server_round + 1, "reallocated": False,
                                       "active_experts": int(self.allocation.total)}
            self._round_allocation = None
            return result
        self._reallocate(server_round)
        return result

    def _reallocate(self, server_round: int) -> None:
        """EEQA step with the round's aggregated importance (only after a round that changed the state)."""
        self.allocation = self.eeqa.step(self._importance or {})
        described = self._describe(self.allocation, server_round)
        described["experts_updated"] = int(self.ledger.current.pop("experts_updated", 0))
        self.allocations.append(described)
        self.ledger.current["smartfed"] = described
        self._round_allocation = None

    # ------------------------------------------------------------------ checkpoint
    def checkpoint(self) -> tuple[dict[str, np.ndarray], dict]:
        """(every expert's tensors, packed; JSON-able EEQA state and current allocation)."""
        meta = {
            "layout_fingerprint": self.layout_fingerprint,
            "backbone_fingerprint": self.backbone_fingerprint,
            "eeqa": self.eeqa.state_dict(),
            "quotas": {m: int(q) for m, q in self.allocation.quotas.items()},
            "active": self.active_sets(),
            "allocations": self.allocations,
        }
        return self.state.to_tensors(), meta

    def state_dict(self) -> tuple[dict[str, np.ndarray], dict]:
        """The base checkpoint (every expert's tensors, history) plus EEQA and the allocation."""
        arrays, meta = super().state_dict()
        _, smartfed = self.checkpoint()
        meta["smartfed"] = smartfed
        return arrays, meta

    def load_state_dict(self, arrays: Mapping[str, np.ndarray], meta: Mapping) -> None:
        """Restore :meth:`state_dict`: experts, EEQA memory and pruning, the next round's allocation."""
        smartfed = meta.get("smartfed")
        if smartfed is None:
            raise ValueError("the checkpoint has no SmartFed state (expert allocation, EEQA): it was not "
                             "written by a SmartFed run")
        for key, ours in (("layout_fingerprint", self.layout_fingerprint),
                          ("backbone_fingerprint", self.backbone_fingerprint)):
            if smartfed.get(key) != ours:
                raise ValueError(f"the checkpoint's {key.replace('_', ' ')} {smartfed.get(key)!r} is not this run's "
                                 f"{ours!r} (another pool or backbone)")
        super().load_state_dict(arrays, meta)
        self.state = ExpertState.from_tensors(self.expert_layout, self.global_state)
        self.eeqa.load_state_dict(smartfed["eeqa"])
        active = {m: np.asarray(smartfed["active"].get(m, []), np.int64) for m in self.expert_layout}
        quotas = {m: int(q) for m, q in smartfed["quotas"].items()}
        self.allocation = Allocation(quotas=quotas, active=active, pruned={m: np.zeros(0, np.int64) for m in active},
                                     importance={}, total=int(sum(quotas.values())))
        self.allocations = list(smartfed.get("allocations", []))
        self._round_allocation = None
        self._importance = None
