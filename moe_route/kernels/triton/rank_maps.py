"""Rank maps in Triton: expert parallelism's routing maps, with the destination rank as the
expert, in one launch.

Token ``t`` goes to rank ``d`` when any of its ``K`` expert ids lies in ``d``'s range
``[d·El, (d+1)·El)``. Slot ``(t, d)`` is expanded source row ``s = d·T + t`` (``K = E = W``).
Its place among rank ``d``'s slots is the count of tokens before ``t`` that go there (routed),
or, for a token that does not, the routed count plus the count of tokens before ``t`` that
do not (idle). Two layouts of the dest rows:

* blocks (``C > 0``): place ``p < C`` lands at row ``d·C + p``, the rest at
  ``W·C + d·(T - C) + p - C``; a routed slot is kept if ``p < C``;
* exact (``C = 0``): the contract's order, routed rows of rank ``d`` at ``off[d] + p``, the
  idle slots after ``off[W]`` in source order.

One program walks the tokens twice (a count, then a running scan per rank), so the places are
the same bits on every run. It also writes ``ids_out``: the ids with the slots whose token
does not travel to their rank set to ``-1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import LaunchKey, ThinKernel, next_pow2


@triton.jit
def _goes(ids_ptr, stride_t, stride_k, t, T, El, K: tl.constexpr, KP: tl.constexpr,
          WP: tl.constexpr):  # fmt: skip
    """``[BLOCK_T, WP]`` int32: whether token ``t`` goes to rank ``d``; and the ids' owners."""
    kk = tl.arange(0, KP)
    d = tl.arange(0, WP)
    mask = (t[:, None] < T) & (kk[None, :] < K)
    ids = tl.load(ids_ptr + t[:, None] * stride_t + kk[None, :] * stride_k, mask=mask, other=-1)
    ids = ids.to(tl.int32)
    owner = tl.where(ids >= 0, ids // El, -1)
    hit = tl.where(owner[:, :, None] == d[None, None, :], 1, 0)
    return tl.max(hit, 1), ids, owner


@triton.jit(do_not_specialize=["T_ids", "T", "C", "El"])
def _rank_maps_kernel(ids_ptr, stride_t, stride_k, s2d_ptr, d2s_ptr, efs_ptr, off_ptr,
                      ids_out_ptr, T_ids, T, C, El, K: tl.constexpr, W: tl.constexpr,
                      KP: tl.constexpr, WP: tl.constexpr, BLOCK_T: tl.constexpr,
                      EXACT: tl.constexpr):  # fmt: skip
    d = tl.arange(0, WP)
    kk = tl.arange(0, KP)
    count = tl.zeros([WP], tl.int32)
    for start in range(0, T, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        goes, _, _ = _goes(ids_ptr, stride_t, stride_k, t, T_ids, El, K, KP, WP)
        count += tl.sum(goes, 0)
    if EXACT:
        first = tl.cumsum(count, 0) - count  # off[d]
        routed = tl.sum(count, 0)
        tl.store(off_ptr + d, tl.where(d < W, first, routed).to(tl.int64), mask=d <= W)
    else:
        tl.store(off_ptr + d, (d * C).to(tl.int64), mask=d <= W)
    running = tl.zeros([WP], tl.int32)
    for start in range(0, T, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        goes, ids, owner = _goes(ids_ptr, stride_t, stride_k, t, T_ids, El, K, KP, WP)
        seen = running[None, :] + tl.cumsum(goes, 0)  # tokens up to t (inclusive) going to d
        running += tl.sum(goes, 0)
        tt = t[:, None]
        dd = d[None, :]
        if EXACT:
            idle = routed + (dd * T - first[None, :]) + (tt - seen)
            row = tl.where(goes > 0, first[None, :] + seen - 1, idle)
            keep = goes > 0
        else:
            p = tl.where(goes > 0, seen - 1, count[None, :] + tt - seen)
            row = tl.where(p < C, dd * C + p, W * C + dd * (T - C) + p - C)
            keep = (goes > 0) & (p < C)
        src = dd * T + tt
        valid = (tt < T) & (dd < W)
        tl.store(s2d_ptr + src, row, mask=valid)
        tl.store(d2s_ptr + row, src, mask=valid)
        tl.store(efs_ptr + src, tl.where(keep, dd, -1), mask=valid)
        kept = tl.max(tl.where((owner[:, :, None] == d[None, None, :]) & keep[:, None, :], 1, 0), 2)
        out = tl.where(kept > 0, ids, -1)
        tl.store(ids_out_ptr + tt * K + kk[None, :], out, mask=(tt < T_ids) & (kk[None, :] < K))


_RANK_MAPS = ThinKernel(_rank_maps_kernel)


def rank_maps_triton(ids: torch.Tensor, local_experts: int, ranks: int, capacity: int,
                     tokens: int, s2d, d2s, efs, off, ids_out) -> None:  # fmt: skip
    """Fill the rank maps of ``ids [T_ids, K]`` over ``tokens >= T_ids`` tokens (the rest
    have no slots): ``s2d``, ``d2s``, ``efs`` ``[tokens·W]`` int32, ``off [W+1]`` int64,
    ``ids_out [T_ids, K]`` int32; ``capacity`` 0 for the exact layout."""
    K = ids.shape[1]
    KP, WP = next_pow2(K), next_pow2(ranks + 1)
    block_t = max(16, min(1024, next_pow2(max(8192 // (KP * WP), 1))))
    key = LaunchKey((ids.dtype, ids.stride(), K, ranks, block_t, capacity == 0))

    def constexprs():
        return dict(K=K, W=ranks, KP=KP, WP=WP, BLOCK_T=block_t, EXACT=capacity == 0,
                    num_warps=4)  # fmt: skip

    args = (ids, *ids.stride(), s2d, d2s, efs, off, ids_out, ids.shape[0], tokens, capacity,
            local_experts)  # fmt: skip
    _RANK_MAPS.launch(key, (1,), args, constexprs)
