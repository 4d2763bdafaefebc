"""The split activation backward on the CPU (interpreter): the row pass
(:func:`moe_route.kernels.triton.act_backward.act_backward_rows_triton`) against the float64
reference for every activation kind and layout, and ``fused_moe``'s backward with the split
forced against the fused kernel; the tuning choice and its dispatch.

Tolerances: the row pass computes ``h`` and ``dz`` in float32 from 16-bit inputs and rounds
them once: float16 2e-3 relative, float32 1e-6, float64 1e-12 (the reference rounds ``h`` to
the dtype the same way, so ``w·h`` is compared at the dtype's own rounding).
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from moe_cases import ACT_IDS, ACT_LAYOUTS, ACT_VARIANTS, NAN, make_ids, needs_interpreter, rand
from moe_cases import moe_case as make_moe

import moe_route
from moe_route import tuning
from moe_route.activations import as_activation
from moe_route.kernels.triton.act_backward import (
    ActBackwardConfig,
    RowPassConfig,
    act_backward_rows_triton,
)
from moe_route.plan import clear_plans, epilogue_for
from moe_route.reference import (
    activation_backward_reference,
    activation_reference,
    routing_maps_reference,
)

kt_moe = importlib.import_module("moe_route.kernels.triton.moe")

ROW_TOL = {torch.float16: 2e-3, torch.float32: 1e-6, torch.float64: 1e-12}
ACTS = list(ACT_LAYOUTS) + list(ACT_VARIANTS.values())
IDS = ACT_IDS + list(ACT_VARIANTS)
#: small tiles: several row tiles and column blocks, a tail in each
SMALL = RowPassConfig(block_m=8, block_n=8, num_warps=4)


def _rows_case(T, K, E, inter, activation, dtype, *, used=None, seed=0):
    """Inputs of the row pass: ``used`` experts of ``E`` hold rows (the others none), 25 % of
    the slots dropped; ``g`` and ``z`` in ``dtype``, router weights in float32 (NaN where
    dropped: never read)."""
    ids = make_ids(T, K, used or E, drop=0.25, seed=seed)
    _, d2s, _, off = routing_maps_reference(ids, E)
    M = T * K
    width = 2 * inter if as_activation(activation).gated else inter
    tw = torch.softmax(rand(T, K, seed=seed + 1), dim=-1).float().masked_fill(ids < 0, NAN)
    g = rand(M, inter, dtype=dtype, seed=seed + 2)
    z = rand(M, width, dtype=dtype, scale=2.0, seed=seed + 3)
    return dict(g=g, z=z, tw=tw, d2s=d2s, off=off, T=T)


def _rows_reference(c, activation, layout, dtype):
    """``(wh, dz, per-row <g, h>)`` in float64, ``h`` rounded to ``dtype`` first; dropped rows
    zero."""
    off, d2s, T = c["off"], c["d2s"], c["T"]
    routed = int(off[-1])
    src = d2s[:routed]
    w = c["tw"].double()[src % T, src // T].unsqueeze(1)
    z, g = c["z"].double()[:routed], c["g"].double()[:routed]
    h = activation_reference(z, activation, layout).to(dtype).double()
    wh = torch.zeros(c["g"].shape, dtype=torch.float64)
    dz = torch.zeros(c["z"].shape, dtype=torch.float64)
    part = torch.zeros(c["g"].shape[0], dtype=torch.float64)
    wh[:routed] = w * h
    dz[:routed] = activation_backward_reference(z, w * g, activation, layout)
    part[:routed] = (g * h).sum(1)
    return wh, dz, part, h


def _run_rows(c, activation, layout, cfg=SMALL, *, g=None, wh=None, dz=None):
    epi = epilogue_for(as_activation(activation), layout)
    g = c["g"] if g is None else g
    wh = torch.full_like(c["g"], NAN) if wh is None else wh
    dz = torch.full_like(c["z"], NAN) if dz is None else dz
    partial = act_backward_rows_triton(
        g, c["z"], c["tw"], c["off"], c["d2s"], wh, dz, cfg, epilogue=epi
    )
    return wh, dz, partial


def _close(got, want, tol, what):
    scale = want.abs().max().item() + 1.0
    err = (got.double() - want).abs().max().item()
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol:.1g} x {scale:.3g}"


@needs_interpreter
@pytest.mark.parametrize(("activation", "layout"), ACTS, ids=IDS)
def test_row_pass_matches_reference(activation, layout):
    """Every kind and layout (gpt-oss's clamped swiglu with alpha and up_offset included), odd
    I = 13 in 8-column blocks, an expert with no rows, dropped slots; float32."""
    dtype = torch.float32
    c = _rows_case(11, 3, 6, 13, activation, dtype, used=5)
    wh, dz, partial = _run_rows(c, activation, layout)
    want_wh, want_dz, want_part, h = _rows_reference(c, activation, layout, dtype)
    routed = int(c["off"][-1])
    assert 0 < routed < c["g"].shape[0]  # some rows routed, some dropped
    assert partial.shape == (c["g"].shape[0], 2) and partial.dtype == torch.float32
    _close(wh, want_wh, ROW_TOL[dtype], "wh")
    _close(dz, want_dz, ROW_TOL[dtype], "dz")
    _close(partial.double().sum(1), want_part, ROW_TOL[dtype], "sum of partials")
    # each partial is its own column block's dot product
    blocks = (c["g"].double()[:routed] * h).split(SMALL.block_n, dim=1)
    for j, block in enumerate(blocks):
        _close(partial[:routed, j], block.sum(1), ROW_TOL[dtype], f"partial[:, {j}]")
    for t in (wh[routed:], dz[routed:], partial[routed:]):  # defined zeros, NaN poison gone
        assert torch.equal(t, torch.zeros_like(t))


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.float64], ids=["fp16", "fp64"])
@pytest.mark.parametrize(
    ("activation", "layout"),
    [("swiglu", "concat"), ACT_VARIANTS["clamped-swiglu"], ("gelu", "concat")],
    ids=["swiglu", "clamped", "gelu"],
)
def test_row_pass_other_dtypes(dtype, activation, layout):
    c = _rows_case(9, 2, 4, 19, activation, dtype, seed=3)
    wh, dz, partial = _run_rows(c, activation, layout)
    want_wh, want_dz, want_part, _ = _rows_reference(c, activation, layout, dtype)
    assert wh.dtype == dz.dtype == dtype
    assert partial.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tol = ROW_TOL[dtype]
    _close(wh, want_wh, tol, "wh")
    _close(dz, want_dz, tol, "dz")
    _close(partial.double().sum(1), want_part, tol, "sum of partials")


@needs_interpreter
@pytest.mark.parametrize(("activation", "layout"), [("swiglu", "interleaved"), ("relu", "concat")])
def test_row_pass_in_place(activation, layout):
    """``g`` read from ``wh``'s buffer and ``dz`` written over ``z`` (how the backward calls it):
    the same bits as separate buffers."""
    c = _rows_case(10, 2, 3, 21, activation, torch.float32, seed=5)
    want = _run_rows(c, activation, layout)
    wh = c["g"].clone()
    z = c["z"].clone()
    got = _run_rows({**c, "z": z}, activation, layout, g=wh, wh=wh, dz=z)
    for a, b, name in zip(got, want, ("wh", "dz", "partial"), strict=True):
        assert torch.equal(a, b), name


@needs_interpreter
def test_row_pass_edges():
    """No rows at all, every slot dropped, one wide column block."""
    c = _rows_case(0, 2, 3, 8, "swiglu", torch.float32)
    wh, dz, partial = _run_rows(c, "swiglu", "concat")
    assert wh.shape == (0, 8) and partial.shape == (0, 1)
    c = _rows_case(5, 2, 3, 8, "swiglu", torch.float32)
    c["off"] = torch.zeros_like(c["off"])  # every slot dropped: offset[E] = 0
    wh, dz, partial = _run_rows(c, "swiglu", "concat", RowPassConfig(16, 64, 4))
    for t in (wh, dz, partial):
        assert torch.equal(t, torch.zeros_like(t))


# ----------------------------------------------------------------------------- whole backward
NAMES = ("x", "w1", "w2", "topk_weights", "b1", "b2", "bias")


def _force(monkeypatch, split: bool, rows: RowPassConfig = SMALL):
    real = tuning.act_backward_config

    def config(*args, **kwargs):
        return dataclasses.replace(real(*args, **kwargs), split=split, rows=rows)

    monkeypatch.setattr(tuning, "act_backward_config", config)
    clear_plans()


def _backward(case, activation, layout, dout):
    leaves = [case[n].clone().requires_grad_(True) for n in NAMES]
    x, w1, w2, tw, b1, b2, bias = leaves
    out = moe_route.fused_moe(x, w1, w2, tw, case["topk_ids"], activation=activation,
                              gate_up_layout=layout, b1=b1, b2=b2, bias=bias,
                              backend="triton")  # fmt: skip
    return torch.autograd.grad(out, leaves, dout)


@pytest.fixture
def counted(monkeypatch):
    """Counts of step 1's two ways in ``fused_moe``'s backward."""
    calls = {"split": 0, "fused": 0}
    for cls, key in ((kt_moe.RowPassLaunch, "split"), (kt_moe.ActBackwardLaunch, "fused")):
        real = cls.__call__

        def wrapped(*args, real=real, key=key, **kw):
            calls[key] += 1
            return real(*args, **kw)

        monkeypatch.setattr(cls, "__call__", wrapped)
    yield calls
    clear_plans()


GRAD_TOL = {torch.float16: 4e-3, torch.float32: 1e-6, torch.float64: 1e-12}


# Each dtype once, each activation at least once (the full product ran the same code paths):
# the dtype decides the rounding of g (16 bits: the two ways differ by it; fp32 / fp64: the
# same GEMM tiles, only the router partials' blocks differ), the activation the row pass's
# epilogue, which test_row_pass_matches_reference and test_row_pass_other_dtypes run against
# the float64 reference with every activation kind and dtype.
SPLIT_CASES = [
    ("swiglu", "concat", torch.float32),
    (*ACT_VARIANTS["clamped-swiglu"], torch.float16),
    ("swiglu", "concat", torch.float64),
]
SPLIT_IDS = ["swiglu-fp32", "clamped-interleaved-fp16", "swiglu-fp64"]


@needs_interpreter
@pytest.mark.parametrize(("activation", "layout", "dtype"), SPLIT_CASES, ids=SPLIT_IDS)
def test_split_backward_matches_fused(monkeypatch, counted, activation, layout, dtype):
    """Every gradient of ``fused_moe`` with the split forced against the fused kernel: they
    differ by ``g``'s rounding to 16 bits only (float32 / float64: the same GEMM tiles on the
    CPU, so only the router partials' blocks differ). Experts with no rows, dropped slots,
    odd H and I, biases; two split runs give the same bits."""
    ids = make_ids(13, 3, 5, drop=0.2, seed=4)  # experts 5, 6 hold no rows
    case = make_moe(13, 3, 7, 27, 13, activation=as_activation(activation), dtype=dtype,
                    b1=True, b2=True, bias="H", ids=ids, seed=2)  # fmt: skip
    case["topk_weights"] = case["topk_weights"].to(dtype)
    dout = rand(13, 27, dtype=dtype, seed=9)
    _force(monkeypatch, False)
    fused = _backward(case, activation, layout, dout)
    assert counted == {"split": 0, "fused": 1}
    _force(monkeypatch, True)
    split = _backward(case, activation, layout, dout)
    again = _backward(case, activation, layout, dout)
    assert counted == {"split": 2, "fused": 1}
    for name, a, b, c in zip(NAMES, split, fused, again, strict=True):
        assert torch.equal(a, c), f"d{name}: two split runs differ"
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if name == "topk_weights":
            dropped = case["topk_ids"] < 0
            assert torch.equal(a[dropped], torch.zeros_like(a[dropped]))
        _close(a, b.double(), GRAD_TOL[dtype], f"d{name}")
        if name in ("w1", "w2", "b1", "b2"):  # experts 5, 6: exact zeros
            assert torch.equal(a[5:], torch.zeros_like(a[5:])), name


def test_tuning_splits_on_hopper_16_bit_above_64_rows():
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        for cc in (None, 80, 90, 100):
            for rpe in (8, 64, 65, 512):
                cfg = tuning.act_backward_config(rpe, dtype, cc)
                assert isinstance(cfg, ActBackwardConfig)
                want = cc is not None and cc >= 90 and dtype.itemsize == 2 and rpe > 64
                assert cfg.split == want, (dtype, cc, rpe)
                # the split's GEMM is the forward GEMM2's (plain) configuration
                assert cfg.gemm == tuning.gemm_config(rpe, False, dtype, cc)
    cfg = tuning.act_backward_config(512, torch.bfloat16, 90)
    assert (cfg.gemm.block_m, cfg.gemm.block_n, cfg.gemm.use_tma) == (128, 256, True)
    assert cfg.gemm.persistent == 1 and cfg.fused.persistent == 0
