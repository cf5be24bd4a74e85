"""An AmoebaNet-like cell network: each cell reads the two previous cell outputs, and every
``long_skip`` cells the output of the cell ``long_skip`` back is added in, so skip connections
span several cells (the case torchgpipe#27 crashed on).  A cut between cells carries two or
three tensors, and the profile's ``cut_bytes`` shows it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from examples._seed import seeded


@dataclass(frozen=True)
class AmoebaConfig:
    cells: int = 6
    channels: int = 16
    image: int = 16
    in_channels: int = 3
    classes: int = 10
    long_skip: int = 3
    batch: int = 8
    seed: int = 0


class Cell(nn.Module):
    """Two branches (3x3 conv on the previous output, 1x1 conv on the one before), summed."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv_prev = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn_prev = nn.BatchNorm2d(c)
        self.conv_skip = nn.Conv2d(c, c, 1, bias=False)
        self.bn_skip = nn.BatchNorm2d(c)

    def forward(self, prev: Tensor, prev_prev: Tensor) -> Tensor:
        a = self.bn_prev(self.conv_prev(F.relu(prev)))
        b = self.bn_skip(self.conv_skip(F.relu(prev_prev)))
        out: Tensor = a + b
        return out


class Stem(nn.Module):
    def __init__(self, cin: int, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.bn(self.conv(x))
        return out


class Classifier(nn.Module):
    def __init__(self, c: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(c, classes)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.fc(torch.flatten(F.adaptive_avg_pool2d(F.relu(x), 1), 1))
        return out


class AmoebaNet(nn.Module):
    def __init__(self, cfg: AmoebaConfig) -> None:
        super().__init__()
        self.long_skip = cfg.long_skip
        self.stem = Stem(cfg.in_channels, cfg.channels)
        self.cells = nn.ModuleList([Cell(cfg.channels) for _ in range(cfg.cells)])
        self.classifier = Classifier(cfg.channels, cfg.classes)

    def forward(self, x: Tensor) -> Tensor:
        s = self.stem(x)
        states = [s, s]
        for i, cell in enumerate(self.cells):
            out = cell(states[-1], states[-2])
            if self.long_skip > 0 and i >= self.long_skip and i % self.long_skip == 0:
                out = out + states[-1 - self.long_skip]
            states.append(out)
        logits: Tensor = self.classifier(states[-1])
        return logits


def build(cfg: AmoebaConfig) -> tuple[AmoebaNet, tuple[Tensor]]:
    def make() -> tuple[AmoebaNet, tuple[Tensor]]:
        model = AmoebaNet(cfg)
        x = torch.randn(cfg.batch, cfg.in_channels, cfg.image, cfg.image)
        return model, (x,)

    return seeded(cfg.seed, make)


def tiny() -> tuple[AmoebaNet, tuple[Tensor]]:
    """6 cells of 16 channels on 16x16 images; a long skip every 3 cells."""
    return build(AmoebaConfig())


def small() -> tuple[AmoebaNet, tuple[Tensor]]:
    """12 cells of 64 channels on 32x32 images."""
    return build(AmoebaConfig(cells=12, channels=64, image=32))
