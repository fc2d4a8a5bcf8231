"""The delta rule: chunked (WY/UT) form == recurrent form, values and gradients."""

import pytest
import torch

from clients.fednl.deltarule import (
    delta_rule_chunked,
    delta_rule_recurrent,
    fla_available,
    l2_normalize,
    ut_transform,
)

torch.set_num_threads(1)


def random_inputs(batch=2, heads=3, length=65, d_k=16, d_v=12, seed=0, state=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, d_k, generator=g)
    k = l2_normalize(torch.randn(batch, heads, length, d_k, generator=g))
    v = torch.randn(batch, heads, length, d_v, generator=g)
    beta = torch.rand(batch, heads, length, generator=g) * 0.98 + 0.01
    s0 = torch.randn(batch, heads, d_v, d_k, generator=g) * 0.5 if state else None
    return q, k, v, beta, s0


@pytest.mark.parametrize("length", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent(length, with_state):
    q, k, v, beta, s0 = random_inputs(length=length, state=with_state)
    o_ref, s_ref = delta_rule_recurrent(q, k, v, beta, initial_state=s0)
    o, s = delta_rule_chunked(q, k, v, beta, chunk_size=64, initial_state=s0)
    assert o.shape == (2, 3, length, 12) and s.shape == (2, 3, 12, 16)
    assert (o - o_ref).abs().max() <= 1e-4
    assert (s - s_ref).abs().max() <= 1e-4


@pytest.mark.parametrize("chunk_size", [1, 5, 32, 128, 1000])
def test_chunk_size_does_not_change_the_result(chunk_size):
    q, k, v, beta, s0 = random_inputs(length=130, state=True)
    o_ref, s_ref = delta_rule_recurrent(q, k, v, beta, initial_state=s0)
    o, s = delta_rule_chunked(q, k, v, beta, chunk_size=chunk_size, initial_state=s0)
    assert (o - o_ref).abs().max() <= 1e-4 and (s - s_ref).abs().max() <= 1e-4


def test_recurrence_is_the_definition():
    """Unrolled by hand: S_t = S_{t-1} + b_t (v_t - S_{t-1} k_t) k_t^T, o_t = S_t q_t."""
    q, k, v, beta, s0 = random_inputs(batch=1, heads=1, length=5, d_k=4, d_v=3, state=True)
    state = s0[0, 0].double()
    for t in range(5):
        k_t, v_t, q_t = k[0, 0, t].double(), v[0, 0, t].double(), q[0, 0, t].double()
        state = state + beta[0, 0, t].double() * torch.outer(v_t - state @ k_t, k_t)
        expected = state @ q_t
        o, _ = delta_rule_recurrent(q[..., : t + 1, :], k[..., : t + 1, :], v[..., : t + 1, :], beta[..., : t + 1], s0)
        assert torch.allclose(o[0, 0, t].double(), expected, atol=1e-5)


def test_memory_recalls_orthonormal_keys_exactly():
    """With beta = 1 and orthonormal keys, each write is exact and never disturbs the others."""
    d = 8
    keys = torch.linalg.qr(torch.randn(d, d))[0].T  # rows orthonormal
    values = torch.randn(d, 5)
    k = keys.reshape(1, 1, d, d)
    v = values.reshape(1, 1, d, 5)
    beta = torch.ones(1, 1, d)
    _, state = delta_rule_chunked(k, k, v, beta, chunk_size=3)
    assert torch.allclose(state[0, 0] @ keys.T, values.T, atol=1e-5)


def test_ut_transform_row_by_row_equals_triangular_solve():
    _, k, v, beta, _ = random_inputs(length=64)
    w_solve, u_solve = ut_transform(k, v, beta, method="solve")
    w_rows, u_rows = ut_transform(k, v, beta, method="rows")
    assert (w_solve - w_rows).abs().max() <= 1e-5 and (u_solve - u_rows).abs().max() <= 1e-5
    # and A is the inverse of I + strictly_lower((beta k) k^T)
    lower = torch.tril((k * beta[..., None]) @ k.transpose(-1, -2), diagonal=-1)
    eye = torch.eye(64)
    assert torch.allclose((eye + lower) @ w_solve, k * beta[..., None], atol=1e-5)
    with pytest.raises(ValueError, match="method"):
        ut_transform(k, v, beta, method="inverse")


def test_gradients_match_between_forms():
    inputs = random_inputs(length=130, state=True, seed=3)
    grads = []
    for form in ("recurrent", "chunked"):
        leaves = [x.clone().requires_grad_(True) for x in inputs]
        q, k, v, beta, s0 = leaves
        if form == "recurrent":
            o, s = delta_rule_recurrent(q, k, v, beta, initial_state=s0)
        else:
            o, s = delta_rule_chunked(q, k, v, beta, chunk_size=64, initial_state=s0)
        weight = torch.linspace(-1, 1, o.numel()).reshape(o.shape)
        ((o * weight).sum() + s.square().sum()).backward()
        grads.append([x.grad for x in leaves])
    for name, g_rec, g_chunk in zip(("q", "k", "v", "beta", "initial_state"), *grads):
        assert g_chunk is not None and torch.isfinite(g_chunk).all(), name
        assert g_chunk.abs().max() > 0, name
        assert (g_chunk - g_rec).abs().max() <= 1e-4 * max(1.0, g_rec.abs().max().item()), name


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_streaming_in_pieces_equals_whole(form):
    q, k, v, beta, _ = random_inputs(length=200)
    whole, final = delta_rule_recurrent(q, k, v, beta)
    state, outputs = None, []
    for start, end in [(0, 1), (1, 64), (64, 129), (129, 200)]:
        piece = [x[:, :, start:end] for x in (q, k, v, beta)]
        if form == "recurrent":
            o, state = delta_rule_recurrent(*piece, initial_state=state)
        else:
            o, state = delta_rule_chunked(*piece, chunk_size=64, initial_state=state)
        outputs.append(o)
    assert (torch.cat(outputs, dim=2) - whole).abs().max() <= 1e-4
    assert (state - final).abs().max() <= 1e-4


def test_qk_l2norm_flag_normalises_q_and_k():
    q, k, v, beta, _ = random_inputs(length=40)
    raw_k = k * 3.0
    o_flag, _ = delta_rule_chunked(q, raw_k, v, beta, chunk_size=16, qk_l2norm=True)
    o_manual, _ = delta_rule_recurrent(l2_normalize(q), l2_normalize(raw_k), v, beta)
    assert (o_flag - o_manual).abs().max() <= 1e-4


def test_empty_sequence_and_dtypes():
    q, k, v, beta, s0 = random_inputs(length=0, state=True)
    for rule in (delta_rule_recurrent, delta_rule_chunked):
        o, s = rule(q, k, v, beta, initial_state=s0)
        assert o.shape == (2, 3, 0, 12) and torch.equal(s, s0)
    q, k, v, beta, _ = random_inputs(length=20)
    o, s = delta_rule_chunked(q.bfloat16(), k.bfloat16(), v.bfloat16(), beta.bfloat16(), chunk_size=8)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32


def test_bad_inputs_raise_clear_errors():
    q, k, v, beta, _ = random_inputs(length=10)
    with pytest.raises(ValueError, match="beta"):
        delta_rule_chunked(q, k, v, beta[..., :5])
    with pytest.raises(ValueError, match="q and k"):
        delta_rule_recurrent(q, k[..., :8], v, beta)
    with pytest.raises(ValueError, match="4-D"):
        delta_rule_chunked(q[0], k[0], v[0], beta[0])
    with pytest.raises(ValueError, match="v must be"):
        delta_rule_chunked(q, k, v[:, :2], beta)
    with pytest.raises(ValueError, match="initial_state"):
        delta_rule_chunked(q, k, v, beta, initial_state=torch.zeros(2, 3, 16, 12))
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ValueError, match="chunk_size"):
            delta_rule_chunked(q, k, v, beta, chunk_size=bad)
    with pytest.raises(TypeError, match="floating"):
        delta_rule_recurrent(q, k, v, (beta > 0.5).long())


@pytest.mark.skipif(torch.cuda.is_available() and fla_available(), reason="fla can run here")
def test_requiring_fla_where_it_cannot_run_is_an_error():
    q, k, v, beta, _ = random_inputs(length=10)
    with pytest.raises(ValueError, match="use_fla=True"):
        delta_rule_chunked(q, k, v, beta, use_fla=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_the_cpu_reference():
    q, k, v, beta, s0 = random_inputs(length=200, state=True)
    o_ref, s_ref = delta_rule_recurrent(q, k, v, beta, initial_state=s0)
    cuda = [x.cuda() for x in (q, k, v, beta, s0)]
    o, s = delta_rule_chunked(*cuda[:4], chunk_size=64, initial_state=cuda[4], use_fla=False)
    assert (o.cpu() - o_ref).abs().max() <= 1e-4 and (s.cpu() - s_ref).abs().max() <= 1e-4
    if fla_available():  # fla's kernel in bf16 against the fp32 reference
        o, s = delta_rule_chunked(*(x.bfloat16() for x in cuda[:4]), initial_state=cuda[4], use_fla=True)
        assert (o.float().cpu() - o_ref).abs().max() <= 5e-2 * max(1.0, o_ref.abs().max().item())
        assert (s.cpu() - s_ref).abs().max() <= 5e-2 * max(1.0, s_ref.abs().max().item())


@pytest.mark.parametrize("rule", [delta_rule_chunked, delta_rule_recurrent])
def test_autocast_does_not_round_the_memory_to_bf16(rule):
    """A model trained under bf16 autocast (train.frozen_bf16) calls the memory with it on: the
    arithmetic stays float32, the result equals the one without autocast."""
    q, k, v, beta, s0 = random_inputs(length=130, state=True)
    o_ref, s_ref = rule(q, k, v, beta, initial_state=s0)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        o, s = rule(q, k, v, beta, initial_state=s0)
    assert o.dtype == s.dtype == torch.float32
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)


# --------------------------------------------------------------------------- grouped heads (memory_heads="kv")
def grouped_inputs(groups=3, kv_heads=2, length=130, state=False, padding=False, seed=5):
    """q on kv_heads * groups query heads; k, v, beta (and the state) on kv_heads memories."""
    q, _, _, _, _ = random_inputs(heads=kv_heads * groups, length=length, seed=seed)
    _, k, v, beta, s0 = random_inputs(heads=kv_heads, length=length, seed=seed + 1, state=state)
    if padding:  # left padding on the first sequence, a hole in the second: beta = 0 there, k and v zeroed
        valid = torch.ones(2, 1, length, dtype=torch.bool)
        valid[0, :, :7] = False
        valid[1, :, 40:45] = False
        beta = beta * valid
        k, v = k * valid[..., None], v * valid[..., None]
    return q, k, v, beta, s0


def repeated(groups, k, v, beta, s0):
    """The per-query-head reference's inputs: k, v, beta and the state repeated to the query heads."""
    out = [x.repeat_interleave(groups, dim=1) for x in (k, v, beta)]
    return (*out, None if s0 is None else s0.repeat_interleave(groups, dim=1))


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("padding", [False, True])
def test_grouped_heads_equal_the_reference_on_repeated_heads(form, with_state, padding):
    """One memory per key/value head, read by its G query heads == the per-query-head form on k, v, beta
    (and the state) repeated to the query heads: outputs, final state, and the gradients wrt q, k, v, beta
    and the state (130 tokens: an incomplete last chunk of 64)."""
    groups, kv_heads = 3, 2
    inputs = grouped_inputs(groups, kv_heads, state=with_state, padding=padding)
    rule = delta_rule_recurrent if form == "recurrent" else delta_rule_chunked
    extra = {} if form == "recurrent" else {"chunk_size": 64}
    results = []
    for grouped in (True, False):
        leaves = [None if x is None else x.clone().requires_grad_(True) for x in inputs]
        q, k, v, beta, s0 = leaves
        if grouped:
            o, s = rule(q, k, v, beta, initial_state=s0, **extra)
        else:
            k, v, beta, s0 = repeated(groups, k, v, beta, s0)
            o, s = delta_rule_recurrent(q, k, v, beta, initial_state=s0)  # the reference, per query head
            s = s.unflatten(1, (kv_heads, groups))
            assert all((s[:, :, g] - s[:, :, 0]).abs().max() <= 1e-5 for g in range(groups))  # G equal copies
            s = s[:, :, 0]
        weight = torch.linspace(-1, 1, o.numel()).reshape(o.shape)
        ((o * weight).sum() + s.square().sum()).backward()
        results.append((o, s, [None if x is None else x.grad for x in leaves]))
    (o, s, grads), (o_ref, s_ref, grads_ref) = results
    assert o.shape == (2, kv_heads * groups, 130, 12) and s.shape == (2, kv_heads, 12, 16)
    assert (o - o_ref).abs().max() <= 1e-4 and (s - s_ref).abs().max() <= 1e-4
    for name, g, g_ref in zip(("q", "k", "v", "beta", "initial_state"), grads, grads_ref):
        if g_ref is None:
            continue
        assert g is not None and torch.isfinite(g).all() and g.abs().max() > 0, name
        assert (g - g_ref).abs().max() <= 1e-4 * max(1.0, g_ref.abs().max().item()), name


@pytest.mark.parametrize("length", [1, 5, 64])
def test_grouped_chunked_equals_grouped_recurrent_on_short_sequences(length):
    q, k, v, beta, s0 = grouped_inputs(groups=2, kv_heads=3, length=length, state=True)
    o_ref, s_ref = delta_rule_recurrent(q, k, v, beta, initial_state=s0)
    o, s = delta_rule_chunked(q, k, v, beta, chunk_size=16, initial_state=s0)
    assert o.shape == (2, 6, length, 12) and s.shape == (2, 3, 12, 16)
    assert (o - o_ref).abs().max() <= 1e-4 and (s - s_ref).abs().max() <= 1e-4
    empty = [x[:, :, :0] for x in (q, k, v, beta)]
    for rule in (delta_rule_recurrent, delta_rule_chunked):
        o, s = rule(*empty, initial_state=s0)
        assert o.shape == (2, 6, 0, 12) and torch.equal(s, s0)


def test_grouped_heads_must_divide_the_query_heads():
    q, k, v, beta, _ = grouped_inputs(groups=3, kv_heads=2, length=10)
    with pytest.raises(ValueError, match="divisor of q's heads"):
        delta_rule_chunked(q[:, :5], k, v, beta)
    with pytest.raises(ValueError, match="initial_state"):  # the state is per memory (key/value head)
        delta_rule_recurrent(q, k, v, beta, initial_state=torch.zeros(2, 6, 12, 16))


@pytest.mark.skipif(not (torch.cuda.is_available() and fla_available()), reason="needs CUDA and fla")
def test_fla_kernel_on_grouped_heads_matches_the_reference():
    inputs = grouped_inputs(groups=3, kv_heads=2, length=200, state=True)
    o_ref, s_ref = delta_rule_recurrent(*inputs[:4], initial_state=inputs[4])
    cuda = [x.cuda() for x in inputs]
    o, s = delta_rule_chunked(*(x.bfloat16() for x in cuda[:4]), initial_state=cuda[4], use_fla=True)
    assert o.shape == o_ref.shape and s.shape == s_ref.shape
    assert (o.float().cpu() - o_ref).abs().max() <= 5e-2 * max(1.0, o_ref.abs().max().item())
    assert (s.cpu() - s_ref).abs().max() <= 5e-2 * max(1.0, s_ref.abs().max().item())
