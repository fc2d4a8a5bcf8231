"""The LoRA knowledge pool (SmartFed mixes its adapters; the LoRA baselines can start from it) and the split
of a LoRA into rank-1 experts.

A *knowledge pool* keeps the LoRA adapters of earlier fine-tuning runs instead of
discarding them. On disk it is one folder::

    pool/
      pool.json                       backbone signature + fingerprint, format version
      <adapter name>/
        adapter_model.safetensors     as written by ``PeftModel.save_pretrained``
        adapter_config.json           idem
        provenance.json               source run, task, rank, alpha, target modules,
                                      backbone fingerprint, created time (UTC, ISO 8601)

Every adapter in a pool was trained on the same backbone: :meth:`Pool.add` refuses an
adapter whose target matrices do not exist in, or do not have the shapes of, the pool's
backbone (:func:`backbone_signature`).

**Rank-1 experts (MoRE).** A LoRA update of one weight matrix is
``ΔW = s · B A`` with ``B ∈ R^{d_out×r}``, ``A ∈ R^{r×d_in}`` and PEFT's scale
``s = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA). It is the sum of ``r``
rank-1 terms, the *experts* ``E_i(x) = s · B[:, i] (A[i, :] x)``. :func:`split_lora`
returns them as an :class:`ExpertSet` with the scale folded into ``B`` (so
``ΔW = ExpertSet.B @ ExpertSet.A``). The experts of every pooled adapter that targets a
matrix, concatenated in adapter-name order, form that matrix's expert set; expert ``i`` of
adapter ``name`` has the stable id ``"name:i"``.

This module needs numpy, safetensors and json only (torch and transformers are imported
lazily, and only to fingerprint a live model or a config), so the server can read a pool
without a torch model.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

POOL_FILE = "pool.json"
PROVENANCE_FILE = "provenance.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
POOL_FORMAT = 1

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# "base_model.model.<module>.lora_A.weight" (save_pretrained / get_peft_model_state_dict);
# the adapter-name segment ("lora_A.default.weight") appears in a raw model state dict.
_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


class PoolError(ValueError):
    """An adapter or pool that cannot be used; the message says why."""


# ----------------------------------------------------------------------------- experts


@dataclass(frozen=True)
class ExpertSet:
    """The rank-1 experts of one target matrix.

    Expert ``i`` computes ``E_i(x) = B[:, i] * (A[i, :] @ x)``; the LoRA scale is already
    folded into ``B``, so the sum of all experts is ``ΔW = B @ A``.

    Attributes:
        ids: stable expert ids, ``"adapter:rank_index"``, one per expert.
        A: ``(E, d_in)`` float32, row ``i`` is expert ``i``'s down-projection.
        B: ``(d_out, E)`` float32, column ``i`` is expert ``i``'s (scaled) up-projection.
    """

    ids: tuple[str, ...]
    A: np.ndarray
    B: np.ndarray

    def __post_init__(self):
        A = np.ascontiguousarray(np.asarray(self.A, dtype=np.float32))
        B = np.ascontiguousarray(np.asarray(self.B, dtype=np.float32))
        ids = tuple(str(i) for i in self.ids)
        if A.ndim != 2 or B.ndim != 2:
            raise ValueError(f"expert A and B must be 2-D, got {A.shape} and {B.shape}")
        if not (len(ids) == A.shape[0] == B.shape[1]):
            raise ValueError(f"{len(ids)} ids for A {A.shape} (E×d_in) and B {B.shape} (d_out×E)")
        if len(set(ids)) != len(ids):
            raise ValueError("expert ids must be unique within a matrix")
        object.__setattr__(self, "ids", ids)
        object.__setattr__(self, "A", A)
        object.__setattr__(self, "B", B)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def d_in(self) -> int:
        return int(self.A.shape[1])

    @property
    def d_out(self) -> int:
        return int(self.B.shape[0])

    def source(self, index: int) -> tuple[str, int]:
        """(adapter name, rank index) of expert ``index``."""
        adapter, _, rank = self.ids[index].rpartition(":")
        return adapter, int(rank)

    def delta_weight(self) -> np.ndarray:
        """``Σ_i B[:, i] A[i, :]``: the dense ``(d_out, d_in)`` update of all experts."""
        return self.B @ self.A

    @classmethod
    def zeros(cls, ids: Iterable[str], d_in: int, d_out: int) -> ExpertSet:
        """Placeholder experts (all zero) with the given ids, to be filled from a downlink."""
        ids = tuple(ids)
        return cls(ids, np.zeros((len(ids), d_in), np.float32), np.zeros((d_out, len(ids)), np.float32))

    @classmethod
    def concat(cls, sets: Iterable[ExpertSet]) -> ExpertSet:
        """The union of several adapters' experts of one matrix, in the given order."""
        sets = list(sets)
        if not sets:
            raise ValueError("cannot concatenate zero expert sets")
        shapes = {(s.d_out, s.d_in) for s in sets}
        if len(shapes) != 1:
            raise ValueError(f"expert sets target matrices of different shapes {sorted(shapes)}")
        ids = tuple(i for s in sets for i in s.ids)
        return cls(ids, np.concatenate([s.A for s in sets], 0), np.concatenate([s.B for s in sets], 1))


def split_lora(adapter: str, lora_A: np.ndarray, lora_B: np.ndarray, scale: float) -> ExpertSet:
    """Split one LoRA pair (``A: r×d_in``, ``B: d_out×r``, ``ΔW = scale·B A``) into r experts."""
    if ":" in adapter or not adapter:
        raise ValueError(f"adapter name {adapter!r} must be non-empty and contain no ':'")
    lora_A = np.asarray(lora_A, dtype=np.float32)
    lora_B = np.asarray(lora_B, dtype=np.float32)
    if lora_A.ndim != 2 or lora_B.ndim != 2 or lora_A.shape[0] != lora_B.shape[1]:
        raise ValueError(f"LoRA A {lora_A.shape} and B {lora_B.shape} do not form a rank-r pair")
    ids = tuple(f"{adapter}:{i}" for i in range(lora_A.shape[0]))
    return ExpertSet(ids, lora_A, np.float32(scale) * lora_B)


def _pattern_value(pattern: Mapping[str, object], module: str, default):
    """PEFT's rule (``peft.utils.other.get_pattern_key``): a key matches ``(.*\\.)?key$``."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def check_lora_config(config: Mapping) -> None:
    """Refuse adapter configs that are not a plain sum of rank-1 terms on Linear weights."""
    peft_type = config.get("peft_type", "")
    peft_type = str(getattr(peft_type, "value", peft_type)).upper()  # str or peft.PeftType
    if peft_type != "LORA":
        raise PoolError(f"adapter is a {peft_type or 'non-PEFT'} adapter; only LoRA adapters split into rank-1 experts")
    if config.get("use_dora"):
        raise PoolError("DoRA adapters rescale the whole weight and are not a sum of rank-1 experts")
    if config.get("fan_in_fan_out"):
        raise PoolError("fan_in_fan_out (Conv1D) adapters are not supported: MoRE wraps nn.Linear")
    if config.get("lora_bias"):
        raise PoolError("adapters with a LoRA bias are not a sum of rank-1 experts")
    if config.get("target_parameters"):
        raise PoolError("adapters on target_parameters (nn.Parameter targets) are not supported")


def split_adapter(adapter: str, tensors: Mapping[str, np.ndarray], config: Mapping) -> dict[str, ExpertSet]:
    """All experts of one PEFT LoRA adapter, keyed by target module name.

    Args:
        adapter: the adapter's name in the pool (expert ids are ``"adapter:i"``).
        tensors: its state dict (``get_peft_model_state_dict`` or the safetensors file).
        config: its ``adapter_config.json`` as a dict (``LoraConfig.to_dict()`` works too).

    Module names are those of the *base* model (``model.layers.0.self_attn.q_proj``), the
    PEFT prefix ``base_model.model.`` removed. The scale honours ``alpha_pattern``,
    ``rank_pattern`` and ``use_rslora`` as PEFT does.
    """
    check_lora_config(config)
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        match = _LORA_KEY.match(key)
        if match is None:
            raise PoolError(
                f"adapter '{adapter}' carries '{key}', which is not a LoRA A/B weight "
                "(modules_to_save, embeddings or magnitude vectors cannot become rank-1 experts)"
            )
        pairs.setdefault(match["module"], {})[match["which"]] = np.asarray(value, dtype=np.float32)
    if not pairs:
        raise PoolError(f"adapter '{adapter}' holds no LoRA weights")
    experts = {}
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise PoolError(f"adapter '{adapter}': module {module} lacks lora_{'B' if 'A' in pair else 'A'}")
        rank = pair["A"].shape[0]
        configured = int(_pattern_value(config.get("rank_pattern") or {}, module, config.get("r", rank)))
        if configured != rank:
            raise PoolError(f"adapter '{adapter}': module {module} has rank {rank} but its config says r={configured}")
        alpha = float(_pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", rank)))
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        experts[module] = split_lora(adapter, pair["A"], pair["B"], scale)
    return experts


# ------------------------------------------------------------------ backbone fingerprint


def _strip_wrappers(name: str) -> str:
    # PEFT's LoraLayer and MoRELinear both keep the frozen Linear as `.base_layer`.
    return name.replace(".base_layer.", ".")


def backbone_signature(model_or_config) -> dict:
    """What identifies a backbone for adapter reuse.

    Accepts a HF ``PreTrainedModel`` (also wrapped by PEFT or by MoRE), a
    ``PretrainedConfig`` (instantiated on the meta device, no weights), or a signature dict
    (returned normalised). The signature holds the model type, hidden size, layer count,
    vocabulary size and ``shapes``: the name and shape of every 2-D ``*.weight`` — the
    matrices an adapter may target.
    """
    if isinstance(model_or_config, Mapping):
        sig = dict(model_or_config)
        missing = {"model_type", "hidden_size", "num_hidden_layers", "vocab_size", "shapes"} - set(sig)
        if missing:
            raise PoolError(f"backbone signature lacks {sorted(missing)}")
        sig["shapes"] = {str(k): [int(d) for d in v] for k, v in sorted(sig["shapes"].items())}
        return sig
    if hasattr(model_or_config, "named_parameters"):
        model = model_or_config
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        config = model.config
        params = model.named_parameters()
    else:
        import torch
        from transformers import AutoModelForCausalLM

        config = model_or_config
        with torch.device("meta"):
            params = list(AutoModelForCausalLM.from_config(config).named_parameters())
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    shapes = {
        _strip_wrappers(name): [int(d) for d in p.shape]
        for name, p in params
        if name.endswith(".weight") and p.ndim == 2 and "lora_" not in name
    }
    return {
        "model_type": str(getattr(text, "model_type", getattr(config, "model_type", ""))),
        "hidden_size": int(text.hidden_size),
        "num_hidden_layers": int(text.num_hidden_layers),
        "vocab_size": int(text.vocab_size),
        "shapes": dict(sorted(shapes.items())),
    }


def backbone_fingerprint(model_or_config) -> str:
    """16 hex digits of SHA-256 over :func:`backbone_signature` (canonical JSON)."""
    blob = json.dumps(backbone_signature(model_or_config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------- pool


def _read_adapter(folder: Path) -> tuple[dict[str, np.ndarray], dict]:
    from safetensors.numpy import load_file

    weights, config = folder / ADAPTER_WEIGHTS, folder / ADAPTER_CONFIG
    for path in (weights, config):
        if not path.is_file():
            raise PoolError(f"{folder} has no {path.name} (expected a PeftModel.save_pretrained folder)")
    return load_file(str(weights)), json.loads(config.read_text())


class Pool:
    """A LoRA knowledge pool folder (see the module docstring for the layout).

    ``Pool(path)`` opens an existing pool; ``Pool(path, backbone=model_or_config)`` creates
    it when absent (recording the backbone signature) or checks that an existing pool was
    built for that backbone.
    """

    def __init__(self, path: str | Path, backbone=None):
        self.path = Path(path)
        meta_path = self.path / POOL_FILE
        if meta_path.is_file():
            self._meta = json.loads(meta_path.read_text())
            if self._meta.get("format") != POOL_FORMAT:
                raise PoolError(f"{meta_path}: unsupported pool format {self._meta.get('format')}")
            if backbone is not None and backbone_fingerprint(backbone) != self.fingerprint:
                raise PoolError(
                    f"pool {self.path} was built for backbone {self.fingerprint}, "
                    f"not {backbone_fingerprint(backbone)}"
                )
        elif backbone is None:
            raise PoolError(f"{self.path} is not a knowledge pool (no {POOL_FILE}); pass backbone= to create one")
        else:
            signature = backbone_signature(backbone)
            self._meta = {
                "format": POOL_FORMAT,
                "backbone_fingerprint": backbone_fingerprint(signature),
                "backbone": signature,
            }
            self.path.mkdir(parents=True, exist_ok=True)
            meta_path.write_text(json.dumps(self._meta, indent=1) + "\n")
        self._experts: dict[str, dict[str, ExpertSet]] = {}

    # -- properties

    @property
    def fingerprint(self) -> str:
        """The backbone fingerprint every adapter of this pool was trained on."""
        return self._meta["backbone_fingerprint"]

    @property
    def signature(self) -> dict:
        return self._meta["backbone"]

    def names(self) -> list[str]:
        """Adapter names, sorted (the order in which experts are concatenated)."""
        if not self.path.is_dir():
            return []
        # Dot-folders are adds in progress (see add); they never count.
        return sorted(
            p.name for p in self.path.iterdir() if not p.name.startswith(".") and (p / PROVENANCE_FILE).is_file()
        )

    def __len__(self) -> int:
        return len(self.names())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and bool(_NAME.match(name)) and (self.path / name / PROVENANCE_FILE).is_file()

    # -- adding

    def _check_shapes(self, name: str, experts: Mapping[str, ExpertSet]) -> None:
        shapes = self.signature["shapes"]
        for module, es in experts.items():
            want = shapes.get(f"{module}.weight")
            if want is None:
                raise PoolError(
                    f"adapter '{name}' targets {module}, which the pool's backbone "
                    f"(fingerprint {self.fingerprint}) does not have: trained on a different model?"
                )
            if [es.d_out, es.d_in] != list(want):
                raise PoolError(
                    f"adapter '{name}' targets {module} with ΔW of shape ({es.d_out}, {es.d_in}) but the "
                    f"pool's backbone (fingerprint {self.fingerprint}) has {tuple(want)}: "
                    "the adapter was trained on a different backbone"
                )

    def add(self, adapter_dir: str | Path, provenance: Mapping, name: str | None = None) -> str:
        """Copy a saved PEFT LoRA adapter into the pool and record its provenance.

        Args:
            adapter_dir: a folder written by ``PeftModel.save_pretrained`` (one adapter).
            provenance: at least ``source_run`` and ``task``; ``rank``, ``alpha``,
                ``target_modules``, ``backbone_fingerprint`` and ``created`` are filled in
                (and refused when given and inconsistent). Extra keys are kept.
            name: the adapter's name in the pool (default: ``provenance['name']`` or the
                folder's name).

        Returns the adapter's name. Raises :class:`PoolError` when the adapter does not fit
        the pool's backbone, is not a plain LoRA, or the name is taken.
        """
        adapter_dir = Path(adapter_dir)
        name = name or provenance.get("name") or adapter_dir.name
        if not _NAME.match(name):
            raise PoolError(f"adapter name {name!r} must match {_NAME.pattern} (it becomes a folder and expert ids)")
        if name in self:
            raise PoolError(f"the pool already has an adapter named '{name}'")
        missing = [k for k in ("source_run", "task") if not provenance.get(k)]
        if missing:
            raise PoolError(f"provenance of '{name}' lacks {missing}")

        tensors, config = _read_adapter(adapter_dir)
        experts = split_adapter(name, tensors, config)
        self._check_shapes(name, experts)

        record = dict(provenance)
        filled = {
            "name": name,
            "rank": int(config["r"]),
            "alpha": float(config["lora_alpha"]),
            "target_modules": sorted(config["target_modules"])
            if isinstance(config.get("target_modules"), list)
            else config.get("target_modules"),
            "backbone_fingerprint": self.fingerprint,
        }
        for key, value in filled.items():
            if key in record and record[key] != value and not (key == "alpha" and float(record[key]) == value):
                raise PoolError(f"provenance of '{name}' says {key}={record[key]!r} but the adapter has {value!r}")
            record[key] = value
        if config.get("rank_pattern"):
            record["rank_pattern"] = config["rank_pattern"]
        record["matrices"] = sorted(experts)
        record["num_experts"] = sum(len(e) for e in experts.values())
        record.setdefault("created", _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))

        # Write into a temporary folder inside the pool, then rename: never half an adapter.
        self.path.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=self.path))
        try:
            shutil.copy2(adapter_dir / ADAPTER_WEIGHTS, tmp / ADAPTER_WEIGHTS)
            shutil.copy2(adapter_dir / ADAPTER_CONFIG, tmp / ADAPTER_CONFIG)
            (tmp / PROVENANCE_FILE).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
            tmp.rename(self.path / name)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._experts[name] = experts
        return name

    # -- reading

    def weights_sha256(self, adapters: Iterable[str] | None = None) -> str:
        """One sha256 over the (given or all) adapters' names and weight files, in name order: which
        pool a comparison ran on (a pool rebuilt on another CPU is not bit-identical)."""
        digest = hashlib.sha256()
        for name in self._adapters(adapters):
            digest.update(name.encode() + b"\0")
            digest.update((self.path / name / ADAPTER_WEIGHTS).read_bytes())
        return digest.hexdigest()

    def provenance(self, name: str) -> dict:
        if name not in self:
            raise KeyError(f"the pool has no adapter '{name}' (it has {self.names()})")
        return json.loads((self.path / name / PROVENANCE_FILE).read_text())

    def list(self) -> list[dict]:
        """The provenance record of every adapter, in name order."""
        return [self.provenance(n) for n in self.names()]

    def experts(self, name: str) -> dict[str, ExpertSet]:
        """One adapter's experts, keyed by target module (cached after the first read)."""
        if name not in self._experts:
            if name not in self:
                raise KeyError(f"the pool has no adapter '{name}' (it has {self.names()})")
            tensors, config = _read_adapter(self.path / name)
            experts = split_adapter(name, tensors, config)
            self._check_shapes(name, experts)
            self._experts[name] = experts
        return self._experts[name]

    def _adapters(self, adapters: Iterable[str] | None) -> list[str]:
        if adapters is None:
            return self.names()
        chosen = sorted(set(adapters))
        missing = [n for n in chosen if n not in self]
        if missing:
            raise KeyError(f"the pool has no adapter(s) {missing} (it has {self.names()})")
        return chosen

    def targets(self, adapters: Iterable[str] | None = None) -> list[str]:
        """Every target matrix that at least one pooled (or given) adapter updates, sorted."""
        return sorted({m for n in self._adapters(adapters) for m in self.experts(n)})

    def experts_for(self, target_module_name: str, adapters: Iterable[str] | None = None) -> ExpertSet:
        """The expert set of one matrix: the union of all pooled (or the given) adapters that target it."""
        names = self._adapters(adapters)
        sets = [e[target_module_name] for n in names if target_module_name in (e := self.experts(n))]
        if not sets:
            raise KeyError(f"no pooled adapter targets '{target_module_name}' (targets: {self.targets(names)})")
        return ExpertSet.concat(sets)

    def load_experts(
        self,
        backbone_fingerprint: str,
        targets: Iterable[str] | None = None,
        adapters: Iterable[str] | None = None,
    ) -> dict[str, ExpertSet]:
        """Expert sets of every (or the given) target matrix, for a model of that backbone.

        ``adapters`` restricts the experts to those pooled adapters (default: all).
        """
        if backbone_fingerprint != self.fingerprint:
            raise PoolError(
                f"pool {self.path} holds adapters for backbone {self.fingerprint}, "
                f"not for the requested {backbone_fingerprint}"
            )
        names = self._adapters(adapters)
        chosen = sorted(targets) if targets is not None else self.targets(names)
        return {m: self.experts_for(m, names) for m in chosen}


def default_pool_dir(model_name: str) -> Path:
    """``$POSTCARD_CACHE/pool/<model name>``: where a model's pool lives by default."""
    from clients.assets import cache_dir

    return cache_dir() / "pool" / str(model_name)


def backbone_descriptor(cfg) -> dict:
    """What names a backbone's *weights* (the fingerprint only covers shapes).

    The model name and checkpoint path, and for random-init models the seed (a tiny Llama
    of seed 1 and one of seed 42 have equal fingerprints but different weights).
    """
    out = {"model": str(cfg.model.name), "path": str(cfg.model.path) if cfg.model.get("path") else None}
    if cfg.model.get("random_init"):
        out["seed"] = int(cfg.seed)
    return out
