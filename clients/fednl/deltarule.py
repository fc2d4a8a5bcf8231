"""The delta rule: a linear associative memory written one token at a time.

Per head, a memory matrix ``S`` (``d_v x d_k``) is updated by one gradient step on
``1/2 ||S k_t - v_t||^2`` with step size ``beta_t``, then read with the query::

    S_t = S_{t-1} + beta_t (v_t - S_{t-1} k_t) k_t^T        S_0 = 0 (or a given state)
    o_t = S_t q_t

Keys should be L2-normalised and ``beta_t`` lie in (0, 1) for the update to be a
contraction (pass ``qk_l2norm=True`` to normalise q and k here). Two exact forms:

* :func:`delta_rule_recurrent`: token by token. Streaming inference: the carried state
  is one ``(batch, heads, d_v, d_k)`` tensor whatever the sequence length.
* :func:`delta_rule_chunked`: the chunk-parallel WY/UT form used for training
  (Yang et al., "Parallelizing Linear Transformers with the Delta Rule", 2024). Within
  a chunk of ``C`` tokens the ``C`` sequential updates collapse to one triangular solve
  (the UT transform) and a few matrix products; only the ``T / C`` chunk boundaries
  remain sequential. Differentiable end to end (BPTT through the memory).

Both agree to float tolerance (``tests/test_deltarule.py``). Shapes follow the HF
attention layout: q, k ``(batch, heads, T, d_k)``, v ``(batch, heads, T, d_v)``, beta
``(batch, heads, T)``; the state is ``(batch, heads, d_v, d_k)`` so that ``o = S q``
(flash-linear-attention stores the transpose, ``d_k x d_v``). Grouped heads (GQA, FedNL's
``memory_heads="kv"``): q may have G times k's heads, ``(batch, heads * G, T, d_k)``; then
k, v, beta and the state keep ``heads`` (one memory per key/value head, written once) and
query head ``h`` reads memory ``h // G``: the same result as repeating k, v, beta and the
state to the query heads (HF's ``repeat_kv`` order), which stays the reference.

Arithmetic is float32 (half-precision inputs are upcast); outputs come back in q's dtype
and the state in float32. On CUDA, with ``flash-linear-attention`` installed and
half-precision inputs, :func:`delta_rule_chunked` may hand the work to its Triton kernel
(``fla.ops.delta_rule.chunk_delta_rule``); the pure-PyTorch code is the reference.
"""

from __future__ import annotations

import contextlib
import importlib.util

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

__all__ = [
    "delta_rule_recurrent",
    "delta_rule_chunked",
    "ut_transform",
    "l2_normalize",
    "fla_available",
    "fla_usable",
]


# --------------------------------------------------------------------------- helpers
def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """Unit L2 norm over the last dimension (as fla's ``use_qk_l2norm_in_kernel``)."""
    return F.normalize(x, p=2.0, dim=-1, eps=eps)


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, initial_state: Tensor | None):
    """Validate shapes; return ``(batch, heads, T, d_k, d_v)`` where ``heads`` are k's (the memories)."""
    for name, x in (("q", q), ("k", k), ("v", v), ("beta", beta)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "q, k, v must be 4-D (batch, heads, T, d); got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(
            "q and k must have the same shape, or k a divisor of q's heads (one memory per key/value head), "
            f"got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    batch, heads, length, d_k = k.shape
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"v must be (batch, heads, T, d_v) = ({batch}, {heads}, {length}, d_v), got v {tuple(v.shape)}"
        )
    if beta.shape != k.shape[:3]:
        raise ValueError(f"beta must be (batch, heads, T) = {tuple(k.shape[:3])}, got beta {tuple(beta.shape)}")
    d_v = v.shape[-1]
    if initial_state is not None and initial_state.shape != (batch, heads, d_v, d_k):
        raise ValueError(
            f"initial_state must be (batch, heads, d_v, d_k) = {(batch, heads, d_v, d_k)}, "
            f"got initial_state {tuple(initial_state.shape)}"
        )
    return batch, heads, length, d_k, d_v


def _initial_state(initial_state: Tensor | None, batch, heads, d_v, d_k, device) -> Tensor:
    if initial_state is None:
        return torch.zeros(batch, heads, d_v, d_k, device=device, dtype=torch.float32)
    return initial_state.to(device=device, dtype=torch.float32)


def _float_inputs(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, initial_state: Tensor | None, qk_l2norm: bool):
    """The inputs upcast to float32 (q, k normalised if asked) and the float32 state to start from."""
    q, k, v, beta = (x.float() for x in (q, k, v, beta))
    if qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    return q, k, v, beta, _initial_state(initial_state, k.shape[0], k.shape[1], v.shape[-1], k.shape[-1], q.device)


def _full_precision(x: Tensor):
    """A context that turns autocast off on ``x``'s device where it is on (a model trained under
    bf16 autocast calls the memory with it on): this module's arithmetic is float32."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.autocast(device_type=x.device.type, enabled=False)
    return contextlib.nullcontext()


# --------------------------------------------------------------------------- recurrent form
def delta_rule_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    *,
    qk_l2norm: bool = False,
) -> tuple[Tensor, Tensor]:
    """Token-by-token delta rule. Returns ``(o, final_state)``.

    ``o`` is ``(batch, q_heads, T, d_v)`` in q's dtype, ``final_state`` is
    ``(batch, heads, d_v, d_k)`` in float32, ``heads`` being k's. With fewer key/value heads
    than query heads (grouped: q ``(batch, heads * G, T, d_k)``), each memory is written once
    and read by its G query heads (query head ``h`` reads memory ``h // G``, as HF's
    ``repeat_kv``): the same answer as repeating k, v, beta (and the state) to the query
    heads. Beyond the outputs, memory is O(1) in T under ``torch.no_grad()`` (autograd, when
    enabled, keeps every step for BPTT).
    """
    batch, heads, length, d_k, d_v = _check_inputs(q, k, v, beta, initial_state)
    groups = q.shape[1] // heads
    with _full_precision(q):  # float32 even under autocast: the state must not round to bf16
        out_dtype = q.dtype
        q, k, v, beta, state = _float_inputs(q, k, v, beta, initial_state, qk_l2norm)
        if groups > 1:  # (B, KV, G, T, d): the G query heads of each memory side by side
            q = q.reshape(batch, heads, groups, length, d_k)
        outputs = []
        for t in range(length):
            k_t = k[:, :, t].unsqueeze(-1)  # (B, H, d_k, 1)
            v_t = v[:, :, t].unsqueeze(-1)  # (B, H, d_v, 1)
            b_t = beta[:, :, t, None, None]  # (B, H, 1, 1)
            error = v_t - state @ k_t  # what the memory gets wrong about this key
            state = state + (b_t * error) @ k_t.transpose(-1, -2)
            if groups == 1:
                outputs.append((state @ q[:, :, t].unsqueeze(-1)).squeeze(-1))
            else:  # the group's G queries read the memory in one product: (B, KV, G, d_v)
                outputs.append(q[:, :, :, t] @ state.transpose(-1, -2))
        if not outputs:
            o = q.new_zeros(batch, heads * groups, 0, d_v)
        elif groups == 1:
            o = torch.stack(outputs, dim=2)
        else:
            o = torch.stack(outputs, dim=3).reshape(batch, heads * groups, length, d_v)
        return o.to(out_dtype), state


# --------------------------------------------------------------------------- chunked (WY/UT) form
def ut_transform(k: Tensor, v: Tensor, beta: Tensor, method: str = "solve") -> tuple[Tensor, Tensor]:
    """The UT transform of one block of keys: ``w = A (beta k)``, ``u = A (beta v)``.

    ``A = (I + strictly_lower((beta k) k^T))^{-1}`` is unit lower triangular. Shapes:
    k ``(..., C, d_k)``, v ``(..., C, d_v)``, beta ``(..., C)``; returns w ``(..., C, d_k)``
    and u ``(..., C, d_v)``. ``method``:

    * ``"solve"``: ``A`` from one batched ``torch.linalg.solve_triangular`` against the
      identity, then two products (used by the chunked form);
    * ``"rows"``: the reference of SPEC.md: start from ``I + strictly_lower(-(beta k) k^T)``
      and complete the inverse by forward substitution, one row at a time.
    """
    k_beta = k * beta.unsqueeze(-1)
    v_beta = v * beta.unsqueeze(-1)
    size = k.shape[-2]
    eye = torch.eye(size, device=k.device, dtype=k.dtype)
    gram = k_beta @ k.transpose(-1, -2)
    if method == "solve":
        # A itself, from one solve against the identity: cheaper than solving for k and v side by side,
        # and nothing to concatenate or slice in the backward pass. A unit lower-triangular solve reads
        # only the strictly lower triangle of its matrix (and its gradient is that triangle's alone), so
        # the Gram matrix goes in as it is: I + strictly_lower(gram) is never built.
        inverse = torch.linalg.solve_triangular(gram, eye.expand_as(gram), upper=False, unitriangular=True)
        return inverse @ k_beta, inverse @ v_beta
    lower = torch.tril(gram, diagonal=-1)
    if method == "rows":
        # A = I + M with M strictly lower; row by row, M[i] = -L[i] - sum_{j<i} L[i, j] M[j].
        neg = -lower
        rows = []
        for i in range(size):
            row = neg[..., i, :]
            if i:
                row = row + (neg[..., i, :i, None] * torch.stack(rows, dim=-2)).sum(-2)
            rows.append(row)
        a = torch.stack(rows, dim=-2) + eye
        return a @ k_beta, a @ v_beta
    raise ValueError(f"method must be 'solve' or 'rows', got {method!r}")


def delta_rule_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    chunk_size: int = 64,
    initial_state: Tensor | None = None,
    *,
    qk_l2norm: bool = False,
    use_fla: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """Chunk-parallel delta rule, exactly equal (to float tolerance) to the recurrence.

    Per chunk of C tokens, with ``S`` the state entering the chunk::

        w, u = UT transform of (k, v, beta)          # all chunks at once
        u'   = u - w S^T                             # what each token really writes
        o    = q S^T + causal(q k^T) u'              # causal mask includes the diagonal
        S    = S + u'^T k

    A sequence shorter than ``chunk_size`` is one short chunk; otherwise the last chunk
    is zero-padded (beta = 0 there, so padding writes nothing). ``use_fla``: None picks
    the fla Triton kernel when it can run (CUDA tensors, fp16/bf16, package installed),
    True requires it, False never uses it. Returns ``(o, final_state)`` as
    :func:`delta_rule_recurrent` does, grouped heads included: with G query heads per
    key/value head, the write path (UT transform, ``u'``, the state update) runs once per
    memory, and the G query heads' chunk rows are stacked (``G*C`` rows) so that each read
    (``q S^T`` and ``causal(q k^T) u'``) is one product per chunk, larger rather than more.
    """
    batch, heads, length, d_k, d_v = _check_inputs(q, k, v, beta, initial_state)
    groups = q.shape[1] // heads
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if use_fla is True and not fla_usable(q):
        raise ValueError(
            "use_fla=True needs flash-linear-attention installed and CUDA fp16/bf16 tensors "
            f"(got device {q.device}, dtype {q.dtype}, fla installed: {fla_available()})"
        )
    if use_fla is not False and length > 0 and fla_usable(q):
        return _fla_chunk_delta_rule(q, k, v, beta, initial_state, qk_l2norm)

    with _full_precision(q):  # float32 even under autocast: the state must not round to bf16
        out_dtype = q.dtype
        q, k, v, beta, state = _float_inputs(q, k, v, beta, initial_state, qk_l2norm)
        if length == 0:
            return q.new_zeros(batch, heads * groups, 0, d_v).to(out_dtype), state

        size = min(chunk_size, length)
        pad = (-length) % size
        if pad:
            q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
            beta = F.pad(beta, (0, pad))
        chunks = (length + pad) // size
        rows = batch * heads  # (batch, heads) folded: every product below is one 3-D batched matmul

        def blocks(x: Tensor) -> Tensor:  # (B, H, T, d) -> (B*H, chunks, C, d), a view
            return x.reshape(rows, chunks, size, x.shape[-1])

        k, v = blocks(k), blocks(v)
        beta = beta.reshape(rows, chunks, size)
        if groups == 1:
            q = blocks(q)
        else:  # (B, KV*G, T, d) -> (B*KV, chunks, G*C, d): a memory's G query heads, chunk by chunk, stacked
            q = q.reshape(batch, heads, groups, chunks, size, d_k).transpose(2, 3).reshape(rows, chunks, -1, d_k)

        # Everything that does not depend on the incoming state, for all chunks in parallel.
        w, u = ut_transform(k, v, beta)
        scores = q @ k.transpose(-1, -2)
        if groups == 1:
            intra = torch.tril(scores)  # causal, the diagonal included
        else:  # the same causal mask on each of the G stacked query blocks
            intra = torch.tril(scores.view(rows, chunks, groups, size, size)).view(rows, chunks, groups * size, size)

        # The state is carried transposed, S^T (B*H, d_k, d_v), so that every step is a (b)addbmm
        # without a copy. Per-chunk views are taken once with unbind: indexing chunk c inside the
        # loop would make autograd materialise (and zero-fill) a full-size gradient buffer per chunk.
        state_t = state.reshape(rows, d_v, d_k).transpose(1, 2)
        outputs = []
        for q_c, k_c, w_c, u_c, intra_c in zip(*(x.unbind(dim=1) for x in (q, k, w, u, intra))):
            u_true = torch.baddbmm(u_c, w_c, state_t, alpha=-1.0)  # what each token of the chunk really writes
            outputs.append(torch.baddbmm(torch.bmm(q_c, state_t), intra_c, u_true))
            state_t = torch.baddbmm(state_t, k_c.transpose(1, 2), u_true)
        if groups == 1:
            o = torch.stack(outputs, dim=1).reshape(batch, heads, chunks * size, d_v)
        else:  # stacked straight into (B, KV, G, chunks, C, d_v): the query heads' layout, no second copy
            o = torch.stack([x.view(batch, heads, groups, size, d_v) for x in outputs], dim=3)
            o = o.view(batch, heads * groups, chunks * size, d_v)
        return o[:, :, :length].to(out_dtype), state_t.transpose(1, 2).reshape(batch, heads, d_v, d_k)


# --------------------------------------------------------------------------- optional CUDA kernel
def fla_available() -> bool:
    """Whether flash-linear-attention is importable (checked without importing it)."""
    return importlib.util.find_spec("fla") is not None


def fla_usable(x: Tensor) -> bool:
    """Whether fla's chunk kernel can take this tensor: CUDA, fp16/bf16, fla installed."""
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and fla_available()


def _fla_chunk_delta_rule(q, k, v, beta, initial_state, qk_l2norm):
    """fla's Triton kernel. fla wants (B, T, H, d) and keeps the state as (d_k, d_v);
    ``scale=1.0`` because this module's readout is ``o = S q`` without 1/sqrt(d_k). Grouped heads
    (fewer key/value heads than query heads) go in repeated to the query heads, the state too:
    the G copies of a memory see the same writes, so the first copy is the memory's final state."""
    from fla.ops.delta_rule import chunk_delta_rule  # imported only when it will run

    heads = k.shape[1]
    groups = q.shape[1] // heads
    if groups > 1:
        k, v, beta = (x.repeat_interleave(groups, dim=1) for x in (k, v, beta))
        if initial_state is not None:
            initial_state = initial_state.repeat_interleave(groups, dim=1)
    h0 = None if initial_state is None else initial_state.float().transpose(-1, -2).contiguous()
    o, state = chunk_delta_rule(
        q.transpose(1, 2).contiguous(),
        k.transpose(1, 2).contiguous(),
        v.transpose(1, 2).contiguous(),
        beta.to(q.dtype).transpose(1, 2).contiguous(),
        scale=1.0,
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=qk_l2norm,
    )
    state = state.float().transpose(-1, -2)
    if groups > 1:
        state = state.unflatten(1, (heads, groups))[:, :, 0]
    return o.transpose(1, 2), state
