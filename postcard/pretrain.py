"""``postcard pretrain [overrides...]``: build θ_pre for ``base=public`` now (``clients.pretrain``).

    postcard pretrain task=cifar10                       # MobileNetV2 (ImageNet) on CIFAR-10's public split
    postcard pretrain task=fmnist base.steps=600
    postcard pretrain task=cifar10 model=resnet18-gn model.pretrained=false model.stem=cifar task.image_size=32

The overrides are those of the runs that will use it (``base=public`` is implied); a θ_pre
already built for the same settings is reused, so this prints its path and report at once.
"""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    from clients.assets import AssetMissing
    from clients.pretrain import ensure_base, read_report
    from fedapps.config import ConfigError, check_overrides, compose

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    overrides = [a for a in args if a != "base=public"] + ["base=public"]
    try:
        check_overrides(overrides)
        cfg = compose(overrides)
    except ConfigError as err:
        print(f"postcard pretrain: {err}", file=sys.stderr)
        return 2
    try:
        path = ensure_base(cfg)
    except (AssetMissing, ValueError) as err:
        print(f"postcard pretrain: {err}", file=sys.stderr)
        return 2
    report = read_report(cfg)
    print(f"θ_pre: {path}\n  held-out public accuracy {report['accuracy_before']:.4f} -> "
          f"{report['accuracy_after']:.4f} ({report['public_images']} public images, {report['held_out']} held out; "
          f"{report['seconds']:.0f} s to train)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
