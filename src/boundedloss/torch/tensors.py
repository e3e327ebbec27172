"""A tensor as the message the collective sends, and the collective's result back.

numpy has no bfloat16: its words travel as ``collective.BFLOAT16`` (uint16 marked so),
and the collective widens them to float32 to aggregate. 16-bit floats travel in their
own dtype (half the bytes of float32).
"""

from __future__ import annotations

import numpy as np
import torch

from ..collective import BFLOAT16

#: dtypes that travel as they are (numpy has them); bfloat16 travels as BFLOAT16 words;
#: anything else as float32
NATIVE_DTYPES = (torch.float32, torch.float64, torch.float16)

#: the dtypes a message keeps: a tensor of another dtype travels as float32
MESSAGE_DTYPES = (*NATIVE_DTYPES, torch.bfloat16)


def as_message(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as the message the collective sends: 16-bit floats in their own
    dtype (half the bytes; aggregated in float32), bfloat16 as its 16-bit words."""
    if t.dtype in NATIVE_DTYPES:
        return t.numpy()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)
    return t.float().numpy()


def as_tensor(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The collective's result as a CPU tensor of ``dtype`` (sharing its memory where
    the dtype is the message's)."""
    if dtype == torch.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(values).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
