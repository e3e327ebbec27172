"""Benchmarks behind `boundedloss bench ...`: each prints a table and writes JSON."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def _plain(row: Any) -> Any:
    """A row as JSON-ready data: a dataclass instance as its dict, anything else as is."""
    if dataclasses.is_dataclass(row) and not isinstance(row, type):
        return dataclasses.asdict(row)
    return row


def write_json(rows: Iterable[Any], path: str) -> None:
    """Rows (dataclasses or dicts) as a JSON list at ``path``, its folder created."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps([_plain(r) for r in rows], indent=2) + "\n")
