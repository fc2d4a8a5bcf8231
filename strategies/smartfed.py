"""SmartFed's server strategy: sparse FedAvg of routed rank-1 experts under EEQA quotas.

The global model is an :class:`~strategies.sparse.ExpertState` — every expert of the
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
   weighted by their ``num-examples`` (:func:`strategies.sparse.aggregate`); experts
   nobody updated keep their values.
5. **Re-allocation.** The aggregated importance feeds :meth:`EEQA.step`, which prunes
   experts that stayed unimportant and shares the budget out again: ``alloc_{t+1}``.
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

from collections.abc import Iterable, Mapping

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid

from strategies import sparse
from strategies.base import PayloadFedAvg
from strategies.eeqa import EEQA, Allocation, select_active

BACKBONE_KEY = "backbone-fingerprint"  # ConfigRecord key: the pool's backbone fingerprint
LAYOUT_KEY = "layout-fingerprint"  # ConfigRecord key: the server's expert layout (for logs)


def matrix_kind(matrix: str) -> str:
    """``"model.layers.3.self_attn.q_proj"`` -> ``"q_proj"`` (for per-kind summaries)."""
    return matrix.rsplit(".", 1)[-1]


def prior_importance(state: sparse.ExpertState) -> dict[str, np.ndarray]:
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

    def __init__(self, *, state: sparse.ExpertState, eeqa: EEQA, backbone_fingerprint: str, **kwargs) -> None:
        layout = state.layout
        if sorted(eeqa.num_experts.items()) != sorted(layout.num_experts.items()):
            raise ValueError("EEQA was built for other matrices or expert counts than the expert layout")
        if eeqa.rounds:
            raise ValueError("pass a fresh EEQA (it is stepped by the strategy)")
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
    def downlink_arrays(self) -> ArrayRecord:
        """The active experts' values (router rows, A rows, B columns) of the current allocation."""
        return sparse.encode(self.state.gather(self.allocation.active), self.downlink_format)

    def _tag(self, config: ConfigRecord) -> None:
        config[BACKBONE_KEY] = self.backbone_fingerprint
        config[LAYOUT_KEY] = self.layout_fingerprint

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        self._round_allocation = self.allocation  # replies are checked against what was sent
        self._tag(config)
        return super().configure_train(server_round, arrays, config, grid)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        self._tag(config)
        return super().configure_evaluate(server_round, arrays, config, grid)

    # ------------------------------------------------------------------ uplink
    def validate_reply(self, msg: Message) -> tuple[dict[str, sparse.MatrixPayload], int]:
        """Decode one training reply into validated sparse parts; PayloadError says why not."""
        record, num_examples = self.reply_record(msg)
        allocation = self._round_allocation or self.allocation
        parts = sparse.decode(
            record,
            self.expert_layout,
            kind="update",
            active=allocation.active,
            budget=allocation.total,
        )
        client = self._client(msg.metadata.src_node_id)
        client["uplink_experts"] = int(sum(p.ids.size for p in parts.values()))
        return parts, num_examples

    def aggregate_payloads(self, payloads: list[Mapping[str, sparse.MatrixPayload]], weights: list[int]):
        """Sparse example-weighted FedAvg of the deltas; keeps the round's importance for EEQA."""
        new_state, importance = sparse.aggregate(self.state, [(p, float(w)) for p, w in zip(payloads, weights)])
        updated = 0
        for m in self.expert_layout:
            touched = np.zeros(self.expert_layout[m].num_experts, bool)
            for payload in payloads:
                if m in payload and payload[m].ids.size:
                    touched[payload[m].ids] = True
            updated += int(touched.sum())
        self.state = new_state
        self._importance = importance
        self._round["experts_updated"] = updated
        return new_state.to_tensors()

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        self._importance = None
        result = super().aggregate_train(server_round, replies)
        self._reallocate(server_round)
        return result

    def _reallocate(self, server_round: int) -> None:
        """EEQA step with the round's aggregated importance (none if every reply was refused)."""
        self.allocation = self.eeqa.step(self._importance or {})
        described = self._describe(self.allocation, server_round)
        described["experts_updated"] = int(self._round.pop("experts_updated", 0))
        self.allocations.append(described)
        self._round["smartfed"] = described
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
        self.state = sparse.ExpertState.from_tensors(self.expert_layout, self.global_state)
        self.eeqa.load_state_dict(smartfed["eeqa"])
        active = {m: np.asarray(smartfed["active"].get(m, []), np.int64) for m in self.expert_layout}
        quotas = {m: int(q) for m, q in smartfed["quotas"].items()}
        self.allocation = Allocation(quotas=quotas, active=active, pruned={m: np.zeros(0, np.int64) for m in active},
                                     importance={}, total=int(sum(quotas.values())))
        self.allocations = list(smartfed.get("allocations", []))
        self._round_allocation = None
        self._importance = None
