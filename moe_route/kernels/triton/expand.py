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

from . import LaunchKey, ThinKernel, cdiv, next_pow2

# docs/decisions.md, "Expand and finalize block widths".
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


class ExpandLaunch:
    """The expand's launch prepared from its operands' layout (``x``'s width, dtype and
    strides, ``K``): what a call of :func:`expand_rows_triton` works out before launching, kept
    by :func:`moe_route.expand_rows`'s call memo for every later call of that signature.
    ``out``: ``[T*K, H]`` of ``out_dtype`` with strides ``out_strides`` (default: ``x``'s
    dtype, contiguous)."""

    __slots__ = ("block_h", "cols", "key", "tail")

    def __init__(self, x: torch.Tensor, K: int, out_dtype=None, out_strides=None, *,
                 block_h: int | None = None):  # fmt: skip
        H = x.shape[1]
        if block_h is None:
            block_h = min(next_pow2(H), BYTES_PER_PROGRAM // x.element_size())
        sx, so = x.stride(), (H, 1) if out_strides is None else tuple(out_strides)
        self.block_h, self.cols = block_h, cdiv(H, block_h)
        self.key = LaunchKey((K, H, block_h, x.dtype, out_dtype or x.dtype, sx, so))
        self.tail = (H, *sx, *so)

    def __call__(self, x, src_to_dest, expert_for_src, out) -> None:
        T = x.shape[0]
        if T == 0 or self.cols == 0:
            return
        _EXPAND.launch(self.key, (T, self.cols), (x, out, src_to_dest, expert_for_src, T,
                       *self.tail), self.constexprs)  # fmt: skip

    def constexprs(self) -> dict:
        return dict(K=self.key.fields[0], BLOCK_H=self.block_h, num_warps=4)


def expand_rows_triton(
    x: torch.Tensor,
    src_to_dest: torch.Tensor,
    expert_for_src: torch.Tensor,
    out: torch.Tensor,
    *,
    block_h: int | None = None,
) -> None:
    """Scatter ``x [T, H]`` into ``out [T*K, H]`` (preallocated) in permuted order."""
    T = x.shape[0]
    if T:
        launch = ExpandLaunch(x, out.shape[0] // T, out.dtype, out.stride(), block_h=block_h)
        launch(x, src_to_dest, expert_for_src, out)


_EXPAND = ThinKernel(_expand_rows_kernel)
