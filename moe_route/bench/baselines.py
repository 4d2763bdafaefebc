"""The PyTorch code a user would write without moe_route: the baselines of every benchmark.

* :func:`argsort_maps` — the routing tables from an ``argsort`` (same bits as the maps kernel);
* :func:`grouped_mm_forward` — ``argsort`` + gather + ``torch._grouped_mm`` ×2 + ``index_add_``
  (no host sync, differentiable: the training baseline too);
* :func:`loop_forward` — the per-expert loop of usual model code (one mask and sync per expert;
  with ``w1``/``w2`` given as lists of per-expert tensors it is the ``nn.ModuleList`` version
  whose backward gives each expert its own gradient);
* :func:`torch_finalize` — gather through the map, weight, sum over ``k``;
* :func:`scaled_grouped_mm_forward` — the FP8 rowwise pipeline in torch itself: rowwise
  quantised tokens, ``torch._scaled_grouped_mm`` ×2 on per-channel FP8 experts, SwiGLU in bf16;
* :func:`transformers_fp8_experts` — transformers' FP8 ``grouped_mm`` experts function on
  block-scaled FP8 experts (the ``quant`` stage's optional baselines);
* :func:`triton_kernels_experts` — OpenAI's ``triton_kernels`` (``matmul_ogs`` with its fused
  gather, gpt-oss SwiGLU, router-weight scale and scatter + reduce), on bf16 or MXFP4 experts:
  the optional peer of the ``forward`` and ``quant`` stages, where that package is importable.
"""

from __future__ import annotations

import importlib.util
import types

import torch
import torch.nn.functional as F

from moe_route.reference import activation_reference


def argsort_maps(ids: torch.Tensor, E: int):
    """What model code writes without a routing kernel: sort unique keys, scatter the inverse.

    Returns ``(src_to_dest int32, dest_to_src int32, expert_for_src int32, offsets int64)`` as
    in :class:`moe_route.RoutingMaps`.
    """
    T, K = ids.shape
    N = T * K
    i = torch.arange(N, device=ids.device)
    t, k = i // K, i % K
    s = k * T + t
    flat = ids.reshape(-1).long()
    key = torch.where(flat < 0, E * N + s, flat * N + i)
    dest_to_src = s[torch.argsort(key)]
    src_to_dest = torch.empty_like(dest_to_src).scatter_(0, dest_to_src, i)
    expert_for_src = torch.empty_like(flat).scatter_(0, s, flat)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, torch.where(flat < 0, E, flat), torch.ones_like(flat))
    offsets = torch.cumsum(counts, 0) - counts
    return src_to_dest.int(), dest_to_src.int(), expert_for_src.int(), offsets


def grouped_mm_route(topk_ids: torch.Tensor, E: int):
    """``(order, token, offs)``: the sorted slot order, its token ids, int32 group ends."""
    K = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=topk_ids.device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    return order, order // K, offs


def grouped_mm_gemm1(x, w1t, token, offs, activation=None):
    """GEMM1 + SwiGLU of the ``_grouped_mm`` pipeline; ``w1t`` is ``[E, H, 2I]``.

    ``activation``: another gated activation (as ``fused_moe`` takes it, e.g.
    :data:`GPT_OSS_ACTIVATION`), computed in float32 by the reference."""
    z = torch._grouped_mm(x[token], w1t, offs=offs)
    if activation is not None:
        return activation_reference(z.float(), activation).to(z.dtype)
    gate, up = z.chunk(2, dim=-1)
    return F.silu(gate) * up


def grouped_mm_gemm2_finalize(h, w2t, topk_weights, order, token, offs, T):
    """GEMM2, router weight, ``index_add_`` reduce; ``w2t`` is ``[E, I, H]``."""
    y = torch._grouped_mm(h, w2t, offs=offs)
    y = y * topk_weights.reshape(-1)[order].unsqueeze(1).to(y.dtype)
    return y.new_zeros(T, y.shape[1]).index_add_(0, token, y)


def grouped_mm_forward(x, w1t, w2t, topk_weights, topk_ids, activation=None):
    """The ``torch._grouped_mm`` pipeline a user would write (no host sync, index_add_ reduce).

    ``w1t = w1.transpose(1, 2)`` (``[E, H, 2I]``), ``w2t = w2.transpose(1, 2)`` (``[E, I, H]``);
    ``activation``: as in :func:`grouped_mm_gemm1`.
    """
    order, token, offs = grouped_mm_route(topk_ids, w1t.shape[0])
    h = grouped_mm_gemm1(x, w1t, token, offs, activation)
    return grouped_mm_gemm2_finalize(h, w2t, topk_weights, order, token, offs, x.shape[0])


def loop_forward(x, w1, w2, topk_weights, topk_ids):
    """Per-expert loop, as in many model files (one boolean mask and sync per expert).

    ``w1``/``w2``: ``[E, 2I, H]``/``[E, H, I]`` tensors, or lists of per-expert ``[2I, H]``/
    ``[H, I]`` tensors (separate parameters, as an ``nn.ModuleList`` of experts has).
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(len(w1)):
        token, slot = torch.where(topk_ids == e)
        if token.numel() == 0:
            continue
        gate, up = (x[token] @ w1[e].t()).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2[e].t()
        out.index_add_(0, token, y.float() * topk_weights[token, slot, None])
    return out.to(x.dtype)


def torch_expand(x: torch.Tensor, dest_to_src: torch.Tensor) -> torch.Tensor:
    """``x_perm[d] = x[dest_to_src[d] mod T]``."""
    return x.index_select(0, dest_to_src.long() % x.shape[0])


def torch_finalize(y, w, src_to_dest, bias=None):
    """``out[t] = bias + Σ_k w[t,k] · y[src_to_dest[k*T+t]]`` in float32, rounded once."""
    T, K = w.shape
    rows_k = y[src_to_dest.view(K, T).long()].float()  # [K, T, H]
    out = (rows_k * w.t().unsqueeze(-1).float()).sum(0)
    if bias is not None:
        out = out + bias.float()
    return out.to(y.dtype)


# --------------------------------------------------------------------------- FP8 baselines

FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def fp8_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q e4m3 [R, C], scale float32 [R])``, ``x ≈ q * scale[:, None]``: one scale per row,
    as a user writes it in torch."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp_min(1e-12) / FP8_MAX
    q = (xf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def _rows(q: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``q[index]`` for FP8 rows (gathered as bytes: FP8 indexing is not on every torch)."""
    return q.view(torch.uint8).index_select(0, index).view(q.dtype)


def _aligned_groups(offs: torch.Tensor, expert_of_row: torch.Tensor, align: int):
    """``(dest, padded_offs, rows)``: each expert's group of the sorted rows starts at a
    multiple of ``align`` (sorted row ``i`` goes to row ``dest[i]`` of a ``rows``-row buffer,
    ``rows`` an upper bound that needs no host sync)."""
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    padded = (counts + align - 1) // align * align
    padded_offs = torch.cumsum(padded, 0, dtype=torch.int32)
    e = expert_of_row.long()
    n = expert_of_row.numel()
    rank = torch.arange(n, device=offs.device) - (offs - counts).long()[e]
    dest = (padded_offs - padded).long()[e] + rank
    return dest, padded_offs, n + offs.numel() * (align - 1)


def scaled_grouped_mm_forward(x, w1_q, w1_scale, w2_q, w2_scale, topk_weights, topk_ids, *,
                              align: int = 1, use_fast_accum: bool = True, mm=None):  # fmt: skip
    """The FP8 rowwise MoE forward with ``torch._scaled_grouped_mm`` (no host sync).

    ``w1_q [E, 2I, H]`` / ``w2_q [E, H, I]`` e4m3 with per-output-channel scales ``w1_scale
    [E, 2I]`` / ``w2_scale [E, H]`` (``moe_route.quantize_experts(w, "fp8_channel")``): the
    operator takes ``mat_b`` as ``[E, K, N]`` column-major, which is ``w_q.transpose(1, 2)``
    with no copy, and its ``scale_b`` as ``[E, N]``. The tokens are quantised rowwise (one
    float32 scale per token), gathered into expert order (``offs``: int32 group ends), GEMM1,
    SwiGLU in bf16, quantised rowwise again, GEMM2, router weight, ``index_add_``.
    ``align > 1`` starts every expert's group at a multiple of ``align`` rows (padding rows of
    zeros), for builds that require aligned groups. ``mm``: the operator (a stand-in in tests).
    """
    mm = torch._scaled_grouped_mm if mm is None else mm
    T, E = x.shape[0], w1_q.shape[0]
    order, token, offs = grouped_mm_route(topk_ids, E)
    xq, xs = fp8_rowwise(x)
    a, sa = _rows(xq, token), xs[token]
    dest = None
    if align > 1:
        expert_of_row = topk_ids.reshape(-1)[order]
        dest, offs, rows = _aligned_groups(offs, expert_of_row, align)
        pad = torch.zeros(rows, a.shape[1], dtype=torch.uint8, device=a.device)
        a = pad.index_copy_(0, dest, a.view(torch.uint8)).view(a.dtype)
        sa = torch.ones(rows, dtype=sa.dtype, device=sa.device).index_copy_(0, dest, sa)

    def gemm(q, s, w_q, w_s):
        return mm(q, w_q.transpose(1, 2), s, w_s, offs=offs, out_dtype=torch.bfloat16,
                  use_fast_accum=use_fast_accum)  # fmt: skip

    gate, up = gemm(a, sa, w1_q, w1_scale).chunk(2, dim=-1)
    hq, hs = fp8_rowwise(F.silu(gate) * up)
    y = gemm(hq, hs, w2_q, w2_scale)
    if dest is not None:
        y = y[dest]
    y = y * topk_weights.reshape(-1)[order].unsqueeze(1).to(y.dtype)
    return y.new_zeros(T, y.shape[1]).index_add_(0, token, y).to(x.dtype)


def transformers_fp8_experts(w1_q, w1_scale, w2_q, w2_scale, block=(128, 128)):
    """``forward(x, topk_weights, topk_ids)`` of transformers' FP8 ``grouped_mm`` experts
    function (``transformers.integrations.finegrained_fp8.fp8_grouped_mm_experts_forward``,
    what ``FP8Experts`` runs with ``experts_implementation="grouped_mm"``) on block-scaled FP8
    experts: ``w1_q [E, 2I, H]`` (gate rows then up rows, its ``gate_up_proj``) and ``w2_q
    [E, H, I]`` (``down_proj``) e4m3, the scales ``[E, N/128, K/128]`` float32 (its
    ``*_scale_inv``): ``moe_route.quantize_experts(w, "fp8")``'s layout, no copy.

    Raises ImportError where transformers lacks that function; the function itself loads its
    Triton kernels from the hub (``kernels``) on its first call and raises if it cannot.
    """
    from transformers.integrations.finegrained_fp8 import (
        FP8Experts,
        fp8_grouped_mm_experts_forward,
    )

    E, two_i, H = w1_q.shape
    config = types.SimpleNamespace(hidden_size=H, num_experts=E, num_local_experts=E,
                                   moe_intermediate_size=two_i // 2,
                                   intermediate_size=two_i // 2, hidden_act="silu")  # fmt: skip
    with torch.device("meta"):  # its parameters are replaced below: allocate nothing
        experts = FP8Experts(config, block_size=tuple(block))
    experts._is_expert_parallel = False  # set by the experts-implementation decorator
    experts.has_gate = True
    for name, t in (("gate_up_proj", w1_q), ("gate_up_proj_scale_inv", w1_scale),
                    ("down_proj", w2_q), ("down_proj_scale_inv", w2_scale)):  # fmt: skip
        setattr(experts, name, torch.nn.Parameter(t, requires_grad=False))
    experts.requires_grad_(False)

    def forward(x, topk_weights, topk_ids):
        return fp8_grouped_mm_experts_forward(experts, x, topk_ids, topk_weights)

    return forward


# --------------------------------------------------------------------------- triton_kernels

#: gpt-oss's clamped SwiGLU, the gated activation that ``triton_kernels`` fuses into GEMM1
#: (``triton_kernels.swiglu.swiglu_fn``), as moe_route's ``activation=``:
#: ``g = min(gate, limit)``, ``out = g · sigmoid(alpha · g) · (clamp(up, ±limit) + 1)``.
GPT_OSS_ALPHA, GPT_OSS_LIMIT = 1.702, 7.0
GPT_OSS_ACTIVATION = f"swiglu(alpha={GPT_OSS_ALPHA}, limit={GPT_OSS_LIMIT}, up_offset=1.0)"


def triton_kernels_available() -> bool:
    """Whether a ``triton_kernels`` package can be imported (e.g. with ``PYTHONPATH=.peers``,
    bench/README.md); importing it is left to :func:`triton_kernels_experts`."""
    return importlib.util.find_spec("triton_kernels") is not None


def triton_kernels_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor, E: int):
    """``matmul_ogs``'s routing from ``topk_ids`` / ``topk_weights`` ``[T, K]``, in torch (no
    host sync): ``(sorted_to_slot, slot_to_sorted, counts, gammas)``.

    The ``T·K`` slots (slot ``t·K + k``) sorted by expert, stably: ``sorted_to_slot[i]`` int32
    is the slot of sorted row ``i`` (what triton_kernels' ``topk`` calls ``col_sorted_indx``:
    GEMM1 reads token ``sorted_to_slot[i] // K`` for row ``i``, GEMM2 writes row ``i`` to slot
    ``sorted_to_slot[i]`` before the sum over ``k``), ``slot_to_sorted`` its inverse
    (``row_sorted_indx``), ``counts`` int32 ``[E]`` the rows of each expert, ``gammas`` float32
    the router weights in sorted-row order (GEMM2 scales row ``i`` by ``gammas[i]``). Every id
    must be in ``[0, E)``.
    """
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    sorted_to_slot = torch.argsort(flat, stable=True).int()
    slot_to_sorted = torch.empty_like(sorted_to_slot).scatter_(
        0, sorted_to_slot.long(), torch.arange(n, dtype=torch.int32, device=flat.device)
    )
    counts = torch.zeros(E, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat.long(), torch.ones(n, dtype=torch.int32, device=flat.device))
    gammas = topk_weights.reshape(-1).float()[sorted_to_slot.long()]
    return sorted_to_slot, slot_to_sorted, counts, gammas


def gate_up_pairs(w1: torch.Tensor) -> torch.Tensor:
    """``w1 [E, 2I, H]`` (gate rows then up rows) as ``[E, H, 2I]`` with the columns in (gate,
    up) pairs, ``gate_j`` at ``2j`` and ``up_j`` at ``2j + 1`` (the pairs triton_kernels'
    SwiGLU reads), ``H``-major (a transposed view of one copy)."""
    E, two_i, H = w1.shape
    i = two_i // 2
    return torch.stack((w1[:, :i], w1[:, i:]), dim=2).reshape(E, two_i, H).transpose(1, 2)


def _cat_experts(parts, layout_cls, layout_opts, unswizzled_tail):
    """One triton_kernels ``Tensor`` of expert chunks converted one at a time (their storages
    joined along the experts with the chunks' strides; the layout made for the whole shape)."""
    from triton_kernels.tensor import Storage, Tensor

    datas = [p.storage.data for p in parts]
    # every chunk is a permutation of a contiguous tensor, the experts outermost
    perm = sorted(range(datas[0].ndim), key=lambda d: -datas[0].stride(d))
    inv = [perm.index(d) for d in range(len(perm))]
    data = torch.cat([d.permute(perm) for d in datas]).permute(inv)
    E = data.shape[0]
    layout = layout_cls(torch.Size((E, *unswizzled_tail)), **layout_opts)
    head = parts[0]
    return Tensor(Storage(data, layout), dtype=head.dtype, shape=[E, *head.shape[1:]])


def _triton_kernels_mxfp4(chunk, E: int, num_warps: int, experts_per_chunk: int):
    """``(value, scale)`` triton_kernels ``Tensor``s of MXFP4 experts: ``chunk(lo, hi)`` gives
    experts ``lo:hi`` as bf16 ``[e, K, N]``; its ``downcast_to_mxfp`` quantises them along ``K``
    (e2m1 pairs per byte, an e8m0 scale per 32), then its default matmul layouts for MXFP4
    weights (Hopper: its swizzled value and scale layouts, ``num_warps`` the kernel's warps),
    a few experts at a time on Hopper (the layouts' conversions take several times the codes'
    size in temporaries), all at once elsewhere."""
    from triton_kernels.numerics_details.mxfp import downcast_to_mxfp
    from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
    from triton_kernels.tensor_details import layout

    v_cls, v_opts = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
    s_cls, s_opts = layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=num_warps)
    hopper = v_cls is layout.HopperMXValueLayout and s_cls is layout.HopperMXScaleLayout
    step = experts_per_chunk if hopper else E
    values, scales = [], []
    for lo in range(0, E, step):
        q, s = downcast_to_mxfp(chunk(lo, min(E, lo + step)), torch.uint8, axis=1)
        tails = (q.shape[1:], s.shape[1:])
        values.append(convert_layout(wrap_torch_tensor(q, dtype=FP4), v_cls, **v_opts))
        scales.append(convert_layout(wrap_torch_tensor(s), s_cls, **s_opts))
        del q, s
    if len(values) == 1:
        return values[0], scales[0]
    return (_cat_experts(values, v_cls, v_opts, tails[0]),
            _cat_experts(scales, s_cls, s_opts, tails[1]))  # fmt: skip


def triton_kernels_experts(w1, w2, *, mxfp4: bool = False, num_warps: int = 8,
                           experts_per_chunk: int = 8):  # fmt: skip
    """``(forward, weight_bytes)``: ``forward(x, topk_weights, topk_ids)`` is the MoE experts
    step with OpenAI's ``triton_kernels`` (the package in Triton's repository under
    ``python/triton_kernels``; raises ImportError where it cannot be imported), with
    gpt-oss's SwiGLU (:data:`GPT_OSS_ACTIVATION`, the gated activation it fuses).

    Each call builds the routing from ``topk_ids`` (:func:`triton_kernels_routing`, a torch
    ``argsort`` as the ``grouped_mm`` pipeline builds its own, then its
    ``make_ragged_tensor_metadata``: part of the timed call, as moe_route builds its maps
    inside ``fused_moe``), then two ``matmul_ogs``: GEMM1 gathers each sorted row's token
    (``GatherIndx``) and applies the SwiGLU in its epilogue (``FusedActivation``, ``FnSpecs``
    ``"swiglu"`` with ``reduction_n=2``); GEMM2 scales each row by its router weight
    (``gammas``) and writes it to its slot (``ScatterIndx``), and ``matmul_ogs``'s reduce
    kernel sums each token's ``K`` slots (its path for ``n_expts_act > 1`` at this version).

    The weights are converted here, once: ``w1 [E, 2I, H]`` to :func:`gate_up_pairs` (a copy),
    ``w2 [E, H, I]`` to ``[E, I, H]`` (a view), both ``K``-major as triton_kernels' own
    benchmark passes bf16 weights; with ``mxfp4`` both quantised to MXFP4 by its own
    quantiser and put in its layouts (:func:`_triton_kernels_mxfp4`; bf16 activations, the
    scales through ``PrecisionConfig(weight_scale=...)``). ``weight_bytes``: all experts'
    converted weights and scales.
    """
    from triton_kernels.matmul_ogs import (
        FnSpecs,
        FusedActivation,
        GatherIndx,
        PrecisionConfig,
        RoutingData,
        ScatterIndx,
        matmul_ogs,
    )
    from triton_kernels.swiglu import swiglu_fn
    from triton_kernels.tensor import make_ragged_tensor_metadata

    E = w1.shape[0]
    if mxfp4:
        v1, s1 = _triton_kernels_mxfp4(lambda lo, hi: gate_up_pairs(w1[lo:hi]), E, num_warps,
                                       experts_per_chunk)  # fmt: skip
        v2, s2 = _triton_kernels_mxfp4(lambda lo, hi: w2[lo:hi].transpose(1, 2), E, num_warps,
                                       experts_per_chunk)  # fmt: skip
        pc1, pc2 = PrecisionConfig(weight_scale=s1), PrecisionConfig(weight_scale=s2)
        stored = (v1.storage.data, v2.storage.data, s1.storage.data, s2.storage.data)
    else:
        v1, v2 = gate_up_pairs(w1), w2.transpose(1, 2)
        pc1 = pc2 = PrecisionConfig()
        stored = (v1, v2)
    weight_bytes = sum(t.numel() * t.element_size() for t in stored)
    spec = FnSpecs("swiglu", swiglu_fn, ("alpha", "limit"), reduction_n=2)
    act = FusedActivation(spec, (GPT_OSS_ALPHA, GPT_OSS_LIMIT))

    def forward(x, topk_weights, topk_ids):
        K = topk_ids.shape[1]
        sorted_to_slot, slot_to_sorted, counts, gammas = triton_kernels_routing(
            topk_ids, topk_weights, E
        )
        meta = make_ragged_tensor_metadata(counts, sorted_to_slot.numel())
        rdata = RoutingData(None, meta.slice_sizes, E, K, meta)
        h = matmul_ogs(x, v1, None, rdata, gather_indx=GatherIndx(sorted_to_slot, slot_to_sorted),
                       precision_config=pc1, fused_activation=act)  # fmt: skip
        return matmul_ogs(h, v2, None, rdata, precision_config=pc2, gammas=gammas,
                          scatter_indx=ScatterIndx(slot_to_sorted, sorted_to_slot))  # fmt: skip

    return forward, weight_bytes
