r"""MoRE — Mixture of Rank-wise Experts (SmartFed), injected into a HF causal LM.

Every pooled LoRA ``ΔW = s·B A`` splits into rank-1 experts
``E_i(x) = B_i (A_i x)`` (scale folded into ``B``; :mod:`clients.pool`). A
:class:`MoRELinear` replaces a target ``nn.Linear`` ``W`` by

.. math::  y = W x + \sum_{i \in \mathrm{TopK}(x)} g_i(x)\, B_i (A_i x),

with a router ``W_router ∈ R^{E×d_in}`` per matrix, evaluated on the *active* experts
only (the quota set by EEQA), and K per token (``top_k``, clipped to the number of active
experts). Gates, by ``gate_mode``:

* ``"softmax"`` (default): ``p = softmax(W_router[active] x)``; the top-K are kept and
  renormalised, then multiplied by K: ``g_i = K p_i / Σ_{j∈TopK} p_j``. The kept gates
  average 1, so a uniform router reproduces the plain sum of the kept experts — with all
  ``r`` experts of one adapter active and K = r, exactly that adapter. Without the factor K
  a mixture of frozen experts (router-only mode) could never exceed ``1/K`` of any
  adapter's update.
* ``"softmax-raw"``: the paper's literal ``g = softmax(W_router x)``, the kept top-K
  probabilities as they are (not renormalised, not scaled).
* ``"ones"``: test hook; every kept expert gets gate 1 (selection still by router logits).

Compute: ``A x`` is evaluated for the active experts only (rows gathered by index), the
gates form a dense ``(tokens, active)`` matrix that is zero outside each token's top-K,
and the mixture is ``((x A_actᵀ) ⊙ G) B_actᵀ`` — the cost of a LoRA of rank |active|.

Training modes (``MoREConfig.mode``): ``"experts+router"`` trains experts' A/B and the
router (the seed's SmartFed); ``"router-only"`` freezes the experts and trains the router
(the published paper's variant). The backbone is always frozen.

Importance (for EEQA), ``MoREConfig.importance``: ``"usage"`` (default) — during training,
each forward updates per active expert an EMA of ``mean_tokens ‖g_i(x) E_i(x)‖ =
mean_t |g_ti (A_i x_t)| · ‖B_i‖`` — gate mass × expert output norm, from tensors the
forward already has. ``"sensitivity"`` — the seed's marginal gain, to first order: each
training step's backward gives ``|Σ_t ∂L/∂z_ti · z_ti|`` (``z_ti = g_ti A_i x_t``), the
change of the batch's loss if expert i's output were removed (``d L(α·E_i)/dα`` at α = 1;
AdaLoRA's sensitivity taken per expert), EMA'd over the round's steps; the proxy is the
training batch, not a held-out set. :func:`importance_state` reports either.
A *training forward* is one in train mode or with gradients enabled (``clients.train``
trains in eval mode, to keep dropout off); evaluation under ``torch.no_grad()`` in eval
mode measures nothing.

State exchange uses the packed form of :mod:`strategies.sparse`
(``<matrix>/ids``, ``/router``, ``/A``, ``/B``, ``/importance``): :func:`active_state`,
:func:`load_mixture`, :func:`importance_state`, :func:`to_layout_ids`. A client round
(``fedapps.smartfed``) holds only the experts the server sent, never the whole pool::

    ids = load_mixture(backbone, codec.decode(downlink), config)   # MoRE layers of the sent experts
    before = active_state(backbone)
    ...local training (no weight decay on experts/routers)...
    update = sparse.delta(active_state(backbone), before) | importance_state(backbone)
    reply = sparse.encode(to_layout_ids(update, ids))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# the layer's settings: torch-free, checked when a config is composed (re-exported)
from clients.smartfed.config import GATE_MODES, IMPORTANCE_MODES, MODES, MoREConfig  # noqa: F401
from clients.pool import ExpertSet, split_adapter, split_lora
from strategies.sparse import ExpertLayout, MatrixLayout, group, importance_report, init_router

__all__ = [
    "GATE_MODES",
    "IMPORTANCE_MODES",
    "MODES",
    "ExpertSet",
    "MoREConfig",
    "MoRELinear",
    "active_state",
    "apply_more",
    "expert_layout",
    "importance_state",
    "MixtureError",
    "load_mixture",
    "more_modules",
    "remove_more",
    "split_adapter",
    "split_lora",
    "to_layout_ids",
]

class MoRELinear(nn.Module):
    """A frozen ``nn.Linear`` plus a routed mixture of rank-1 experts.

    Args:
        base: the frozen linear layer (kept as ``base_layer``, as PEFT does).
        experts_A: ``(E, d_in)`` expert down-projections.
        experts_B: ``(d_out, E)`` expert up-projections (LoRA scale folded in).
        top_k: experts kept per token.
        router: initial ``(E, d_in)`` router weights (default zeros: uniform routing).
        expert_ids: stable ids of the E experts (default ``"0".."E-1"``).
        gate_mode: see the module docstring.
        train_experts: whether A/B are trainable (False = router-only).
        importance_decay: EMA factor for :attr:`importance`.
        importance_mode: ``"usage"`` or ``"sensitivity"`` (the module docstring).
    """

    def __init__(
        self,
        base: nn.Linear,
        experts_A: torch.Tensor | np.ndarray,
        experts_B: torch.Tensor | np.ndarray,
        top_k: int,
        router: torch.Tensor | np.ndarray | None = None,
        *,
        expert_ids: Sequence[str] | None = None,
        gate_mode: str = "softmax",
        train_experts: bool = True,
        importance_decay: float = 0.9,
        importance_mode: str = "usage",
    ):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"MoRELinear wraps nn.Linear, got {type(base).__name__}")
        if gate_mode not in GATE_MODES:
            raise ValueError(f"gate_mode must be one of {GATE_MODES}, got {gate_mode!r}")
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        if importance_mode not in IMPORTANCE_MODES:
            raise ValueError(f"importance_mode must be one of {IMPORTANCE_MODES}, got {importance_mode!r}")
        device = base.weight.device
        A = torch.as_tensor(experts_A, dtype=torch.float32).to(device)
        B = torch.as_tensor(experts_B, dtype=torch.float32).to(device)
        E = A.shape[0]
        if A.shape != (E, base.in_features) or B.shape != (base.out_features, E):
            raise ValueError(
                f"experts A {tuple(A.shape)} / B {tuple(B.shape)} do not fit a Linear "
                f"{base.in_features}->{base.out_features} (want ({E}, {base.in_features}) and "
                f"({base.out_features}, {E}))"
            )
        router = torch.zeros(E, base.in_features) if router is None else torch.as_tensor(router, dtype=torch.float32)
        if router.shape != (E, base.in_features):
            raise ValueError(f"router has shape {tuple(router.shape)}, expected ({E}, {base.in_features})")
        self.expert_ids = tuple(str(i) for i in expert_ids) if expert_ids is not None else tuple(map(str, range(E)))
        if len(self.expert_ids) != E:
            raise ValueError(f"{len(self.expert_ids)} expert ids for {E} experts")

        self.base_layer = base
        base.requires_grad_(False)
        self.expert_A = nn.Parameter(A.clone(), requires_grad=train_experts)
        self.expert_B = nn.Parameter(B.clone(), requires_grad=train_experts)
        self.router = nn.Parameter(router.clone().to(device))
        self.top_k = int(top_k)
        self.gate_mode = gate_mode
        self.importance_decay = float(importance_decay)
        self.importance_mode = importance_mode
        self.register_buffer("active_idx", torch.arange(E, device=device))
        self.register_buffer("importance_ema", torch.zeros(E, device=device))
        self.register_buffer("importance_steps", torch.zeros(E, dtype=torch.long, device=device))

    # -- structure

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    @property
    def num_experts(self) -> int:
        return len(self.expert_ids)

    @property
    def num_active(self) -> int:
        return int(self.active_idx.numel())

    @property
    def train_experts(self) -> bool:
        return self.expert_A.requires_grad

    def set_active(self, indices: Sequence[int] | torch.Tensor | np.ndarray) -> None:
        """Make exactly these experts active (the quota); stored sorted."""
        if isinstance(indices, torch.Tensor):
            indices = indices.detach().cpu().numpy()
        idx = torch.as_tensor(np.asarray(indices, dtype=np.int64).reshape(-1))
        if idx.numel() and (idx.min() < 0 or idx.max() >= self.num_experts):
            raise ValueError(f"active indices must be in [0, {self.num_experts}), got {idx.tolist()}")
        if torch.unique(idx).numel() != idx.numel():
            raise ValueError("active indices must be unique")
        self.active_idx = torch.sort(idx).values.to(self.active_idx.device)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, experts={self.num_experts}, "
            f"active={self.num_active}, top_k={self.top_k}, gate_mode={self.gate_mode!r}, "
            f"train_experts={self.train_experts}"
        )

    # -- routing

    def gates(self, x: torch.Tensor) -> torch.Tensor:
        """Dense gates ``(tokens, num_active)``: ``g_i(x)`` for the top-K, 0 elsewhere.

        Columns follow :attr:`active_idx`. Logits and softmax are computed in fp32.
        """
        n = self.num_active
        xf = x.reshape(-1, self.in_features)
        if n == 0:
            return xf.new_zeros(xf.shape[0], 0)
        k = min(self.top_k, n)
        logits = xf.float() @ self.router.index_select(0, self.active_idx).t()
        if self.gate_mode == "ones":
            if k == n:
                return torch.ones_like(logits)
            return torch.zeros_like(logits).scatter(-1, logits.topk(k, dim=-1).indices, 1.0)
        probs = F.softmax(logits, dim=-1)
        kept, index = probs.topk(k, dim=-1)
        if self.gate_mode == "softmax":
            kept = k * kept / kept.sum(dim=-1, keepdim=True)
        return torch.zeros_like(probs).scatter(-1, index, kept)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        y = self.base_layer(x, *args, **kwargs)
        if self.num_active == 0:
            return y
        xf = x.reshape(-1, self.in_features)
        A = self.expert_A.index_select(0, self.active_idx).to(xf.dtype)  # (n, d_in)
        B = self.expert_B.index_select(1, self.active_idx).to(xf.dtype)  # (d_out, n)
        z = (xf @ A.t()) * self.gates(xf).to(xf.dtype)  # (T, n): g_i(x) A_i x
        # a training forward (see the module docstring), but not the replay of a checkpointed
        # layer inside backward (train.grad_checkpointing), which would count the step twice
        if (self.training or torch.is_grad_enabled()) and torch._C._current_graph_task_id() == -1:
            if self.importance_mode == "usage":
                self._track_importance(z, B)
            elif z.requires_grad:  # sensitivity: measured from this forward's gradient, in backward
                idx, kept = self.active_idx.clone(), z.detach()
                z.register_hook(lambda grad: self._update_importance(idx, (grad.float() * kept.float()).sum(0).abs()))
        mixture = z @ B.t()
        return y + mixture.reshape(*x.shape[:-1], self.out_features).to(y.dtype)

    # -- importance

    @torch.no_grad()
    def _track_importance(self, z: torch.Tensor, B: torch.Tensor) -> None:
        # ‖g_ti E_i(x_t)‖ = |g_ti A_i x_t| · ‖B_i‖, averaged over the batch's tokens.
        self._update_importance(self.active_idx, z.detach().float().abs().mean(dim=0) * B.detach().float().norm(dim=0))

    @torch.no_grad()
    def _update_importance(self, idx: torch.Tensor, stat: torch.Tensor) -> None:
        """One step's statistic of the active experts ``idx`` into their EMA."""
        first = self.importance_steps[idx] == 0
        d = self.importance_decay
        old = self.importance_ema[idx]
        self.importance_ema[idx] = torch.where(first, stat, d * old + (1 - d) * stat)
        self.importance_steps[idx] += 1

    @property
    def importance(self) -> torch.Tensor:
        """Per expert ``(E,)``: the EMA of gate mass × output norm (or of the sensitivity); NaN if not measured."""
        measured = self.importance_steps > 0
        return torch.where(measured, self.importance_ema, torch.full_like(self.importance_ema, float("nan")))

    def reset_importance(self) -> None:
        self.importance_ema.zero_()
        self.importance_steps.zero_()


# ---------------------------------------------------------------------------- model level


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def apply_more(
    model: nn.Module,
    pool_experts: Mapping[str, ExpertSet] | ExpertLayout,
    config: MoREConfig | None = None,
) -> nn.Module:
    """Replace the target ``nn.Linear`` modules of ``model`` by :class:`MoRELinear` (in place).

    Args:
        model: a HF causal LM (module names as in ``model.named_modules()``).
        pool_experts: ``{module name: ExpertSet}`` (``Pool.load_experts``), or an
            :class:`~strategies.sparse.ExpertLayout` (experts start at zero). A client gets its
            layers from the downlink with :func:`load_mixture` instead.
        config: :class:`MoREConfig` (default: top-2, experts+router, softmax gates).

    The whole backbone is frozen; only the experts (unless router-only) and routers train.
    Returns ``model``.
    """
    config = config or MoREConfig()
    if isinstance(pool_experts, ExpertLayout):
        if pool_experts.train_experts != config.train_experts:
            raise ValueError(f"the layout is {pool_experts.mode} but the config says {config.mode}")
        pool_experts = {m: ExpertSet.zeros(ml.expert_ids, ml.d_in, ml.d_out) for m, ml in pool_experts.matrices.items()}
    if not pool_experts:
        raise ValueError("no experts to inject")
    unknown = set(config.active or {}) - set(pool_experts)
    if unknown:
        raise ValueError(f"active sets given for matrices without experts: {sorted(unknown)}")
    model.requires_grad_(False)
    for name in sorted(pool_experts):
        experts = pool_experts[name]
        try:
            module = model.get_submodule(name)
        except AttributeError as err:
            raise ValueError(f"the model has no module '{name}' (expert sets must use base-model module names)") from err
        if isinstance(module, MoRELinear):
            raise ValueError(f"'{name}' already is a MoRE layer")
        if not isinstance(module, nn.Linear):
            raise TypeError(f"'{name}' is a {type(module).__name__}; MoRE targets nn.Linear modules")
        if tuple(module.weight.shape) != (experts.d_out, experts.d_in):
            raise ValueError(
                f"experts of '{name}' are {experts.d_out}x{experts.d_in} but the module's weight is "
                f"{tuple(module.weight.shape)}: built for another backbone?"
            )
        layer = MoRELinear(
            module,
            experts.A,
            experts.B,
            config.top_k,
            init_router(name, len(experts), experts.d_in, config.router_seed, config.router_std),
            expert_ids=experts.ids,
            gate_mode=config.gate_mode,
            train_experts=config.train_experts,
            importance_decay=config.importance_decay,
            importance_mode=config.importance,
        )
        if config.active is not None and name in config.active:
            layer.set_active(config.active[name])
        _replace(model, name, layer)
    return model


def remove_more(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_more` (in place): every MoRE layer gives its frozen base layer back.

    A model without MoRE layers is returned unchanged. Lets a client that receives a new
    mixture each round (its active experts only) rebuild the layers on the same backbone.
    """
    for name, module in list(model.named_modules()):
        if isinstance(module, MoRELinear):
            _replace(model, name, module.base_layer)
    return model


def more_modules(model: nn.Module) -> dict[str, MoRELinear]:
    """``{module name: MoRELinear}`` of a model after :func:`apply_more`, sorted by name."""
    found = {name: m for name, m in model.named_modules() if isinstance(m, MoRELinear)}
    if not found:
        raise ValueError("the model has no MoRE layers (call apply_more first)")
    return dict(sorted(found.items()))


def expert_layout(model: nn.Module) -> ExpertLayout:
    """The :class:`~strategies.sparse.ExpertLayout` of the injected layers (compare fingerprints)."""
    layers = more_modules(model)
    modes = {layer.train_experts for layer in layers.values()}
    if len(modes) != 1:
        raise ValueError("MoRE layers disagree on whether experts train")
    return ExpertLayout(
        {n: MatrixLayout(m.in_features, m.out_features, m.expert_ids) for n, m in layers.items()}, modes.pop()
    )


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).numpy().copy()


@torch.no_grad()
def active_state(model: nn.Module, include_frozen: bool = False) -> dict[str, np.ndarray]:
    """The trainable tensors of the active experts and their router rows, packed.

    Per MoRE layer ``m``: ``m/ids`` (active indices, int64), ``m/router`` ``(k, d_in)`` and,
    when experts train (or ``include_frozen``), ``m/A`` ``(k, d_in)`` and ``m/B``
    ``(k, d_out)`` (B columns as rows). Feed two of these to ``strategies.sparse.delta``.
    """
    out: dict[str, np.ndarray] = {}
    for name, layer in more_modules(model).items():
        idx = layer.active_idx
        out[f"{name}/ids"] = idx.cpu().numpy().astype(np.int64)
        out[f"{name}/router"] = _numpy(layer.router[idx])
        if layer.train_experts or include_frozen:
            out[f"{name}/A"] = _numpy(layer.expert_A[idx])
            out[f"{name}/B"] = _numpy(layer.expert_B[:, idx].t())
    return out


@torch.no_grad()
def importance_state(model: nn.Module) -> dict[str, np.ndarray]:
    """The importance report ``m/importance`` ``(2, k)`` of every MoRE layer.

    Row 0: the active experts' indices, row 1: their importance (EMA of gate mass × output
    norm) — all active experts, including those no token was routed to (importance 0),
    which ``strategies.sparse.delta`` leaves out of the deltas. Layers not measured (no
    training forward since the mixture was loaded) are left out.
    """
    out: dict[str, np.ndarray] = {}
    for name, layer in more_modules(model).items():
        values = layer.importance[layer.active_idx]
        if values.numel() and not torch.isnan(values).any():
            out[f"{name}/importance"] = importance_report(layer.active_idx.cpu().numpy(), _numpy(values))
    return out


class MixtureError(ValueError):
    """A downlink that cannot be a mixture (missing fields, bad ids, wrong shapes); says which."""


def load_mixture(model: nn.Module, tensors: Mapping[str, np.ndarray], config: MoREConfig) -> dict[str, np.ndarray]:
    """Rebuild ``model``'s MoRE layers from a packed state of active experts (a downlink).

    The one loader of a downlink: every matrix of ``tensors`` gets a MoRE layer holding
    exactly the experts sent (``ids``, ``router``, ``A``, ``B``; their rows in that order);
    matrices not sent stay plain backbone layers, layers of an earlier mixture are removed
    first. Returns ``{matrix: the experts' layout indices}`` (layer expert ``j`` is layout
    expert ``ids[j]``), to translate the reply back with :func:`to_layout_ids`.
    """
    remove_more(model)
    experts, routers, ids = {}, {}, {}
    for matrix, fields in group(tensors).items():
        missing = [f for f in ("ids", "router", "A", "B") if f not in fields]
        if missing:
            raise MixtureError(f"the downlink of '{matrix}' lacks {missing}")
        raw = np.asarray(fields["ids"], np.float64)
        if raw.ndim != 1 or np.any(raw != np.round(raw)) or np.any(raw < 0) or np.unique(raw).size != raw.size:
            raise MixtureError(f"the downlink of '{matrix}' has invalid expert ids")
        ids[matrix] = raw.astype(np.int64)
        experts[matrix] = ExpertSet(tuple(str(i) for i in ids[matrix]), fields["A"], np.asarray(fields["B"]).T)
        routers[matrix] = np.asarray(fields["router"], np.float32)
    if not experts:
        raise MixtureError("the downlink holds no expert: the server's budget is 0?")
    try:
        apply_more(model, experts, config)
    except ValueError as err:  # a matrix the model lacks, A/B of the wrong width
        raise MixtureError(f"the downlink does not fit this model: {err}") from None
    with torch.no_grad():
        for matrix, layer in more_modules(model).items():
            router = torch.from_numpy(routers[matrix])
            if tuple(router.shape) != tuple(layer.router.shape):
                raise MixtureError(
                    f"router of '{matrix}' has shape {tuple(router.shape)}, expected {tuple(layer.router.shape)}"
                )
            layer.router.copy_(router.to(layer.router.device))
    return ids


def to_layout_ids(update: Mapping[str, np.ndarray], ids: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A packed update with layer-local expert indices -> the server's layout indices."""
    out = {}
    for key, value in update.items():
        matrix, field = key.rsplit("/", 1)
        if field == "ids":
            value = ids[matrix][np.asarray(value, np.int64)]
        elif field == "importance":
            value = np.array(value, np.float32)
            value[0] = ids[matrix][value[0].astype(np.int64)]
        out[key] = value
    return out