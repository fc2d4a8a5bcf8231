"""ResNet-18 with GroupNorm: FLITE's paper backbone, loaded from a checkpoint the user gives.

No package ships ResNet-18-GN weights, so the model only exists with ``model.path``
pointing at a state dict (``.pt``/``.pth`` saved with ``torch.save``, or
``.safetensors``). Module names follow torchvision's ``resnet18`` with every
``BatchNorm2d`` replaced by ``GroupNorm(groups, channels)`` (the layout of the usual
ResNet-GN checkpoints, e.g. timm's or FL papers' ``resnet18_gn``)::

    conv1, bn1, layer1..layer4 (BasicBlocks: conv1 bn1 conv2 bn2 [downsample.0 .1]), fc

The head (``fc``) is replaced by a new ``Linear(512, num_classes)`` when the checkpoint's
has another size. GroupNorm keeps no running statistics, which suits non-IID clients.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

FEATURE_DIM = 512


class CheckpointError(ValueError):
    """A ResNet-18-GN checkpoint that cannot be used; the message says why."""


def _gn(channels: int, groups: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(groups, channels), channels)


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = _gn(c_out, groups)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = _gn(c_out, groups)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), _gn(c_out, groups))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet18GN(nn.Module):
    """``embed(x)``: pooled (N, 512) features; ``forward(x)``: (N, num_classes) logits."""

    def __init__(self, num_classes: int = 10, groups: int = 32):
        super().__init__()
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = _gn(64, groups)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        widths, c_in = (64, 128, 256, 512), 64
        for i, width in enumerate(widths, 1):
            stride = 1 if i == 1 else 2
            self.add_module(f"layer{i}", nn.Sequential(BasicBlock(c_in, width, stride, groups),
                                                       BasicBlock(width, width, 1, groups)))
            c_in = width
        self.fc = nn.Linear(FEATURE_DIM, num_classes)

    @property
    def head(self) -> nn.Linear:
        return self.fc

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        for i in range(1, 5):
            x = getattr(self, f"layer{i}")(x)
        return torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.embed(x))


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path).expanduser()
    if not path.is_file():
        raise CheckpointError(f"ResNet-18-GN checkpoint {path} does not exist (model.path must name a state-dict "
                              "file: .pt/.pth or .safetensors)")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as err:  # a corrupt or foreign file: say which and why
        raise CheckpointError(f"cannot read the ResNet-18-GN checkpoint {path}: {err}") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path} does not hold a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in state.items()}


def resnet18_gn(path: str | Path, num_classes: int, groups: int = 32) -> ResNet18GN:
    """The ResNet-18-GN of the checkpoint at ``path``, its head resized to ``num_classes``."""
    model = ResNet18GN(num_classes=num_classes, groups=groups)
    state = read_state_dict(path)
    head = {k: v for k, v in state.items() if k.startswith("fc.")}
    body = {k: v for k, v in state.items() if not k.startswith("fc.")}
    ours = {k: v for k, v in model.state_dict().items() if not k.startswith("fc.")}
    missing, unexpected = sorted(set(ours) - set(body)), sorted(set(body) - set(ours))
    if missing or unexpected:
        raise CheckpointError(f"{path} is not a ResNet-18 with GroupNorm in torchvision's layout "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    for key, value in body.items():
        if tuple(value.shape) != tuple(ours[key].shape):
            raise CheckpointError(f"{path}: tensor '{key}' has shape {tuple(value.shape)}, expected "
                                  f"{tuple(ours[key].shape)}")
    model.load_state_dict(body, strict=False)
    if head.get("fc.weight") is not None and tuple(head["fc.weight"].shape) == (num_classes, FEATURE_DIM):
        model.fc.load_state_dict({k.removeprefix("fc."): v for k, v in head.items()})
    return model
