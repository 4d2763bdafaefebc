"""The rank maps of expert parallelism (moe_route/kernels/triton/rank_maps.py and its torch
twin): which rank each token travels to and where its row sits in the send buffer.

The exact layout must equal :func:`moe_route.build_routing_maps` on the rank ids (the data
contract, built by other kernels); the block layout is checked against a direct Python
statement of it; the Triton kernel (interpreted) and the torch implementation give the same
integers.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from moe_cases import needs_interpreter

import moe_route
from moe_route.kernels.torch_impl import rank_maps_torch
from moe_route.kernels.triton.rank_maps import rank_maps_triton


def rank_ids(ids: torch.Tensor, El: int, W: int) -> torch.Tensor:
    """``[T, W]``: ``d`` where token ``t`` has an expert on rank ``d``, else ``-1``."""
    owner = torch.where(ids >= 0, ids // El, -1)
    goes = (owner.unsqueeze(-1) == torch.arange(W)).any(1)
    return torch.where(goes, torch.arange(W), -1)


def block_layout(ids, El, W, C, T):
    """The block layout in plain Python: ``(s2d, efs, ids_out)``."""
    T_ids, K = ids.shape
    goes = rank_ids(ids, El, W) >= 0
    s2d, efs = [0] * (T * W), [-1] * (T * W)
    keep = [[False] * W for _ in range(T)]
    for d in range(W):
        order = [t for t in range(T) if t < T_ids and goes[t, d]]
        order += [t for t in range(T) if not (t < T_ids and goes[t, d])]
        for p, t in enumerate(order):
            routed = t < T_ids and bool(goes[t, d])
            s2d[d * T + t] = d * C + p if p < C else W * C + d * (T - C) + p - C
            if routed and p < C:
                efs[d * T + t], keep[t][d] = d, True
    ids_out = ids.clone()
    for t in range(T_ids):
        for k in range(K):
            e = int(ids[t, k])
            if e >= 0 and (e // El >= W or not keep[t][e // El]):
                ids_out[t, k] = -1
    return s2d, efs, ids_out


def triton_tables(ids, El, W, C, T):
    N = T * W
    s2d, d2s, efs = (torch.empty(N, dtype=torch.int32) for _ in range(3))
    off, ids_out = torch.empty(W + 1, dtype=torch.int64), torch.empty_like(ids)
    rank_maps_triton(ids, El, W, C, T, s2d, d2s, efs, off, ids_out)
    return s2d, d2s, efs, off, ids_out


def random_ids(T, K, E, seed, dtype=torch.int32):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else None
    if ids is None:
        return torch.zeros(0, K, dtype=dtype)
    ids = ids.to(dtype)
    ids[torch.rand(T, K, generator=g) < 0.2] = -1  # dropped slots
    return ids


def check_tables(tables, ids, El, W, C, T):
    s2d, d2s, efs, off, ids_out = tables
    N = T * W
    assert torch.equal(torch.sort(s2d.long()).values, torch.arange(N))  # a bijection
    assert torch.equal(d2s.long()[s2d.long()], torch.arange(N))  # and its inverse
    if C == 0:
        want = moe_route.build_routing_maps(rank_ids(ids, El, W), W)
        assert ids.shape[0] == T
        for got, ref in zip((s2d, d2s, efs, off), want.tensors(), strict=True):
            assert torch.equal(got, ref)
        assert torch.equal(ids_out, torch.where(ids // El < W, ids, -1))
    else:
        s2d_ref, efs_ref, ids_ref = block_layout(ids, El, W, C, T)
        assert s2d.tolist() == s2d_ref
        assert efs.tolist() == efs_ref
        assert torch.equal(ids_out, ids_ref)
        assert torch.equal(off, torch.arange(W + 1) * C)


CASES = [  # (T_ids, T, K, El, W, C): C = 0 exact; T > T_ids padding tokens
    (13, 13, 3, 2, 4, 13),
    (13, 13, 3, 2, 4, 5),
    (13, 13, 3, 2, 4, 0),
    (7, 11, 2, 3, 2, 11),
    (40, 40, 8, 4, 8, 40),
    (40, 40, 8, 4, 8, 0),
    (0, 0, 2, 2, 2, 0),
    (0, 6, 2, 2, 2, 6),
    (300, 300, 4, 1, 8, 120),
]


@pytest.mark.parametrize(("T_ids", "T", "K", "El", "W", "C"), CASES)
def test_torch_rank_maps(T_ids, T, K, El, W, C):
    ids = random_ids(T_ids, K, El * W, seed=T_ids + 7 * W + C)
    check_tables(rank_maps_torch(ids, El, W, C, T), ids, El, W, C, T)


@needs_interpreter
@pytest.mark.parametrize(("T_ids", "T", "K", "El", "W", "C"), CASES)
def test_triton_rank_maps_equal_torch(T_ids, T, K, El, W, C):
    ids = random_ids(T_ids, K, El * W, seed=T_ids + 7 * W + C, dtype=torch.int64)
    got = triton_tables(ids, El, W, C, T)
    check_tables(got, ids, El, W, C, T)
    for a, b in zip(got, rank_maps_torch(ids, El, W, C, T), strict=True):
        assert torch.equal(a, b)


def test_ids_out_of_range_travel_nowhere():
    """Unchecked ids at or past E belong to no rank: no row, slot dropped."""
    ids = torch.tensor([[0, 9], [12, 3], [-1, 5]], dtype=torch.int32)  # E = 8: 9, 12 invalid
    tables = rank_maps_torch(ids, 2, 4, 3, 3)
    check_tables(tables, ids, 2, 4, 3, 3)
    assert tables[4].tolist() == [[0, -1], [-1, 3], [-1, 5]]


@needs_interpreter
def test_strided_ids():
    ids = random_ids(9, 6, 8, seed=3)[:, ::2]  # [9, 3] with stride 2
    check_tables(triton_tables(ids, 2, 4, 4, 9), ids, 2, 4, 4, 9)


@settings(max_examples=25, deadline=None)
@given(
    T=st.integers(0, 40), K=st.integers(1, 4), El=st.integers(1, 3), W=st.integers(1, 5),
    cap=st.integers(0, 45), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_rank_maps_invariants(T, K, El, W, cap, seed):
    K = min(K, El * W)
    ids = random_ids(T, K, El * W, seed)
    C = cap if cap == 0 else min(cap, T) if T else 0
    check_tables(rank_maps_torch(ids, El, W, C, T), ids, El, W, C, T)
