"""Convolutional networks written as torchvision and timm write them, tiny and seeded.

The registry's torchvision wheel is a CUDA build that does not import beside the CPU torch,
so these are equivalent models in plain PyTorch, with the patterns that make splitting hard:

* ``resnet``: torchvision's ResNet layout (``conv1, bn1, relu, maxpool, layer1..4, avgpool,
  fc``) with ``ReLU(inplace=True)`` as a layer of its own: it writes into its input;
* ``mobilenet``: MobileNetV3-style inverted residuals, depthwise convolutions,
  squeeze-and-excitation, ``Hardswish(inplace=True)``;
* ``convnext``: ConvNeXt blocks (depthwise 7x7, channels-last LayerNorm through
  ``permute``, layer scale, stochastic depth 0.1) on a ``channels_last`` model and input:
  the tensors crossing cuts are not contiguous;
* ``densenet``: dense blocks whose layers each read the concatenation of every earlier
  feature map (a growing list of tensors crosses every cut), with transitions;
* ``googlenet``: inception modules (four branches concatenated), max pooling in between.

Each returns ``(model, images, loss)``; the loss is cross-entropy against class 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from examples._seed import seeded

BATCH = 4
CLASSES = 10

Entry = tuple[nn.Module, tuple[Tensor], Callable[[Tensor], Tensor]]


def class0_loss(logits: Tensor) -> Tensor:
    """Cross-entropy against class 0 for every sample (any batch size)."""
    return F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device))


def _entry(seed: int, make: Callable[[], nn.Module], image: int, channels_last: bool = False) -> Entry:
    def build() -> tuple[nn.Module, tuple[Tensor]]:
        model = make()
        x = torch.randn(BATCH, 3, image, image)
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
            x = x.contiguous(memory_format=torch.channels_last)
        return model, (x,)

    model, inputs = seeded(seed, build)
    return model, inputs, class0_loss


# --------------------------------------------------------------------------- ResNet


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision's ResNet, two blocks per stage."""

    def __init__(self, widths: tuple[int, ...] = (8, 16, 32, 64)) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = widths[0]
        for i, w in enumerate(widths):
            blocks = [BasicBlock(cin, w, 1 if i == 0 else 2), BasicBlock(w, w, 1)]
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
            cin = w
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        out: Tensor = self.fc(torch.flatten(self.avgpool(x), 1))
        return out


def resnet() -> Entry:
    """ResNet-18 layout, widths 8..64, 32x32 images."""
    return _entry(11, ResNet, 32)


# --------------------------------------------------------------------------- MobileNetV3


class SqueezeExcite(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.fc1 = nn.Conv2d(c, max(8, c // 4), 1)
        self.fc2 = nn.Conv2d(max(8, c // 4), c, 1)

    def forward(self, x: Tensor) -> Tensor:
        s = F.adaptive_avg_pool2d(x, 1)
        s = F.hardsigmoid(self.fc2(F.relu(self.fc1(s))), inplace=True)
        return x * s


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, hidden: int, cout: int, stride: int, se: bool) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.Hardswish(inplace=True),
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden),
            nn.Hardswish(inplace=True),
        ]  # fmt: skip
        if se:
            layers.append(SqueezeExcite(hidden))
        layers += [nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.block = nn.Sequential(*layers)
        self.use_res = stride == 1 and cin == cout

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.block(x)
        return out + x if self.use_res else out


class Head(nn.Module):
    def __init__(self, cin: int, hidden: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, hidden, 1, bias=False)
        self.bn = nn.BatchNorm2d(hidden)
        self.act = nn.Hardswish(inplace=True)
        self.fc = nn.Linear(hidden, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = self.act(self.bn(self.conv(x)))
        out: Tensor = self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
        return out


class MobileNetV3(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.Hardswish(inplace=True))
        spec = [(8, 16, 8, 1, True), (8, 32, 16, 2, False), (16, 48, 16, 1, True), (16, 64, 24, 2, True), (24, 96, 24, 1, True)]
        self.features = nn.Sequential(*(InvertedResidual(*s) for s in spec))
        self.head = Head(24, 64)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.head(self.features(self.stem(x)))
        return out


def mobilenet() -> Entry:
    """MobileNetV3-style: 5 inverted residuals, 32x32 images."""
    return _entry(12, MobileNetV3, 32)


# --------------------------------------------------------------------------- ConvNeXt


class DropPath(nn.Module):
    """Stochastic depth (timm's ``drop_path``): drops whole residual branches per sample."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = 1.0 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
        return x * mask / keep


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int, drop_path: float) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 0.1))
        self.drop_path = DropPath(drop_path)

    def forward(self, x: Tensor) -> Tensor:
        y = self.dwconv(x).permute(0, 2, 3, 1)  # (N, H, W, C)
        y = self.pwconv2(F.gelu(self.pwconv1(self.norm(y))))
        y = (self.gamma * y).permute(0, 3, 1, 2)  # back to (N, C, H, W): not contiguous
        return x + self.drop_path(y)


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an (N, C, H, W) tensor, through channels-last."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    def __init__(self, dims: tuple[int, ...] = (16, 32), depths: tuple[int, ...] = (2, 2), drop_path: float = 0.1) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], 4, 4), LayerNorm2d(dims[0], eps=1e-6))
        stages: list[nn.Module] = []
        for i, (dim, depth) in enumerate(zip(dims, depths, strict=True)):
            if i > 0:
                stages.append(nn.Sequential(LayerNorm2d(dims[i - 1], eps=1e-6), nn.Conv2d(dims[i - 1], dim, 2, 2)))
            stages.extend(ConvNeXtBlock(dim, drop_path) for _ in range(depth))
        self.stages = nn.Sequential(*stages)
        self.norm = nn.LayerNorm(dims[-1], eps=1e-6)
        self.head = nn.Linear(dims[-1], CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stages(self.stem(x))
        out: Tensor = self.head(self.norm(x.mean((-2, -1))))
        return out


def convnext() -> Entry:
    """ConvNeXt: 2 stages of 2 blocks, stochastic depth 0.1, channels_last, 32x32 images."""
    return _entry(13, ConvNeXt, 32, channels_last=True)


# --------------------------------------------------------------------------- DenseNet


class DenseLayer(nn.Module):
    def __init__(self, cin: int, growth: int) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(cin)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(cin, 4 * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(4 * growth)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(4 * growth, growth, 3, padding=1, bias=False)

    def forward(self, features: list[Tensor]) -> Tensor:
        x = torch.cat(features, 1)
        out: Tensor = self.conv2(self.relu2(self.norm2(self.conv1(self.relu1(self.norm1(x))))))
        return out


class DenseBlock(nn.ModuleDict):
    """torchvision's ``_DenseBlock``: a ModuleDict whose layers read every earlier output."""

    def __init__(self, layers: int, cin: int, growth: int) -> None:
        super().__init__()
        for i in range(layers):
            self[f"denselayer{i + 1}"] = DenseLayer(cin + i * growth, growth)

    def forward(self, x: Tensor) -> Tensor:
        features = [x]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class Transition(nn.Sequential):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__(nn.BatchNorm2d(cin), nn.ReLU(inplace=True), nn.Conv2d(cin, cout, 1, bias=False), nn.AvgPool2d(2, 2))


class DenseNet(nn.Module):
    def __init__(self, growth: int = 8, blocks: tuple[int, ...] = (3, 3)) -> None:
        super().__init__()
        c = 2 * growth
        self.conv0 = nn.Conv2d(3, c, 3, 1, 1, bias=False)
        self.norm0 = nn.BatchNorm2d(c)
        self.relu0 = nn.ReLU(inplace=True)
        body: list[nn.Module] = []
        for i, n in enumerate(blocks):
            body.append(DenseBlock(n, c, growth))
            c += n * growth
            if i < len(blocks) - 1:
                body.append(Transition(c, c // 2))
                c //= 2
        self.body = nn.ModuleList(body)
        self.norm5 = nn.BatchNorm2d(c)
        self.classifier = nn.Linear(c, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu0(self.norm0(self.conv0(x)))
        for part in self.body:
            x = part(x)
        out: Tensor = self.classifier(torch.flatten(F.adaptive_avg_pool2d(F.relu(self.norm5(x)), 1), 1))
        return out


def densenet() -> Entry:
    """DenseNet: two dense blocks of 3 layers (growth 8) and a transition, 16x16 images."""
    return _entry(14, DenseNet, 16)


# --------------------------------------------------------------------------- GoogLeNet


class ConvBN(nn.Module):
    def __init__(self, cin: int, cout: int, k: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, padding=k // 2, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.bn(self.conv(x)), inplace=True)


class Inception(nn.Module):
    def __init__(self, cin: int, c1: int, c3r: int, c3: int, c5r: int, c5: int, pool: int) -> None:
        super().__init__()
        self.branch1 = ConvBN(cin, c1, 1)
        self.branch2 = nn.Sequential(ConvBN(cin, c3r, 1), ConvBN(c3r, c3, 3))
        self.branch3 = nn.Sequential(ConvBN(cin, c5r, 1), ConvBN(c5r, c5, 3))
        self.branch4 = nn.Sequential(nn.MaxPool2d(3, 1, 1, ceil_mode=True), ConvBN(cin, pool, 1))

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([self.branch1(x), self.branch2(x), self.branch3(x), self.branch4(x)], 1)


class GoogLeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = ConvBN(3, 16, 3)
        self.maxpool1 = nn.MaxPool2d(2, 2, ceil_mode=True)
        self.inception3a = Inception(16, 8, 8, 16, 4, 8, 8)  # -> 40
        self.inception3b = Inception(40, 16, 8, 16, 4, 8, 8)  # -> 48
        self.maxpool3 = nn.MaxPool2d(2, 2, ceil_mode=True)
        self.inception4a = Inception(48, 16, 8, 16, 4, 8, 8)  # -> 48
        self.inception4b = Inception(48, 16, 16, 24, 4, 8, 16)  # -> 64
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(0.2)
        self.fc = nn.Linear(64, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool1(self.conv1(x))
        x = self.maxpool3(self.inception3b(self.inception3a(x)))
        x = self.inception4b(self.inception4a(x))
        out: Tensor = self.fc(self.dropout(torch.flatten(self.avgpool(x), 1)))
        return out


def googlenet() -> Entry:
    """GoogLeNet: 4 inception modules, dropout 0.2 before the classifier, 32x32 images."""
    return _entry(15, GoogLeNet, 32)


ENTRIES = ("resnet", "mobilenet", "convnext", "densenet", "googlenet")
