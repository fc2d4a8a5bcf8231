"""A tiny randomly initialised CNN for fast tests of the vision path.

Two conv blocks (3x3 conv -> norm -> ReLU -> 2x2 max-pool), global average pooling and a
linear head: a few thousand parameters, so a forward/backward pass on a batch of 32x32
images takes milliseconds on one CPU thread. It takes any image size >= 4 px.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

NORMS = ("group", "batch")


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "group":
        # GroupNorm keeps no running statistics, which suits non-IID federated clients.
        return nn.GroupNorm(num_groups=min(4, channels), num_channels=channels)
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    raise ValueError(f"unknown norm {kind!r}; valid: {', '.join(NORMS)}")


class TinyCNN(nn.Module):
    """``TinyCNN(in_channels, num_classes, width=16, norm="group")``.

    Input (N, in_channels, H, W) float images; output (N, num_classes) logits.
    Channels go ``in_channels -> width -> 2*width``; ``embed`` returns the pooled
    (N, 2*width) features before the head, ``head`` is the final Linear.
    """

    def __init__(self, in_channels: int, num_classes: int, width: int = 16, norm: str = "group"):
        super().__init__()
        for name, value in (("in_channels", in_channels), ("num_classes", num_classes), ("width", width)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.in_channels = in_channels
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            _norm(norm, width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False),
            _norm(norm, 2 * width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(2 * width, num_classes)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 4 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"expected images of shape (N, {self.in_channels}, H, W), got {tuple(x.shape)}"
            )
        return torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))
