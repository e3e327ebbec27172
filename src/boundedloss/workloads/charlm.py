"""A character-level language model on text that ships with Python itself.

The corpus is a fixed list of the standard library's own source files (read from the
running interpreter's stdlib directory, so nothing is downloaded); the last 10% is the
held-out set. Bytes above 127 map to one "other" symbol.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

CORPUS_FILES = (
    "textwrap.py", "heapq.py", "bisect.py", "fnmatch.py", "shlex.py", "difflib.py",
    "argparse.py", "queue.py", "sched.py", "string.py", "glob.py", "colorsys.py",
)
VOCAB = 128


@dataclass(frozen=True)
class TextData:
    train: torch.Tensor  # int64 symbol ids
    test: torch.Tensor


def load_stdlib_text(max_bytes: int = 400_000) -> TextData:
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for name in CORPUS_FILES:
        path = root / name
        if path.exists():
            parts.append(path.read_bytes())
    if not parts:
        raise FileNotFoundError(f"no standard-library sources found under {root}")
    raw = np.frombuffer(b"\n".join(parts)[:max_bytes], dtype=np.uint8)
    ids = torch.from_numpy(np.minimum(raw, VOCAB - 1).astype(np.int64))
    cut = int(len(ids) * 0.9)
    return TextData(ids[:cut], ids[cut:])


class CharLM(nn.Module):
    def __init__(self, embed: int = 64, hidden: int = 192):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, embed)
        self.rnn = nn.GRU(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(x))
        return self.head(out)


def batches(ids: torch.Tensor, seq: int, batch: int, generator: torch.Generator):
    """Random (input, target) windows of ``seq`` symbols."""
    starts = torch.randint(0, len(ids) - seq - 1, (batch,), generator=generator)
    idx = starts[:, None] + torch.arange(seq + 1)[None, :]
    window = ids[idx]
    return window[:, :-1], window[:, 1:]


@torch.no_grad()
def perplexity(
    model: nn.Module, ids: torch.Tensor, seq: int = 128, max_windows: int = 256
) -> float:
    """exp(mean cross-entropy per symbol) over consecutive held-out windows."""
    model.eval()
    n = min(max_windows, (len(ids) - 1) // seq)
    x = ids[: n * seq].reshape(n, seq)
    y = ids[1 : n * seq + 1].reshape(n, seq)
    logits = model(x).float()  # (a bfloat16 model's metric in float32)
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
    model.train()
    return float(torch.exp(loss))
