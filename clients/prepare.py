"""``python -m clients.prepare``: locate every embedded asset and run the one-time conversions.

``make assets`` (and the Docker image's install script) call it once; later runs find the
converted files in ``$POSTCARD_CACHE``.
"""

from __future__ import annotations

from clients.assets import AssetMissing, force_offline, mmlu_jsonl, mobilenet_v2_weights, shakespeare_dir, smollm2_checkpoint
from clients.tasks import vision


def prepare_all() -> None:
    """Locate every embedded asset and run the one-time conversions."""
    force_offline()
    print(f"SmolLM2 checkpoint : {smollm2_checkpoint()}")
    print(f"MMLU               : {mmlu_jsonl()}")
    print(f"Shakespeare plays  : {shakespeare_dir()}")
    print(f"MobileNetV2 weights: {mobilenet_v2_weights()}")
    for name in vision.DATASETS:
        try:
            print(f"{name:<19}: {vision.dataset_file(name)}")
        except AssetMissing as err:
            print(f"{name:<19}: not available ({err})")


if __name__ == "__main__":
    prepare_all()
