"""Expand (permute) rows: ``x_perm[d] = x[t]`` for every dest row ``d`` of token ``t``.

Written as a scatter, not a gather: program ``(t, c)`` reads columns
``[c*BLOCK_H, (c+1)*BLOCK_H)`` of ``x[t]`` once and writes them to the ``K`` dest rows
``expanded_source_row_to_expanded_dest_row[k*T + t]``, so ``x`` is read exactly once (a gather
per dest row reads each token ``K`` times). Dest rows of dropped slots are written as zeros.
Every dest row has exactly one writer (the maps are a permutation): no atomics.
Loads and stores are 16 bytes wide when the row pitch is a multiple of 16 bytes (Triton
specialises on pointer and stride divisibility); other ``H`` run the same code unvectorised.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import ThinKernel, cdiv, next_pow2

# NOTE: 2 KiB of columns per program beat 4/8/16 KiB on an H200 for both gather and scatter
# forms at the mixtral and deepseek shapes (bench/bench_routing.py --sweep).
BYTES_PER_PROGRAM = 2048


@triton.jit(do_not_specialize=["T"])
def _expand_rows_kernel(
    x_ptr,
    out_ptr,
    src_to_dest_ptr,
    expert_for_src_ptr,
    T,
    H,
    stride_xt,
    stride_xh,
    stride_od,
    stride_oh,
    K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = cols < H
    row = tl.load(x_ptr + t * stride_xt + cols * stride_xh, mask=in_row)
    for k in tl.static_range(K):
        src = k * T + t
        routed = tl.load(expert_for_src_ptr + src) >= 0
        dest = tl.load(src_to_dest_ptr + src).to(tl.int64)
        tl.store(
            out_ptr + dest * stride_od + cols * stride_oh, tl.where(routed, row, 0.0), mask=in_row
        )


def expand_rows_triton(
    x: torch.Tensor,
    src_to_dest: torch.Tensor,
    expert_for_src: torch.Tensor,
    out: torch.Tensor,
    *,
    block_h: int | None = None,
) -> None:
    """Scatter ``x [T, H]`` into ``out [T*K, H]`` (preallocated) in permuted order."""
    T, H = x.shape
    if T == 0 or H == 0:
        return
    K = out.shape[0] // T
    if block_h is None:
        block_h = min(next_pow2(H), BYTES_PER_PROGRAM // x.element_size())
    sx, so = x.stride(), out.stride()
    _EXPAND.launch(
        (K, H, block_h, x.dtype, out.dtype, sx, so),
        (T, cdiv(H, block_h)),
        (x, out, src_to_dest, expert_for_src, T, H, *sx, *so),
        lambda: dict(K=K, BLOCK_H=block_h, num_warps=4),
    )


_EXPAND = ThinKernel(_expand_rows_kernel)
