"""Seed-regenerated low-rank factors, shared by FLITE (``clients.flite``) and the latent channel
(``fedapps.channel``): a layer's ``A``, ``B`` and latent basis drawn from a 64-bit seed and its
name, bit-identical on every machine, and the water-filling split of a latent budget.

A layer ``l`` viewed as ``W ∈ R^{m×n}`` with ``k`` latents ``z`` moves by
``ΔW(z) = A · diag(Vᵀ z) · B`` (``A ∈ R^{m×r}``, ``B ∈ R^{r×n}``, ``V ∈ R^{k×r}``);
``clients.flite.layer`` has the whole derivation.

Generation (bit-reproducible)
    ``A``, ``B`` and the raw ``V`` are drawn, in that order, from a CPU ``torch.Generator``
    seeded with the first 8 bytes of ``sha256(seed as 8 little-endian bytes ‖ 0x00 ‖ layer
    name)``. Each entry takes 24 random bits from ``torch.randint`` and is mapped to a
    uniform value on ``(-√3, √3)`` (unit variance) with correctly rounded IEEE operations
    only, so every machine gets the same bits. (``torch.randn`` is avoided: its vectorised
    Box–Muller path uses SIMD approximations of log/sin/cos chosen by CPU capability.)
    The factors are fp32, then moved to the module's device; they are non-persistent
    buffers, never in a ``state_dict`` nor in a payload.

Scaling (why the naive version learned so little)
    The raw directions ``D_j`` are neither normalised nor orthogonal, and their size has
    nothing to do with the layer they perturb, so a latent step means wildly different
    things in different layers. FLITE here replaces ``V`` by ``c · L⁻¹ V`` where
    ``L Lᵀ = V (AᵀA ∘ BBᵀ) Vᵀ`` is the (``k × k``, exact, computed in float64) Gram matrix of
    the directions: afterwards the ``D_j`` are **orthonormal** in the Frobenius inner product
    times ``c``. Still the structured form, still linear in ``z`` (so the averaging identity
    holds), and now ``‖ΔW(z)‖_F = c · ‖z‖`` exactly: Euclidean geometry in latent space is
    weight-space geometry, which suits both Adam and the server's averaging. With::

        c = scale · ρ_l · sqrt(m·n / k)

    a latent vector with unit-RMS coordinates moves the layer by ``scale · ρ_l`` in RMS,
    where ``ρ_l`` is the RMS of the pretrained parameters (``scale_mode="weight"``; 1 when
    they are all zero) or 1 (``scale_mode="unit"``). Every layer, large or small, conv,
    linear or norm, then takes the same *relative* step per unit of latent. The raw
    factors are what the fingerprint's checksum covers; ``L`` and ``ρ_l`` are derived in
    float64, so different machines agree on them to the last fp32 bit or so.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch

KINDS = ("linear", "conv", "norm")
_SQRT3 = math.sqrt(3.0)
_BITS = 24


@dataclass(frozen=True)
class LayerSpec:
    """Everything about an adapted layer that clients must agree on (part of the fingerprint).

    ``name`` is the module's name in the model given to ``apply_flite``; it seeds the
    factors, so renaming a module changes its factors.
    """

    name: str
    kind: str  # "linear" | "conv" | "norm"
    matrix_shape: tuple[int, int]  # (m, n)
    latents: int  # k
    rank: int  # r (>= k)
    param_names: tuple[str, ...]  # ("weight",) or, for norms, ("weight", "bias")

    @property
    def numel(self) -> int:
        return self.matrix_shape[0] * self.matrix_shape[1]

    def as_list(self) -> list:
        return [self.name, self.kind, list(self.matrix_shape), self.latents, self.rank, list(self.param_names)]


@dataclass
class RawFactors:
    """The generator's output for one layer: ``A (m×r)``, ``B (r×n)``, ``V (k×r)``, fp32 on the CPU."""

    A: torch.Tensor
    B: torch.Tensor
    V: torch.Tensor

    def digest(self) -> str:
        """sha256 of the little-endian fp32 bytes of A, B, V (in that order)."""
        h = hashlib.sha256()
        for t in (self.A, self.B, self.V):
            h.update(np.ascontiguousarray(t.numpy(), dtype="<f4").tobytes())
        return h.hexdigest()


def layer_seed(seed: int, name: str) -> int:
    """Deterministic 64-bit generator seed of a layer (never Python's salted ``hash()``)."""
    if not 0 <= int(seed) < 2**64:
        raise ValueError(f"seed must be an unsigned 64-bit integer, got {seed}")
    data = int(seed).to_bytes(8, "little") + b"\x00" + name.encode("utf-8")
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


def _uniform(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Unit-variance uniform values on (-√3, √3), exactly reproducible across CPUs."""
    bits = torch.randint(0, 2**_BITS, shape, generator=generator, dtype=torch.int64)
    u = (bits.to(torch.float64) + 0.5) * (2.0 ** -_BITS)  # exact: centres of 2^24 bins in (0, 1)
    return ((2.0 * u - 1.0) * _SQRT3).to(torch.float32)  # correctly rounded


def generate_raw_factors(seed: int, spec: LayerSpec) -> RawFactors:
    """Regenerate a layer's raw factors on the CPU from (seed, layer name)."""
    m, n = spec.matrix_shape
    generator = torch.Generator(device="cpu")
    generator.manual_seed(layer_seed(seed, spec.name))
    A = _uniform((m, spec.rank), generator)
    B = _uniform((spec.rank, n), generator)
    V = _uniform((spec.latents, spec.rank), generator)
    return RawFactors(A, B, V)


def reference_rms(params: list[torch.Tensor], mode: str) -> float:
    """``ρ_l``: RMS of the pretrained parameters (mode "weight"; 1.0 if all zero) or 1.0 ("unit")."""
    if mode == "unit":
        return 1.0
    if mode != "weight":
        raise ValueError(f"unknown scale mode {mode!r}")
    # On the CPU in float64 (one parameter at a time): the same value on every machine up to
    # the last bits, and no float64 needed on the accelerator (MPS has none).
    total = sum(float(torch.sum(p.detach().to("cpu", torch.float64) ** 2)) for p in params)
    numel = sum(p.numel() for p in params)
    rms = math.sqrt(total / max(numel, 1))
    if not math.isfinite(rms):
        raise ValueError("pretrained parameters hold NaN or Inf; cannot scale FLITE factors")
    return rms if rms > 0.0 else 1.0


def latent_basis(raw: RawFactors, coeff: float, name: str = "layer") -> torch.Tensor:
    """``c · L⁻¹ V`` (fp32, ``k × r``): makes the directions ``D_j`` orthonormal, times ``coeff``.

    The Gram matrix of the directions is ``G = V (AᵀA ∘ BBᵀ) Vᵀ`` (``k × k``), cheap to form
    without any ``m·n``-sized object; ``G = L Lᵀ`` (Cholesky) and ``L⁻¹ V`` gives Gram ``I``.
    """
    A, B, V = (t.to(torch.float64) for t in (raw.A, raw.B, raw.V))
    gram = V @ ((A.T @ A) * (B @ B.T)) @ V.T
    gram = 0.5 * (gram + gram.T)
    L, info = torch.linalg.cholesky_ex(gram)
    if int(info) != 0:
        k, r = V.shape
        raise ValueError(
            f"FLITE layer '{name}': its {k} latent directions are linearly dependent "
            f"(rank {r}, {A.shape[0]}x{B.shape[1]} parameters); use fewer latents for this layer"
        )
    basis = torch.linalg.solve_triangular(L, V, upper=False)
    return (coeff * basis).to(torch.float32)


@contextlib.contextmanager
def one_thread():
    """Run the block on one torch thread: a reduction's order (hence its last bits) then
    depends on nothing but the inputs, not on how many threads this process was given."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def dense_map(A: torch.Tensor, basis: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """The explicit ``(m·n) × k`` matrix of ``z ↦ vec(A · diag(basisᵀ z) · B)``.

    Column ``j`` is ``vec(A · diag(basis[j]) · B)``. Memory ``4·m·n·k`` bytes: small layers
    only. Formed on the CPU on one thread (then moved), so every client derives the same bits
    whatever its thread count or device (tested across processes). Two CPUs whose BLAS picks
    another kernel could still differ in the last bits: each entry is a sum of ``r`` products,
    so by at most ``r·2⁻²⁴`` relative (``r`` = ``flite.rank``, 64).
    """
    m, n, k, device = A.shape[0], B.shape[1], basis.shape[0], A.device
    A, basis, B = (t.detach().cpu() for t in (A, basis, B))
    with one_thread():
        cols = (A.unsqueeze(1) * basis.unsqueeze(0)) @ B  # (m, k, n): A · diag(basis[j]) · B
    return cols.permute(0, 2, 1).reshape(m * n, k).contiguous().to(device)


@dataclass
class LayerFactors:
    """What a wrapper needs: raw ``A``, ``B``, the orthonormalised scaled ``basis`` (``k×r``),
    the scaling coefficient ``c`` and the digest of the raw factors."""

    A: torch.Tensor
    B: torch.Tensor
    basis: torch.Tensor
    coeff: float
    digest: str


def build_factors(seed: int, spec: LayerSpec, params: list[torch.Tensor], scale: float, scale_mode: str) -> LayerFactors:
    """Regenerate a layer's factors and scale them against its pretrained ``params`` (on one
    CPU thread: the same bits in every process, :func:`one_thread`)."""
    raw = generate_raw_factors(seed, spec)
    with one_thread():
        rho = reference_rms(params, scale_mode)
        coeff = float(scale) * rho * math.sqrt(spec.numel / spec.latents)
        basis = latent_basis(raw, coeff, spec.name)
    return LayerFactors(A=raw.A, B=raw.B, basis=basis, coeff=coeff, digest=raw.digest())


def split_budget(total: int, weights: list[float], caps: list[int]) -> list[int]:
    """Share ``total`` integer units among layers in proportion to ``weights``.

    Every layer gets at least 1 and at most its cap: the real-valued shares are
    ``clip(λ · weight, 1, cap)`` with ``λ`` found by bisection so that they sum to ``total``
    (water filling), then rounded with the largest remainder method (ties: earlier layer
    first), so the result sums to ``total`` exactly.
    """
    n = len(weights)
    if n == 0:
        return []
    if any(not w > 0 for w in weights):
        raise ValueError(f"split weights must be positive, got {weights}")
    if total < n:
        raise ValueError(f"a budget of {total} latents cannot give each of {n} layers one latent")
    if total > sum(caps):
        raise ValueError(f"a budget of {total} latents exceeds the {sum(caps)} parameters of the adapted layers")

    def shares(lam: float) -> list[float]:
        return [min(max(lam * w, 1.0), float(c)) for w, c in zip(weights, caps)]

    lo, hi = 0.0, 1.0
    while sum(shares(hi)) < total:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if sum(shares(mid)) < total:
            lo = mid
        else:
            hi = mid
    ideal = shares(hi)
    alloc = [min(math.floor(x + 1e-9), c) for x, c in zip(ideal, caps)]
    order = sorted(range(n), key=lambda i: (-(ideal[i] - alloc[i]), i))
    left = total - sum(alloc)
    while left > 0:  # the largest remainders first; loops again only on float round-off
        for i in order:
            if left and alloc[i] < caps[i]:
                alloc[i] += 1
                left -= 1
    while left < 0:  # round-off the other way: take back from the smallest remainders
        for i in reversed(order):
            if left and alloc[i] > 1:
                alloc[i] -= 1
                left += 1
    return alloc
