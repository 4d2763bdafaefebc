"""The decode path of ``fused_moe``: two launches, no routing maps (inference, a few tokens).

At decode sizes (``T*K`` slots at most 16 and no more than the experts; up to 64 and half the
experts where the experts are small) most routed slots have their own expert's weights to read
and little to share a tile with (the slots that do share one read its tiles at about the same
time, from L2), so sorting the slots by expert buys nothing and costs launches: the maps
kernel, GEMM1, GEMM2 and the finalize are four launches and five buffers of host time, several
times the device time of reading the touched weights. Here the slots are taken as they come
from ``topk_ids``:

1. :func:`_decode_up_kernel`, program ``(slot, n-tile)``: ``h[slot] = act(x[t] W1[e]^T + b1[e])``
   over an ``I``-tile, ``e = topk_ids[t, k]`` (a dropped slot does nothing);
2. :func:`_decode_down_kernel`, program ``(t, n-tile)``: for ``k = 0 .. K-1`` in order,
   ``y = h[slot] W2[e]^T + b2[e]`` rounded to the output dtype (as GEMM2 stores it), then
   ``out[t] = Σ_k w[t,k] y + bias``, rounded once: the standalone finalize's sum, term by term.

With ``counts``, program ``(0, 0)`` of the second launch also writes the routed slots per
expert (``MoELayer``'s ``tokens_per_expert``): integer sums, no extra launch.

The kernels launch plainly, without programmatic dependent launch, which made them slower
(docs/decisions.md, "No programmatic dependent launch").

Each output element has one owner and a fixed order: the same bits on every run. Each product
is one row times a weight tile, computed as an MMA with the row in the first of ``BLOCK_M``
rows (the others zero): the MMA's operands are what Triton software-pipelines, so the weight
loads of several steps are in flight at once, which the kernels (bound by reading the touched
weights) need more than the arithmetic the padding wastes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import LaunchKey, ThinKernel, cdiv, launch_key_part
from .activation import gated_forward, plain_forward
from .fp8_codes import fp8_scale
from .gemm_mainloop import GemmEpilogue, _gate_up_rows, _mma, _precision
from .mxfp4 import _mxfp4_dot
from .quant import _fp8_operand, _scaled_fp8_dot, _scaled_fp8_dot_t

#: rows of the MMA tile that carries one token row (the smallest ``tl.dot`` takes)
_ROWS = 16
#: the most slots (``T*K``) a decode call has (:func:`moe_route.tuning.decode_config`)
MAX_SLOTS = 64


@launch_key_part
@dataclass(frozen=True)
class DecodeConfig:
    """Tiles of the two decode kernels (chosen by :mod:`moe_route.tuning`)."""

    #: GEMM1: ``I`` columns per program and the ``H`` step
    up_n: int
    up_k: int
    #: GEMM2: ``H`` columns per program and the ``I`` step
    down_n: int
    down_k: int
    num_warps: int
    num_stages: int
    #: the second launch one program per (slot, column tile) rather than per (token, column
    #: tile), the last slot to arrive summing the token's terms
    split: bool = False
    #: FP8 products transposed, the weights first (SM90's FP8 MMA takes 64 weight rows by the
    #: 16 token rows; :func:`.quant._scaled_fp8_dot_t`)
    swap: bool = False
    #: the path serves CUDA-graph capture too: where its two launches take no longer on the
    #: device than the sorted path's experts step, which also waits for the maps' launch
    graphs: bool = False


@triton.jit
def _row_tile(v_ptrs, k_ok, BLOCK_M: tl.constexpr):
    """``[v; 0; ...]``: the row ``v`` (``[BLOCK_K]`` pointers, read where ``k_ok``) in the first
    of ``BLOCK_M`` rows, the MMA's first operand. One masked ``[BLOCK_M, BLOCK_K]`` load goes
    through the pipelined shared-memory path like the weight tile (docs/decisions.md, "Decode
    tiles")."""
    first = tl.arange(0, BLOCK_M)[:, None] == 0
    return tl.load(v_ptrs[None, :] + tl.zeros([BLOCK_M, 1], dtype=tl.int32),
                   mask=first & k_ok[None, :], other=0.0)  # fmt: skip


@triton.jit
def _row_times(v_ptrs, w_ptrs, k_ok, col_ok, acc, DOT_PRECISION: tl.constexpr,
               BLOCK_M: tl.constexpr):  # fmt: skip
    """``acc + [v; 0; ...] @ w`` (:func:`_row_tile`), times a ``[BLOCK_K, BLOCK_N]`` weight tile
    read where ``k_ok`` and ``col_ok`` (zeros elsewhere). The weight rows past the matrix are
    masked, not clamped into bounds: as in the grouped GEMM's main loop, a clamp hides the
    rows' contiguity from Triton, and a weight that is n-contiguous (a transposed view) then
    loads element by element."""
    a = _row_tile(v_ptrs, k_ok, BLOCK_M)
    w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
    return _mma(a, w, acc, DOT_PRECISION)


@triton.jit
def _past_h(h_ptr, AT, DTYPE: tl.constexpr):
    """Element ``AT`` of a ``DTYPE`` array in ``h``'s buffer (:func:`_scratch`): the second
    launch's ``SPLIT`` terms, or its arrival counters."""
    return h_ptr.to(tl.pointer_type(DTYPE), bitcast=True) + AT


@triton.jit
def _zero_arrivals(h_ptr, ARRIVED_AT, ARRIVALS):
    """Program ``(0, 0)`` of a first launch zeroes the second launch's ``ARRIVALS`` counters
    (its ``SPLIT`` mode; none otherwise), int32 words ``ARRIVED_AT ...`` of ``h``'s buffer."""
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        arrived_ptr = _past_h(h_ptr, ARRIVED_AT, tl.int32)
        for i0 in range(0, ARRIVALS, 1024):
            i = i0 + tl.arange(0, 1024)
            tl.store(arrived_ptr + i, tl.zeros([1024], tl.int32), mask=i < ARRIVALS)


@triton.jit
def _routed_slot(ids_ptr, stride_it, stride_ik, TOP_K: tl.constexpr):
    """``(slot, t, e)`` of a first launch's program: its slot ``t*K + k`` and the slot's
    expert id (negative where dropped)."""
    slot = tl.program_id(0)
    t = slot // TOP_K
    e = tl.load(ids_ptr + t * stride_it + (slot % TOP_K) * stride_ik)
    return slot, t, e


@triton.jit
def _zero_acc(ACC: tl.constexpr, SWAP: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):  # fmt: skip
    """A zero accumulator of ``BLOCK_M`` rows by ``BLOCK_N`` columns (``SWAP``: transposed)."""
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=ACC)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    return acc


@triton.jit
def _first_row(acc, BLOCK_M: tl.constexpr, SWAP: tl.constexpr = False):
    """Row 0 of ``acc`` (``SWAP``: of ``acc.T``, column 0 of a transposed accumulator)."""
    if SWAP:
        row = tl.sum(tl.where(tl.arange(0, BLOCK_M)[None, :] == 0, acc, 0.0), axis=1)
    else:
        row = tl.sum(tl.where(tl.arange(0, BLOCK_M)[:, None] == 0, acc, 0.0), axis=0)
    return row


@triton.jit(do_not_specialize=["T", "ARRIVED_AT", "ARRIVALS"])
def _decode_up_kernel(
    x_ptr, w_ptr, b_ptr, ids_ptr, h_ptr, ARRIVED_AT, ARRIVALS, T, N_OUT, KD, E,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wk, stride_be, stride_bn, stride_it,
    stride_ik, stride_hs, stride_hn,
    TOP_K: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr, ALPHA: tl.constexpr,
    LIMIT: tl.constexpr, UP_OFFSET: tl.constexpr, GATE_SOFTCAP: tl.constexpr,
    UP_SOFTCAP: tl.constexpr, INTERLEAVED: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACC: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Program ``(slot = t*K + k, n-tile)``: ``h[slot, cols]`` (and :func:`_zero_arrivals`)."""
    _zero_arrivals(h_ptr, ARRIVED_AT, ARRIVALS)
    slot, t, e = _routed_slot(ids_ptr, stride_it, stride_ik, TOP_K)
    if (e < 0) | (e >= E):  # dropped (or an unchecked id past the experts): h never read
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N_OUT
    gate_rows, up_rows = _gate_up_rows(cols, N_OUT, GATED, INTERLEAVED)
    ks = tl.arange(0, BLOCK_K)
    w_base = w_ptr + e.to(tl.int64) * stride_we
    g_ptrs = w_base + gate_rows[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk
    u_ptrs = w_base + up_rows[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk
    x_ptrs = x_ptr + t.to(tl.int64) * stride_xt + ks * stride_xh
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    for k0 in range(0, KD, BLOCK_K):
        k_ok = k0 + ks < KD
        acc_g = _row_times(x_ptrs, g_ptrs, k_ok, col_ok, acc_g, DOT_PRECISION, BLOCK_M)
        if GATED:
            acc_u = _row_times(x_ptrs, u_ptrs, k_ok, col_ok, acc_u, DOT_PRECISION, BLOCK_M)
            u_ptrs += BLOCK_K * stride_wk
        g_ptrs += BLOCK_K * stride_wk
        x_ptrs += BLOCK_K * stride_xh
    gate = _first_row(acc_g, BLOCK_M)
    if HAS_BIAS:
        b_base = b_ptr + e.to(tl.int64) * stride_be
        gate += tl.load(b_base + gate_rows * stride_bn, mask=col_ok, other=0.0).to(ACC)
    if GATED:
        up = _first_row(acc_u, BLOCK_M)
        if HAS_BIAS:
            up += tl.load(b_base + up_rows * stride_bn, mask=col_ok, other=0.0).to(ACC)
        h = gated_forward(gate, up, ACT, ALPHA, LIMIT, UP_OFFSET, GATE_SOFTCAP, UP_SOFTCAP)
    else:
        h = plain_forward(gate, ACT)
    tl.store(h_ptr + slot.to(tl.int64) * stride_hs + cols * stride_hn,
             h.to(h_ptr.dtype.element_ty), mask=col_ok)  # fmt: skip


@triton.jit
def _row_times_fp8(h_ptrs, w_ptrs, ws_ptrs, k_ok, col_ok, acc, UE8M0: tl.constexpr,
                   UPCAST: tl.constexpr, SWAP: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
    """:func:`_row_times` on FP8 experts: the float32 row ``h`` (one 128-column scale block)
    quantised as the sorted path's GEMM2 quantises its rows (:func:`.quant._fp8_mainloop`,
    ``A_QUANT = 1``), then ``acc + ([h_q; 0; ...] @ w) · h_s · w_s``, scaled as it scales.
    ``SWAP``: ``w_ptrs`` address ``[BLOCK_N, BLOCK_K]`` and ``acc`` is transposed, as the
    sorted path's swapped tiles hold them."""
    v = _row_tile(h_ptrs, k_ok, BLOCK_M)
    a_s = fp8_scale(tl.max(tl.abs(v), axis=1), UE8M0)
    a = _fp8_operand(v, a_s, UPCAST)
    w_s = tl.load(ws_ptrs, mask=col_ok, other=0.0)
    if SWAP:
        w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc += _scaled_fp8_dot_t(w, a, a_s, w_s, UPCAST)
    else:
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += _scaled_fp8_dot(a, w, a_s, w_s, UPCAST)
    return acc


@triton.jit
def _row_times_mxfp4(h_ptrs, w_base, s_base, cols, col_ok, k_ok, k0, KP, acc, acc_odd,
                     stride_wn, stride_wk, stride_sn, stride_sk, UPCAST: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """:func:`_row_times` on MXFP4 experts, as the sorted path's GEMMs compute it
    (:func:`.mxfp4._mxfp4_dot`): the 16-bit row ``h``'s even columns times the low nibbles'
    weights into ``acc``, its odd columns times the high nibbles' into ``acc_odd``."""
    a = _row_tile(h_ptrs, k_ok, BLOCK_M)
    a_even, a_odd = tl.split(tl.reshape(a, [BLOCK_M, BLOCK_K // 2, 2]))
    return _mxfp4_dot(a_even, a_odd, w_base, s_base, cols, col_ok, k0, KP, acc, acc_odd,
                      stride_wn, stride_wk, stride_sn, stride_sk, not UPCAST,
                      BLOCK_K)  # fmt: skip


@triton.jit
def _expert_counts(ids_ptr, counts_ptr, T, E, stride_it, stride_ik, TOP_K: tl.constexpr,
                   SLOTS: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
    """``counts[e]`` = slots of the ``T*K <= SLOTS`` routed to expert ``e`` (dropped and
    out-of-range ids counted nowhere)."""
    slots = tl.arange(0, SLOTS)
    ids = tl.load(ids_ptr + (slots // TOP_K) * stride_it + (slots % TOP_K) * stride_ik,
                  mask=slots < T * TOP_K, other=-1)  # fmt: skip
    for e0 in range(0, E, BLOCK_E):
        experts = e0 + tl.arange(0, BLOCK_E)
        hits = (ids[:, None] == experts[None, :]).to(tl.int64)
        tl.store(counts_ptr + experts, tl.sum(hits, axis=0), mask=experts < E)


@triton.jit(do_not_specialize=["T", "TERMS_AT", "ARRIVED_AT"])
def _decode_down_kernel(
    h_ptr, w_ptr, ws_ptr, b2_ptr, ids_ptr, tw_ptr, bias_ptr, out_ptr, counts_ptr, TERMS_AT,
    ARRIVED_AT, T, H, KD, KP, E, stride_hs, stride_hn, stride_we, stride_wn, stride_wk,
    stride_se, stride_sn, stride_sk, stride_b2e, stride_b2n, stride_it, stride_ik, stride_wt,
    stride_wkk, stride_bt, stride_bh, stride_ot, stride_oh,
    TOP_K: tl.constexpr, HAS_B2: tl.constexpr, HAS_BIAS: tl.constexpr, ACC: tl.constexpr,
    OUT_ACC: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COUNTS: tl.constexpr, SLOTS: tl.constexpr,
    FP8: tl.constexpr, MXFP4: tl.constexpr, SN: tl.constexpr, UE8M0: tl.constexpr,
    UPCAST: tl.constexpr, SPLIT: tl.constexpr, SWAP: tl.constexpr,
):  # fmt: skip
    """Program ``(t, n-tile)``: ``out[t, cols]``, its ``K`` slots summed in order (and, with
    ``COUNTS``, program ``(0, 0)`` the slots per expert). ``FP8``: ``h`` holds float32 rows,
    quantised here per ``BLOCK_K = 128`` columns, ``W2`` e4m3 codes with block or channel
    scales (``ws``; ``SN`` rows per block, a zero k-stride per channel). ``MXFP4``: ``W2``
    packed e2m1 codes with ue8m0 scales per 32 values (``ws``), ``KP = ceil(KD / 2)`` bytes
    per row (an argument, so that its divisibility specialises the loads).

    ``SPLIT`` (too few tokens for ``T`` programs to stream the weights): program ``(slot,
    n-tile)`` computes its slot's term of the sum into ``terms`` and counts itself in
    ``arrived[t, n-tile]`` (zeroed by the first launch), both in ``h``'s buffer past its end
    (element ``TERMS_AT`` and int32 word ``ARRIVED_AT``: :func:`_scratch`); the slot program
    that arrives last sums the token's ``K`` terms in slot order, as the finalize does: the
    same bits. ``SWAP`` (FP8): each block's product transposed, the weights first
    (:func:`_row_times_fp8`)."""
    if COUNTS:  # noqa: SIM102 (a constexpr branch, then a runtime one)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            _expert_counts(ids_ptr, counts_ptr, T, E, stride_it, stride_ik, TOP_K, SLOTS, 128)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    ks = tl.arange(0, BLOCK_K)
    total = tl.zeros([BLOCK_N], dtype=OUT_ACC)
    acc = _zero_acc(ACC, SWAP, BLOCK_M, BLOCK_N)
    acc_odd = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)  # (MXFP4: the odd columns' products)
    # One loop over (slot, I-step) pairs rather than a loop per slot: the weight loads stay
    # in flight across the slots' boundaries (a loop per slot drains its pipeline K times).
    steps = tl.maximum(tl.cdiv(KD, BLOCK_K), 1)  # (I = 0: one step, for b2)
    if SPLIT:
        t = (tl.program_id(0) // TOP_K).to(tl.int64)
        k_first = tl.program_id(0) % TOP_K
        n_steps = steps
    else:
        t = tl.program_id(0).to(tl.int64)
        k_first = 0
        n_steps = TOP_K * steps
    for i in tl.range(0, n_steps):
        k = k_first + i // steps
        k0 = (i % steps) * BLOCK_K
        e = tl.load(ids_ptr + t * stride_it + k * stride_ik)
        # a dropped slot (or an unchecked id past the experts) adds nothing, reads nothing
        routed = (e >= 0) & (e < E)
        k_ok = (k0 + ks < KD) & routed
        w_e = w_ptr + tl.maximum(e, 0).to(tl.int64) * stride_we
        if SWAP:
            w_ptrs = w_e + cols[:, None].to(tl.int64) * stride_wn + (k0 + ks)[None, :] * stride_wk
        else:
            w_ptrs = w_e + cols[None, :].to(tl.int64) * stride_wn + (k0 + ks)[:, None] * stride_wk
        h_ptrs = h_ptr + (t * TOP_K + k) * stride_hs + (k0 + ks) * stride_hn
        if FP8:
            step = k0 // BLOCK_K
            ws_ptrs = (ws_ptr + tl.maximum(e, 0).to(tl.int64) * stride_se
                       + (cols // SN).to(tl.int64) * stride_sn + step * stride_sk)  # fmt: skip
            acc = _row_times_fp8(h_ptrs, w_ptrs, ws_ptrs, k_ok, col_ok, acc, UE8M0, UPCAST,
                                 SWAP, BLOCK_M)  # fmt: skip
        elif MXFP4:
            e0 = tl.maximum(e, 0).to(tl.int64)
            acc, acc_odd = _row_times_mxfp4(
                h_ptrs, w_ptr + e0 * stride_we, ws_ptr + e0 * stride_se, cols, col_ok & routed,
                k_ok, k0, KP, acc, acc_odd, stride_wn, stride_wk, stride_sn,
                stride_sk, UPCAST, BLOCK_M, BLOCK_K,
            )  # fmt: skip
        else:
            acc = _row_times(h_ptrs, w_ptrs, k_ok, col_ok, acc, DOT_PRECISION, BLOCK_M)
        if k0 + BLOCK_K >= KD:  # the slot's last step: its term of the finalize's sum
            if MXFP4:
                acc += acc_odd
                acc_odd = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
            y = _first_row(acc, BLOCK_M, SWAP)
            acc = _zero_acc(ACC, SWAP, BLOCK_M, BLOCK_N)
            if HAS_B2:
                b2 = tl.load(b2_ptr + tl.maximum(e, 0).to(tl.int64) * stride_b2e
                             + cols * stride_b2n, mask=col_ok & routed, other=0.0)  # fmt: skip
                y += b2.to(ACC)
            y = y.to(out_ptr.dtype.element_ty).to(OUT_ACC)  # GEMM2's output, as stored
            w = tl.load(tw_ptr + t * stride_wt + k * stride_wkk, mask=routed,
                        other=0.0).to(OUT_ACC)  # fmt: skip
            # the finalize's term, as it adds it: the select keeps the product rounded on its
            # own (a multiply-add contracted into one FMA rounds once, other bits)
            total += tl.where(routed, w * y, 0.0)
    if SPLIT:
        terms_ptr = _past_h(h_ptr, TERMS_AT, OUT_ACC)
        slot = t * TOP_K + k_first
        tl.store(terms_ptr + slot * H + cols, total, mask=col_ok)
        # every thread's term stored before the count (the atomic releases them at GPU scope)
        tl.debug_barrier()
        tile = t * tl.num_programs(1) + tl.program_id(1)
        arrived_ptr = _past_h(h_ptr, ARRIVED_AT, tl.int32)
        if tl.atomic_add(arrived_ptr + tile, 1, sem="acq_rel") != TOP_K - 1:
            return
        total = tl.zeros([BLOCK_N], dtype=OUT_ACC)
        for kk in tl.static_range(TOP_K):  # 0 + the terms in slot order, as the finalize
            total += tl.load(terms_ptr + (t * TOP_K + kk) * H + cols, mask=col_ok,
                             cache_modifier=".cg")  # fmt: skip
    if HAS_BIAS:
        total += tl.load(bias_ptr + t * stride_bt + cols * stride_bh, mask=col_ok).to(OUT_ACC)
    tl.store(out_ptr + t * stride_ot + cols * stride_oh, total.to(out_ptr.dtype.element_ty),
             mask=col_ok)  # fmt: skip


def _scratch(split: bool, T: int, slots: int, n_inter: int, H: int, tiles: int,
             h_dtype: torch.dtype, terms_dtype: torch.dtype, device) -> tuple:  # fmt: skip
    """``(h, terms_at, arrived_at, arrivals)``: one allocation for a call's scratch, ``h``
    (``[slots, n_inter]`` rows) and, in the second launch's ``SPLIT`` mode, past its end the
    slots' terms (``[slots, H]`` of ``terms_dtype`` from element ``terms_at``) and an int32
    count per (token, column tile) of the slots that have arrived (``arrivals`` of them from
    word ``arrived_at``), zeroed by the first launch, or here where none runs (``n_inter =
    0``). One allocation rather than three: each costs an eager call host time."""
    h_size = h_dtype.itemsize
    h_bytes = slots * n_inter * h_size
    if not split:
        return torch.empty(slots * n_inter, dtype=h_dtype, device=device), 0, 0, 0
    terms_at = -(-h_bytes // 16) * 16  # (bytes; 16-byte aligned, as h is)
    arrived_at = terms_at + slots * H * terms_dtype.itemsize
    arrivals = T * tiles
    new = torch.empty if n_inter else torch.zeros
    h = new(-(-(arrived_at + 4 * arrivals) // h_size), dtype=h_dtype, device=device)
    return h, terms_at // terms_dtype.itemsize, arrived_at // 4, arrivals


class DecodeLaunch:
    """The two decode launches prepared for one configuration of arguments: what depends only
    on their metadata (dtypes, strides, sizes other than ``T``, which optional tensors exist,
    the epilogue and tiles) is computed once, here; a call then allocates ``h`` and ``out``
    and launches. Keeps no tensor. ``counts``: the second launch also writes the routed slots
    per expert into the ``counts`` a call passes. A call's tensors must have the metadata of
    those it was prepared from (``T`` may differ): :func:`moe_route.moe.fused_moe` keeps one
    per call signature, :func:`moe_decode_triton` prepares one per call.
    """

    def __init__(self, x, w1, w2, topk_weights, topk_ids, b1, b2, bias,
                 epilogue: GemmEpilogue, cfg: DecodeConfig, counts: bool):  # fmt: skip
        H = x.shape[1]
        K = topk_ids.shape[1]
        E, n_inter = w1.shape[0], w2.shape[2]
        self.K, self.H, self.n_inter, self.counts = K, H, n_inter, counts
        self.split = cfg.split
        self.has_b1, self.has_b2, self.has_bias = b1 is not None, b2 is not None, bias is not None
        self.up_tiles, self.down_tiles = cdiv(n_inter, cfg.up_n), cdiv(H, cfg.down_n)
        acc = tl.float64 if x.dtype == torch.float64 else tl.float32
        precision = _precision(x.dtype, False)
        wide = torch.float64 in (x.dtype, topk_weights.dtype)
        out_acc = tl.float64 if wide else tl.float32
        self.terms_dtype = torch.float64 if wide else torch.float32
        epi = epilogue
        sx, sw1, sw2, sid, stw = x.stride(), w1.stride(), w2.stride(), topk_ids.stride(), \
            topk_weights.stride()  # fmt: skip
        sh, so = (n_inter, 1), (H, 1)  # h and out are new, contiguous
        sb1 = b1.stride() if b1 is not None else (0, 0)
        sb2 = b2.stride() if b2 is not None else (0, 0)
        b1_dtype = b1.dtype if b1 is not None else w1.dtype
        b2_dtype = b2.dtype if b2 is not None else w2.dtype
        if bias is None:
            bias_dtype, sbias = x.dtype, (0, 0)
        else:
            bias_dtype = bias.dtype
            sbias = (0, bias.stride(0)) if bias.dim() == 1 else bias.stride()
        self.up_key = LaunchKey((cfg, epi, x.dtype, w1.dtype, b1_dtype, topk_ids.dtype, sx, sw1,
                                 sb1, sid, K, n_inter, H, E, b1 is not None))  # fmt: skip
        self.up_tail = (n_inter, H, E, *sx, *sw1, *sb1, *sid, *sh)
        self.up_constexprs = lambda: dict(
            TOP_K=K, ACT=epi.act, GATED=epi.gated, ALPHA=epi.alpha, LIMIT=epi.limit,
            UP_OFFSET=epi.up_offset, GATE_SOFTCAP=epi.gate_softcap, UP_SOFTCAP=epi.up_softcap,
            INTERLEAVED=epi.interleaved, HAS_BIAS=b1 is not None,
            ACC=acc, DOT_PRECISION=precision, BLOCK_M=_ROWS, BLOCK_N=cfg.up_n, BLOCK_K=cfg.up_k,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        self.down_key = LaunchKey((
            cfg, x.dtype, w2.dtype, b2_dtype, topk_weights.dtype, bias_dtype, topk_ids.dtype,
            sw2, sb2, sid, stw, sbias, K, H, n_inter, E, b2 is not None, bias is not None, counts,
        ))  # fmt: skip
        self.down_tail = (H, n_inter, n_inter, E, *sh, *sw2, 0, 0, 0, *sb2, *sid, *stw, *sbias, *so)
        self.down_constexprs = lambda: dict(
            TOP_K=K, HAS_B2=b2 is not None, HAS_BIAS=bias is not None, ACC=acc, OUT_ACC=out_acc,
            DOT_PRECISION=precision, BLOCK_M=_ROWS, BLOCK_N=cfg.down_n, BLOCK_K=cfg.down_k,
            COUNTS=counts, SLOTS=MAX_SLOTS, FP8=False, MXFP4=False, SN=1, UE8M0=False, UPCAST=False,
            SPLIT=cfg.split, SWAP=False, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip

    def __call__(self, x, w1, w2, topk_weights, topk_ids, b1, b2, bias,
                 counts: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """``fused_moe``'s output ``[T, H]`` (and, prepared with ``counts``, the slots per
        expert written into ``counts``)."""
        T = x.shape[0]
        out = x.new_empty(T, self.H)
        if T == 0 or self.H == 0:  # (counts are asked for by MoELayer only, whose H >= 1)
            if counts is not None:
                counts.zero_()
            return out
        slots = T * self.K
        h, terms_at, arrived_at, arrivals = _scratch(
            self.split, T, slots, self.n_inter, self.H, self.down_tiles, x.dtype,
            self.terms_dtype, x.device,
        )  # fmt: skip
        if self.n_inter:  # (I = 0: no h to compute; GEMM2 still adds b2)
            _UP.launch(self.up_key, (slots, self.up_tiles),
                       (x, w1, b1 if self.has_b1 else w1, topk_ids, h, arrived_at, arrivals, T,
                        *self.up_tail),
                       self.up_constexprs)  # fmt: skip
        _DOWN.launch(
            self.down_key, (slots if self.split else T, self.down_tiles),
            (h, w2, w2, b2 if self.has_b2 else w2, topk_ids, topk_weights,
             bias if self.has_bias else out, out, counts if self.counts else out, terms_at,
             arrived_at, T, *self.down_tail),
            self.down_constexprs,
        )  # fmt: skip
        return out


def moe_decode_triton(x, w1, w2, topk_weights, topk_ids, b1, b2, bias, epilogue: GemmEpilogue,
                      cfg: DecodeConfig, counts: torch.Tensor | None = None):  # fmt: skip
    """``fused_moe``'s output ``[T, H]`` through the two decode kernels (inputs checked);
    ``counts`` (``[E] int64``, ``T*K <= MAX_SLOTS``), if given, gets the routed slots per
    expert. Prepares its :class:`DecodeLaunch` on every call."""
    args = (x, w1, w2, topk_weights, topk_ids, b1, b2, bias)
    return DecodeLaunch(*args, epilogue, cfg, counts is not None)(*args, counts)


_UP = ThinKernel(_decode_up_kernel)
_DOWN = ThinKernel(_decode_down_kernel)
