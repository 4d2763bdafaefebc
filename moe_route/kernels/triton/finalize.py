"""finalizeMoeRouting, standalone path: unpermute, scale, K-way reduce, add bias.

Program ``(t, c)`` owns columns ``[c*BLOCK_H, (c+1)*BLOCK_H)`` of output token ``t``. For
``k = 0..K-1`` (unrolled, so the K row loads are in flight together) it reads the permuted row
``expanded_source_row_to_expanded_dest_row[k*T + t]`` of ``y_perm``, scales it by
``topk_weights[t, k]`` and adds it to a float32 accumulator (float64 for float64 inputs);
``bias`` is added once after the sum and the result is rounded once. Dropped slots
(``expert_for_source_row == -1``) are masked out of both the load and the sum, so nothing
they hold (NaN included) reaches the output.
Every output element has one owner: no atomics, the same bits on every run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import LaunchKey, ThinKernel, cdiv, next_pow2

# docs/decisions.md, "Expand and finalize block widths".
BYTES_PER_PROGRAM = 2048


@triton.jit(do_not_specialize=["T"])
def _finalize_kernel(
    y_ptr,
    w_ptr,
    src_to_dest_ptr,
    expert_for_src_ptr,
    bias_ptr,
    out_ptr,
    T,
    H,
    stride_yd,
    stride_yh,
    stride_wt,
    stride_wk,
    stride_bt,
    stride_bh,
    stride_ot,
    stride_oh,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UNIT_WEIGHTS: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = cols < H
    acc = tl.zeros([BLOCK_H], dtype=ACC)
    for k in tl.static_range(K):
        src = k * T + t
        routed = tl.load(expert_for_src_ptr + src) >= 0
        dest = tl.load(src_to_dest_ptr + src).to(tl.int64)
        row = tl.load(y_ptr + dest * stride_yd + cols * stride_yh, mask=in_row & routed, other=0.0)
        if UNIT_WEIGHTS:
            acc += tl.where(routed, row.to(ACC), 0.0)
        else:
            w = tl.load(w_ptr + t * stride_wt + k * stride_wk, mask=routed, other=0.0).to(ACC)
            acc += tl.where(routed, w * row.to(ACC), 0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + t * stride_bt + cols * stride_bh, mask=in_row).to(ACC)
    tl.store(
        out_ptr + t * stride_ot + cols * stride_oh, acc.to(out_ptr.dtype.element_ty), mask=in_row
    )


class FinalizeLaunch:
    """The finalize's launch prepared from its operands' layout (dtypes, strides, ``H``,
    ``K``, whether there are weights and a bias, of which shape): what a call of
    :func:`finalize_triton` works out before launching, kept by
    :func:`moe_route.finalize_moe_routing`'s call memo for every later call of that signature.
    ``out``: ``[T, H]`` with strides ``out_strides`` (default contiguous)."""

    __slots__ = ("block_h", "cols", "cx", "key", "strides", "unit")

    def __init__(self, y_perm: torch.Tensor, topk_weights: torch.Tensor | None, bias, K: int,
                 out_dtype, out_strides=None, *, block_h: int | None = None):  # fmt: skip
        H = y_perm.shape[1]
        self.unit = unit = topk_weights is None
        if block_h is None:
            block_h = min(next_pow2(H), BYTES_PER_PROGRAM // y_perm.element_size())
        self.block_h, self.cols = block_h, cdiv(H, block_h)
        if bias is None:
            sb = (0, 0)  # never read: HAS_BIAS is False
        elif bias.dim() == 1:
            sb = (0, bias.stride(0))
        else:
            sb = bias.stride()
        w_dtype = out_dtype if unit else topk_weights.dtype
        acc = tl.float64 if torch.float64 in (y_perm.dtype, w_dtype) else tl.float32
        sy = y_perm.stride()
        sw = (0, 0) if unit else topk_weights.stride()
        so = (H, 1) if out_strides is None else tuple(out_strides)
        b_dtype = out_dtype if bias is None else bias.dtype
        self.key = LaunchKey((K, H, block_h, acc, bias is not None, unit, y_perm.dtype, w_dtype,
                              b_dtype, out_dtype, sy, sw, sb, so))  # fmt: skip
        self.strides = (H, *sy, *sw, *sb, *so)
        self.cx = dict(K=K, HAS_BIAS=bias is not None, UNIT_WEIGHTS=unit, ACC=acc,
                       BLOCK_H=block_h, num_warps=4)  # fmt: skip

    def __call__(self, y_perm, topk_weights, src_to_dest, expert_for_src, bias, out) -> None:
        T = out.shape[0]
        if T == 0 or self.cols == 0:
            return
        w_arg = out if self.unit else topk_weights  # never read with UNIT_WEIGHTS
        b_arg = out if bias is None else bias
        _FINALIZE.launch(self.key, (T, self.cols), (y_perm, w_arg, src_to_dest, expert_for_src,
                         b_arg, out, T, *self.strides), self.constexprs)  # fmt: skip

    def constexprs(self) -> dict:
        return dict(self.cx)  # (the launch-checking path adds options to it)


def finalize_triton(
    y_perm: torch.Tensor,
    topk_weights: torch.Tensor | None,
    src_to_dest: torch.Tensor,
    expert_for_src: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    *,
    block_h: int | None = None,
) -> None:
    """Reduce ``y_perm [T*K, H]`` into ``out [T, H]`` (preallocated). ``topk_weights=None``:
    every weight is 1 (the backward of an expand: no weights tensor to build and fill)."""
    T = out.shape[0]
    if T:
        launch = FinalizeLaunch(y_perm, topk_weights, bias, src_to_dest.numel() // T, out.dtype,
                                out.stride(), block_h=block_h)  # fmt: skip
        launch(y_perm, topk_weights, src_to_dest, expert_for_src, bias, out)


_FINALIZE = ThinKernel(_finalize_kernel)


@triton.jit(do_not_specialize=["T"])
def _finalize_backward_kernel(
    dout_ptr,
    y_ptr,
    w_ptr,
    src_to_dest_ptr,
    expert_for_src_ptr,
    dy_ptr,
    dw_ptr,
    T,
    H,
    stride_dt,
    stride_dh,
    stride_yd,
    stride_yh,
    stride_wt,
    stride_wk,
    stride_dyd,
    stride_dyh,
    stride_gt,
    stride_gk,
    K: tl.constexpr,
    K_POW2: tl.constexpr,
    NEED_DY: tl.constexpr,
    NEED_DW: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Program ``t``: ``dy[dest] = w[t,k] dout[t]`` (zero rows for dropped slots) and
    ``dw[t,k] = <dout[t], y[dest]>``, reading ``dout[t]`` once per column block for all K."""
    t = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, K_POW2)
    dots = tl.zeros([K_POW2], dtype=ACC)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        in_row = cols < H
        g = tl.load(dout_ptr + t * stride_dt + cols * stride_dh, mask=in_row, other=0.0).to(ACC)
        for k in tl.static_range(K):
            src = k * T + t
            routed = tl.load(expert_for_src_ptr + src) >= 0
            dest = tl.load(src_to_dest_ptr + src).to(tl.int64)
            if NEED_DY:
                w = tl.load(w_ptr + t * stride_wt + k * stride_wk, mask=routed, other=0.0)
                dy = tl.where(routed, w.to(ACC) * g, 0.0)
                tl.store(dy_ptr + dest * stride_dyd + cols * stride_dyh,
                         dy.to(dy_ptr.dtype.element_ty), mask=in_row)  # fmt: skip
            if NEED_DW:
                row = tl.load(y_ptr + dest * stride_yd + cols * stride_yh, mask=in_row & routed,
                              other=0.0)  # fmt: skip
                dots = tl.where(ks == k, dots + tl.sum(g * row.to(ACC)), dots)
    if NEED_DW:
        routed_k = tl.load(expert_for_src_ptr + ks * T + t, mask=ks < K, other=-1) >= 0
        dots = tl.where(routed_k, dots, 0.0)
        tl.store(dw_ptr + t * stride_gt + ks * stride_gk, dots.to(dw_ptr.dtype.element_ty),
                 mask=ks < K)  # fmt: skip


_FINALIZE_BACKWARD = ThinKernel(_finalize_backward_kernel)


def finalize_backward_triton(
    dout: torch.Tensor,
    y_perm: torch.Tensor,
    topk_weights: torch.Tensor,
    src_to_dest: torch.Tensor,
    expert_for_src: torch.Tensor,
    dy: torch.Tensor | None,
    dw: torch.Tensor | None,
) -> None:
    """Gradients of :func:`finalize_triton` w.r.t. ``y_perm`` (into ``dy``) and
    ``topk_weights`` (into ``dw``), each skipped when ``None``; every tensor is addressed
    through its own strides (``dy`` need not be laid out like ``y_perm``). Rows of ``dy``
    that no slot owns (past ``T*K``) are not written; dropped slots' rows get zeros."""
    T, K = topk_weights.shape
    H = dout.shape[1]
    if T == 0:
        return
    acc = tl.float64 if torch.float64 in (dout.dtype, y_perm.dtype) else tl.float32
    dy_arg = dy if dy is not None else y_perm
    dw_arg = dw if dw is not None else topk_weights
    block_h = min(next_pow2(max(H, 1)), 1024)
    key = (
        dout.dtype, y_perm.dtype, topk_weights.dtype, dy_arg.dtype, dw_arg.dtype, dout.stride(),
        y_perm.stride(), topk_weights.stride(), dy_arg.stride(), dw_arg.stride(), K, H,
        dy is not None, dw is not None, block_h,
    )  # fmt: skip
    _FINALIZE_BACKWARD.launch(
        key, (T,),
        (
            dout, y_perm, topk_weights, src_to_dest, expert_for_src, dy_arg, dw_arg, T, H,
            dout.stride(0), dout.stride(1), y_perm.stride(0), y_perm.stride(1),
            topk_weights.stride(0), topk_weights.stride(1), dy_arg.stride(0), dy_arg.stride(1),
            dw_arg.stride(0), dw_arg.stride(1),
        ),
        lambda: dict(
            K=K, K_POW2=next_pow2(K), NEED_DY=dy is not None, NEED_DW=dw is not None,
            ACC=acc, BLOCK_H=block_h, num_warps=4,
        ),
    )  # fmt: skip
