"""The PyTorch code a user would write without moe_route: the baselines of every benchmark.

* :func:`argsort_maps` — the routing tables from an ``argsort`` (same bits as the maps kernel);
* :func:`grouped_mm_forward` — ``argsort`` + gather + ``torch._grouped_mm`` ×2 + ``index_add_``
  (no host sync, differentiable: the training baseline too);
* :func:`loop_forward` — the per-expert loop of usual model code (one mask and sync per expert;
  with ``w1``/``w2`` given as lists of per-expert tensors it is the ``nn.ModuleList`` version
  whose backward gives each expert its own gradient);
* :func:`torch_finalize` — gather through the map, weight, sum over ``k``.
"""

from __future__ import annotations

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
