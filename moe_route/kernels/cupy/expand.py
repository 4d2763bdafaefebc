"""Launcher of ``expand.cu``: ``x_perm[d] = x[t]`` for every dest row ``d`` of token ``t``."""

from __future__ import annotations

import numpy as np
import torch

from . import _nvrtc

# Threads per block: each moves one unit (16 bytes, or one element) of one token row.
# 64 threads per block: docs/decisions.md, "CuPy kernel shapes".
THREADS = 64
_ELEMENT_UNITS = {2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}


def rows_aligned(t: torch.Tensor, nbytes: int) -> bool:
    """Every row of the 2-D ``t`` is contiguous and starts on an ``nbytes`` boundary."""
    es = t.element_size()
    return (
        t.stride(1) == 1
        and t.data_ptr() % nbytes == 0
        and (t.stride(0) * es) % nbytes == 0
        and (t.shape[1] * es) % nbytes == 0
    )


def expand_rows_cupy(
    x: torch.Tensor,
    src_to_dest: torch.Tensor,
    expert_for_src: torch.Tensor,
    out: torch.Tensor,
    *,
    threads: int = THREADS,
) -> None:
    """Scatter ``x [T, H]`` into ``out [T*K, H]`` (preallocated) in permuted order."""
    T, H = x.shape
    if T == 0 or H == 0:
        return
    K = out.shape[0] // T
    es = x.element_size()
    if rows_aligned(x, 16) and rows_aligned(out, 16):
        unit, per_unit = "Bytes16", 16 // es
        width, x_col, out_col = H // per_unit, 1, 1
    else:
        unit, per_unit = _ELEMENT_UNITS[es], 1
        width, x_col, out_col = H, x.stride(1), out.stride(1)
    blocks_per_row = -(-width // threads)
    if blocks_per_row > 65535:
        raise ValueError(
            f"x has H={H} columns: the CuPy expand kernel handles rows of at most "
            f"{65535 * threads * per_unit} elements"
        )
    strides = _nvrtc.int32s(
        "x/out strides", x.stride(0) // per_unit, x_col, out.stride(0) // per_unit, out_col
    )
    k = _nvrtc.kernel("expand.cu", f"expand_rows<{unit}, {K}>", x.device.index)
    args = (
        _nvrtc.ptr(x), _nvrtc.ptr(out), _nvrtc.ptr(src_to_dest), _nvrtc.ptr(expert_for_src),
        np.int32(T), np.int32(width), *strides,
    )  # fmt: skip
    _nvrtc.launch(k, x.device, (T, blocks_per_row), (threads,), args)
