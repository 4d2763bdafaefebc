"""The rank maps of expert parallelism in torch ops, the twin of
:mod:`moe_route.kernels.triton.rank_maps`."""

from __future__ import annotations

import torch


def rank_maps_torch(ids: torch.Tensor, local_experts: int, ranks: int, capacity: int,
                    tokens: int):  # fmt: skip
    """:func:`moe_route.kernels.triton.rank_maps.rank_maps_triton` in torch ops:
    ``(s2d, d2s, efs, off, ids_out)`` of the rank maps of ``ids [T_ids, K]`` over ``tokens``
    tokens (``capacity`` 0: the exact layout)."""
    T_ids = ids.shape[0]
    T, W, C, dev = tokens, ranks, capacity, ids.device
    d = torch.arange(W, device=dev)
    owner = torch.where(ids >= 0, torch.div(ids, local_experts, rounding_mode="floor"), -1)
    goes = (owner.unsqueeze(-1) == d).any(1)  # [T_ids, W]
    if T_ids < T:
        goes = torch.cat([goes, goes.new_zeros(T - T_ids, W)])
    t = torch.arange(T, device=dev).unsqueeze(1)
    seen = goes.to(torch.int64).cumsum(0)  # tokens up to t going to d
    count = seen[-1] if T else torch.zeros(W, dtype=torch.int64, device=dev)
    if C == 0:
        first = count.cumsum(0) - count
        routed = count.sum()
        idle = routed + (d * T - first) + (t - seen)
        row = torch.where(goes, first + seen - 1, idle)
        keep = goes
        off = torch.cat([first, routed.view(1)])
    else:
        p = torch.where(goes, seen - 1, count + t - seen)
        row = torch.where(p < C, d * C + p, W * C + d * (T - C) + p - C)
        keep = goes & (p < C)
        off = torch.arange(W + 1, device=dev, dtype=torch.int64) * C
    s2d = row.t().reshape(-1).to(torch.int32)  # source row d*T + t
    src = (d.unsqueeze(1) * T + t.t()).reshape(-1).to(torch.int32)
    d2s = torch.empty_like(s2d).scatter_(0, s2d.long(), src)
    efs = torch.where(keep, d, -1).t().reshape(-1).to(torch.int32)
    kept = torch.gather(keep[:T_ids], 1, owner.clamp(0, W - 1).long()) & (ids >= 0) & (owner < W)
    return s2d, d2s, efs, off, torch.where(kept, ids, -1)
