"""Aggregators: what a hole in a message becomes.

The transport delivers, per message, a buffer and a bool per chunk; :mod:`.masks` turns
that into a bool per element (no half floats at chunk edges). An :class:`Aggregator`
then estimates the mean over the N workers' contributions from the elements that
arrived:

- :class:`ZeroFill` (``"zero"``) - a hole is 0: ``s / N`` (MLT, DBLP);
- :class:`UnbiasedRescale` (``"unbiased"``) - ``s / k``, divided by what arrived
  (arXiv 2507.07114);
- :class:`BubbleFill` (``"bubble"``) - every worker's hole filled with the arrived mean,
  ``previous`` where nothing arrived (LTP);
- :class:`StaleFill` (``"stale"``) - ``s / k``, and last round's value where nothing
  arrived: the lossy broadcast's receiver (2507.07114, MLT); :func:`apply_broadcast`
  for one message.

:class:`HadamardDispersion` (OptiReduce) encodes each message before it is sent so that
a lost chunk's error spreads thinly over every coordinate; :class:`Dispersed` runs any
aggregator in that encoded domain. Aggregators know nothing about policies, sockets or
collectives.
"""

from __future__ import annotations

from .base import Aggregator
from .fill import (
    AGGREGATORS,
    BubbleFill,
    StaleFill,
    UnbiasedRescale,
    ZeroFill,
    apply_broadcast,
    fill_holes,
    make_aggregator,
)
from .hadamard import Dispersed, HadamardDispersion, message_seed
from .masks import (
    burst_chunk_mask,
    chunk_count,
    chunk_mask_from_elements,
    element_mask,
    random_chunk_mask,
)

__all__ = [
    "AGGREGATORS",
    "Aggregator",
    "BubbleFill",
    "Dispersed",
    "HadamardDispersion",
    "StaleFill",
    "UnbiasedRescale",
    "ZeroFill",
    "apply_broadcast",
    "burst_chunk_mask",
    "chunk_count",
    "chunk_mask_from_elements",
    "element_mask",
    "fill_holes",
    "make_aggregator",
    "message_seed",
    "random_chunk_mask",
]
