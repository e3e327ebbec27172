"""Fashion-MNIST (70,000 28x28 grey images of clothing in 10 classes, MIT), read from
the files Debian's ``dataset-fashion-mnist`` package installs: nothing is downloaded.

Its own split is kept: 60,000 training images, 10,000 test images.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .idx import IdxError, read_idx_gz

if TYPE_CHECKING:
    from .images import ImageData

PACKAGE = "dataset-fashion-mnist"
#: where the package puts its files
DATA_DIR = Path("/usr/share/datasets/fashion-mnist")
#: (images, labels) file names of each part
FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
         "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
SIDE = 28


def check_installed(directory: Path | None = None) -> None:
    """``FileNotFoundError`` (one line, naming the package) if a file is missing."""
    directory = DATA_DIR if directory is None else directory
    missing = [n for pair in FILES.values() for n in pair if not (directory / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"Fashion-MNIST is not installed: no {directory / missing[0]} (it comes with "
            f"Debian's {PACKAGE} package: apt-get install {PACKAGE})")


def read_part(directory: Path, part: str) -> tuple[np.ndarray, np.ndarray]:
    """(images (n, 28, 28) uint8, labels (n,) int64) of ``part`` (train or test)."""
    image_file, label_file = (directory / n for n in FILES[part])
    images, labels = read_idx_gz(image_file), read_idx_gz(label_file)
    if images.dtype != np.uint8 or images.shape[1:] != (SIDE, SIDE):
        raise IdxError(f"{image_file}: {images.dtype} images of shape {images.shape}, "
                       f"not (n, {SIDE}, {SIDE}) uint8")
    if labels.dtype != np.uint8 or labels.shape != images.shape[:1]:
        raise IdxError(f"{label_file}: {labels.dtype} labels of shape {labels.shape}, not "
                       f"{images.shape[0]} uint8 labels (one per image)")
    if labels.size and labels.max() > 9:
        raise IdxError(f"{label_file}: a label of {labels.max()} (classes are 0-9)")
    return images, labels.astype(np.int64)


def load_fashion_mnist(directory: Path | None = None) -> ImageData:
    """The training and test sets, images scaled to [0, 1]."""
    import torch

    from .images import ImageData

    directory = DATA_DIR if directory is None else directory
    check_installed(directory)
    tensors = []
    for part in ("train", "test"):
        images, labels = read_part(directory, part)
        pixels = torch.from_numpy(images).unsqueeze(1).float().div_(255.0)
        tensors += [pixels, torch.from_numpy(labels)]
    return ImageData(*tensors)
