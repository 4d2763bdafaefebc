"""The router-weight gradient of the backward.

``d w[t,k] = <dout[t], y[d]> = Σ_j partial[d, j] + <dout[t], b2[e]>`` with ``d = dest(k*T+t)``,
where ``partial[d, j]`` are the per-column-block dot products ``<dout[t] W2[e], h[d]>`` left by
step 1 of the backward (the fused epilogue of :mod:`.gemm_act_backward` or the row pass of
:mod:`.act_backward`), summed here in fixed order.
GEMM2's output ``y`` is never stored for it. Dropped slots get zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import LaunchKey, ThinKernel, cdiv, next_pow2


@triton.jit(do_not_specialize=["T"])
def _router_weight_grad_kernel(
    partial_ptr,
    dout_ptr,
    b2_ptr,
    src_to_dest_ptr,
    expert_for_src_ptr,
    dw_ptr,
    T,
    H,
    NT,
    stride_pm,
    stride_dt,
    stride_dh,
    stride_be,
    stride_bh,
    stride_wt,
    stride_wk,
    K: tl.constexpr,
    HAS_B2: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_NT: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    s_ok = s < T * K
    e = tl.load(expert_for_src_ptr + s, mask=s_ok, other=-1)
    routed = e >= 0
    d = tl.load(src_to_dest_ptr + s, mask=routed, other=0).to(tl.int64)
    j = tl.arange(0, BLOCK_NT)
    p = tl.load(
        partial_ptr + d[:, None] * stride_pm + j[None, :],
        mask=routed[:, None] & (j < NT)[None, :],
        other=0.0,
    )
    g = tl.sum(p.to(ACC), axis=1)
    t = (s % T).to(tl.int64)
    k = s // T
    if HAS_B2:
        e64 = tl.maximum(e, 0).to(tl.int64)
        for h0 in range(0, H, BLOCK_H):
            hh = h0 + tl.arange(0, BLOCK_H)
            m = routed[:, None] & (hh < H)[None, :]
            dv = tl.load(dout_ptr + t[:, None] * stride_dt + hh[None, :] * stride_dh, mask=m)
            bv = tl.load(b2_ptr + e64[:, None] * stride_be + hh[None, :] * stride_bh, mask=m)
            g += tl.sum(tl.where(m, dv.to(ACC) * bv.to(ACC), 0.0), axis=1)
    g = tl.where(routed, g, 0.0)
    tl.store(dw_ptr + t * stride_wt + k * stride_wk, g.to(dw_ptr.dtype.element_ty), mask=s_ok)


class RouterGradLaunch:
    """The router-weight gradient's launch prepared from its operands' layout (dtypes,
    strides, ``K``, the partials' column blocks, whether there is ``b2``): what a call of
    :func:`router_weight_grad_triton` works out before launching, kept among the backward
    launch sequence's prepared launches (:func:`.moe.prepared`)."""

    __slots__ = ("cx", "key", "strides")

    #: source slots per program
    BLOCK_S = 64

    def __init__(self, partial, dout, b2, dw):
        K, nt = dw.shape[1], partial.shape[1]
        acc = tl.float64 if torch.float64 in (partial.dtype, dout.dtype) else tl.float32
        bt = b2 if b2 is not None else dout
        self.key = LaunchKey((
            K, nt, partial.dtype, dout.dtype, bt.dtype, dw.dtype, partial.stride(),
            dout.stride(), bt.stride(), dw.stride(), b2 is not None,
        ))  # fmt: skip
        sb = (bt.stride(0), bt.stride(1)) if b2 is not None else (0, 0)
        self.strides = (partial.stride(0), *dout.stride(), *sb, *dw.stride())
        self.cx = dict(K=K, HAS_B2=b2 is not None, ACC=acc, BLOCK_S=self.BLOCK_S,
                       BLOCK_NT=next_pow2(nt), BLOCK_H=128, num_warps=4)  # fmt: skip

    def __call__(self, partial, dout, b2, src_to_dest, expert_for_src, dw) -> None:
        T, K = dw.shape
        if T == 0:
            return
        bt = b2 if b2 is not None else dout
        _ROUTER_GRAD.launch(
            self.key, (cdiv(T * K, self.BLOCK_S),),
            (partial, dout, bt, src_to_dest, expert_for_src, dw, T, dout.shape[1],
             partial.shape[1], *self.strides),
            self.constexprs,
        )  # fmt: skip

    def constexprs(self) -> dict:
        return dict(self.cx)


def router_weight_grad_triton(
    partial: torch.Tensor,
    dout: torch.Tensor,
    b2: torch.Tensor | None,
    src_to_dest: torch.Tensor,
    expert_for_src: torch.Tensor,
    dw: torch.Tensor,
) -> None:
    """``dw [T, K]`` (preallocated) from GEMM2-backward's ``partial [M, NT]``; see above."""
    RouterGradLaunch(partial, dout, b2, dw)(partial, dout, b2, src_to_dest, expert_for_src, dw)


_ROUTER_GRAD = ThinKernel(_router_weight_grad_kernel)
