"""The activation's backward over the permuted rows, given GEMM2's input gradient ``g``.

Step 1 of the backward (:mod:`.moe`) runs one of two ways (:class:`ActBackwardConfig`):

* fused: ``_gemm_act_bwd_kernel`` of :mod:`.gemm_act_backward`, the activation's backward in the
  epilogue of ``g = dout[t] @ W2[e]``;
* split: the plain grouped GEMM stores ``g`` in the input dtype, then the row pass here
  (:func:`act_backward_rows_triton`) reads it back with ``z`` and the router weights.

The split trades ``g``'s round trip through memory (and its rounding to the input dtype) for a
GEMM with a plain store, whose main loop is no longer held back by a register-heavy epilogue.

Row pass, for each permuted row ``d`` of ``[0, M)`` and each block ``j`` of ``BLOCK_N`` columns
of ``I``: for a routed row (``d < offset[E]``) with ``src = dest_to_src[d]``, ``t = src mod T``,
``k = src div T`` and ``w = w[t, k]``:

* ``h = act(z[d])`` computed in the accumulator dtype and rounded to ``wh``'s dtype (the
  forward's bits, as GEMM1 stored ``h``); ``wh[d] = w·h``;
* ``dz[d] = act'(z[d])·(w·g[d])`` in ``z``'s gate/up layout;
* ``partial[d, j] = Σ g[d]·h`` over the block's columns, in the accumulator dtype: the
  router-weight gradient's per-block dot products (summed in fixed order by
  :func:`.router_grad.router_weight_grad_triton`).

Dropped rows (``d >= offset[E]``) get zeros in ``wh``, ``dz`` and ``partial``: every output
row is defined. The activation math is :mod:`.activation`'s, shared with the fused epilogue.
One program per ``[BLOCK_M, BLOCK_N]`` tile, column blocks fastest (consecutive programs
stream the same rows); ``M`` and ``T`` are not specialised.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from . import LaunchKey, ThinKernel, cdiv, launch_key_part
from .activation import gated_backward, gated_forward, plain_backward, plain_forward
from .gemm_mainloop import GemmConfig, GemmEpilogue, _acc


@launch_key_part
@dataclass(frozen=True)
class RowPassConfig:
    """Tiles of the row pass (:func:`act_backward_rows_triton`)."""

    #: rows per program
    block_m: int = 16
    #: columns of ``I`` per program; also the router partials' block (``NT = cdiv(I, block_n)``)
    block_n: int = 128
    num_warps: int = 4


@dataclass(frozen=True)
class ActBackwardConfig:
    """Step 1 of the backward, GEMM2's input gradient with the activation's backward: which way
    it runs and the tiles of both ways (chosen by :func:`moe_route.tuning.act_backward_config`;
    the tiles of the way not taken are there for comparisons)."""

    #: the fused kernel's tiles (:func:`.gemm_act_backward.grouped_gemm_act_backward_triton`)
    fused: GemmConfig
    #: the split's plain GEMM ``g = dout[t] @ W2[e]`` (:func:`.grouped_gemm.grouped_gemm_triton`)
    gemm: GemmConfig
    #: the split's row pass
    rows: RowPassConfig = field(default_factory=RowPassConfig)
    #: True: the plain GEMM, then the row pass; False: the fused kernel
    split: bool = False


@triton.jit(do_not_specialize=["M_ROWS", "T"])
def _act_bwd_rows_kernel(
    g_ptr, z_ptr, weights_ptr, offsets_ptr, dest_to_src_ptr, wh_ptr, dz_ptr, partial_ptr,
    E, M_ROWS, N_OUT, T, stride_gm, stride_zm, stride_whm, stride_dzm, stride_wt, stride_wk,
    ACT: tl.constexpr, GATED: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
    UP_OFFSET: tl.constexpr, GATE_SOFTCAP: tl.constexpr, UP_SOFTCAP: tl.constexpr,
    INTERLEAVED: tl.constexpr, ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    n_blocks = tl.cdiv(N_OUT, BLOCK_N)
    pid = tl.program_id(0)
    j = pid % n_blocks
    rows = (pid // n_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
    in_m = rows < M_ROWS
    routed = rows < tl.load(offsets_ptr + E)  # offset[E] <= M
    col_ok = cols < N_OUT
    mask = routed[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    src = tl.load(dest_to_src_ptr + rows, mask=routed, other=0)
    t = (src % T).to(tl.int64)
    w = tl.load(weights_ptr + t * stride_wt + (src // T) * stride_wk, mask=routed, other=0.0)
    w = w.to(ACC)[:, None]
    g = tl.load(g_ptr + rows64[:, None] * stride_gm + cols[None, :], mask=mask, other=0.0)
    g = g.to(ACC)
    z_rows = z_ptr + rows64[:, None] * stride_zm
    if GATED:
        if INTERLEAVED:
            # gate and up side by side: one contiguous [BLOCK_M, 2*BLOCK_N] load, split after
            cols2 = 2 * j * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
            mask2 = routed[:, None] & (cols2 < 2 * N_OUT)[None, :]
            zz = tl.load(z_rows + cols2[None, :], mask=mask2, other=0.0).to(ACC)
            zg, zu = tl.split(tl.reshape(zz, [BLOCK_M, BLOCK_N, 2]))
        else:
            zg = tl.load(z_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
            zu = tl.load(z_rows + N_OUT + cols[None, :], mask=mask, other=0.0).to(ACC)
        h = gated_forward(zg, zu, ACT, ALPHA, LIMIT, UP_OFFSET, GATE_SOFTCAP, UP_SOFTCAP)
    else:
        zg = tl.load(z_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
        h = plain_forward(zg, ACT)
    h = h.to(wh_ptr.dtype.element_ty).to(ACC)  # the forward's h, bit for bit
    part = tl.sum(g * h, axis=1)
    dh = g * w
    wh = tl.where(routed[:, None], h * w, 0.0).to(wh_ptr.dtype.element_ty)
    # `g` may be `wh` itself and `z` may be `dz`: every load of this tile is done before any
    # thread stores (the stores of `w·h` do not depend on the loads of `g`).
    tl.debug_barrier()
    out_mask = in_m[:, None] & col_ok[None, :]
    tl.store(wh_ptr + rows64[:, None] * stride_whm + cols[None, :], wh, mask=out_mask)
    dz_rows = dz_ptr + rows64[:, None] * stride_dzm
    dz_ty = dz_ptr.dtype.element_ty
    if GATED:
        d_gate, d_up = gated_backward(
            zg, zu, dh, ACT, ALPHA, LIMIT, UP_OFFSET, GATE_SOFTCAP, UP_SOFTCAP
        )
        d_gate = tl.where(routed[:, None], d_gate, 0.0).to(dz_ty)
        d_up = tl.where(routed[:, None], d_up, 0.0).to(dz_ty)
        if INTERLEAVED:
            both = tl.reshape(tl.join(d_gate, d_up), [BLOCK_M, 2 * BLOCK_N])
            tl.store(dz_rows + cols2[None, :], both,
                     mask=in_m[:, None] & (cols2 < 2 * N_OUT)[None, :])  # fmt: skip
        else:
            tl.store(dz_rows + cols[None, :], d_gate, mask=out_mask)
            tl.store(dz_rows + N_OUT + cols[None, :], d_up, mask=out_mask)
    else:
        d_x = tl.where(routed[:, None], plain_backward(zg, dh, ACT), 0.0).to(dz_ty)
        tl.store(dz_rows + cols[None, :], d_x, mask=out_mask)
    part = tl.where(routed, part, 0.0)
    tl.store(partial_ptr + rows64 * n_blocks + j, part, mask=in_m)


_ROWS = ThinKernel(_act_bwd_rows_kernel)


class RowPassLaunch:
    """The row pass's launch prepared from its operands' layout (dtypes, row strides, the
    router weights' strides, ``E``, ``I``, the tiles and epilogue): what a call of
    :func:`act_backward_rows_triton` works out before launching, kept among the backward
    launch sequence's prepared launches (:func:`.moe.prepared`)."""

    __slots__ = ("cx", "key", "nt", "partial_dtype", "strides")

    def __init__(self, g, z, topk_weights, wh, dz, E: int, cfg: RowPassConfig, *,
                 epilogue: GemmEpilogue):  # fmt: skip
        n_out = g.shape[1]
        self.nt = cdiv(n_out, cfg.block_n)
        self.partial_dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
        st = topk_weights.stride()
        self.strides = (g.stride(0), z.stride(0), wh.stride(0), dz.stride(0), *st)
        self.key = LaunchKey((cfg, epilogue, g.dtype, z.dtype, topk_weights.dtype, wh.dtype,
                              dz.dtype, *self.strides, E, n_out))  # fmt: skip
        self.cx = dict(
            ACT=epilogue.act, GATED=epilogue.gated, ALPHA=epilogue.alpha, LIMIT=epilogue.limit,
            UP_OFFSET=epilogue.up_offset, GATE_SOFTCAP=epilogue.gate_softcap,
            UP_SOFTCAP=epilogue.up_softcap, INTERLEAVED=epilogue.interleaved, ACC=_acc(g.dtype),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
        )  # fmt: skip

    def __call__(self, g, z, topk_weights, offsets, dest_to_src, wh, dz) -> torch.Tensor:
        M, n_out = g.shape
        partial = torch.empty(M, self.nt, dtype=self.partial_dtype, device=g.device)
        if M == 0 or n_out == 0:
            return partial
        E, bm = offsets.shape[0] - 1, self.cx["BLOCK_M"]
        _ROWS.launch(
            self.key, (cdiv(M, bm) * self.nt,),
            (g, z, topk_weights, offsets, dest_to_src, wh, dz, partial, E, M, n_out,
             topk_weights.shape[0], *self.strides),
            self.constexprs,
        )  # fmt: skip
        return partial

    def constexprs(self) -> dict:
        return dict(self.cx)


def act_backward_rows_triton(
    g: torch.Tensor,
    z: torch.Tensor,
    topk_weights: torch.Tensor,
    offsets: torch.Tensor,
    dest_to_src: torch.Tensor,
    wh: torch.Tensor,
    dz: torch.Tensor,
    cfg: RowPassConfig,
    *,
    epilogue: GemmEpilogue,
) -> torch.Tensor:
    """The row pass (module docstring); returns the partial router-weight gradients
    ``[M, cdiv(I, cfg.block_n)]``, float32 (float64 for float64 ``g``).

    ``g [M, I]`` (GEMM2's input gradient over the permuted rows, in the rows' dtype),
    ``z [M, 2I or I]`` (GEMM1's saved pre-activation, ``W1``'s gate/up layout),
    ``topk_weights [T, K]``, ``offsets [E+1]``, ``dest_to_src [M]``; writes ``wh [M, I]`` and
    ``dz`` (laid out like ``z``). Each tensor's rows have unit column stride. ``g`` may be
    ``wh`` itself and ``dz`` may be ``z``: a tile reads its elements before it writes them.
    """
    launch = RowPassLaunch(g, z, topk_weights, wh, dz, offsets.numel() - 1, cfg,
                           epilogue=epilogue)  # fmt: skip
    return launch(g, z, topk_weights, offsets, dest_to_src, wh, dz)
