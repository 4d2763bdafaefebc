"""The launch sequences of ``fused_moe`` on the Triton backend, forward and backward.

Forward: (expand) → GEMM1 + activation → GEMM2 → finalize (standalone kernel, or in GEMM2's
epilogue). Backward (from ``x``, GEMM1's saved pre-activation ``z``, the weights and the maps;
never ``x_perm``, ``h`` or GEMM2's output):

0. On Hopper (16-bit), ``dout`` permuted into ``[M, H]`` by an expand, so that steps 1 and 3
   read both of their operands through TMA (``x`` likewise before step 5);
1. GEMM2's backward with the activation's backward: ``g = dout[t] @ W2[e]`` (rows read from
   ``dout`` through the maps, or from its permuted copy), recompute ``h = act(z)``, write
   ``w[t,k]·h`` (for ``dW2``), ``dz = act'(z)·w[t,k] g`` and the partial router-weight
   gradients ``<g, h>`` per column block: in the epilogue of the GEMM (fused), or (split,
   :mod:`.act_backward`) a plain GEMM storing ``g`` into ``w·h``'s buffer, then a pass over
   the rows;
2. ``d w[t,k]``: those partials summed in fixed order (+ ``<dout[t], b2[e]>``);
3. ``dW2[e] = Σ dout[t]^T (w h)`` by the deterministic per-expert reduction;
4. ``dx_perm = dz @ W1[e]`` (grouped GEMM over ``W1`` seen k-major) and ``dx[t]``, the sum
   of its ``K`` copies in fixed ``k`` order (the finalize kernel with unit weights);
5. ``dW1[e] = Σ dz^T x[t]`` last, when ``dx_perm`` is freed.

The weight gradients (steps 3 and 5) are the TMA kernel of :mod:`.weight_grad` where the
operands allow, else its pointer kernel reading ``dout`` / ``x`` through the maps.

Everything runs on the caller's stream: memory passes on a side stream beside the GEMMs slow
the GEMMs by most of what they save, and sustained steps are power-bound (docs/decisions.md,
"No side stream in the backward").

No float atomics anywhere in the backward: same inputs, same bits. The caller (the plan)
chooses the paths and every tile configuration; what depends only on the operands' layouts is
decided here when a launch is prepared (:class:`WeightGradOperand`: expand the token rows or
gather them; the launchers: TMA or pointer loads). The stage-by-stage backward
(:func:`grouped_gemm_backward_triton`) computes the activation's backward with
:func:`moe_route.reference.activation_backward_reference` (torch ops on the device).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cdiv
from .act_backward import ActBackwardConfig, RowPassLaunch
from .expand import ExpandLaunch
from .finalize import FinalizeLaunch, finalize_triton
from .gemm_act_backward import ActBackwardLaunch
from .gemm_finalize import grouped_gemm_finalize_triton
from .gemm_mainloop import IDENTITY, GemmConfig, GemmEpilogue
from .grouped_gemm import GemmLaunch, grouped_gemm_triton
from .quant import SCALE_K, QuantGemmLaunch, in_loop_quant
from .quantize_rows import QuantizeRowsLaunch
from .router_grad import RouterGradLaunch
from .tma import TMA_DTYPES
from .weight_grad import (
    WeightGradConfig,
    WeightGradLaunch,
    expert_weight_grad_triton,
    tma_operands_ok,
)


@dataclass(frozen=True)
class MoEConfigs:
    """Every launch configuration of one ``fused_moe`` call (from :mod:`moe_route.tuning`)."""

    gemm1: GemmConfig
    #: GEMM1 storing its pre-activation ``z`` too (the training forward)
    gemm1_z: GemmConfig
    gemm2: GemmConfig
    act_bwd: ActBackwardConfig
    dx: GemmConfig
    wgrad2: WeightGradConfig
    wgrad1: WeightGradConfig
    epilogue: GemmEpilogue
    #: ``"standalone"``, ``"fused"`` (ordered) or ``"fused_atomic"``.
    finalize: str
    gather: bool
    allow_tf32: bool


def prepared(launches: dict, name: str, make, *args, **kwargs):
    """``launches[name]``, made by ``make(*args, **kwargs)`` on its first use.

    A launch sequence keeps its prepared launches (:class:`.grouped_gemm.GemmLaunch` and the
    like) in ``launches``: a new dict per call on the op's route; on the eager route the
    caller's memo (:class:`moe_route.moe.FusedCall`: one per call signature, and in the
    backward one per layout of ``dout``), so that a later call launches without working out
    strides, keys and constexprs again. Both routes run the same code and launch the same
    variants. What a prepared launch keeps is what the signature fixes: the inputs' layouts
    and the layouts of the buffers the sequence allocates (contiguous rows, ``empty_like`` of
    an input), never a row count or an address."""
    launch = launches.get(name)
    if launch is None:
        launch = launches[name] = make(*args, **kwargs)
    return launch


def moe_forward_triton(x, w1, w2, topk_weights, b1, b2, bias, maps, cfg: MoEConfigs, store_z,
                       launches=None):  # fmt: skip
    """``(out [T, H], z)``: ``z`` is GEMM1's pre-activation when ``store_z``, else empty.
    ``launches``: see :func:`prepared` (one dict per ``store_z``)."""
    L = {} if launches is None else launches
    src_to_dest, dest_to_src, expert_for_src, offsets = maps
    M = dest_to_src.numel()
    T, H = x.shape
    K = topk_weights.shape[1]
    n_inter = w2.shape[2]
    z = x.new_empty(M, w1.shape[1]) if store_z else x.new_empty(0)
    h = x.new_empty(M, n_inter)
    if cfg.gather:
        rows, d2s = x, dest_to_src
    else:
        rows, d2s = x.new_empty(M, H), None
        prepared(L, "expand", ExpandLaunch, x, K)(x, src_to_dest, expert_for_src, rows)
    pre = z if store_z else None
    gemm1 = prepared(L, "gemm1", GemmLaunch, rows, w1, h, cfg.gemm1_z if store_z else cfg.gemm1,
                     cfg.epilogue, b1, cfg.gather, pre, cfg.allow_tf32)  # fmt: skip
    gemm1(rows, w1, offsets, h, b1, d2s, M, pre)
    del rows  # x_perm, when there is one: not held while GEMM2 writes y
    if cfg.finalize == "fused_atomic":
        acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        acc = torch.zeros(T, H, dtype=acc_dtype, device=x.device)
        if bias is not None:
            acc += bias.to(acc_dtype)
        grouped_gemm_finalize_triton(
            h, w2, offsets, src_to_dest, dest_to_src, expert_for_src, topk_weights, acc,
            cfg.gemm2, ordered=False, b2=b2, allow_tf32=cfg.allow_tf32,
        )  # fmt: skip
        return acc.to(x.dtype), z
    out = x.new_empty(T, H)
    if cfg.finalize == "fused":
        grouped_gemm_finalize_triton(
            h, w2, offsets, src_to_dest, dest_to_src, expert_for_src, topk_weights, out,
            cfg.gemm2, ordered=True, b2=b2, bias=bias, allow_tf32=cfg.allow_tf32,
        )  # fmt: skip
        return out, z
    y = x.new_empty(M, H)
    gemm2 = prepared(L, "gemm2", GemmLaunch, h, w2, y, cfg.gemm2, IDENTITY, b2, False, None,
                     cfg.allow_tf32)  # fmt: skip
    gemm2(h, w2, offsets, y, b2)
    del h
    if T:
        fin = prepared(L, "finalize", FinalizeLaunch, y, topk_weights, bias, K, x.dtype)
        fin(y, topk_weights, src_to_dest, expert_for_src, bias, out)
    return out, z


def moe_backward_triton(dout, x, w1, w2, topk_weights, b1, b2, z, maps, cfg: MoEConfigs,
                        need_dx, need_dw1, need_dw2, need_dtopk, dz_out=None,
                        launches=None):  # fmt: skip
    """``(dx, dw1, dw2, d_topk_weights, db1, db2)``; ``None`` for those not asked for.

    ``dz_out``: where GEMM1's pre-activation gradient goes, ``z`` itself allowed (each tile
    of step 1 reads its ``z`` elements before it writes their ``dz``); a new tensor if None.
    ``launches``: see :func:`prepared` (one dict per layout of ``dout``).
    """
    L = {} if launches is None else launches
    src_to_dest, dest_to_src, expert_for_src, offsets = maps
    T, H = x.shape
    K = topk_weights.shape[1]
    M = dest_to_src.numel()
    tf32 = cfg.allow_tf32
    # 1. g = dout[t] @ W2[e]; wh = w act(z); dz = act'(z) w g; partial <g, h> per column tile.
    # With TMA, dout is permuted once (an expand) for this GEMM and dW2 to read through TMA.
    wh = x.new_empty(M, w2.shape[2])
    dz = torch.empty_like(z) if dz_out is None else dz_out
    dout_rows = prepared(L, "dout_rows", WeightGradOperand, dout, K, cfg.wgrad2, wh)
    rows, gathered = dout_rows(dout, src_to_dest, expert_for_src, M)
    w2t = w2.transpose(1, 2)
    ab = cfg.act_bwd
    if ab.split:
        # g lives in wh's buffer (no [M, I] more at the backward's peak): the row pass reads
        # each tile of g before it writes w·h over it.
        gemm = prepared(L, "act_gemm", GemmLaunch, rows, w2t, wh, ab.gemm, IDENTITY, None,
                        gathered, None, tf32)  # fmt: skip
        gemm(rows, w2t, offsets, wh, None, dest_to_src, M)
        row_pass = prepared(L, "act_rows", RowPassLaunch, wh, z, topk_weights, wh, dz,
                            offsets.shape[0] - 1, ab.rows, epilogue=cfg.epilogue)  # fmt: skip
        partial = row_pass(wh, z, topk_weights, offsets, dest_to_src, wh, dz)
    else:
        act = prepared(L, "act", ActBackwardLaunch, rows, w2t, z, topk_weights, wh, ab.fused,
                       epilogue=cfg.epilogue, allow_tf32=tf32, permuted=not gathered)  # fmt: skip
        partial = act(rows, w2t, offsets, dest_to_src, z, topk_weights, wh, dz)
    dtopk = dw2 = db2 = dx = dw1 = db1 = None
    if need_dtopk:
        dtopk = torch.empty_like(topk_weights)
        router = prepared(L, "router", RouterGradLaunch, partial, dout, b2, dtopk)
        router(partial, dout, b2, src_to_dest, expert_for_src, dtopk)
    del partial
    if need_dw2:
        dw2 = torch.empty_like(w2)
        db2 = torch.empty(w2.shape[:2], dtype=b2.dtype, device=x.device) if b2 is not None else None
        wgrad2 = prepared(L, "wgrad2", WeightGradLaunch, rows, wh, dw2, cfg.wgrad2, db=db2,
                          a_gather=gathered, db_scale=topk_weights, allow_tf32=tf32)  # fmt: skip
        wgrad2(rows, wh, offsets, dw2, db2, dest_to_src, topk_weights, M)
    del wh, rows
    if need_dx:
        dx_perm = x.new_empty(M, H)
        w1t = w1.transpose(1, 2)
        dx_gemm = prepared(L, "dx", GemmLaunch, dz, w1t, dx_perm, cfg.dx, IDENTITY, None, False,
                           None, tf32)  # fmt: skip
        dx_gemm(dz, w1t, offsets, dx_perm)
        dx = x.new_empty(T, H)
        if T:
            dx_sum = prepared(L, "dx_sum", FinalizeLaunch, dx_perm, None, None, K, x.dtype)
            dx_sum(dx_perm, None, src_to_dest, expert_for_src, None, dx)
        del dx_perm
    # dW1 last: dx_perm is freed by then, so the peak holds dz, dW1 and dW2 but no [M, H].
    if need_dw1:
        dw1 = torch.empty_like(w1)
        db1 = torch.empty(w1.shape[:2], dtype=b1.dtype, device=x.device) if b1 is not None else None
        x_rows = prepared(L, "x_rows", WeightGradOperand, x, K, cfg.wgrad1, dz)
        b, gather = x_rows(x, src_to_dest, expert_for_src, M)
        wgrad1 = prepared(L, "wgrad1", WeightGradLaunch, dz, b, dw1, cfg.wgrad1, db=db1,
                          b_gather=gather, allow_tf32=tf32)  # fmt: skip
        wgrad1(dz, b, offsets, dw1, db1, dest_to_src, None, M)
    return dx, dw1, dw2, dtopk, db1, db2


def grouped_gemm_backward_triton(dout, a, w, offsets, src_to_dest, dest_to_src, expert_for_src,
                                 bias, activation, gate_up_layout, epilogue: GemmEpilogue, gather,
                                 need_da, need_dw, need_db, cfg: GemmConfig, dx_cfg: GemmConfig,
                                 wgrad_cfg: WeightGradConfig, allow_tf32):  # fmt: skip
    """``(da, dw, db)`` of :func:`grouped_gemm_triton` (stage-by-stage use; ``None`` for those
    not asked for). The pre-activation is recomputed (one more GEMM) for a non-identity
    activation: this backward saves only the op's inputs (``fused_moe`` saves ``z``)."""
    from ...reference import activation_backward_reference

    M = dest_to_src.numel()
    dz = dout
    if epilogue != IDENTITY:
        z = a.new_empty(M, w.shape[1])
        grouped_gemm_triton(
            a, w, offsets, z, cfg, bias=bias, dest_to_src=dest_to_src if gather else None,
            num_rows=M, allow_tf32=allow_tf32,
        )  # fmt: skip
        acc = torch.float64 if a.dtype == torch.float64 else torch.float32
        dz = activation_backward_reference(z.to(acc), dout.to(acc), activation, gate_up_layout)
        dz = dz.to(a.dtype)
    da = dw = db = None
    if need_da:
        da_perm = a.new_empty(M, a.shape[1])
        grouped_gemm_triton(dz, w.transpose(1, 2), offsets, da_perm, dx_cfg, allow_tf32=allow_tf32)
        da = da_perm
        if gather:
            da = a.new_empty(a.shape)
            finalize_triton(da_perm, None, src_to_dest, expert_for_src, None, da)
    if need_dw or need_db:
        dw = torch.empty_like(w)
        db = torch.empty(w.shape[:2], dtype=w.dtype, device=a.device) if need_db else None
        b, b_gather = a, False
        if gather:
            K = M // a.shape[0] if a.shape[0] else 1
            operand = WeightGradOperand(a, K, wgrad_cfg, dz)
            b, b_gather = operand(a, src_to_dest, expert_for_src, M)
        expert_weight_grad_triton(
            dz, b, offsets, dw, wgrad_cfg, db=db, dest_to_src=dest_to_src,
            b_gather=b_gather, num_rows=M, allow_tf32=allow_tf32,
        )  # fmt: skip
    return da, dw, db


class WeightGradOperand:
    """How a weight gradient reads ``[T, C]`` token rows: permuted into ``[M, C]`` by an
    expand when the TMA kernel will read them, or the pointer kernel with ``cfg.permuted``
    (an expand, ~1 % of the GEMM's time), else the rows themselves, gathered through the maps
    by the pointer kernel. Decided from the layouts of the rows and of ``other`` (the
    gradient's other operand: the buffers of the launch sequence, from the caching
    allocator)."""

    __slots__ = ("expand",)

    def __init__(self, token_rows: torch.Tensor, K: int, cfg: WeightGradConfig, other):
        permute = cfg.permuted
        if cfg.use_tma:
            row_bytes = token_rows.shape[1] * token_rows.element_size()
            sixteen_bit = token_rows.dtype in TMA_DTYPES
            permute = sixteen_bit and row_bytes % 16 == 0 and tma_operands_ok(other)
        self.expand = ExpandLaunch(token_rows, K) if permute else None

    def __call__(self, token_rows, src_to_dest, expert_for_src, M: int):
        """``(operand, gathered)``."""
        if self.expand is None:
            return token_rows, True
        rows = token_rows.new_empty(M, token_rows.shape[1])
        self.expand(token_rows, src_to_dest, expert_for_src, rows)
        return rows, False


# --------------------------------------------------------------------------- quantised experts
@dataclass(frozen=True)
class QuantConfigs:
    """The launch configurations of one ``fused_moe`` call on quantised experts."""

    gemm1: GemmConfig
    gemm2: GemmConfig
    epilogue: GemmEpilogue
    #: FP8 activations and weights (else MXFP4 weights, 16-bit activations)
    fp8: bool
    #: columns per scale of the tokens' FP8 codes (0: one per token)
    x_group: int
    #: rows per scale block of the FP8 weights (1: per channel)
    w_block_rows: int
    ue8m0: bool
    #: FP8: GEMM1 quantises the gathered 16-bit tokens in its main loop (the quantiser's codes
    #: and scales, so the same products) instead of reading a quantiser launch's codes: one
    #: launch and two buffers fewer per call, each token quantised once per column tile
    in_loop: bool = False


def moe_forward_quant_triton(x, w1, w1_scale, w2, w2_scale, topk_weights, b1, b2, bias, maps,
                             cfg: QuantConfigs, launches=None) -> torch.Tensor:  # fmt: skip
    """``out [T, H]`` of the experts on quantised weights (:mod:`.quant`): on FP8, the tokens
    quantised once (``[T, H]``; with ``cfg.in_loop``, by GEMM1's main loop instead), GEMM1
    gathering their codes and writing GEMM2's input as FP8 codes and scales, GEMM2 writing
    16-bit rows; on MXFP4, 16-bit rows throughout. Then the standalone finalize.
    ``launches``: see :func:`prepared`."""
    L = {} if launches is None else launches
    src_to_dest, dest_to_src, expert_for_src, offsets = maps
    M = dest_to_src.numel()
    T, H = x.shape
    K = topk_weights.shape[1]
    n_inter = w1.shape[1] // 2 if cfg.epilogue.gated else w1.shape[1]
    fp8 = torch.float8_e4m3fn
    a_quant = in_loop_quant(cfg.x_group) if cfg.fp8 and cfg.in_loop else 0
    rows, rows_s, hs = x, None, None
    if not cfg.fp8:
        h = x.new_empty(M, n_inter)
    else:
        if not a_quant:
            groups = 1 if cfg.x_group == 0 else cdiv(H, cfg.x_group)
            rows = torch.empty(T, H, dtype=fp8, device=x.device)
            rows_s = torch.empty(T, groups, dtype=torch.float32, device=x.device)
            quant_x = prepared(L, "quant_x", QuantizeRowsLaunch, x, cfg.x_group, cfg.ue8m0)
            quant_x(x, rows, rows_s)
        h = torch.empty(M, n_inter, dtype=fp8, device=x.device)
        hs = torch.empty(M, cdiv(n_inter, SCALE_K), dtype=torch.float32, device=x.device)
    gemm1 = prepared(L, "gemm1", QuantGemmLaunch, rows, rows_s, w1, w1_scale, x.shape[1],
                     cfg.gemm1, cfg.epilogue, b1, True, h.dtype, cfg.fp8, not cfg.fp8,
                     cfg.w_block_rows, cfg.ue8m0, a_quant)  # fmt: skip
    gemm1(rows, rows_s, w1, w1_scale, offsets, h, hs, b1, dest_to_src, M)
    del rows, rows_s
    y = x.new_empty(M, H)
    gemm2 = prepared(L, "gemm2", QuantGemmLaunch, h, hs, w2, w2_scale, n_inter, cfg.gemm2,
                     IDENTITY, b2, False, y.dtype, False, not cfg.fp8, cfg.w_block_rows,
                     cfg.ue8m0)  # fmt: skip
    gemm2(h, hs, w2, w2_scale, offsets, y, None, b2)
    del h, hs
    out = x.new_empty(T, H)
    if T:
        fin = prepared(L, "finalize", FinalizeLaunch, y, topk_weights, bias, K, x.dtype)
        fin(y, topk_weights, src_to_dest, expert_for_src, bias, out)
    return out
