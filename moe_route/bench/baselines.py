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
  block-scaled FP8 experts (the ``quant`` stage's optional baselines).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F


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


def grouped_mm_gemm1(x, w1t, token, offs):
    """GEMM1 + SwiGLU of the ``_grouped_mm`` pipeline; ``w1t`` is ``[E, H, 2I]``."""
    gate, up = torch._grouped_mm(x[token], w1t, offs=offs).chunk(2, dim=-1)
    return F.silu(gate) * up


def grouped_mm_gemm2_finalize(h, w2t, topk_weights, order, token, offs, T):
    """GEMM2, router weight, ``index_add_`` reduce; ``w2t`` is ``[E, I, H]``."""
    y = torch._grouped_mm(h, w2t, offs=offs)
    y = y * topk_weights.reshape(-1)[order].unsqueeze(1).to(y.dtype)
    return y.new_zeros(T, y.shape[1]).index_add_(0, token, y)


def grouped_mm_forward(x, w1t, w2t, topk_weights, topk_ids):
    """The ``torch._grouped_mm`` pipeline a user would write (no host sync, index_add_ reduce).

    ``w1t = w1.transpose(1, 2)`` (``[E, H, 2I]``), ``w2t = w2.transpose(1, 2)`` (``[E, I, H]``).
    """
    order, token, offs = grouped_mm_route(topk_ids, w1t.shape[0])
    h = grouped_mm_gemm1(x, w1t, token, offs)
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
