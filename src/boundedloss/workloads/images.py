"""Classifying small square one-channel images into 10 classes: the split every image
data set loads into, the MLP and the CNN that train on it, and test accuracy."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ImageData:
    x_train: torch.Tensor  # (n, 1, side, side) float32, scaled to [0, 1]
    y_train: torch.Tensor  # (n,) int64, 0-9
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def side(self) -> int:
        return int(self.x_train.shape[-1])


class ImageMLP(nn.Module):
    def __init__(self, side: int = 8, hidden: int = 256, depth: int = 2):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = side * side
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, 10))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ImageCNN(nn.Module):
    """Two 3x3 convolutions and two dense layers. Images of 16 pixels a side or more are
    pooled after each convolution (28x28 -> 14x14 -> 7x7), keeping a Fashion-MNIST step
    cheap on a CPU; smaller ones (digits' 8x8) after the second only."""

    def __init__(self, side: int = 8, channels: int = 32):
        super().__init__()
        early_pool: list[nn.Module] = [nn.MaxPool2d(2)] if side >= 16 else []
        out_side = side // 4 if early_pool else side // 2
        self.net = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
            *early_pool,
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.BatchNorm2d(2 * channels),
            nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(2 * channels * out_side * out_side, 128), nn.ReLU(),
            nn.Linear(128, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 1000) -> float:
    """The fraction of ``x`` classified as ``y``, ``batch`` images at a time (a CNN's
    activations for all 10,000 of Fashion-MNIST's test images at once would be ~0.5 GB)."""
    model.eval()
    right = sum(int((model(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum())
                for i in range(0, len(y), batch))
    model.train()
    return right / max(1, len(y))
