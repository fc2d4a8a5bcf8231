"""FLITE configuration.

FLITE keeps PEFT's split into *config* (this file), *layer* (``layer.py``: the wrapper
modules and the seed-regenerated factors) and *model* (``model.py``: target matching,
injection, latent get/set, layout and fingerprint), but it is deliberately **not** a
registered PEFT tuner:

* ``peft.register_peft_method`` (peft 0.21.2) only accepts names already listed in PEFT's
  closed ``PeftType`` enum ("Unknown PEFT type ..., please add an entry to
  peft.utils.peft_types.PeftType"), so a custom method would have to monkey-patch a
  library enum, which breaks silently on PEFT upgrades;
* PEFT's ``BaseTuner`` machinery is built around several named adapters and
  ``save_pretrained`` of their parameters, while FLITE's whole state is one flat latent
  vector whose wire format (``strategies.codec``) and compatibility check (the
  fingerprint) Postcard owns; norm-layer affine parameters, which FLITE also
  parametrises, have no PEFT target-layer counterpart.

What PEFT would give for free (target matching by name suffix or regex, in-place
injection, freezing) is small and lives in ``model.py``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

SCALE_MODES = ("weight", "unit")
SPLITS = ("uniform", "sqrt", "size", "late", "sensitivity")
DEFAULT_SEED = 0x5EED_F117_E000_0001  # any 64-bit value; every client and the server share it
DEFAULT_HEADS = ("lm_head", "classifier", "head", "fc")
PARAMETRISATION_VERSION = "flite-v1"  # part of the fingerprint: bump when the factor maths changes


@dataclass
class FliteConfig:
    """How FLITE parametrises a backbone: ``θ_l = θ_pre,l + U_l V_lᵀ z_l`` per adapted layer.

    Factors
        seed: shared unsigned 64-bit seed. Each layer's factors come from a CPU
            ``torch.Generator`` seeded with ``sha256(seed, layer name)``; they are never stored
            in a checkpoint nor sent.
        rank: ``r``, the number of rank-1 components ``a_i b_iᵀ`` per layer. A layer with more
            latents than ``rank`` uses ``r = its latents`` so its latent directions stay
            linearly independent.

    Latents (the payload)
        latents: latents per adapted weight layer (Linear / Conv). ``None`` splits
            ``latent_budget`` across the weight layers instead.
        latent_budget: total latents of the model (norm layers included) when ``latents``
            is ``None``; 1,280 is FLITE's vision setting (648 bytes in int4).
        split: how the weight layers share the budget: ``"sqrt"`` (proportional to the
            square root of the layer's size, the default), ``"uniform"`` (equal shares),
            ``"size"`` (proportional to the layer's size) or ``"late"`` (``"sqrt"`` times the
            layer's position, 1 for the first weight layer to n for the last: the last
            blocks first) or ``"sensitivity"`` (proportional to ``sensitivity[layer name]``).
            Every layer gets at least one latent and never more than it has parameters.
            ``"sqrt"`` and 12 latents per norm layer were the better choices in a short
            centralised MobileNetV2 / CIFAR-10 probe (uniform shares starve the large late
            layers); the project's benchmark, not this default, is the reference.
        sensitivity: per weight layer (module name -> a number > 0) the weights of
            ``split="sensitivity"``: for ``base=public``, θ_pre's gradient norm per layer on the
            public split (``clients.pretrain.base_sensitivity``, filled in by the FLITE app).
            Part of the latent layout, so of the fingerprint.
        include_norms: also parametrise the affine parameters (weight and bias) of norm
            layers (BatchNorm, GroupNorm, LayerNorm, RMSNorm and HF ``*RMSNorm``), each with
            ``norm_latents`` latents taken from the budget first.
        norm_latents: latents per norm layer.

    Targets
        target_modules: which Linear/Conv layers to adapt. ``None``: all of them outside
            the head; a list of names: a module matches when its name equals an entry or
            ends with ``"." + entry`` (PEFT's rule, e.g. ``["q_proj", "v_proj"]``); a string:
            a regular expression that must match the full module name.
        exclude_modules: same forms; matching modules (of any kind) are never adapted.
        head_modules: names of the classification / LM head (a module is part of the head
            when its name equals an entry or starts with ``entry + "."``). Missing names are
            ignored.
        freeze_head: ``True`` (FLITE's choice): the head gets no latents; combined with
            :func:`clients.models.heads.orthogonal_head_` it is a frozen orthogonal classifier,
            never trained nor sent. ``False``: head layers are ordinary targets.

    Scaling (see ``layer.py`` for the maths)
        scale: the latent directions of a layer are orthonormal (Frobenius inner
            product) and scaled so that a latent vector whose coordinates have unit RMS
            moves the layer's parameters by ``scale × ρ_l`` in RMS, where ``ρ_l`` is the
            RMS of the pretrained parameters (``scale_mode="weight"``) or 1
            (``scale_mode="unit"``). With Adam, ``scale`` and the learning rate trade off
            one for one; what matters is that every layer gets the same *relative* step.
        norm_scale: ``scale`` for norm layers (``None``: the same as ``scale``).
        scale_mode: ``"weight"`` or ``"unit"``, as above.

    Implementation
        structured_threshold: layers with more parameters than this use the structured
            form ``ΔW = A · diag(Vᵀ z) · B`` (never materialising a ``|θ_l| × k`` matrix);
            smaller ones materialise that dense map once. Both forms are the same linear
            map (tested), so this does not change the fingerprint.
    """

    seed: int = DEFAULT_SEED
    rank: int = 64
    latents: int | None = None
    latent_budget: int = 1280
    split: str = "sqrt"
    sensitivity: dict[str, float] | None = None
    include_norms: bool = True
    norm_latents: int = 12
    target_modules: list[str] | str | None = None
    exclude_modules: list[str] | str | None = None
    head_modules: list[str] = field(default_factory=lambda: list(DEFAULT_HEADS))
    freeze_head: bool = True
    scale: float = 1.0
    norm_scale: float | None = None
    scale_mode: str = "weight"
    structured_threshold: int = 8192

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> FliteConfig:
        """Raise ``ValueError`` naming the offending field; return ``self``."""

        def check_int(name: str, value, minimum: int) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"FliteConfig.{name} must be an integer >= {minimum}, got {value!r}")

        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise ValueError(f"FliteConfig.seed must be an unsigned 64-bit integer, got {self.seed!r}")
        check_int("rank", self.rank, 1)
        if self.latents is not None:
            check_int("latents", self.latents, 1)
        check_int("latent_budget", self.latent_budget, 1)
        check_int("norm_latents", self.norm_latents, 1)
        check_int("structured_threshold", self.structured_threshold, 0)
        if self.split not in SPLITS:
            raise ValueError(f"FliteConfig.split must be one of {SPLITS}, got {self.split!r}")
        if self.sensitivity is not None:
            if not isinstance(self.sensitivity, Mapping) or not all(
                    isinstance(k, str) and not isinstance(v, bool) and isinstance(v, (int, float)) and 0 < v < float("inf")
                    for k, v in self.sensitivity.items()):
                raise ValueError("FliteConfig.sensitivity must map layer names to finite numbers > 0")
        if self.scale_mode not in SCALE_MODES:
            raise ValueError(f"FliteConfig.scale_mode must be one of {SCALE_MODES}, got {self.scale_mode!r}")
        for name in ("scale", "norm_scale"):
            value = getattr(self, name)
            if value is None and name == "norm_scale":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
                raise ValueError(f"FliteConfig.{name} must be a finite number > 0, got {value!r}")
        for name in ("target_modules", "exclude_modules"):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    re.compile(value)
                except re.error as err:
                    raise ValueError(f"FliteConfig.{name} is not a valid regular expression: {err}") from None
            elif value is not None and not (
                isinstance(value, Sequence) and all(isinstance(v, str) and v for v in value)
            ):
                raise ValueError(f"FliteConfig.{name} must be None, a regex string or a list of names, got {value!r}")
        if isinstance(self.head_modules, str) or not all(isinstance(v, str) and v for v in self.head_modules):
            raise ValueError(f"FliteConfig.head_modules must be a list of module names, got {self.head_modules!r}")
        return self

    @property
    def effective_norm_scale(self) -> float:
        return float(self.scale if self.norm_scale is None else self.norm_scale)

    def to_dict(self) -> dict:
        """Plain dict (lists, not tuples), e.g. to write into the run's config.yaml."""
        out = dataclasses.asdict(self)
        for key in ("target_modules", "exclude_modules", "head_modules"):
            if isinstance(out[key], tuple):
                out[key] = list(out[key])
        return out

    @classmethod
    def from_dict(cls, values: Mapping) -> FliteConfig:
        """Build from a mapping (e.g. a Hydra/OmegaConf node converted to a dict);
        unknown keys raise ``ValueError`` instead of being silently ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown FliteConfig keys {unknown}; valid keys: {sorted(known)}")
        kwargs = dict(values)
        for key in ("target_modules", "exclude_modules", "head_modules"):
            if key in kwargs and kwargs[key] is not None and not isinstance(kwargs[key], str):
                kwargs[key] = list(kwargs[key])
        return cls(**kwargs)
