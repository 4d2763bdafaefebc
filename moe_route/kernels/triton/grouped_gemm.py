"""GEMM1 and GEMM2: the grouped GEMM with bias and activation, per-tile and persistent.

The main loop, the tile-to-expert search and the configs are :mod:`.gemm_mainloop`'s.

* :func:`_gemm_kernel` — GEMM1 and GEMM2: bias, then the activation (plain, or gated with gate
  and up accumulators over the same ``A`` tile, ``W1`` rows gate-then-up or interleaved; its
  math and parameters in :mod:`.activation`, from a :class:`~.gemm_mainloop.GemmEpilogue`), and
  with ``STORE_PRE`` (training) also the pre-activation ``z``, rounded to the input dtype, from
  which the activation is then computed (the backward recomputes ``act(z)`` from the saved
  ``z`` and must see the forward's bits). ``GATHER`` reads ``A`` row ``d`` as
  ``x[dest_to_src[d] mod T]``: ``x_perm`` is never written. Programs past the experts write
  zeros to the dropped rows ``[offset[E], M)``, so every output row is defined.
* :func:`_gemm_persistent_kernel` (``GemmConfig.persistent``) does the same work with a few
  programs per SM, each looping over the routed tiles with a stride of the grid (the tiles'
  experts from one prefix sum per program; an exact loop bound read from ``offsets`` on the
  device, so no host sync and a routing-independent grid), the loop flattened so that the
  next tile's loads overlap this tile's epilogue. Its groups never mix experts
  (:func:`~.gemm_mainloop._expert_grouped_tile`). Each tile is computed by the same
  :func:`_gemm_tile`: the same arithmetic in both kernels, whatever the order.

:class:`GemmLaunch` is the launch prepared from the operands' layouts;
:func:`grouped_gemm_triton` the one-shot launcher.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import LaunchKey, ThinKernel, cdiv, cuda_index, next_pow2, shared_memory_optin
from .activation import gated_forward, plain_forward
from .gemm_mainloop import (
    _VARYING,
    IDENTITY,
    GemmConfig,
    GemmEpilogue,
    _a_descriptor,
    _a_rows,
    _acc,
    _beyond_tiles,
    _expert_ends,
    _expert_grouped_tile,
    _gate_up_descriptor,
    _gate_up_rows,
    _m_tiles,
    _mainloop,
    _precision,
    _program_tile,
    _tile_expert,
    _w_descriptor,
    _zero_rows,
    num_sms,
)
from .tma import TMA_DTYPES, bounded_rows_descriptor, layout_ok, store_rows, store_rows_part, tma_ok


@triton.jit
def _gemm_tile(
    a_ptr, a_desc, w_ptr, w_desc, out_ptr, z_ptr, out_desc, z_desc, bias_ptr, dest_to_src_ptr, e,
    first_row, row_end, n_tile, N_OUT, KD, T,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on, stride_zm,
    stride_be, stride_bn,
    ACT: tl.constexpr, GATED: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
    UP_OFFSET: tl.constexpr, GATE_SOFTCAP: tl.constexpr, UP_SOFTCAP: tl.constexpr,
    INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr,
    GATHER: tl.constexpr, STORE_PRE: tl.constexpr, ACC: tl.constexpr,
    DOT_PRECISION: tl.constexpr, A_DESC: tl.constexpr, W_DESC: tl.constexpr,
    W_KMAJOR: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, ONE_DOT: tl.constexpr, OUT_DESC: tl.constexpr, Z_DESC: tl.constexpr,
):  # fmt: skip
    """One ``[BLOCK_M, BLOCK_N]`` output tile of expert ``e``'s rows ``[first_row, row_end)``:
    main loop, bias, pre-activation, activation, store.

    ``OUT_DESC`` / ``Z_DESC``: ``out`` / ``z`` (``[M, 2, N_OUT]`` when gated) stored through
    bounded-rows descriptors (:mod:`.tma`) whose bound is ``row_end``: asynchronous copies,
    which the persistent kernel's next tile overlaps, instead of masked stores."""
    rows = first_row + tl.arange(0, BLOCK_M)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N_OUT
    row_ok = rows < row_end
    gate_rows, up_rows = _gate_up_rows(cols, N_OUT, GATED, INTERLEAVED)
    a_rows = _a_rows(dest_to_src_ptr, rows, row_ok, T, GATHER)
    acc, acc_up = _mainloop(
        a_ptr, a_desc, w_ptr, w_desc, e, first_row, a_rows, row_ok, gate_rows, up_rows, col_ok,
        n_tile * BLOCK_N, N_OUT, KD, stride_am, stride_ak, stride_we, stride_wn, stride_wk,
        GATED and not ONE_DOT, A_DESC, W_DESC, W_KMAJOR, EVEN_K, DOT_PRECISION, ACC, BLOCK_M,
        BLOCK_N, BLOCK_K, ONE_DOT,
    )  # fmt: skip
    if HAS_BIAS:
        b_base = bias_ptr + e.to(tl.int64) * stride_be
        acc += tl.load(b_base + gate_rows * stride_bn, mask=col_ok, other=0.0).to(ACC)[None, :]
        if GATED:
            acc_up += tl.load(b_base + up_rows * stride_bn, mask=col_ok, other=0.0).to(ACC)[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    n0 = n_tile * BLOCK_N
    # TMA coordinates are 32-bit (the launcher takes descriptors for fewer than 2^30 rows)
    size = (row_end - first_row).to(tl.int32)
    first = first_row.to(tl.int32)
    if STORE_PRE:
        z_rows = z_ptr + rows[:, None].to(tl.int64) * stride_zm
        zg = acc.to(z_ptr.dtype.element_ty)
        if Z_DESC and GATED:
            store_rows_part(z_desc, first, size, 0, n0, zg, BLOCK_M, BLOCK_N)
        elif Z_DESC:
            store_rows(z_desc, first, size, n0, zg, BLOCK_M, BLOCK_N)
        else:
            tl.store(z_rows + gate_rows[None, :], zg, mask=mask)
        acc = zg.to(ACC)
        if GATED:
            zu = acc_up.to(z_ptr.dtype.element_ty)
            if Z_DESC:
                store_rows_part(z_desc, first, size, 1, n0, zu, BLOCK_M, BLOCK_N)
            else:
                tl.store(z_rows + up_rows[None, :], zu, mask=mask)
            acc_up = zu.to(ACC)
    if GATED:
        h = gated_forward(acc, acc_up, ACT, ALPHA, LIMIT, UP_OFFSET, GATE_SOFTCAP, UP_SOFTCAP)
    else:
        h = plain_forward(acc, ACT)
    if OUT_DESC:
        store_rows(out_desc, first, size, n0, h, BLOCK_M, BLOCK_N)
    else:
        out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on
        tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=_VARYING)
def _gemm_kernel(
    a_ptr, a_desc, w_ptr, w_desc, out_ptr, z_ptr, bias_ptr, offsets_ptr, dest_to_src_ptr,
    E, M_ROWS, M_TILES, N_OUT, KD, T,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on, stride_zm,
    stride_be, stride_bn,
    ACT: tl.constexpr, GATED: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
    UP_OFFSET: tl.constexpr, GATE_SOFTCAP: tl.constexpr, UP_SOFTCAP: tl.constexpr,
    INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr,
    GATHER: tl.constexpr, STORE_PRE: tl.constexpr, ACC: tl.constexpr,
    DOT_PRECISION: tl.constexpr, A_DESC: tl.constexpr, W_DESC: tl.constexpr,
    W_KMAJOR: tl.constexpr, EVEN_K: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    m_tile, n_tile = _program_tile(M_TILES, N_OUT, BLOCK_N, GROUP_M)
    if _beyond_tiles(offsets_ptr, m_tile, E, M_ROWS, BLOCK_M):
        return
    e, first_row, row_end = _tile_expert(offsets_ptr, m_tile, E, BLOCK_M, E_POW2)
    if e >= E:  # past the experts: the dropped rows [offset[E], M) are zeros, then done
        _zero_rows(out_ptr, z_ptr, first_row, n_tile, M_ROWS, N_OUT, stride_om, stride_on,
                   stride_zm, GATED, STORE_PRE, BLOCK_M, BLOCK_N)  # fmt: skip
        return
    _gemm_tile(
        a_ptr, a_desc, w_ptr, w_desc, out_ptr, z_ptr, out_ptr, z_ptr, bias_ptr, dest_to_src_ptr,
        e, first_row, row_end, n_tile, N_OUT, KD, T, stride_am, stride_ak, stride_we, stride_wn,
        stride_wk, stride_om, stride_on, stride_zm, stride_be, stride_bn, ACT, GATED, ALPHA,
        LIMIT, UP_OFFSET, GATE_SOFTCAP, UP_SOFTCAP, INTERLEAVED, HAS_BIAS, GATHER, STORE_PRE,
        ACC, DOT_PRECISION, A_DESC, W_DESC, W_KMAJOR, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, 0, False,
        False,
    )  # fmt: skip


@triton.jit(do_not_specialize=_VARYING)
def _gemm_persistent_kernel(
    a_ptr, a_desc, w_ptr, w_desc, out_ptr, z_ptr, out_desc, z_desc, bias_ptr, offsets_ptr,
    dest_to_src_ptr,
    E, M_ROWS, M_TILES, N_OUT, KD, T,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on, stride_zm,
    stride_be, stride_bn,
    ACT: tl.constexpr, GATED: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
    UP_OFFSET: tl.constexpr, GATE_SOFTCAP: tl.constexpr, UP_SOFTCAP: tl.constexpr,
    INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr,
    GATHER: tl.constexpr, STORE_PRE: tl.constexpr, ACC: tl.constexpr,
    DOT_PRECISION: tl.constexpr, A_DESC: tl.constexpr, W_DESC: tl.constexpr,
    W_KMAJOR: tl.constexpr, EVEN_K: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, ONE_DOT: tl.constexpr, OUT_DESC: tl.constexpr,
    Z_DESC: tl.constexpr,
):  # fmt: skip
    """:func:`_gemm_kernel`'s work, done by a fixed number of programs (a few per SM).

    Program ``p`` of ``P`` takes tiles ``p, p + P, ...`` of the routed tiles, numbered in the
    expert-grouped order (:func:`_expert_grouped_tile`); the experts' tile ends are summed once per
    program, so the loop bound is exact (``routed m-tiles x n-tiles``, read from ``offsets``
    on the device: no host sync, the grid does not depend on the routing) and the loop body has
    no branch, for the compiler to flatten and software-pipeline across tiles. The dropped rows'
    zero tiles follow in a second loop, in reverse program order (the programs that got one
    tile fewer above take them first). ``M_TILES`` (the per-tile kernel's bound) is unused.
    ``ONE_DOT``: a gated ``W1``'s gate and up rows through one TMA box and one accumulator
    (see :func:`_mainloop` and the launcher's note).
    """
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    ex = tl.arange(0, E_POW2)
    ends = _expert_ends(offsets_ptr, E, ex, BLOCK_M)
    routed_tiles = tl.max(ends, axis=0)
    n_tiles = tl.cdiv(N_OUT, BLOCK_N)
    for tile in tl.range(pid, routed_tiles * n_tiles, programs, flatten=True,
                         warp_specialize=WARP_SPECIALIZE):  # fmt: skip
        e, first_row, row_end, n_tile = _expert_grouped_tile(
            offsets_ptr, ends, tile, n_tiles, E, ex, BLOCK_M, GROUP_M, E_POW2
        )
        _gemm_tile(
            a_ptr, a_desc, w_ptr, w_desc, out_ptr, z_ptr, out_desc, z_desc, bias_ptr,
            dest_to_src_ptr, e, first_row, row_end, n_tile, N_OUT, KD, T, stride_am, stride_ak,
            stride_we, stride_wn, stride_wk, stride_om, stride_on, stride_zm, stride_be,
            stride_bn, ACT, GATED, ALPHA, LIMIT, UP_OFFSET, GATE_SOFTCAP, UP_SOFTCAP,
            INTERLEAVED, HAS_BIAS, GATHER, STORE_PRE, ACC, DOT_PRECISION, A_DESC, W_DESC,
            W_KMAJOR, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, ONE_DOT, OUT_DESC, Z_DESC,
        )  # fmt: skip
    routed = tl.load(offsets_ptr + E)
    zero_tiles = tl.cdiv(M_ROWS - routed, BLOCK_M) * n_tiles
    for tile in range(programs - 1 - pid, zero_tiles, programs):
        _zero_rows(out_ptr, z_ptr, routed + (tile // n_tiles) * BLOCK_M, tile % n_tiles, M_ROWS,
                   N_OUT, stride_om, stride_on, stride_zm, GATED, STORE_PRE, BLOCK_M,
                   BLOCK_N)  # fmt: skip


# --------------------------------------------------------------------------- launchers
_GEMM = ThinKernel(_gemm_kernel)
_GEMM_PERSISTENT = ThinKernel(_gemm_persistent_kernel)


def _store_descriptors(out, z, epilogue: GemmEpilogue, cfg: GemmConfig, n_out: int,
                       stage_bytes: int):  # fmt: skip
    """``(out_desc, z_desc)`` for the persistent kernel's TMA stores, or ``(None, None)``
    where shared memory cannot hold the copies' staging beside the main loop's
    ``num_stages`` buffers (``stage_bytes`` each): one output tile, two when ``z``'s gate and
    up halves are stored too (``scripts/kernel_resources.py``: 213080 B for 3 stages of
    128x256x64 or of gated 128x128x64 with ``z``, no spills; 4 stages do not fit an H100).
    Only 16-bit tensors TMA can address, ``z`` not in the interleaved gate/up layout, fewer
    than 2^30 rows (32-bit coordinates)."""
    tile = cfg.block_m * cfg.block_n * out.element_size()
    staging = 2 * tile if z is not None and epilogue.gated else tile
    if cfg.num_stages * stage_bytes + staging + _SMEM_RESERVED > _smem_per_block(out.device):
        return None, None
    if not (out.dtype in TMA_DTYPES and tma_ok(out) and out.shape[0] < 2**30):
        return None, None
    if z is None:
        return bounded_rows_descriptor(out, (cfg.block_m, cfg.block_n)), None
    if z.dtype not in TMA_DTYPES or (epilogue.gated and epilogue.interleaved):
        return None, None
    if epilogue.gated:  # [M, 2, N_OUT]: a partial column tile of the gate half stops at N_OUT
        if not layout_ok(z, (z.stride(0), n_out * z.stride(1), z.stride(1))):
            return None, None
        z_desc = bounded_rows_descriptor(z, (cfg.block_m, 1, cfg.block_n), parts=2)
    elif tma_ok(z):
        z_desc = bounded_rows_descriptor(z, (cfg.block_m, cfg.block_n))
    else:
        return None, None
    return bounded_rows_descriptor(out, (cfg.block_m, cfg.block_n)), z_desc


#: Shared memory a kernel takes beside its buffers (barriers, alignment).
_SMEM_RESERVED = 1 << 10


def _smem_per_block(device: torch.device) -> int:
    """Shared memory one block may take on ``device`` (opt-in maximum; 0 off CUDA)."""
    if device.type != "cuda":
        return 0
    return shared_memory_optin(cuda_index(device))


#: ``GemmLaunch._descriptors``'s answer without TMA.
_NO_DESCRIPTORS = (None, None, False, 0, None, None)


class GemmLaunch:
    """GEMM1 / GEMM2's launch prepared from the operands' layout: dtypes, strides, shapes
    but ``M``, the config and epilogue, which optional operands there are. What a call of
    :func:`grouped_gemm_triton` works out before launching, kept by
    :func:`moe_route.grouped_gemm`'s call memo for every later call of that signature. The
    TMA descriptors (``cfg.use_tma``) depend on the addresses too: they are built per call.

    ``out`` / ``pre_activation``: given as tensors, or as ``None`` for a contiguous
    ``[M, N_out]`` output (what the callers allocate) and no pre-activation.
    """

    __slots__ = ("E", "cfg", "cx", "epilogue", "gather", "kd", "key", "n_out", "sms",
                 "static", "strides")  # fmt: skip

    def __init__(self, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None,
                 cfg: GemmConfig, epilogue: GemmEpilogue, bias: torch.Tensor | None,
                 gather: bool, pre_activation: torch.Tensor | None, allow_tf32: bool):  # fmt: skip
        E, n_w, kd = w.shape
        n_out = n_w // 2 if epilogue.gated else n_w
        self.E, self.kd, self.n_out, self.cfg, self.epilogue = E, kd, n_out, cfg, epilogue
        self.gather = gather
        out_dtype, so = (a.dtype, (n_out, 1)) if out is None else (out.dtype, out.stride())
        sz0 = so[0] if pre_activation is None else pre_activation.stride(0)
        # each stride tuple read once (a Tensor.stride() call per element costs more)
        sa, sw = a.stride(), w.stride()
        sb = bias.stride() if bias is not None else (0, 0)
        b_dtype = out_dtype if bias is None else bias.dtype
        store_pre = pre_activation is not None
        self.static = (
            cfg, epilogue, a.dtype, w.dtype, out_dtype, b_dtype, sa, sw, so, sz0,
            sb if bias is not None else None, gather, store_pre, allow_tf32, E, n_out, kd,
        )  # fmt: skip
        self.strides = (*sa, *sw, *so, sz0, *sb)
        self.cx = dict(
            ACT=epilogue.act, GATED=epilogue.gated, ALPHA=epilogue.alpha, LIMIT=epilogue.limit,
            UP_OFFSET=epilogue.up_offset, GATE_SOFTCAP=epilogue.gate_softcap,
            UP_SOFTCAP=epilogue.up_softcap, INTERLEAVED=epilogue.interleaved,
            HAS_BIAS=bias is not None, GATHER=gather, STORE_PRE=store_pre, ACC=_acc(a.dtype),
            DOT_PRECISION=_precision(a.dtype, allow_tf32), EVEN_K=kd % cfg.block_k == 0,
            E_POW2=next_pow2(E + 1), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )  # fmt: skip
        self.sms = cfg.persistent * num_sms(a.device) if cfg.persistent else 0
        # without TMA nothing depends on the addresses: one key for every call
        self.key = None if cfg.use_tma else LaunchKey((*self.static, False, False, False, 0,
                                                       False, False))  # fmt: skip
        # (the key's last six fields: which descriptors a call has, as in __call__)

    def __call__(
        self, a, w, offsets, out, bias=None, dest_to_src=None, num_rows=None, pre_activation=None
    ) -> None:
        E, n_out, kd, cfg = self.E, self.n_out, self.kd, self.cfg
        M = a.shape[0] if num_rows is None else num_rows
        if M == 0 or n_out == 0:
            return
        bm = cfg.block_m
        key, descs = self.key, _NO_DESCRIPTORS
        if key is None:
            descs = self._descriptors(a, w, out, pre_activation)
            a_desc, w_desc, w_kmajor, one_dot, out_desc, z_desc = descs
            key = (*self.static, a_desc is not None, w_desc is not None, w_kmajor, one_dot,
                   out_desc is not None, z_desc is not None)  # fmt: skip
        a_desc, w_desc, _, _, out_desc, z_desc = descs
        m_tiles = _m_tiles(M, E, bm)
        tiles = m_tiles * cdiv(n_out, cfg.block_n)
        z = pre_activation if pre_activation is not None else out
        b = bias if bias is not None else out
        kernel, grid, extra = _GEMM, tiles, ()
        if cfg.persistent:
            kernel, grid = _GEMM_PERSISTENT, min(tiles, self.sms)
            extra = (out_desc if out_desc is not None else out,
                     z_desc if z_desc is not None else z)  # fmt: skip
        kernel.launch(
            key, (grid,),
            (
                a, a_desc if a_desc is not None else a, w, w_desc if w_desc is not None else w,
                out, z, *extra, b, offsets, dest_to_src if self.gather else offsets, E, M,
                m_tiles, n_out, kd, a.shape[0], *self.strides,
            ),
            lambda: self.constexprs(descs),
        )  # fmt: skip

    def _descriptors(self, a, w, out, pre_activation) -> tuple:
        """``(a_desc, w_desc, w_kmajor, one_dot, out_desc, z_desc)`` for this call's tensors."""
        cfg, epilogue, n_out = self.cfg, self.epilogue, self.n_out
        bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
        a_desc = None if self.gather else _a_descriptor(a, bm, bk, cfg.use_tma)
        w_desc, w_kmajor, one_dot = None, False, 0
        if cfg.persistent and cfg.use_tma and epilogue.gated:
            # One accumulator of twice the width: two make ptxas serialise the wgmma
            # instructions (docs/decisions.md, "Gated GEMM1 accumulator").
            w_desc, one_dot = _gate_up_descriptor(w, n_out, bn, bk, epilogue.interleaved)
        if w_desc is None and not (epilogue.gated and epilogue.interleaved):
            w_desc, w_kmajor = _w_descriptor(w, bn, bk, cfg.use_tma)
        out_desc = z_desc = None
        if cfg.persistent and cfg.tma_store and cfg.use_tma:
            stage_bytes = (bm + (2 if epilogue.gated else 1) * bn) * bk * a.element_size()
            out_desc, z_desc = _store_descriptors(out, pre_activation, epilogue, cfg, n_out,
                                                  stage_bytes)  # fmt: skip
        return a_desc, w_desc, w_kmajor, one_dot, out_desc, z_desc

    def constexprs(self, descs: tuple) -> dict:
        a_desc, w_desc, w_kmajor, one_dot, out_desc, z_desc = descs
        cx = dict(self.cx, A_DESC=a_desc is not None, W_DESC=w_desc is not None,
                  W_KMAJOR=w_kmajor)  # fmt: skip
        cfg = self.cfg
        if cfg.persistent:
            # the automatic warp specialisation wants every load of the loop through TMA
            cx["WARP_SPECIALIZE"] = cfg.warp_specialize and cx["A_DESC"] and cx["W_DESC"]
            cx["ONE_DOT"] = one_dot
            cx["OUT_DESC"] = out_desc is not None
            cx["Z_DESC"] = z_desc is not None
        return cx


def grouped_gemm_triton(
    a: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor,
    cfg: GemmConfig,
    *,
    epilogue: GemmEpilogue = IDENTITY,
    bias: torch.Tensor | None = None,
    dest_to_src: torch.Tensor | None = None,
    num_rows: int | None = None,
    pre_activation: torch.Tensor | None = None,
    allow_tf32: bool = False,
) -> None:
    """``out[d] = act(a[d] @ w[e].T + bias[e])`` for the rows ``d`` of each expert ``e``.

    Args:
        a: ``[M, Kd]`` permuted rows, or ``x [T, Kd]`` read through ``dest_to_src`` (gather).
        w: ``[E, N, Kd]`` (``N = 2*N_out`` for gated activations), any strides.
        offsets: ``expert_first_token_offset [E+1]`` int64.
        out: ``[M, N_out]``.
        dest_to_src: ``expanded_dest_row_to_expanded_source_row``: ``a`` is then ``x`` and
            row ``d`` reads ``x[dest_to_src[d] mod T]`` (``x_perm`` never exists).
        num_rows: ``M = T*K`` (default ``a.shape[0]``).
        pre_activation: ``[M, N]`` contiguous rows; also write GEMM1's pre-activation there.

    ``cfg.persistent``: the persistent kernel on ``cfg.persistent * num_sms`` programs (at most
    the per-tile grid), the same output.
    """
    launch = GemmLaunch(a, w, out, cfg, epilogue, bias, dest_to_src is not None, pre_activation,
                        allow_tf32)  # fmt: skip
    launch(a, w, offsets, out, bias, dest_to_src, num_rows, pre_activation)
