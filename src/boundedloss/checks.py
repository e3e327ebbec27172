"""The checks every command makes of its arguments before anything starts: numbers are
finite and in range, ranks named by a loss spec exist, each name is given once, output
folders can be written. Each raises ValueError with one line that names the option."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import click

from .net.loss import Combined, LossModel, Microburst, parse_loss_spec


def writable_folder(path: str | os.PathLike, option: str) -> None:
    """``path`` is, or can be made, a folder this process can write into."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{option} {p} is a file, not a folder")
    existing = p
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise ValueError(f"{option} {p} cannot be made: {existing} is a file")
    if existing.exists() and not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {p} cannot be written: {existing} is not writable")


def writable_file(path: str | os.PathLike, option: str) -> None:
    """``path`` can be written: its folder can be, and it is not a folder itself."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{option} {p} is a folder, not a file")
    try:
        writable_folder(p.parent, option)
    except ValueError as e:
        raise ValueError(f"{option} {p} cannot be written: "
                         f"{str(e).removeprefix(option + ' ')}") from None


class FiniteFloatRange(click.FloatRange):
    """click's FloatRange, which lets nan and inf through its bounds, but finite."""

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{rv} is not a finite number", param, ctx)
        return rv


def _models(model: LossModel) -> Iterable[LossModel]:
    if isinstance(model, Combined):
        for m in model.models:
            yield from _models(m)
    else:
        yield model
        if isinstance(model, Microburst) and model.base is not None:
            yield from _models(model.base)


def loss_ranks_exist(spec: str, world: int, option: str = "--loss") -> None:
    """Every ``rank=`` in the loss spec names one of the job's ``world`` ranks."""
    model = parse_loss_spec(spec)
    if model is None:
        return
    for m in _models(model):
        rank = getattr(m, "rank", None)
        if rank is not None and not 0 <= rank < world:
            raise ValueError(f"{option}: rank={rank} does not exist: the run has {world} "
                             f"ranks (0..{world - 1})")


def distinct(names: Iterable[str], option: str) -> None:
    """No name given twice."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"{option} names {name} twice")
        seen.add(name)


def credit_fits(credit_bytes: int | None, mtu: int | None = None) -> None:
    """A credit budget the transport takes: at least two DATA datagrams - of the default
    chunk, or of the largest chunk a link of ``mtu`` carries (what a job there agrees
    on; train checks its own --chunk-bytes)."""
    from .net.udp import largest_chunk
    from .protocol import TransportConfig

    if credit_bytes is None:
        return
    try:
        if mtu is None:
            TransportConfig(credit_bytes=credit_bytes)
        else:
            TransportConfig(chunk_bytes=largest_chunk(mtu), credit_bytes=credit_bytes)
    except ValueError as e:
        raise ValueError(f"--credit {credit_bytes}: {e}") from None
