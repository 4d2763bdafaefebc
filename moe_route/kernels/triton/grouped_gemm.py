"""Grouped GEMM over expert-grouped rows, with fused activation, bias, gather and finalize.

One launch covers every expert. Rows of expert ``e`` are ``[offset[e], offset[e+1])`` of the
permuted order; they are cut into ``BLOCK_M``-row *m-tiles*, numbered expert after expert.
:func:`_expert_tile_start_kernel` turns ``expert_first_token_offset`` into ``tile_start[e]``
(first m-tile of expert ``e``; ``tile_start[E]`` = number of m-tiles) on the device, and each
GEMM program finds its expert by a binary search of ``tile_start``. The grid is an upper bound
that depends only on ``T*K`` and the tile sizes (``cdiv(T*K, BLOCK_M) + E`` m-tiles), never on
the routing: programs past the last real m-tile exit at once, and an expert with no rows owns
no m-tile, so it costs nothing. No host synchronisation, no per-expert launch.

Program ``pid`` computes the ``[BLOCK_M, BLOCK_N]`` output tile ``(m_tile, n_tile)``, m-tiles
grouped ``GROUP_M`` at a time so that consecutive programs reuse the same weight columns in L2.

Epilogues (constexpr-selected):

* ``ACTIVATION``: identity / silu / gelu (erf) / relu, or the gated swiglu / geglu, for which
  the program computes the gate and the up columns of its tile with two accumulators over the
  same ``A`` tile and writes only the ``I`` activated columns. ``INTERLEAVED`` picks the gate/up
  row layout of ``W1`` (gate rows then up rows, or alternating).
* ``GATHER``: ``A`` rows are read from ``x [T, K]`` through
  ``expanded_dest_row_to_expanded_source_row`` (``t = s mod T``): ``x_perm`` is never written.
* ``FINALIZE`` (GEMM2), the epilogue-fused finalize, in one of two modes:

  - ``ORDERED`` (deterministic): the tile stores its rows of ``y`` (rounded to the output
    dtype, as the standalone GEMM2 does) to a scratch ``[T*K, H]`` buffer, then each row bumps
    the arrival counter of its ``(token, column tile)``. The row whose bump completes the
    token (counter reaches its number of routed slots) reduces the token's rows in ``k`` order,
    ``Σ_k w[t,k]·y[dest(k*T+t)]`` in float32, adds ``bias`` once and writes ``out[t]``: the
    arithmetic of the standalone finalize kernel, in the same order, so the bits do not depend
    on which tile arrives last. A tile compacts its last-arriving rows before reducing them.
    The aim is to overlap the finalize's reads with other programs' MMAs instead of a separate
    memory-bound launch; it has not yet beaten that launch (``arch.FUSED_FINALIZE_WINS``).
    Tokens with every slot dropped get ``bias`` (or zeros) from the programs past the last
    expert.
  - atomic: scale each row by its router weight and ``atomic_add`` it into a float32
    ``[T, H]`` output (the permuted output is not written; the sum order varies run to run).
* ``STORE_PRE`` (GEMM1 when training): also write the pre-activation ``z`` (after the bias,
  rounded to the input dtype) and compute the activation from the rounded ``z``, so that the
  backward, which recomputes ``h = act(z)`` from the saved ``z``, sees the forward's bits.
* ``ACT_BWD`` (backward of GEMM2 and of the activation): the product is
  ``g[d] = dout[t] @ W2[e]`` (``A`` gathered from ``dout``, ``W = W2`` seen as ``[E, I, H]``).
  The epilogue recomputes ``h[d] = act(z[d])`` and writes ``w[t,k]·h[d]`` (for ``dW2``), the partial
  router-weight gradient ``<g[d], h[d]>`` of its column tile to ``partial[d, n_tile]`` (summed
  in fixed order by :mod:`.weight_grad`), scales ``g`` by the router weight and writes the
  pre-activation gradient ``dz`` (gate and up columns in ``W1``'s layout).

Without ``FINALIZE`` the m-tiles after the last expert write zeros to the dropped rows
``[offset[E], M)``, so every output row is defined.

``W`` may be stored n-major (``[E, N, Kd]`` with unit stride along ``Kd``, the usual weight) or
k-major (unit stride along ``N``, e.g. ``W2.transpose(1, 2)`` in the backward); TMA reads
either (``W_KMAJOR``). float64 (for ``gradcheck``) multiplies on the FMA units (``"fma"``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...arch import compute_capability

ACT_CODES = {"identity": 0, "silu": 1, "gelu": 2, "relu": 3, "swiglu": 4, "geglu": 5}
# Rows per step of the ordered fused finalize's reduction (see the kernel).
RED_ROWS = 16


@triton.jit
def _expert_tile_start_kernel(
    offsets_ptr, tile_start_ptr, E, BLOCK_M: tl.constexpr, NUM: tl.constexpr
):
    e = tl.arange(0, NUM)
    lo = tl.load(offsets_ptr + e, mask=e < E, other=0)
    hi = tl.load(offsets_ptr + e + 1, mask=e < E, other=0)
    tiles = ((hi - lo + BLOCK_M - 1) // BLOCK_M).to(tl.int32)
    tl.store(tile_start_ptr + e, tl.cumsum(tiles, 0) - tiles, mask=e <= E)


@triton.jit
def _apply_activation(x, ACTIVATION: tl.constexpr):
    if ACTIVATION == 1 or ACTIVATION == 4:
        x = x * tl.sigmoid(x)
    elif ACTIVATION == 2 or ACTIVATION == 5:
        x = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACTIVATION == 3:
        x = tl.maximum(x, 0.0)
    return x


@triton.jit
def _activation_grad(x, ACTIVATION: tl.constexpr):
    """d act / dx at ``x`` (relu' (0) = 0, as torch)."""
    if ACTIVATION == 1 or ACTIVATION == 4:
        s = tl.sigmoid(x)
        d = s * (1.0 + x * (1.0 - s))
    elif ACTIVATION == 2 or ACTIVATION == 5:
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        d = cdf + x * tl.exp(-0.5 * x * x) * 0.3989422804014327
    elif ACTIVATION == 3:
        d = tl.where(x > 0.0, 1.0, 0.0).to(x.dtype)
    else:
        d = tl.full(x.shape, 1.0, x.dtype)
    return d


@triton.jit
def _routed_slots(expert_for_src_ptr, t, mask, T, TOP_K: tl.constexpr):
    """Routed (not dropped) slots of each token ``t``: how many rows the finalize sums."""
    n = tl.zeros(t.shape, dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        n += (tl.load(expert_for_src_ptr + j * T + t, mask=mask, other=-1) >= 0).to(tl.int32)
    return n


@triton.jit
def _store_final(final_ptr, bias_ptr, t, cols, row_mask, col_mask, acc, stride_ft, stride_fh,
                 stride_bt, stride_bh, HAS_BIAS: tl.constexpr):  # fmt: skip
    """``out[t, cols] = acc + bias[t, cols]``, rounded once (the standalone finalize's tail)."""
    mask = row_mask[:, None] & col_mask[None, :]
    if HAS_BIAS:
        b = tl.load(bias_ptr + t[:, None] * stride_bt + cols[None, :] * stride_bh, mask=mask)
        acc += b.to(acc.dtype)
    ptrs = final_ptr + t[:, None] * stride_ft + cols[None, :] * stride_fh
    tl.store(ptrs, acc.to(final_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mma(a, b, acc, DOT_PRECISION: tl.constexpr):
    """``acc + a @ b``; ``"fma"`` (float64) multiplies on the CUDA cores."""
    # One return after the branch: a `return` inside a constexpr `if` does not stop the
    # compiler from generating (and rejecting) the code after it.
    if DOT_PRECISION == "fma":
        out = acc + tl.sum(a[:, :, None].to(acc.dtype) * b[None, :, :].to(acc.dtype), axis=1)
    else:
        out = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return out


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    a_desc,
    w_desc,
    out_ptr,
    bias_ptr,
    offsets_ptr,
    tile_start_ptr,
    dest_to_src_ptr,
    weights_ptr,
    z_ptr,
    dz_ptr,
    partial_ptr,
    final_ptr,
    counter_ptr,
    src_to_dest_ptr,
    expert_for_src_ptr,
    final_bias_ptr,
    E,
    M_ROWS,
    M_TILES,
    N_OUT,
    KD,
    T,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    stride_be,
    stride_bn,
    stride_wt,
    stride_wkk,
    stride_zm,
    stride_ft,
    stride_fh,
    stride_fbt,
    stride_fbh,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    TWO_PRODUCTS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATHER: tl.constexpr,
    FINALIZE: tl.constexpr,
    ORDERED: tl.constexpr,
    FINAL_BIAS: tl.constexpr,
    TOP_K: tl.constexpr,
    STORE_PRE: tl.constexpr,
    ACT_BWD: tl.constexpr,
    ACC: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    A_DESC: tl.constexpr,
    W_DESC: tl.constexpr,
    W_KMAJOR: tl.constexpr,
    LOG2_E: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    RED_M: tl.constexpr,
):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N_OUT, BLOCK_N)
    in_group = GROUP_M * n_tiles
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(M_TILES - first_m, GROUP_M)
    m_tile = first_m + (pid % in_group) % group_size
    n_tile = (pid % in_group) // group_size
    routed_tiles = tl.load(tile_start_ptr + E)
    if m_tile >= routed_tiles:
        # Past the experts: the dropped rows [offset[E], M) are written as zeros, then done.
        rows = tl.load(offsets_ptr + E) + (m_tile - routed_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        if FINALIZE:
            if ORDERED:  # a token with no routed slot: out[t] = bias[t] (or 0), via its k=0 row
                src = tl.load(dest_to_src_ptr + rows, mask=rows < M_ROWS, other=T)
                t = (src % T).to(tl.int64)
                lone = (src < T) & (_routed_slots(expert_for_src_ptr, t, src < T, T, TOP_K) == 0)
                _store_final(final_ptr, final_bias_ptr, t, cols, lone, cols < N_OUT,
                             tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC), stride_ft, stride_fh,
                             stride_fbt, stride_fbh, FINAL_BIAS)  # fmt: skip
            return
        zero_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on
        zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=out_ptr.dtype.element_ty)
        zero_mask = (rows[:, None] < M_ROWS) & (cols[None, :] < N_OUT)
        tl.store(zero_ptrs, zeros, mask=zero_mask)
        if STORE_PRE or ACT_BWD:  # z or dz too (all 2*N_OUT columns when gated, any layout)
            zero_base = dz_ptr if ACT_BWD else z_ptr
            z_zero = zero_base + rows[:, None].to(tl.int64) * stride_zm + cols[None, :]
            tl.store(z_zero, zeros, mask=zero_mask)
            if GATED:
                tl.store(z_zero + N_OUT, zeros, mask=zero_mask)
        return

    # Expert of this m-tile: the last e with tile_start[e] <= m_tile (it has rows).
    # Invariant: tile_start[lo] <= m_tile < tile_start[hi]; LOG2_E halvings reach hi = lo + 1.
    lo = tl.zeros([], dtype=tl.int32)
    hi = tl.zeros([], dtype=tl.int32) + E
    for _ in tl.static_range(LOG2_E):
        mid = (lo + hi) // 2
        right = tl.load(tile_start_ptr + mid) <= m_tile
        active = hi - lo > 1
        lo = tl.where(active & right, mid, lo)
        hi = tl.where(active & ~right, mid, hi)
    e = lo
    row_end = tl.load(offsets_ptr + e + 1)
    first_row = tl.load(offsets_ptr + e) + (m_tile - tl.load(tile_start_ptr + e)) * BLOCK_M
    rows = first_row + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    if GATHER:
        a_rows = (tl.load(dest_to_src_ptr + rows, mask=row_ok, other=0) % T).to(tl.int64)
    else:
        a_rows = rows

    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N_OUT
    if GATED:
        if INTERLEAVED:
            gate_rows = 2 * cols
            up_rows = 2 * cols + 1
        else:
            gate_rows = cols
            up_rows = cols + N_OUT
    else:
        gate_rows = cols
        up_rows = cols
    # GATED / INTERLEAVED describe z's columns; with ACT_BWD the product has one operand, W
    # columns `cols`, and TWO_PRODUCTS (the forward's gate and up accumulators) is off.
    w_rows = cols if ACT_BWD else gate_rows
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak
    w_base = w_ptr + e.to(tl.int64) * stride_we
    g_ptrs = w_base + w_rows[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk
    u_ptrs = w_base + up_rows[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    # With A_DESC / W_DESC the tiles come through TMA tensor descriptors (Hopper): rows past
    # the expert or the matrix are read (or zero-filled) but never stored.
    n0 = n_tile * BLOCK_N
    for k0 in range(0, KD, BLOCK_K):
        k_ok = k0 + ks < KD
        if A_DESC:
            a = a_desc.load([first_row.to(tl.int32), k0])
        elif EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if W_DESC and W_KMAJOR:
            wg = tl.reshape(w_desc.load([e, k0, n0]), [BLOCK_K, BLOCK_N])
        elif W_DESC:
            wg = tl.reshape(w_desc.load([e, n0, k0]), [BLOCK_N, BLOCK_K]).T
        elif EVEN_K:
            wg = tl.load(g_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            wg = tl.load(g_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc = _mma(a, wg, acc, DOT_PRECISION)
        if TWO_PRODUCTS:
            if W_DESC and W_KMAJOR:  # concat layout: the up rows start at N_OUT
                wu = tl.reshape(w_desc.load([e, k0, N_OUT + n0]), [BLOCK_K, BLOCK_N])
            elif W_DESC:
                wu = tl.reshape(w_desc.load([e, N_OUT + n0, k0]), [BLOCK_N, BLOCK_K]).T
            elif EVEN_K:
                wu = tl.load(u_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                wu = tl.load(u_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            acc_up = _mma(a, wu, acc_up, DOT_PRECISION)
            u_ptrs += BLOCK_K * stride_wk
        a_ptrs += BLOCK_K * stride_ak
        g_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:
        b_base = bias_ptr + e.to(tl.int64) * stride_be
        acc += tl.load(b_base + gate_rows * stride_bn, mask=col_ok, other=0.0).to(ACC)[None, :]
        if GATED:
            acc_up += tl.load(b_base + up_rows * stride_bn, mask=col_ok, other=0.0).to(ACC)[None, :]

    mask = row_ok[:, None] & col_ok[None, :]
    z_rows = z_ptr + rows[:, None].to(tl.int64) * stride_zm
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on
    if ACT_BWD:
        # acc = g = dout[t] @ W2[e] for the I-columns `cols`; z holds GEMM1's pre-activation.
        src = tl.load(dest_to_src_ptr + rows, mask=row_ok, other=0)
        t = (src % T).to(tl.int64)
        k = src // T
        wt = tl.load(weights_ptr + t * stride_wt + k * stride_wkk, mask=row_ok, other=0.0)
        zg = tl.load(z_rows + gate_rows[None, :], mask=mask, other=0.0).to(ACC)
        act = _apply_activation(zg, ACTIVATION)
        if GATED:
            zu = tl.load(z_rows + up_rows[None, :], mask=mask, other=0.0).to(ACC)
            h = (act * zu).to(out_ptr.dtype.element_ty)  # the forward's h, bit for bit
        else:
            h = act.to(out_ptr.dtype.element_ty)
        # w·h for dW2 = Σ dout[t]^T (w h): the weight-gradient kernel then scales nothing.
        tl.store(out_ptrs, (h.to(ACC) * wt.to(ACC)[:, None]).to(out_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip
        part = tl.sum(acc * h.to(ACC), axis=1)  # this tile's share of <dout[t] W2[e], h[d]>
        tl.store(partial_ptr + rows.to(tl.int64) * n_tiles + n_tile, part, mask=row_ok)
        dh = acc * wt.to(ACC)[:, None]
        dact = _activation_grad(zg, ACTIVATION)
        dz_rows = dz_ptr + rows[:, None].to(tl.int64) * stride_zm
        if GATED:
            tl.store(
                dz_rows + gate_rows[None, :],
                (dh * zu * dact).to(dz_ptr.dtype.element_ty),
                mask=mask,
            )
            tl.store(dz_rows + up_rows[None, :], (dh * act).to(dz_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(
                dz_rows + gate_rows[None, :], (dh * dact).to(dz_ptr.dtype.element_ty), mask=mask
            )
        return

    if STORE_PRE:
        zg_r = acc.to(z_ptr.dtype.element_ty)
        tl.store(z_rows + gate_rows[None, :], zg_r, mask=mask)
        acc = zg_r.to(ACC)
        if GATED:
            zu_r = acc_up.to(z_ptr.dtype.element_ty)
            tl.store(z_rows + up_rows[None, :], zu_r, mask=mask)
            acc_up = zu_r.to(ACC)
    acc = _apply_activation(acc, ACTIVATION)
    if GATED:
        acc = acc * acc_up

    if FINALIZE and ORDERED:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        # Every thread's stores of this tile are done before any row announces its arrival;
        # the counter's acq_rel then publishes them to, and orders them before, the last
        # arriver's reads (which go to L2: cache_modifier .cg, never a stale L1 line).
        tl.debug_barrier()
        src = tl.load(dest_to_src_ptr + rows, mask=row_ok, other=0)
        t = (src % T).to(tl.int64)
        arrived = tl.atomic_add(
            counter_ptr + t * n_tiles + n_tile, 1, mask=row_ok, sem="acq_rel", scope="gpu"
        )
        last = row_ok & (arrived == _routed_slots(expert_for_src_ptr, t, row_ok, T, TOP_K) - 1)
        n_last = tl.sum(last.to(tl.int32), axis=0)
        if n_last > 0:
            tl.debug_barrier()
            # About one row in K arrives last. Compact those rows to the front (a sort of the
            # row positions, last rows first) and reduce them RED_M at a time, so the K-row
            # gather costs registers and instructions for those rows only, not for the tile.
            # NOTE: the first version gathered over the whole tile, K unrolled: 0.31-0.98x the
            # standalone pair on an H100 (bench/data/fused_sweep_h100.csv), and ptxas (sm_90a,
            # Triton 3.5.1) spilled 1.4-5.8 KB per thread. Compacted: 155 registers, no spill
            # at 128x128 (scripts/kernel_resources.py); not yet timed on a GPU.
            pos = tl.arange(0, BLOCK_M)
            order = tl.sort(tl.where(last, pos, pos + BLOCK_M)) % BLOCK_M
            t_groups = tl.reshape(tl.gather(t, order, 0), [BLOCK_M // RED_M, RED_M])
            group = tl.arange(0, BLOCK_M // RED_M)
            for g in range(0, tl.cdiv(n_last, RED_M)):
                t_g = tl.sum(tl.where((group == g)[:, None], t_groups, 0), axis=0)
                ok_g = g * RED_M + tl.arange(0, RED_M) < n_last
                red = tl.zeros([RED_M, BLOCK_N], dtype=ACC)
                for j in range(TOP_K):  # the standalone kernel's sum, term by term
                    s_j = j * T + t_g
                    ok = ok_g & (tl.load(expert_for_src_ptr + s_j, mask=ok_g, other=-1) >= 0)
                    d_j = tl.load(src_to_dest_ptr + s_j, mask=ok, other=0).to(tl.int64)
                    w_j = tl.load(
                        weights_ptr + t_g * stride_wt + j * stride_wkk, mask=ok, other=0.0
                    )
                    y_ptrs = out_ptr + d_j[:, None] * stride_om + cols[None, :] * stride_on
                    y_ok = ok[:, None] & col_ok[None, :]
                    y_j = tl.load(y_ptrs, mask=y_ok, other=0.0, cache_modifier=".cg")
                    red += tl.where(ok[:, None], w_j.to(ACC)[:, None] * y_j.to(ACC), 0.0)
                _store_final(final_ptr, final_bias_ptr, t_g, cols, ok_g, col_ok, red, stride_ft,
                             stride_fh, stride_fbt, stride_fbh, FINAL_BIAS)  # fmt: skip
    elif FINALIZE:
        src = tl.load(dest_to_src_ptr + rows, mask=row_ok, other=0)
        t = (src % T).to(tl.int64)
        k = src // T
        w = tl.load(weights_ptr + t * stride_wt + k * stride_wkk, mask=row_ok, other=0.0)
        acc = acc * w.to(ACC)[:, None]
        tl.atomic_add(out_ptr + t[:, None] * stride_om + cols[None, :] * stride_on, acc, mask=mask)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


class FinalizeEpilogue(NamedTuple):
    """What GEMM2's epilogue needs to finalize into ``out [T, H]`` itself.

    ``ordered=True`` is the deterministic mode (arrival counters, the last row of each token
    reduces the token in ``k`` order, the bits of the standalone kernel for the same ``y``);
    ``ordered=False`` adds ``w[t,k]·y[d]`` into the launcher's float32 ``out`` with atomics
    (``out``, ``bias``, ``src_to_dest`` and ``expert_for_src`` here are then unused).
    """

    #: ``[T, K]`` router weights (float32 or the activations' dtype).
    topk_weights: torch.Tensor
    #: ``[T*K] int32`` ``expanded_source_row_to_expanded_dest_row``.
    src_to_dest: torch.Tensor
    #: ``[T*K] int32`` ``expert_for_source_row``.
    expert_for_src: torch.Tensor
    #: ``[T, H]`` result, in the activations' dtype (ordered mode).
    out: torch.Tensor
    #: optional ``[H]`` or ``[T, H]`` added once per token (ordered mode).
    bias: torch.Tensor | None
    ordered: bool


def _pick_config(rows_per_expert: float, n_out: int, kd: int, gated: bool, dtype: torch.dtype):
    """Tile sizes by problem size (no autotuning: nothing to sync or recompile per T).

    Returns ``(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)``.
    """
    if dtype == torch.float64:  # gradcheck sizes; FMA products, small tiles
        return 16, 32, 16, 1, 4, 1
    big_k = 64 if dtype != torch.float32 else 32
    if rows_per_expert <= 16:
        return 16, 64, 128 if dtype != torch.float32 else 64, 1, 4, 4
    if rows_per_expert <= 64:
        return 64, 64 if gated else 128, big_k, 4, 4, 4
    if gated:
        return 128, 128, big_k, 8, 8, 3
    return 128, 256 if dtype != torch.float32 else 128, big_k, 8, 8, 3


def _tma_ok(t: torch.Tensor) -> bool:
    es = t.element_size()
    return (
        t.stride(-1) == 1
        and t.data_ptr() % 16 == 0
        and all((st * es) % 16 == 0 for st in t.stride()[:-1])
    )


def _descriptors(a, w, bm, bn, bk, gather, interleaved, use_tma):
    """TMA descriptors for ``a`` (``[M, Kd]``) and ``w`` (``[E, N, Kd]``, n- or k-major).

    Returns ``(a_desc, w_desc, w_kmajor)``; a descriptor is ``None`` where TMA cannot be used.
    """
    if use_tma is None:
        cc = compute_capability(a.device)  # cached per device, honours MOE_ROUTE_ARCH
        use_tma = cc is not None and cc >= 90
    if not use_tma or a.dtype not in (torch.float16, torch.bfloat16):
        return None, None, False
    from triton.tools.tensor_descriptor import TensorDescriptor

    a_desc = None if gather or not _tma_ok(a) else TensorDescriptor.from_tensor(a, [bm, bk])
    if interleaved:
        return a_desc, None, False
    if _tma_ok(w):
        return a_desc, TensorDescriptor.from_tensor(w, [1, bn, bk]), False
    wt = w.transpose(1, 2)  # k-major storage, e.g. W2.transpose(1, 2) in the backward
    if _tma_ok(wt):
        return a_desc, TensorDescriptor.from_tensor(wt, [1, bk, bn]), True
    return a_desc, None, False


def grouped_gemm_triton(
    a: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    activation: str = "identity",
    interleaved: bool = False,
    dest_to_src: torch.Tensor | None = None,
    gather: bool = False,
    finalize: FinalizeEpilogue | None = None,
    num_rows: int | None = None,
    pre_activation: torch.Tensor | None = None,
    act_backward: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    allow_tf32: bool = False,
    config: tuple | None = None,
    use_tma: bool | None = None,
) -> torch.Tensor | None:
    """``out[d] = act(a[d] @ w[e].T + bias[e])`` for the rows ``d`` of each expert ``e``.

    Args:
        a: ``[M, Kd]`` permuted rows, or ``x [T, Kd]`` with ``gather``.
        w: ``[E, N, Kd]`` (``N = 2*N_out`` for gated activations), any strides.
        offsets: ``expert_first_token_offset [E+1]`` int64.
        out: ``[M, N_out]``. With ``finalize``: ordered, the scratch rows of ``y`` (any
            ``[M, N_out]`` buffer of the output dtype, nothing else reads it); atomic, a float32
            ``[T, N_out]`` accumulated into (the caller initialises it with the bias or zeros).
        dest_to_src: ``expanded_dest_row_to_expanded_source_row``, for ``gather``,
            ``finalize`` and ``act_backward``.
        gather: read ``A`` row ``d`` as ``x[dest_to_src[d] mod T]`` (``x_perm`` never exists).
        finalize: the epilogue-fused finalize (GEMM2); see :class:`FinalizeEpilogue`.
        num_rows: ``M = T*K`` (the permuted row count), when ``a`` is ``x``.
        pre_activation: ``[M, N]`` contiguous; also write GEMM1's pre-activation ``z`` here
            (the activation is then computed from the rounded ``z``).
        act_backward: ``(z [M, 2I or I], dz like z, topk_weights [T, K])``: ``a`` is
            ``dout [T, H]`` (gathered), ``w`` is ``W2`` seen as ``[E, I, H]``, ``out`` receives
            ``w[t,k]·act(z)`` ``[M, I]`` (zero in dropped rows, as ``dz``), ``activation`` and
            ``interleaved`` describe ``z``; see the module docstring. Returns the partial
            router-weight gradients ``[M, cdiv(I, BLOCK_N)]`` float32 (float64 for float64).
        use_tma: load tiles through TMA tensor descriptors where the layout allows it
            (16-bit dtypes, unit stride along K or N, 16-byte aligned pitches; ``w`` not
            interleaved; ``a`` not gathered). Default: on SM90+ GPUs.
    """
    E = w.shape[0]
    gated = activation in ("swiglu", "geglu")
    two_products = gated and act_backward is None
    n_out = w.shape[1] // 2 if two_products else w.shape[1]
    kd = w.shape[2]
    M = num_rows if num_rows is not None else a.shape[0]
    T = a.shape[0]
    if finalize is not None:
        T = finalize.topk_weights.shape[0]
    if act_backward is not None:
        T = act_backward[2].shape[0]
    if M == 0 or n_out == 0:
        if finalize is not None and finalize.ordered:  # no rows at all: out = bias or zeros
            fill = finalize.bias if finalize.bias is not None else 0.0
            finalize.out.copy_(torch.broadcast_to(fill, finalize.out.shape))
        return a.new_zeros(M, 1, dtype=torch.float32) if act_backward is not None else None
    if config is None and act_backward is not None and a.dtype != torch.float64 and M / E > 64:
        # NOTE: H200, bf16 (bench/bench_train.py --stages --sweep): the activation-backward
        # epilogue (z in, w*h and dz out) is register-heavy; 64x64 tiles on 4 warps beat
        # 128x128 on 8 by 36% at qwen3 (I=768); at deepseek (I=2048) 4 stages won by 11%.
        config = (64, 64, 64, 4, 4, 4) if n_out < 2048 else (128, 128, 64, 8, 8, 4)
    bm, bn, bk, group_m, warps, stages = config or _pick_config(M / E, n_out, kd, gated, a.dtype)
    tile_start = torch.empty(E + 1, dtype=torch.int32, device=a.device)
    _expert_tile_start_kernel[(1,)](
        offsets, tile_start, E, BLOCK_M=bm, NUM=triton.next_power_of_2(E + 1)
    )
    # Σ_e cdiv(rows_e, bm) + cdiv(dropped, bm) <= cdiv(M, bm) + E + 1, whatever the routing.
    m_tiles = triton.cdiv(M, bm) + E + 1
    grid = (m_tiles * triton.cdiv(n_out, bn),)
    a_desc, w_desc, w_kmajor = _descriptors(
        a, w, bm, bn, bk, gather, two_products and interleaved, use_tma
    )
    b = bias if bias is not None else out
    wts = finalize.topk_weights if finalize is not None else out
    z = dz = partial = out  # never read unless STORE_PRE / ACT_BWD
    # Never read unless FINALIZE with ORDERED (final bias: and FINAL_BIAS).
    final = counter = s2d = efs = fbias = out
    sft = sfh = sfbt = sfbh = 0
    ordered = finalize is not None and finalize.ordered
    if ordered:
        final, s2d, efs = finalize.out, finalize.src_to_dest, finalize.expert_for_src
        sft, sfh = final.stride()
        counter = torch.zeros(T, triton.cdiv(n_out, bn), dtype=torch.int32, device=a.device)
        if finalize.bias is not None:
            fbias = finalize.bias
            sfbt, sfbh = (0, fbias.stride(0)) if fbias.dim() == 1 else fbias.stride()
    if act_backward is not None:
        z, dz, wts = act_backward
        assert z.stride() == dz.stride() and z.stride(1) == 1, "dz must be laid out like z"
        acc_dtype = torch.float64 if a.dtype == torch.float64 else torch.float32
        partial = torch.empty(M, triton.cdiv(n_out, bn), dtype=acc_dtype, device=a.device)
    elif pre_activation is not None:
        z = pre_activation
    if a.dtype == torch.float64:
        precision = "fma"
    else:
        precision = "tf32" if allow_tf32 or a.dtype != torch.float32 else "ieee"
    _grouped_gemm_kernel[grid](
        a, w, a_desc if a_desc is not None else a, w_desc if w_desc is not None else w,
        out, b, offsets, tile_start,
        dest_to_src if dest_to_src is not None else tile_start, wts, z, dz, partial,
        final, counter, s2d, efs, fbias,
        E, M, m_tiles, n_out, kd, T,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1),
        b.stride(0) if bias is not None else 0, b.stride(1) if bias is not None else 0,
        wts.stride(0) if wts is not out else 0, wts.stride(1) if wts is not out else 0,
        z.stride(0) if z is not out else 0, sft, sfh, sfbt, sfbh,
        ACTIVATION=ACT_CODES[activation], GATED=gated, TWO_PRODUCTS=two_products,
        INTERLEAVED=interleaved, HAS_BIAS=bias is not None, GATHER=gather,
        FINALIZE=finalize is not None, ORDERED=ordered,
        FINAL_BIAS=ordered and finalize.bias is not None,
        TOP_K=finalize.topk_weights.shape[1] if ordered else 1,  # the atomic mode needs no K
        STORE_PRE=pre_activation is not None,
        ACT_BWD=act_backward is not None,
        ACC=tl.float64 if a.dtype == torch.float64 else tl.float32, DOT_PRECISION=precision,
        A_DESC=a_desc is not None, W_DESC=w_desc is not None, W_KMAJOR=w_kmajor,
        LOG2_E=max(1, (E).bit_length()), EVEN_K=kd % bk == 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, RED_M=min(bm, RED_ROWS),
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return partial if act_backward is not None else None
