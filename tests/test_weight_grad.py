"""The weight-gradient kernels (moe_route/kernels/triton/weight_grad.py) against a float64
per-expert ``A^T B``: the pointer kernel (operands gathered through the maps or not) and the
TMA kernel (both operands permuted, every row step through descriptors bounded at the
expert's last row; one tile per program or persistent, tiles ordered along either
dimension, a loop per tile or one flat loop over a program's tiles' row steps), with bias
gradients
scaled by the router weights, experts without rows, NaN rows past the last expert (dropped
slots: never read) and odd sizes. CPU runs use the interpreter in float16
(its bf16 ``tl.dot`` is wrong); tests/test_gpu_training.py covers bf16 on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from moe_cases import make_ids, needs_interpreter

from moe_route.kernels.triton.weight_grad import WeightGradConfig, expert_weight_grad_triton
from moe_route.reference import routing_maps_reference

pytestmark = needs_interpreter

# float16 operands, float32 accumulation over <= 40 rows, rounded once to float16
TOL = 2e-3


def _setup(T, K, E, N, KD, seed, drop=0.0):
    g = torch.Generator().manual_seed(seed)
    ids = make_ids(T, K, E, drop=drop, seed=seed)
    s2d, d2s, efs, off = routing_maps_reference(ids, E)
    M = T * K
    a = torch.randn(M, N, generator=g).half()
    b = torch.randn(M, KD, generator=g).half()
    w = torch.rand(T, K, generator=g).half()
    return (s2d, d2s, efs, off), a, b, w


def _oracle(a, b, off, d2s, w):
    E = off.numel() - 1
    T = w.shape[0]
    dw = torch.zeros(E, a.shape[1], b.shape[1], dtype=torch.float64)
    db = torch.zeros(E, a.shape[1], dtype=torch.float64)
    for e in range(E):
        lo, hi = int(off[e]), int(off[e + 1])
        dw[e] = a[lo:hi].double().T @ b[lo:hi].double()
        src = d2s[lo:hi]
        s = w[src % T, src // T].double()
        db[e] = (a[lo:hi].double() * s[:, None]).sum(0)
    return dw, db


def _rel(got, want):
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize(
    ("use_tma", "persistent", "k_fastest", "flat", "tma_store"),
    [(False, 0, True, False, True), (True, 0, True, False, True), (True, 1, True, False, True),
     (True, 2, False, False, True), (True, 0, True, True, True), (True, 1, True, True, True),
     (True, 3, False, True, True), (True, 1, True, True, False)],
    ids=["pointers", "tma", "tma-persistent", "tma-persistent-along-n", "flat",
         "flat-persistent", "flat-persistent-along-n", "flat-persistent-pointer-stores"],
)  # fmt: skip
@pytest.mark.parametrize(
    ("T", "K", "E", "N", "KD", "drop"),
    [(13, 2, 5, 48, 80, 0.0), (9, 3, 7, 16, 32, 0.2), (20, 1, 2, 80, 48, 0.0)],
    ids=["odd", "dropped+empty", "long-experts"],
)
def test_weight_grad_kernels_match_float64(use_tma, persistent, k_fastest, flat, tma_store, T, K,
                                           E, N, KD, drop):  # fmt: skip
    # sizes: multiples of 16 elements (the interpreter's descriptors want 16-element strides),
    # not of the 32-wide tiles; rows per expert not a multiple of the 8-row step
    maps, a, b, w = _setup(T, K, E, N, KD, seed=T + E, drop=drop)
    _, d2s, _, off = maps
    cfg = WeightGradConfig(8, 32, 32, 4, 2, use_tma=use_tma, persistent=persistent,
                           k_fastest=k_fastest, flat=flat, tma_store=tma_store)  # fmt: skip
    routed = int(off[-1])
    a[routed:] = float("nan")  # the dropped slots' rows: no kernel may read them
    b[routed:] = float("nan")
    dw = torch.full((E, N, KD), float("nan"), dtype=torch.float16)  # poisoned
    db = torch.full((E, N), float("nan"), dtype=torch.float16)
    expert_weight_grad_triton(a, b, off, dw, cfg, db=db, dest_to_src=d2s, db_scale=w,
                              num_rows=T * K)  # fmt: skip
    want_dw, want_db = _oracle(a, b, off, d2s, w)
    assert not dw.isnan().any() and not db.isnan().any()
    assert _rel(dw, want_dw) < TOL and _rel(db, want_db) < TOL
    empty = (off[1:] == off[:-1]).nonzero().flatten()
    assert torch.equal(dw[empty], torch.zeros_like(dw[empty]))


def test_gathered_operand_matches_permuted():
    """The pointer kernel reading token rows through the maps gives what the TMA kernel gives
    on the permuted rows (the two routes of the backward); a TMA config with a gathered
    operand takes the pointer kernel."""
    T, K, E, N, KD = 11, 2, 4, 16, 48
    maps, a, _, _ = _setup(T, K, E, N, KD, seed=3)
    _, d2s, _, off = maps
    x = torch.randn(T, KD, generator=torch.Generator().manual_seed(5)).half()
    x_perm = x[d2s % T]
    out = []
    for cfg, b, gather in (
        (WeightGradConfig(8, 16, 16, 4, 2, use_tma=True), x, True),
        (WeightGradConfig(8, 16, 16, 4, 2, use_tma=True), x_perm, False),
    ):
        dw = torch.empty(E, N, KD, dtype=torch.float16)
        expert_weight_grad_triton(a, b, off, dw, cfg, dest_to_src=d2s, b_gather=gather,
                                  num_rows=T * K)  # fmt: skip
        out.append(dw)
    assert _rel(out[1], out[0].double()) < TOL


def test_tuning_writes_short_reductions_with_pointer_stores():
    """The bf16 SM90 tiles for 17-128 rows per expert take one program per SM and pointer
    stores (docs/decisions.md, "Weight gradients at 17-128 rows per expert": with TMA stores,
    dW's dirty lines push the operands out of L2), 128x256 above 64 rows; longer reductions
    keep the TMA store; the decode sizes take the pointer kernel."""
    from moe_route import tuning

    for rows in (17.0, 64.0, 65.0, 128.0):
        cfg = tuning.weight_grad_config(rows, 4096, 7168, torch.bfloat16, 90)
        assert (cfg.use_tma, cfg.persistent, cfg.flat, cfg.tma_store) == (True, 1, True, False)
        # above 64 rows, 128x256 tiles on 8 warps (fewer operand reads per byte of dW)
        wide = rows > 64
        assert (cfg.block_n, cfg.block_k, cfg.num_warps) == ((128, 256, 8) if wide else
                                                             (128, 128, 4))  # fmt: skip
    for rows in (256.0, 1024.0):
        cfg = tuning.weight_grad_config(rows, 4096, 7168, torch.bfloat16, 90)
        assert cfg.use_tma and cfg.tma_store
    assert not tuning.weight_grad_config(8.0, 4096, 7168, torch.bfloat16, 90).use_tma
