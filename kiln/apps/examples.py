"""Example models used by the demo, the tests and the benchmarks."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """Linear 64->256, GELU, Linear 256->10, softmax."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 256)
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x):
        return torch.softmax(self.fc2(F.gelu(self.fc1(x))), dim=-1)


class EncoderLayer(nn.Module):
    def __init__(self, d: int, heads: int, ff: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, ff)
        self.fc2 = nn.Linear(ff, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Encoder(nn.Module):
    """A 2-layer pre-norm transformer encoder written with torch.nn."""

    def __init__(self, d: int = 64, heads: int = 4, ff: int = 128, layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(d, heads, ff) for _ in range(layers))
        self.ln = nn.LayerNorm(d)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.ln(x)


def mlp_example(seed: int = 0):
    torch.manual_seed(seed)
    return MLP().eval(), (torch.randn(8, 64),)


def encoder_example(seed: int = 0, batch: int = 2, seq: int = 16):
    torch.manual_seed(seed)
    return Encoder().eval(), (torch.randn(batch, seq, 64),)


class ResidualBlock(nn.Module):
    def __init__(self, c: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c, 2 * c, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(2 * c)
        self.conv2 = nn.Conv2d(2 * c, 2 * c, 3, padding=1, groups=2, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * c)
        self.down = nn.Sequential(nn.Conv2d(c, 2 * c, 1, stride=stride), nn.BatchNorm2d(2 * c))

    def forward(self, x):
        return torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))) + self.down(x))


class SmallResNet(nn.Module):
    """A ResNet-style CNN: strided, padded and grouped convs, batch norm, max pool, adaptive avg pool."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        self.block = ResidualBlock(8, 2)
        self.avg = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = self.block(self.pool(torch.relu(self.stem(x))))
        return self.fc(torch.flatten(self.avg(x), 1))


def resnet_example(seed: int = 0):
    torch.manual_seed(seed)
    model = SmallResNet()
    for m in model.modules():  # non-trivial batch-norm statistics
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    return model.eval(), (torch.randn(2, 3, 16, 16),)
