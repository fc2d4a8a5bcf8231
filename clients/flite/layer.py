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

Generation and scaling (seed-regenerated, bit-reproducible factors, orthonormalised and scaled
per layer) live in ``clients.factors``, shared with the latent channel.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

# the factors, shared with the latent channel (re-exported: clients.flite's own names)
from clients.factors import (  # noqa: F401
    KINDS,
    LayerFactors,
    LayerSpec,
    RawFactors,
    build_factors,
    dense_map,
    generate_raw_factors,
    latent_basis,
    layer_seed,
    one_thread,
    reference_rms,
)


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
