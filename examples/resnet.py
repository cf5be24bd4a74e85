"""A ResNet-style residual network with BatchNorm (CIFAR-sized).

The blocks live in per-stage ``nn.Sequential`` containers; a block whose shape changes has a
1x1 ``downsample`` shortcut.  ``tiny`` returns a loss function (cross-entropy against fixed
labels) as the third element, to show the optional loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from examples._seed import seeded


@dataclass(frozen=True)
class ResNetConfig:
    widths: Sequence[int] = field(default_factory=lambda: (8, 16, 32))
    blocks_per_stage: int = 2
    image: int = 16
    channels: int = 3
    classes: int = 10
    batch: int = 8
    seed: int = 0


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + self.downsample(x))


class Stem(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.bn(self.conv(x)))


class ResNet(nn.Module):
    def __init__(self, cfg: ResNetConfig) -> None:
        super().__init__()
        widths = list(cfg.widths)
        self.stem = Stem(cfg.channels, widths[0])
        stages = []
        cin = widths[0]
        for i, w in enumerate(widths):
            blocks = []
            for j in range(cfg.blocks_per_stage):
                blocks.append(BasicBlock(cin, w, 2 if (j == 0 and i > 0) else 1))
                cin = w
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, cfg.classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stages(self.stem(x))
        out: Tensor = self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
        return out


def class0_loss(logits: Tensor) -> Tensor:
    """Cross-entropy against label 0 for every sample (works at any batch size)."""
    return F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device))


def build(cfg: ResNetConfig) -> tuple[ResNet, tuple[Tensor]]:
    def make() -> tuple[ResNet, tuple[Tensor]]:
        model = ResNet(cfg)
        x = torch.randn(cfg.batch, cfg.channels, cfg.image, cfg.image)
        return model, (x,)

    return seeded(cfg.seed, make)


def tiny() -> tuple[ResNet, tuple[Tensor], Callable[[Tensor], Tensor]]:
    """3 stages of 2 blocks, widths 8/16/32, 16x16 images; with a cross-entropy loss."""
    model, inputs = build(ResNetConfig())
    return model, inputs, class0_loss


def small() -> tuple[ResNet, tuple[Tensor]]:
    """4 stages of 2 blocks, widths 32..256, 32x32 images (ResNet-18-like)."""
    return build(ResNetConfig(widths=(32, 64, 128, 256), image=32))
