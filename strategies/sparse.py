"""SmartFed's sparse expert payload, the wire format: layout, packing, validation, deltas.

Server and clients share an :class:`ExpertLayout`: for every target matrix (e.g.
``model.layers.0.self_attn.q_proj``) its input/output sizes and the ordered ids of its
rank-1 experts (``"adapter:i"``, see ``clients.pool``). On the wire an expert is
named by its *index* in that order.

Per expert the trainable tensors are its down-projection row ``A_i ∈ R^{d_in}``, its
(scaled) up-projection column ``B_i ∈ R^{d_out}`` and its router row ``R_i ∈ R^{d_in}``
(the router of a matrix is ``W_router ∈ R^{E×d_in}``; only active experts' rows are ever
used, so only those travel).

Packed form
-----------
A payload (client -> server update, or server -> client state) is a flat
``dict[str, np.ndarray]``, per matrix ``m`` that it touches::

    m/ids         (k,)        expert indices into the layout's ids (integers, exact in fp32)
    m/router      (k, d_in)   router rows
    m/A           (k, d_in)   expert down-projection rows     (absent in router-only mode)
    m/B           (k, d_out)  expert up-projection columns, stored as rows (absent likewise)
    m/importance  (2, k')     update only, optional: row 0 expert indices, row 1 their
                              importance (EMA of gate mass × ‖expert output‖)

and goes on the wire as one ``ArrayRecord`` through :mod:`strategies.codec` (raw fp32).
An update carries *deltas* (the client's value minus the value it downloaded); a state
carries values. The importance report has its own ids because it covers every active
expert the client measured, while the deltas cover only the experts that changed: an
expert no token was routed to has no gradient, hence no delta (it is not sent, see
:func:`delta`), but its importance 0 is what lets EEQA prune it.

Why packed rather than one key per expert (``expert/<id>/A``, ``expert/<id>/B``, ...)?
Flower 1.42 sends a record as a tree of objects: every ``Array`` costs, beyond its data,
its name and 64-hex-digit object id in the record's body, its own body (dtype, shape,
stype, chunk ids) and an ``ArrayChunk`` header — about 360 bytes (:func:`wire_bytes`
measures it). Keyed, that is 2–3 arrays per expert; packed, 2–4 arrays per *matrix* plus
4 bytes per id. Measured for 8 experts of a 576×576 matrix (SmolLM2's q_proj):
56.7 kB packed vs 63.9 kB keyed in experts+router mode, 19.2 kB vs 21.3 kB router-only.
Keyed wins only for a matrix that sends a single expert (router-only: 2.7 vs 3.0 kB);
quotas are normally several experts per matrix. ``tests/test_sparse_payload.py`` checks it.

What the server keeps and how it averages these payloads is :mod:`strategies.expert_state`
(clients import this module, never that one).

numpy and flwr only: strategies never import clients or torch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord

from strategies import codec
from strategies.codec import PayloadError

FIELDS = ("ids", "router", "A", "B", "importance")
EXPERT_FIELDS = ("A", "B")
VALUE_FIELDS = ("router", "A", "B")
MAX_EXPERTS = 2**24  # indices travel as fp32, exact below 2^24
KINDS = ("update", "state")


# -------------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class MatrixLayout:
    """One target matrix: ``W ∈ R^{d_out×d_in}`` and the ordered ids of its experts."""

    d_in: int
    d_out: int
    expert_ids: tuple[str, ...]

    def __post_init__(self):
        object.__setattr__(self, "expert_ids", tuple(str(i) for i in self.expert_ids))
        if self.d_in <= 0 or self.d_out <= 0:
            raise ValueError(f"matrix sizes must be positive, got d_in={self.d_in}, d_out={self.d_out}")
        if len(set(self.expert_ids)) != len(self.expert_ids):
            raise ValueError("expert ids must be unique within a matrix")
        if len(self.expert_ids) >= MAX_EXPERTS:
            raise ValueError(f"at most {MAX_EXPERTS - 1} experts per matrix")

    @property
    def num_experts(self) -> int:
        return len(self.expert_ids)


@dataclass(frozen=True)
class ExpertLayout:
    """The expert structure both sides agree on (compare :meth:`fingerprint`)."""

    matrices: Mapping[str, MatrixLayout]
    train_experts: bool = True

    def __post_init__(self):
        if not self.matrices:
            raise ValueError("an expert layout needs at least one matrix")
        for name in self.matrices:
            if not name or "/" in name:
                raise ValueError(f"matrix name {name!r} must be non-empty and contain no '/'")
        object.__setattr__(self, "matrices", dict(sorted(self.matrices.items())))

    def __contains__(self, name: object) -> bool:
        return name in self.matrices

    def __getitem__(self, name: str) -> MatrixLayout:
        return self.matrices[name]

    def __iter__(self):
        return iter(self.matrices)

    @property
    def num_experts(self) -> dict[str, int]:
        return {m: ml.num_experts for m, ml in self.matrices.items()}

    @property
    def total_experts(self) -> int:
        return sum(self.num_experts.values())

    @property
    def mode(self) -> str:
        return "experts+router" if self.train_experts else "router-only"

    def to_json(self) -> str:
        return json.dumps(
            {
                "train_experts": self.train_experts,
                "matrices": {
                    m: {"d_in": ml.d_in, "d_out": ml.d_out, "expert_ids": list(ml.expert_ids)}
                    for m, ml in self.matrices.items()
                },
            },
            sort_keys=True,
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str) -> ExpertLayout:
        data = json.loads(text)
        return cls(
            {m: MatrixLayout(int(v["d_in"]), int(v["d_out"]), tuple(v["expert_ids"])) for m, v in data["matrices"].items()},
            bool(data["train_experts"]),
        )

    def fingerprint(self) -> str:
        """16 hex digits of SHA-256 over the canonical JSON of the layout."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]


def init_router(matrix: str, num_experts: int, d_in: int, seed: int = 0, std: float = 0.02) -> np.ndarray:
    """Initial router ``W_router ∈ R^{E×d_in}``: N(0, std²), reproducible from (seed, matrix).

    Server and clients call this with the same arguments and get the same bits (numpy's
    PCG64 seeded with the seed and a hash of the matrix name), so neither needs to send it.
    """
    digest = int.from_bytes(hashlib.sha256(matrix.encode()).digest()[:8], "little")
    rng = np.random.default_rng([int(seed) & (2**64 - 1), digest])
    return (rng.standard_normal((num_experts, d_in)) * std).astype(np.float32)


# ------------------------------------------------------------------------------- payload


@dataclass
class MatrixPayload:
    """The part of a payload that concerns one matrix (see the module docstring).

    ``ids``/``router``/``A``/``B`` are the experts' tensors (``ids`` may be empty when a
    client only reports importance); ``importance_ids``/``importance`` the importance
    report, on its own id set.
    """

    ids: np.ndarray
    router: np.ndarray | None = None
    A: np.ndarray | None = None
    B: np.ndarray | None = None
    importance_ids: np.ndarray | None = None
    importance: np.ndarray | None = None

    def tensors(self, matrix: str) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        if np.size(self.ids):
            out[f"{matrix}/ids"] = np.asarray(self.ids)
            for name in VALUE_FIELDS:
                value = getattr(self, name)
                if value is not None:
                    out[f"{matrix}/{name}"] = value
        if self.importance is not None:
            out[f"{matrix}/importance"] = importance_report(self.importance_ids, self.importance)
        return out


def importance_report(ids, values) -> np.ndarray:
    """The ``m/importance`` tensor: ``(2, k')``, row 0 expert indices, row 1 importance."""
    ids = np.asarray(ids, dtype=np.float64).reshape(-1)
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    if ids.shape != values.shape:
        raise ValueError(f"importance report: {ids.size} ids for {values.size} values")
    return np.stack([ids, values]).astype(np.float32)


def split_key(key: str) -> tuple[str, str]:
    """``"model.layers.0.self_attn.q_proj/router"`` -> (matrix, field)."""
    matrix, sep, name = key.rpartition("/")
    if not sep or not matrix or name not in FIELDS:
        raise PayloadError(f"unexpected tensor '{key}': keys are '<matrix>/<field>' with field in {list(FIELDS)}")
    return matrix, name


def group(tensors: Mapping[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """Flat packed dict -> {matrix: {field: array}} (structure only, no validation)."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        matrix, name = split_key(key)
        out.setdefault(matrix, {})[name] = value
    return out


def to_tensors(payload: Mapping[str, MatrixPayload]) -> dict[str, np.ndarray]:
    """{matrix: MatrixPayload} -> flat packed dict."""
    out: dict[str, np.ndarray] = {}
    for matrix, part in payload.items():
        out.update(part.tensors(matrix))
    return out


def _integral(values: np.ndarray) -> bool:
    return bool(np.all(values == np.round(values)))


def encode(tensors: Mapping[str, np.ndarray] | Mapping[str, MatrixPayload], fmt: str = "fp32") -> ArrayRecord:
    """A packed payload -> one ArrayRecord (:func:`strategies.codec.encode`).

    ``fmt`` applies to the value tensors (router, A, B); ids and importance always travel
    as fp32 because int4 would not keep ids exact.
    """
    if tensors and isinstance(next(iter(tensors.values())), MatrixPayload):
        tensors = to_tensors(tensors)
    exact: dict[str, np.ndarray] = {}
    values: dict[str, np.ndarray] = {}
    for key, value in tensors.items():
        _, name = split_key(key)
        (values if name in VALUE_FIELDS else exact)[key] = value
        if name in ("ids", "importance"):
            ids = np.asarray(value) if name == "ids" else np.asarray(value)[0]
            if ids.size and (ids.min() < 0 or ids.max() >= MAX_EXPERTS or not _integral(ids)):
                raise ValueError(f"'{key}' must hold integer expert indices in [0, {MAX_EXPERTS})")
    record = codec.encode(exact, "fp32")
    for key, array in codec.encode(values, fmt).items():
        record[key] = array
    return record


def check_ids(matrix: str, raw: np.ndarray, num_experts: int, what: str = "ids") -> np.ndarray:
    if raw.ndim != 1:
        raise PayloadError(f"'{matrix}/{what}' must be 1-D, got shape {raw.shape}")
    if not _integral(raw):
        raise PayloadError(f"'{matrix}/{what}' holds non-integer expert ids")
    ids = raw.astype(np.int64)
    unknown = ids[(ids < 0) | (ids >= num_experts)]
    if unknown.size:
        raise PayloadError(
            f"matrix '{matrix}': unknown expert id(s) {sorted(set(unknown.tolist()))[:8]} in '{what}' "
            f"(the layout has {num_experts} experts, ids 0..{num_experts - 1})"
        )
    if np.unique(ids).size != ids.size:
        raise PayloadError(f"matrix '{matrix}': duplicated expert ids in '{what}'")
    return ids


def _check_quota(matrix: str, ids: np.ndarray, allowed: set[int], what: str) -> None:
    if ids.size > len(allowed):
        raise PayloadError(
            f"budget overrun: matrix '{matrix}' carries {what} of {ids.size} experts "
            f"but the client's quota is {len(allowed)}"
        )
    outside = sorted(set(ids.tolist()) - allowed)
    if outside:
        raise PayloadError(f"matrix '{matrix}': expert id(s) {outside[:8]} in {what} are not in the client's active set")


def validate(
    tensors: Mapping[str, np.ndarray],
    layout: ExpertLayout,
    *,
    kind: str = "update",
    active: Mapping[str, Iterable[int]] | None = None,
    budget: int | None = None,
    router: bool = True,
) -> dict[str, MatrixPayload]:
    """Check a packed payload against the layout; return it as {matrix: MatrixPayload}.

    Args:
        tensors: the packed dict (already fp32 and finite when it comes from codec).
        layout: the server's expert layout.
        kind: ``"update"`` (client -> server: deltas, with A/B iff the layout trains
            experts, and an optional importance report) or ``"state"`` (server -> client:
            values; ids, router, and A and B — optional in router-only mode, where clients
            holding the pool already have the frozen experts; no importance).
        active: the client's active set per matrix (its quota): a matrix absent from it has
            quota 0; more experts than the quota is a budget overrun, and ids outside the
            set are refused (for the updated experts and for the importance report).
        budget: the most experts the client may update in total.
        router: whether an update carries router rows (False once the routers are frozen:
            then it must not).

    Raises :class:`PayloadError` naming the matrix and the reason.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    parts: dict[str, MatrixPayload] = {}
    total = 0
    for matrix, fields in group(tensors).items():
        if matrix not in layout:
            raise PayloadError(f"unknown matrix '{matrix}' (not in the server's expert layout)")
        ml = layout[matrix]
        allowed = {int(i) for i in active.get(matrix, ())} if active is not None else None
        part = MatrixPayload(ids=np.zeros(0, np.int64))

        if kind == "state" and "importance" in fields:
            raise PayloadError(f"matrix '{matrix}': a state payload carries no importance")
        has_experts = any(n in fields for n in ("ids", *VALUE_FIELDS))
        if kind == "update" and not router and "router" in fields:
            raise PayloadError(f"matrix '{matrix}' carries router rows, but the routers are frozen this round")
        if has_experts or kind == "state":
            required = ["ids", "router"] if kind == "state" or router else ["ids"]
            if layout.train_experts:
                required += list(EXPERT_FIELDS)
            elif kind == "state":  # frozen experts: sent to clients without the pool, or not
                if any(n in fields for n in EXPERT_FIELDS):
                    required += list(EXPERT_FIELDS)
            else:
                present = [n for n in EXPERT_FIELDS if n in fields]
                if present:
                    raise PayloadError(f"matrix '{matrix}' carries expert {present} but this run is router-only")
            missing = [n for n in required if n not in fields]
            if missing:
                raise PayloadError(f"matrix '{matrix}' lacks {missing} ({layout.mode} {kind})")
            part.ids = check_ids(matrix, np.asarray(fields["ids"]), ml.num_experts)
            k = part.ids.size
            want = {"router": (k, ml.d_in), "A": (k, ml.d_in), "B": (k, ml.d_out)}
            for name, shape in want.items():
                if name not in fields:
                    continue
                value = np.asarray(fields[name], dtype=np.float32)
                if value.shape != shape:
                    raise PayloadError(f"'{matrix}/{name}' has shape {value.shape}, expected {shape}")
                if not np.all(np.isfinite(value)):
                    raise PayloadError(f"'{matrix}/{name}' holds NaN or Inf")
                setattr(part, name, value)
            if allowed is not None:
                _check_quota(matrix, part.ids, allowed, "updates")
            total += k

        if "importance" in fields:
            report = np.asarray(fields["importance"], dtype=np.float64)
            if report.ndim != 2 or report.shape[0] != 2:
                raise PayloadError(f"'{matrix}/importance' has shape {report.shape}, expected (2, k): ids and values")
            if not np.all(np.isfinite(report)):
                raise PayloadError(f"'{matrix}/importance' holds NaN or Inf")
            part.importance_ids = check_ids(matrix, report[0], ml.num_experts, "importance")
            if np.any(report[1] < 0):
                raise PayloadError(f"'{matrix}/importance' holds negative values")
            part.importance = report[1].astype(np.float32)
            if allowed is not None:
                _check_quota(matrix, part.importance_ids, allowed, "importance")
        parts[matrix] = part
    if budget is not None and total > budget:
        raise PayloadError(f"budget overrun: the payload updates {total} experts, the client's budget is {budget}")
    return parts


def decode(
    record: ArrayRecord,
    layout: ExpertLayout,
    *,
    kind: str = "update",
    active: Mapping[str, Iterable[int]] | None = None,
    budget: int | None = None,
    router: bool = True,
) -> dict[str, MatrixPayload]:
    """ArrayRecord -> validated {matrix: MatrixPayload} (see :func:`validate`)."""
    return validate(codec.decode(record), layout, kind=kind, active=active, budget=budget, router=router)


def delta(
    after: Mapping[str, np.ndarray], before: Mapping[str, np.ndarray], drop_unchanged: bool = True
) -> dict[str, np.ndarray]:
    """Client side: the update ``after - before`` of two packed states with the same ids.

    With ``drop_unchanged`` experts whose every delta is exactly zero (no token routed to
    them, so no gradient reached them) are left out: they were not updated, cost nothing
    on the wire, and do not pull the server's average towards zero.
    """
    a, b = group(after), group(before)
    if set(a) != set(b):
        raise ValueError(f"before/after cover different matrices: {sorted(set(a) ^ set(b))}")
    out: dict[str, np.ndarray] = {}
    for matrix in sorted(a):
        fa, fb = a[matrix], b[matrix]
        if not np.array_equal(np.asarray(fa["ids"]), np.asarray(fb["ids"])):
            raise ValueError(f"matrix '{matrix}': the active set changed between before and after")
        names = [n for n in VALUE_FIELDS if n in fa]
        if [n for n in VALUE_FIELDS if n in fb] != names:
            raise ValueError(f"matrix '{matrix}': before/after carry different fields")
        deltas = {n: np.asarray(fa[n], np.float32) - np.asarray(fb[n], np.float32) for n in names}
        keep = np.ones(len(fa["ids"]), dtype=bool)
        if drop_unchanged:
            keep = np.zeros(len(fa["ids"]), dtype=bool)
            for d in deltas.values():
                keep |= np.any(d != 0, axis=1)
        if not keep.any():
            continue
        out[f"{matrix}/ids"] = np.asarray(fa["ids"])[keep]
        for name, d in deltas.items():
            out[f"{matrix}/{name}"] = d[keep]
    return out


def wire_bytes(record: ArrayRecord) -> int:
    """Bytes Flower 1.42 serialises for a record.

    Flower sends a record as a tree of objects, each once per object id: the record's body
    (names -> Array object ids), each Array's body (dtype, shape, stype, chunk ids) and the
    ArrayChunks holding the data. This sums their serialised sizes.
    """
    seen: set[str] = set()

    def walk(obj) -> int:
        size = len(obj.deflate())
        children = obj.children or {}
        for object_id, child in children.items() if isinstance(children, Mapping) else children:
            if object_id not in seen:
                seen.add(object_id)
                size += walk(child)
        return size

    return walk(record)
