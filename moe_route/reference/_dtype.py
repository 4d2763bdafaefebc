"""The reference's arithmetic dtype: float32, or float64 when any input is float64 (for
``gradcheck``); every stage computes in it and rounds its result once."""

from __future__ import annotations

import torch


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    return (
        torch.float64
        if any(t is not None and t.dtype == torch.float64 for t in tensors)
        else torch.float32
    )
