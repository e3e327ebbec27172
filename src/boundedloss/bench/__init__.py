"""Benchmarks behind `boundedloss bench ...`: each prints a table and writes JSON."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path


def write_json(rows, path: str) -> None:
    """Rows (dataclasses or dicts) as a JSON list at ``path``, its folder created."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    data = [dataclasses.asdict(r) if dataclasses.is_dataclass(r) else r for r in rows]
    p.write_text(json.dumps(data, indent=2) + "\n")
