"""scikit-learn's bundled handwritten digits (1,797 8x8 images; the models that train
on them are in :mod:`.images`).

Real data that ships with an installed package: no download at run time. The split is
fixed by a seed so that every rank of a job, and every policy of a comparison, sees the
same train and test sets.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from .images import ImageData


def bundled_digits() -> tuple[np.ndarray, np.ndarray]:
    """(images (1797, 8, 8), labels): the CSV scikit-learn's ``load_digits`` reads.

    Read straight from the installed package: importing ``sklearn.datasets`` costs
    about 2 s of CPU (scipy and friends), paid by every rank of every run - 8 ranks
    sharing 2 cores wait ~8 s for it. Falls back to ``load_digits`` should the file
    move."""
    import gzip
    from importlib.util import find_spec

    spec = find_spec("sklearn")  # (locates the package without importing it)
    roots = spec.submodule_search_locations if spec is not None else None
    for root in roots or ():
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            with gzip.open(path, "rt") as f:
                data = np.loadtxt(f, delimiter=",")
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits  # type: ignore[import-untyped]  # ships no types

    bunch = load_digits()
    return bunch.images, bunch.target


def load_digits_split(seed: int = 0, test_fraction: float = 0.25) -> ImageData:
    images, target = bundled_digits()
    x = (images.astype(np.float32) / 16.0)[:, None, :, :]
    y = target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = int(round(len(y) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return ImageData(
        torch.from_numpy(x[train]), torch.from_numpy(y[train]),
        torch.from_numpy(x[test]), torch.from_numpy(y[test]),
    )


def flat_gradient(model: nn.Module) -> np.ndarray:
    """All parameter gradients laid back to back (the order DDP buckets use, reversed
    aside), as one float32 numpy vector."""
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]).numpy()


def worker_gradients(
    model: nn.Module, data: ImageData, workers: int, batch: int, seed: int
) -> list[np.ndarray]:
    """One real minibatch gradient per worker: each draws its own batch of the train
    set, as data-parallel workers do."""
    rng = np.random.default_rng(seed)
    loss_fn = nn.CrossEntropyLoss()
    grads = []
    for _ in range(workers):
        idx = torch.from_numpy(rng.choice(len(data.y_train), size=batch, replace=False))
        model.zero_grad(set_to_none=True)
        loss_fn(model(data.x_train[idx]), data.y_train[idx]).backward()
        grads.append(flat_gradient(model).copy())
    return grads
