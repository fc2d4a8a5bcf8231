"""ResNet-18 with GroupNorm: FLITE's paper backbone, loaded from a checkpoint the user gives.

No package ships ResNet-18-GN weights, so the model comes from ``model.path`` pointing at
a state dict (``.pt``/``.pth`` saved with ``torch.save``, or ``.safetensors``), or from a
random init (``model.pretrained=false``) trained on the task's public split first
(``base=public``, see ``clients.pretrain``). ``model.stem=cifar`` swaps the ImageNet stem
(7x7 stride-2 conv + max-pool) for the CIFAR one (3x3 stride-1 conv, no pool) for 32 px
images. Module names follow torchvision's ``resnet18`` with every
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

from clients.models.weights import CheckpointError, load_weights, read_state_dict  # noqa: F401 (re-exported)

FEATURE_DIM = 512
STEMS = ("imagenet", "cifar")  # 7x7/2 conv + max-pool (torchvision), or 3x3/1 conv, no pool (CIFAR ResNets)


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

    def __init__(self, num_classes: int = 10, groups: int = 32, stem: str = "imagenet"):
        super().__init__()
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        if stem not in STEMS:
            raise ValueError(f"unknown ResNet stem {stem!r}; valid: {', '.join(STEMS)}")
        if stem == "cifar":  # 32 px images: a 3x3 stride-1 stem and no max-pool keep the resolution
            self.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
            self.maxpool = nn.Identity()
        else:
            self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
            self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.bn1 = _gn(64, groups)
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


def resnet18_gn(path: str | Path | None, num_classes: int, groups: int = 32, stem: str = "imagenet") -> ResNet18GN:
    """The ResNet-18-GN of the checkpoint at ``path`` (its head kept when it has ``num_classes``
    outputs, else a new one), or a random init when ``path`` is None (to pretrain with ``base=public``)."""
    model = ResNet18GN(num_classes=num_classes, groups=groups, stem=stem)
    if path is None:
        model.head_loaded = False
        return model
    return load_weights(model, path, what="ResNet-18 with GroupNorm")
