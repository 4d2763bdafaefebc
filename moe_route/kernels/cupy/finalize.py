"""Launcher of ``finalize.cu``: ``out[t] = bias[t] + Σ_k w[t, k] · y_perm[dest(k*T + t)]``."""

from __future__ import annotations

import numpy as np
import torch

from . import _nvrtc
from .expand import rows_aligned

# Threads per block (each owns one unit, 16 bytes or one element, of one output row at a time),
# the permuted rows each thread loads at once (the kernel's KCHUNK), and the units each thread
# walks through (the blocks per token are cdiv(units of a row, THREADS * UNITS_PER_THREAD)).
# Slot tables in shared memory, 256 threads, 8 rows in flight: docs/decisions.md, "CuPy kernel
# shapes".
THREADS = 256
ROWS_IN_FLIGHT = 8
UNITS_PER_THREAD = 4
CTYPES = {
    torch.bfloat16: "bf16_t",
    torch.float16: "f16_t",
    torch.float32: "float",
    torch.float64: "double",
}


def _vector_width(y_perm, bias, out) -> int:
    """Elements per thread: a 16-byte unit of ``y_perm`` when every row it touches allows it."""
    n = 16 // y_perm.element_size()
    if y_perm.shape[1] % n or not (rows_aligned(y_perm, 16) and rows_aligned(out, 16)):
        return 1
    if bias is not None:
        unit = min(16, n * bias.element_size())  # a bias of another dtype moves n elements too
        rows = bias if bias.dim() == 2 else bias.unsqueeze(0)
        if not rows_aligned(rows, unit):
            return 1
    return n


def finalize_cupy(
    y_perm: torch.Tensor,
    topk_weights: torch.Tensor,
    src_to_dest: torch.Tensor,
    expert_for_src: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    *,
    threads: int = THREADS,
    rows_in_flight: int = ROWS_IN_FLIGHT,
    units_per_thread: int = UNITS_PER_THREAD,
) -> None:
    """Reduce ``y_perm [T*K, H]`` into ``out [T, H]`` (preallocated)."""
    T, K = topk_weights.shape
    H = out.shape[1]
    if T == 0 or H == 0:
        return
    n = _vector_width(y_perm, bias, out)
    width = H // n
    # gridDim.y is at most 65535; the kernel's column loop covers any longer row.
    blocks_per_row = min(-(-width // (threads * units_per_thread)), 65535)
    acc = "double" if torch.float64 in (y_perm.dtype, topk_weights.dtype) else "float"
    ty = CTYPES[y_perm.dtype]
    tb = ty if bias is None else CTYPES[bias.dtype]
    tw = CTYPES[topk_weights.dtype]
    name = f"finalize_rows<{ty}, {tw}, {tb}, {acc}, {n}, {K}, {min(K, rows_in_flight)}>"
    if bias is None:
        bias_t = bias_col = 0
    elif bias.dim() == 1:
        bias_t, bias_col = 0, bias.stride(0)
    else:
        bias_t, bias_col = bias.stride()
    strides = _nvrtc.int32s(
        "y_perm/topk_weights/bias/out strides",
        *y_perm.stride(), *topk_weights.stride(), bias_t, bias_col, *out.stride(),
    )  # fmt: skip
    k = _nvrtc.kernel("finalize.cu", name, y_perm.device.index)
    args = (
        _nvrtc.ptr(y_perm), _nvrtc.ptr(topk_weights), _nvrtc.ptr(src_to_dest),
        _nvrtc.ptr(expert_for_src), _nvrtc.ptr(bias), _nvrtc.ptr(out),
        np.int32(T), np.int32(width), *strides,
    )  # fmt: skip
    _nvrtc.launch(k, y_perm.device, (T, blocks_per_row), (threads,), args)
