"""FLITE layers: seed-regenerated factors and the wrapper modules that use them.

The maths
---------
An adapted layer ``l`` views its trainable parameters as a matrix ``W ∈ R^{m×n}``:

* ``nn.Linear``: the weight, ``(out, in)``;
* ``nn.Conv1d/2d/3d``: the kernel reshaped to ``(out, in/groups · kh · kw)``, i.e. the
  weight's own shape flattened after the first axis, so grouped and depthwise convs work;
* norm layers: the affine parameters stacked as rows, ``[weight; bias]`` (``(2, d)``) or
  ``[weight]`` (``(1, d)``) when there is no bias (RMSNorm).

Its ``k`` latents ``z`` give ``W = W_pre + ΔW(z)`` with the structured form::

    ΔW(z) = A · diag(Vᵀ z) · B,    A ∈ R^{m×r},  B ∈ R^{r×n},  V ∈ R^{k×r}

which is FLITE's ``U_l V_lᵀ z_l`` with ``U_l``'s columns ``vec(a_i b_iᵀ)`` (``a_i`` the columns
of ``A``, ``b_i`` the rows of ``B``). Latent ``j`` moves the layer along the direction
``D_j = A · diag(V[j]) · B``; the dense reference form materialises the ``(m·n) × k``
matrix whose column ``j`` is ``vec(D_j)`` (row-major, like ``W.reshape(-1)``), so both forms
are the same linear map (the tests check it).

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
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

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


class FliteLayer(nn.Module):
    """Base of the wrappers: holds the frozen ``base_layer``, the latent ``flite_z`` (one
    ``nn.Parameter`` of ``k`` zeros, so the model starts as the backbone exactly) and the
    factors as non-persistent buffers.

    Structured form (``structured=True``): buffers ``flite_A (m×r)``, ``flite_B (r×n)``,
    ``flite_V (k×r)``; ``ΔW = A · diag(Vᵀ z) · B``. Dense form: one buffer ``flite_U``
    (``(m·n) × k``); ``ΔW = U z``. Attributes the wrapper lacks (``in_features``,
    ``weight``, ...) are read from the base layer; ``weight`` is the *pretrained* weight.
    """

    kind = ""

    def __init__(self, base_layer: nn.Module, spec: LayerSpec, factors: LayerFactors, structured: bool):
        super().__init__()
        if spec.kind != self.kind:
            raise ValueError(f"{type(self).__name__} cannot wrap a '{spec.kind}' layer")
        self.base_layer = base_layer
        self.flite_spec = spec
        self.flite_structured = bool(structured)
        self.flite_digest = factors.digest
        self.flite_coeff = factors.coeff
        ref = getattr(base_layer, spec.param_names[0])
        device = ref.device
        self.flite_z = nn.Parameter(torch.zeros(spec.latents, dtype=torch.float32, device=device))
        if self.flite_structured:
            self.register_buffer("flite_A", factors.A.to(device), persistent=False)
            self.register_buffer("flite_B", factors.B.to(device), persistent=False)
            self.register_buffer("flite_V", factors.basis.to(device), persistent=False)
        else:
            self.register_buffer("flite_U", dense_map(factors.A, factors.basis, factors.B).to(device), persistent=False)

    # -- attribute passthrough -------------------------------------------------------------
    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "base_layer":
                raise
            return getattr(self.base_layer, name)

    # -- the map z -> ΔW --------------------------------------------------------------------
    def delta_matrix(self) -> torch.Tensor:
        """``ΔW(z)`` as the ``m × n`` matrix (differentiable in ``flite_z``)."""
        m, n = self.flite_spec.matrix_shape
        z = self.flite_z
        if self.flite_structured:
            s = z.to(self.flite_V.dtype) @ self.flite_V  # (r,) = Vᵀ z
            return (self.flite_A * s) @ self.flite_B
        return (self.flite_U @ z.to(self.flite_U.dtype)).view(m, n)

    def dense_map(self) -> torch.Tensor:
        """The ``(m·n) × k`` matrix of this layer's map (materialised even in structured form)."""
        if self.flite_structured:
            return dense_map(self.flite_A, self.flite_V, self.flite_B)
        return self.flite_U

    def delta_parameters(self) -> dict[str, torch.Tensor]:
        """``ΔW(z)`` split back into the shapes of the adapted parameters."""
        delta = self.delta_matrix()
        if len(self.flite_spec.param_names) == 1:
            name = self.flite_spec.param_names[0]
            return {name: delta.reshape(getattr(self.base_layer, name).shape)}
        return {
            name: delta[i].reshape(getattr(self.base_layer, name).shape)
            for i, name in enumerate(self.flite_spec.param_names)
        }

    def effective_parameters(self) -> dict[str, torch.Tensor]:
        """``θ_pre + ΔW(z)`` per adapted parameter, in the base parameters' dtype."""
        out = {}
        for name, delta in self.delta_parameters().items():
            base = getattr(self.base_layer, name)
            out[name] = base + delta.to(base.dtype)
        return out

    def extra_repr(self) -> str:
        s = self.flite_spec
        form = "structured" if self.flite_structured else "dense"
        return f"latents={s.latents}, rank={s.rank}, form={form}, matrix={s.matrix_shape[0]}x{s.matrix_shape[1]}"


class FliteLinear(FliteLayer):
    """``nn.Linear`` with ``W = W_pre + ΔW(z)``.

    Structured form: ``y = base(x) + ((x Bᵀ) ⊙ (Vᵀ z)) Aᵀ`` — the LoRA-style path, so no
    ``out × in`` tensor is created or kept for backward (what makes it usable on LLMs).
    """

    kind = "linear"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        if self.flite_structured:
            s = (self.flite_z.to(self.flite_V.dtype) @ self.flite_V).to(x.dtype)
            h = F.linear(x, self.flite_B.to(x.dtype)) * s
            return base(x) + F.linear(h, self.flite_A.to(x.dtype))
        weight = self.effective_parameters()["weight"]
        return F.linear(x, weight, base.bias)


class FliteConv(FliteLayer):
    """``nn.Conv1d/2d/3d`` with kernel ``W_pre + ΔW(z)`` (``ΔW`` is kernel-sized, built per call)."""

    kind = "conv"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        weight = self.effective_parameters()["weight"]
        return base._conv_forward(x, weight, base.bias)


class FliteNorm(FliteLayer):
    """Any norm layer with affine parameters: runs the base layer's own forward (BatchNorm
    statistics, RMSNorm epsilon and dtype handling included) with ``θ_pre + ΔW(z)``
    swapped in for its weight/bias through ``torch.func.functional_call``."""

    kind = "norm"

    def forward(self, *args, **kwargs):
        return functional_call(self.base_layer, self.effective_parameters(), args, kwargs)


WRAPPERS: dict[str, type[FliteLayer]] = {"linear": FliteLinear, "conv": FliteConv, "norm": FliteNorm}
