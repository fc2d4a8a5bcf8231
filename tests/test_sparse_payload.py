"""Sparse expert payload: wire round trip, rejections, sparse weighted aggregation."""

import numpy as np
import pytest
from flwr.app import Array

from strategies import codec
from strategies import sparse
from strategies.codec import PayloadError
from strategies.expert_state import ExpertState, aggregate
from strategies.sparse import ExpertLayout, MatrixLayout, MatrixPayload

Q, V = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"


def _layout(train_experts=True):
    return ExpertLayout(
        {
            Q: MatrixLayout(6, 4, [f"a:{i}" for i in range(3)] + ["b:0", "b:1"]),
            V: MatrixLayout(6, 5, ["a:0", "a:1", "a:2"]),
        },
        train_experts,
    )


def _update(layout, ids_per_matrix, seed=0, importance=True):
    rng = np.random.default_rng(seed)
    out = {}
    for m, ids in ids_per_matrix.items():
        ml, k = layout[m], len(ids)
        out[f"{m}/ids"] = np.asarray(ids, np.int64)
        out[f"{m}/router"] = rng.standard_normal((k, ml.d_in)).astype(np.float32)
        if layout.train_experts:
            out[f"{m}/A"] = rng.standard_normal((k, ml.d_in)).astype(np.float32)
            out[f"{m}/B"] = rng.standard_normal((k, ml.d_out)).astype(np.float32)
        if importance:
            out[f"{m}/importance"] = sparse.importance_report(ids, rng.random(k))
    return out


def _state(layout, seed=1):
    rng = np.random.default_rng(seed)
    experts = {
        m: (rng.standard_normal((ml.num_experts, ml.d_in)), rng.standard_normal((ml.d_out, ml.num_experts)))
        for m, ml in layout.matrices.items()
    }
    return ExpertState.initial(layout, experts, router_seed=3, router_std=0.1)


def test_round_trip_update_and_state():
    layout = _layout()
    update = _update(layout, {Q: [4, 0], V: [1]})
    parts = sparse.decode(sparse.encode(update), layout, active={Q: [0, 1, 4], V: [1, 2]}, budget=3)
    assert set(parts) == {Q, V}
    assert parts[Q].ids.dtype == np.int64 and parts[Q].ids.tolist() == [4, 0]
    for key, value in sparse.to_tensors(parts).items():
        np.testing.assert_array_equal(value, update[key])

    state = _state(layout)
    down = state.gather({Q: [3, 1], V: [0, 1, 2]})
    got = sparse.decode(sparse.encode(down), layout, kind="state")
    assert got[Q].ids.tolist() == [1, 3]  # gather sorts
    np.testing.assert_array_equal(got[Q].B, state.B[Q][[1, 3]])
    back = ExpertState.from_tensors(layout, state.to_tensors())
    for m in layout:
        np.testing.assert_array_equal(back.router[m], state.router[m])


def test_router_only_payload_round_trip():
    layout = _layout(train_experts=False)
    update = _update(layout, {V: [2]})
    parts = sparse.decode(sparse.encode(update), layout)
    assert parts[V].A is None and parts[V].B is None
    np.testing.assert_array_equal(parts[V].router, update[f"{V}/router"])
    # The downlink may carry the frozen experts (clients without the pool) or not.
    state = _state(layout)
    full = sparse.decode(sparse.encode(state.gather({V: [2]})), layout, kind="state")
    np.testing.assert_array_equal(full[V].A, state.A[V][[2]])
    slim = sparse.decode(sparse.encode(state.gather({V: [2]}, include_experts=False)), layout, kind="state")
    assert slim[V].A is None
    with pytest.raises(ValueError, match="must carry"):
        _state(_layout()).gather({V: [2]}, include_experts=False)


def test_packed_form_is_smaller_on_the_wire_than_one_key_per_expert():
    layout = _layout()
    update = _update(layout, {Q: [0, 1, 2, 3], V: [0, 1, 2]}, importance=False)
    packed = sparse.encode(update)
    keyed = {}
    for m in (Q, V):
        for j, i in enumerate(update[f"{m}/ids"]):
            eid = layout[m].expert_ids[i]
            for f in ("A", "B", "router"):
                keyed[f"expert/{m}/{eid}/{f}"] = update[f"{m}/{f}"][j]
    assert sparse.wire_bytes(packed) < sparse.wire_bytes(codec.encode(keyed))
    data = sum(v.size * 4 for v in update.values())
    assert data < sparse.wire_bytes(packed) < data + 8 * 400  # 4 arrays per matrix, 2 matrices


def test_layout_json_and_fingerprint():
    layout = _layout()
    again = ExpertLayout.from_json(layout.to_json())
    assert again == layout and again.fingerprint() == layout.fingerprint()
    assert _layout(False).fingerprint() != layout.fingerprint()
    assert layout.total_experts == 8


def test_init_router_is_reproducible():
    a = sparse.init_router(Q, 5, 6, seed=7)
    np.testing.assert_array_equal(a, sparse.init_router(Q, 5, 6, seed=7))
    assert not np.array_equal(a, sparse.init_router(V, 5, 6, seed=7))
    assert not np.array_equal(a, sparse.init_router(Q, 5, 6, seed=8))


def test_delta_drops_unchanged_experts():
    layout = _layout()
    before = _update(layout, {Q: [0, 2, 4]}, importance=False)
    after = {k: v.copy() for k, v in before.items()}
    after[f"{Q}/router"][1] += 0.5
    after[f"{Q}/A"][2, 0] -= 1.0
    d = sparse.delta(after, before)
    assert d[f"{Q}/ids"].tolist() == [2, 4]
    np.testing.assert_allclose(d[f"{Q}/router"][0], np.full(6, 0.5))
    assert sparse.delta(before, before) == {}
    assert sparse.delta(after, before, drop_unchanged=False)[f"{Q}/ids"].tolist() == [0, 2, 4]


def test_aggregation_is_the_example_weighted_mean_over_updaters():
    layout = _layout()
    state = _state(layout)
    c1 = sparse.decode(sparse.encode(_update(layout, {Q: [0, 1], V: [2]}, seed=10)), layout)
    c2 = sparse.decode(sparse.encode(_update(layout, {Q: [1, 3]}, seed=11)), layout)
    new, importance = aggregate(state, [(c1, 10.0), (c2, 30.0)])

    def row(part, i, field):
        return getattr(part, field)[part.ids.tolist().index(i)]

    for field in ("A", "B", "router"):
        old, got = getattr(state, field), getattr(new, field)
        # expert 0 (client 1 only), 3 (client 2 only): their own delta.
        np.testing.assert_allclose(got[Q][0], old[Q][0] + row(c1[Q], 0, field), rtol=1e-6)
        np.testing.assert_allclose(got[Q][3], old[Q][3] + row(c2[Q], 3, field), rtol=1e-6)
        # expert 1 (both): (10 d1 + 30 d2) / 40.
        mean = (10 * row(c1[Q], 1, field) + 30 * row(c2[Q], 1, field)) / 40
        np.testing.assert_allclose(got[Q][1], old[Q][1] + mean, rtol=1e-5, atol=1e-6)
        # experts nobody updated keep their value.
        np.testing.assert_array_equal(got[Q][[2, 4]], old[Q][[2, 4]])
        np.testing.assert_array_equal(got[V][[0, 1]], old[V][[0, 1]])
        np.testing.assert_allclose(got[V][2], old[V][2] + row(c1[V], 2, field), rtol=1e-6)
    imp = importance[Q]
    assert np.isnan(imp[[2, 4]]).all()
    np.testing.assert_allclose(imp[1], (10 * c1[Q].importance[1] + 30 * c2[Q].importance[0]) / 40, rtol=1e-6)
    assert np.isnan(importance[V][:2]).all()
    # The input state is untouched.
    np.testing.assert_array_equal(state.A[Q], _state(layout).A[Q])


def test_aggregation_refuses_bad_weights():
    layout = _layout()
    with pytest.raises(ValueError, match="num-examples"):
        aggregate(_state(layout), [({}, -1.0)])


def _raw_record(tensors):
    """Encode without encode()'s checks (to forge bad payloads)."""
    return codec.encode(tensors)


@pytest.mark.parametrize(
    "mutate, kwargs, reason",
    [
        (lambda u: u.__setitem__(f"{Q}/ids", np.array([0, 9])), {}, "unknown expert id"),
        (lambda u: u.__setitem__(f"{Q}/ids", np.array([0.0, 1.5])), {}, "non-integer"),
        (lambda u: u.__setitem__(f"{Q}/ids", np.array([1, 1])), {}, "duplicated"),
        (lambda u: u.__setitem__(f"{Q}/A", np.zeros((2, 5), np.float32)), {}, "shape"),
        (lambda u: u.__setitem__(f"{Q}/B", np.zeros((2, 6), np.float32)), {}, "shape"),
        (lambda u: u.__setitem__(f"{Q}/router", np.zeros((3, 6), np.float32)), {}, "shape"),
        (lambda u: u.__setitem__(f"{Q}/importance", sparse.importance_report([0, 1], [-1, 1])), {}, "negative"),
        (lambda u: u.__setitem__(f"{Q}/importance", np.ones(2, np.float32)), {}, "expected \\(2, k\\)"),
        (lambda u: u.__setitem__(f"{Q}/importance", sparse.importance_report([0, 7], [1, 1])), {}, "unknown expert id"),
        (lambda u: None, {"active": {Q: [0, 1], V: [2]}}, "in updates are not in the client's active set"),
        (lambda u: u.pop(f"{Q}/A"), {}, "lacks"),
        (lambda u: u.pop(f"{Q}/ids"), {}, r"lacks \['ids'\]"),
        (lambda u: u.__setitem__("model.layers.9.mlp.up_proj/ids", np.array([0])), {}, "unknown matrix"),
        (lambda u: u.__setitem__(f"{Q}/bias", np.zeros(2, np.float32)), {}, "unexpected tensor"),
        (lambda u: None, {"active": {Q: [0], V: [0, 1]}}, "budget overrun"),
        (lambda u: None, {"active": {Q: [0, 2], V: [0, 1]}}, "not in the client's active set"),
        (lambda u: None, {"active": {V: [0, 1]}}, "budget overrun"),
        (lambda u: None, {"budget": 2}, "budget overrun"),
    ],
)
def test_decode_rejects(mutate, kwargs, reason):
    layout = _layout()
    update = _update(layout, {Q: [0, 1], V: [1]})
    mutate(update)
    with pytest.raises(PayloadError, match=reason):
        sparse.decode(_raw_record(update), layout, **kwargs)


def test_importance_report_may_cover_experts_without_deltas():
    layout = _layout()
    update = _update(layout, {Q: [1]}, importance=False)
    update[f"{Q}/importance"] = sparse.importance_report([0, 1, 4], [0.0, 2.0, 0.0])
    update[f"{V}/importance"] = sparse.importance_report([2], [0.5])  # no expert of V changed
    parts = sparse.decode(sparse.encode(update), layout, active={Q: [0, 1, 4], V: [2]}, budget=1)
    assert parts[V].ids.size == 0 and parts[V].router is None
    new, importance = aggregate(_state(layout), [(parts, 5)])
    np.testing.assert_array_equal(importance[Q], [0.0, 2.0, np.nan, np.nan, 0.0])
    np.testing.assert_array_equal(new.router[V], _state(layout).router[V])
    with pytest.raises(PayloadError, match="in importance are not in the client's active set"):
        sparse.decode(sparse.encode(update), layout, active={Q: [1, 4, 3], V: [2]})


def test_decode_rejects_non_finite_values():
    layout = _layout()
    update = _update(layout, {Q: [0, 1]})
    record = sparse.encode(update)
    bad = update[f"{Q}/A"].copy()
    bad[0, 0] = np.nan
    record[f"{Q}/A"] = Array(dtype="float32", shape=bad.shape, stype=codec.FP32, data=bad.astype("<f4").tobytes())
    with pytest.raises(PayloadError, match="NaN or Inf"):
        sparse.decode(record, layout)


def test_decode_rejects_mode_mismatches():
    experts_update = _update(_layout(True), {Q: [0]})
    with pytest.raises(PayloadError, match="router-only"):
        sparse.decode(sparse.encode(experts_update), _layout(False))
    with pytest.raises(PayloadError, match="carries no importance"):
        sparse.decode(sparse.encode(experts_update), _layout(True), kind="state")
    router_update = _update(_layout(False), {Q: [0]}, importance=False)
    with pytest.raises(PayloadError, match="lacks"):
        sparse.decode(sparse.encode(router_update), _layout(True), kind="state")
    half = dict(experts_update)
    del half[f"{Q}/B"], half[f"{Q}/importance"]
    with pytest.raises(PayloadError, match=r"lacks \['B'\]"):
        sparse.decode(sparse.encode(half), _layout(False), kind="state")


def test_encode_refuses_non_integer_ids():
    with pytest.raises(ValueError, match="integer expert indices"):
        sparse.encode({f"{Q}/ids": np.array([0.5]), f"{Q}/router": np.zeros((1, 6))})


def test_payload_objects_and_flat_dicts_encode_alike():
    layout = _layout()
    update = _update(layout, {Q: [0, 1]})
    parts = sparse.validate(update, layout)
    assert isinstance(parts[Q], MatrixPayload)
    a, b = sparse.encode(update), sparse.encode(parts)
    assert sorted(a.keys()) == sorted(b.keys())
    assert all(a[k].data == b[k].data for k in a.keys())


def test_int4_values_keep_ids_and_importance_exact():
    layout = _layout()
    update = _update(layout, {Q: [0, 4], V: [1]})
    parts = sparse.decode(sparse.encode(update, "int4"), layout)
    assert parts[Q].ids.tolist() == [0, 4]
    np.testing.assert_array_equal(parts[Q].importance, update[f"{Q}/importance"][1])
    for name in ("A", "B", "router"):
        sent = update[f"{Q}/{name}"]
        step = (sent.max() - sent.min()) / 15
        assert np.abs(getattr(parts[Q], name) - sent).max() <= step / 2 + 1e-6
