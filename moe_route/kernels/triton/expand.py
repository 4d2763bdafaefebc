"""Expand (permute) rows: ``x_perm[d] = x[dest_to_src[d] mod T]``, a row gather.

Program ``(d, c)`` copies columns ``[c*BLOCK_H, (c+1)*BLOCK_H)`` of dest row ``d``. Rows past
``expert_first_token_offset[E]`` (dropped slots) are written as zeros without reading ``x``.
Loads and stores are 16 bytes wide when the row pitch is a multiple of 16 bytes (Triton
specialises on pointer and stride divisibility); other ``H`` run the same code unvectorised.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# NOTE: 8 KiB of columns per program (H = 4096 in bf16 is one program per row) measured best
# on an H100 among 2/4/8/16 KiB (bench/bench_routing.py --sweep).
BYTES_PER_PROGRAM = 8192


@triton.jit
def _expand_rows_kernel(
    x_ptr,
    out_ptr,
    dest_to_src_ptr,
    offsets_ptr,
    T,
    H,
    E,
    stride_xt,
    stride_xh,
    stride_od,
    stride_oh,
    BLOCK_H: tl.constexpr,
):
    d = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = cols < H
    routed = d < tl.load(offsets_ptr + E)
    src = tl.load(dest_to_src_ptr + d)
    t = (src % T).to(tl.int64)
    row = tl.load(x_ptr + t * stride_xt + cols * stride_xh, mask=in_row & routed, other=0.0)
    tl.store(out_ptr + d.to(tl.int64) * stride_od + cols * stride_oh, row, mask=in_row)


def expand_rows_triton(
    x: torch.Tensor,
    dest_to_src: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor,
    *,
    block_h: int | None = None,
) -> None:
    """Gather ``x [T, H]`` into ``out [T*K, H]`` (preallocated) in permuted order."""
    T, H = x.shape
    N = out.shape[0]
    if N == 0 or H == 0:
        return
    if block_h is None:
        block_h = min(triton.next_power_of_2(H), BYTES_PER_PROGRAM // x.element_size())
    grid = (N, triton.cdiv(H, block_h))
    _expand_rows_kernel[grid](
        x, out, dest_to_src, offsets, T, H, offsets.numel() - 1,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        BLOCK_H=block_h, num_warps=4,
    )  # fmt: skip
