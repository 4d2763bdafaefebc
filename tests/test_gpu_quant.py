"""Quantised experts on a CUDA device: the compiled FP8 / MXFP4 kernels against float64
products of the same quantised operands, the activation quantiser's bits against the
reference, determinism, poisoned memory, odd sizes, CUDA-graph capture and
``torch.compile(fullgraph=True)``.

Tolerance: 2e-3 relative (Frobenius) against the float64 product of the same quantised
operands: the quantisation the format defines is the only error beyond the bf16 output's
rounding (2^-9) and float32 accumulation.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import capture_cuda_graph

import moe_route
from moe_route import quant as Q

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = "cuda"
FORMATS = ("fp8", "fp8_ue8m0", "fp8_channel", "mxfp4")
# (T, H, I, E, K): odd sizes with partial scale blocks; a decode size; a prefill size
# (odd block counts and a partial column tile on the warp-specialised SM90 kernel)
SHAPES = [
    (130, 264, 200, 16, 4),
    (1, 2048, 768, 128, 8),
    (1024, 2048, 768, 32, 8),
    (300, 384, 320, 8, 2),
]


def _case(T, H, n_inter, E, K, seed=0):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    x = torch.randn(T, H, device=CUDA, generator=g).bfloat16()
    w1 = torch.randn(E, 2 * n_inter, H, device=CUDA, generator=g) * H**-0.5
    w2 = torch.randn(E, H, n_inter, device=CUDA, generator=g) * n_inter**-0.5
    logits = torch.randn(T, E, device=CUDA, generator=g)
    if E > 2:
        logits[:, E - 1] = -1e9  # an expert without rows
    tw, ids = torch.softmax(logits, -1).topk(K, -1)
    ids = ids.to(torch.int32)
    if T > 1:
        ids[1, 0] = -1  # a dropped slot
    return x, w1, w2, tw, ids


def _expected64(x, w1q, s1, w2q, s2, tw, ids, spec):
    """float64 products of the quantised operands, per expert (tokens and GEMM2's input
    quantised by the reference quantisers). Each routed expert's weights are dequantised on
    their own: the whole float64 experts of the larger cases take gigabytes."""
    H = x.shape[1]
    if spec.fp8:
        xq, xs = Q.quantize_fp8_rows(x, spec.act_group, ue8m0=spec.ue8m0)
        rows = Q.dequantize_fp8_rows(xq, xs, spec.act_group).double()
    else:
        rows = x.double()
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in ids[ids >= 0].unique().tolist():
        t, k = (ids == e).nonzero(as_tuple=True)
        w1 = Q.dequantize_experts(w1q[e : e + 1], s1[e : e + 1], spec, H)[0].double()
        n_inter = w1.shape[0] // 2
        w2 = Q.dequantize_experts(w2q[e : e + 1], s2[e : e + 1], spec, n_inter)[0].double()
        z = rows[t] @ w1.T
        h = torch.nn.functional.silu(z[:, :n_inter]) * z[:, n_inter:]
        if spec.fp8:
            hq, hs = Q.quantize_fp8_rows(h.float(), 128, ue8m0=spec.ue8m0)
            h = Q.dequantize_fp8_rows(hq, hs, 128).double()
        else:
            h = h.to(x.dtype).double()
        out.index_add_(0, t, (h @ w2.T) * tw[t, k, None].double())
    return out


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _quantised(w1, w2, fmt):
    w1q, s1 = moe_route.quantize_experts(w1, fmt)
    w2q, s2 = moe_route.quantize_experts(w2, fmt)
    return w1q, s1, w2q, s2


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_forward_against_float64(fmt, shape):
    """End to end: within the format's quantisation of GEMM2's input (a code of ``act(z)``
    flips wherever the float32 and float64 ``z`` fall on two sides of a rounding midpoint;
    the stages' own error is held to 2e-3 by :func:`test_quant_gemm_stages`)."""
    x, w1, w2, tw, ids = _case(*shape)
    w1q, s1, w2q, s2 = _quantised(w1, w2, fmt)
    # poison the caching allocator: every output element must be written
    torch.full((64 << 20,), float("nan"), device=CUDA)
    with torch.no_grad():
        out = moe_route.fused_moe(x, w1q, w2q, tw, ids, quant=fmt, w1_scale=s1, w2_scale=s2)
    assert torch.isfinite(out).all()
    ref = _expected64(x, w1q, s1, w2q, s2, tw, ids, Q.as_quant(fmt))
    assert _rel(out, ref) < (2e-2 if Q.as_quant(fmt).fp8 else 4e-3)
    full = moe_route.fused_moe(x, w1.bfloat16(), w2.bfloat16(), tw, ids)
    assert _rel(out, full) < (0.08 if fmt != "mxfp4" else 0.25)


def _per_expert(rows, W, offsets):
    """``rows[d] @ W[e].T`` for the rows ``d`` of each expert ``e`` (expert-sorted rows)."""
    ends = offsets.tolist()
    return torch.cat([rows[lo:hi] @ W[e].T for e, (lo, hi) in enumerate(itertools.pairwise(ends))])


@pytest.mark.parametrize("in_loop", [False, True], ids=["codes", "in_loop"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_gemm_stages(fmt, shape, in_loop):
    """Each GEMM against float64 products of the very operands it read: GEMM1's float32
    pre-activation, its quantised output within one e4m3 step of the float64 value, GEMM2 on
    GEMM1's own codes and scales, each within 2e-3. ``in_loop`` (FP8 at decode sizes,
    ``QuantConfigs.in_loop``): GEMM1 quantises the 16-bit tokens in its main loop, and the
    reference quantiser's codes of the same rows are the operands."""
    from moe_route.kernels.triton.gemm_mainloop import IDENTITY
    from moe_route.kernels.triton.quant import QuantGemmLaunch
    from moe_route.plan import epilogue_for

    spec = Q.as_quant(fmt)
    x, w1, w2, _tw, ids = _case(*shape)
    T, H = x.shape
    E, n_inter = w1.shape[0], w2.shape[2]
    w1q, s1, w2q, s2 = _quantised(w1, w2, fmt)
    _s2d, d2s, _efs, offsets = moe_route.build_routing_maps(ids, E).tensors()
    M, n = d2s.numel(), int(offsets[-1])
    cfg = moe_route.tuning.quant_gemm_config(M / E, True, not spec.fp8, 90)
    if in_loop and (not spec.fp8 or cfg.block_m != 16):
        pytest.skip("GEMM1 quantising the tokens: FP8 at 16-row tiles (decode sizes) only")
    a_quant = (1 if spec.act_group else 2) if in_loop else 0
    sn = spec.block[0] if spec.format == "fp8_block" else 1
    if spec.fp8:
        a, a_s = moe_route.quantize_activations(x, fmt)
        rows64 = Q.dequantize_fp8_rows(a, a_s, spec.act_group).double()
    else:
        a, a_s, rows64 = x, None, x.double()
    W1 = Q.dequantize_experts(w1q, s1, spec, H).double()
    W2 = Q.dequantize_experts(w2q, s2, spec, n_inter).double()
    z64 = _per_expert(rows64[(d2s[:n] % T).long()], W1, offsets)
    h64 = torch.nn.functional.silu(z64[:, :n_inter]) * z64[:, n_inter:]
    # GEMM1's float32 output (the activation applied), then its quantised output
    epi = epilogue_for("swiglu", "concat")
    h32 = torch.empty(M, n_inter, device=CUDA)
    a1, a1_s = (x, None) if in_loop else (a, a_s)
    QuantGemmLaunch(a1, a1_s, w1q, s1, H, cfg, epi, None, True, h32.dtype, False, not spec.fp8,
                    sn, spec.ue8m0, a_quant)(a1, a1_s, w1q, s1, offsets, h32, None, None, d2s,
                                             M)  # fmt: skip
    assert _rel(h32[:n], h64) < 2e-3
    if spec.fp8:
        hq = torch.empty(M, n_inter, device=CUDA, dtype=torch.float8_e4m3fn)
        hs = torch.empty(M, -(-n_inter // 128), device=CUDA)
        QuantGemmLaunch(a1, a1_s, w1q, s1, H, cfg, epi, None, True, hq.dtype, True, False, sn,
                        spec.ue8m0, a_quant)(a1, a1_s, w1q, s1, offsets, hq, hs, None, d2s,
                                             M)  # fmt: skip
        hk = Q.dequantize_fp8_rows(hq[:n], hs[:n], 128).double()
        # half an e4m3 step (2^-4 relative), plus the product's error (float32 sums of FP8
        # tensor-core partials) relative to the row's largest value
        row_max = h64.abs().amax(1, keepdim=True)
        assert ((hk - h64).abs() <= 0.07 * h64.abs() + 2e-3 * row_max).all()
        a2, a2_s, h_in = hq, hs, hk
    else:
        a2, a2_s = h32.to(x.dtype), None
        h_in = a2[:n].double()
    cfg2 = moe_route.tuning.quant_gemm_config(M / E, False, not spec.fp8, 90)
    y = torch.empty(M, H, device=CUDA)
    QuantGemmLaunch(a2, a2_s, w2q, s2, n_inter, cfg2, IDENTITY, None, False, y.dtype, False,
                    not spec.fp8, sn, spec.ue8m0)(a2, a2_s, w2q, s2, offsets, y)  # fmt: skip
    y64 = _per_expert(h_in, W2, offsets)
    assert _rel(y[:n], y64) < 2e-3


@pytest.mark.parametrize("layout", ["concat", "interleaved"])
@pytest.mark.parametrize("shape", [(1024, 2048, 768, 32, 8), (700, 264, 200, 4, 2)],
                         ids=lambda s: "x".join(map(str, s)))  # fmt: skip
@pytest.mark.parametrize("fmt", ["fp8", "fp8_channel"])
def test_quant_tma_matches_pointers(monkeypatch, fmt, shape, layout):
    """The prefill GEMMs, TMA-fed where the layout allows (not at H=264, whose FP8 rows are
    not 16-byte multiples), against the pointer-fed kernel on the same tiles. On SM90 the
    warp-specialised kernel takes them where it serves: it scales a block's product by the
    row's and the weight's scale in one multiply (per channel, the weight's after the loop),
    so it agrees within float32 rounding, which can move a code of GEMM2's FP8 input by one
    step; elsewhere TMA and pointers give the same bits."""
    import dataclasses

    from moe_route import tuning
    from moe_route.plan import clear_plans

    x, w1, w2, tw, ids = _case(*shape)
    w1q, s1, w2q, s2 = _quantised(w1, w2, fmt)
    kw = dict(quant=fmt, w1_scale=s1, w2_scale=s2, gate_up_layout=layout)
    assert tuning.quant_gemm_config(ids.numel() / w1.shape[0], True, False, 90).use_tma
    with torch.no_grad():
        out = moe_route.fused_moe(x, w1q, w2q, tw, ids, **kw)
        config = tuning.quant_gemm_config

        def pointers(*args):
            return dataclasses.replace(config(*args), use_tma=False)

        monkeypatch.setattr(tuning, "quant_gemm_config", pointers)
        clear_plans()
        try:
            ref = moe_route.fused_moe(x, w1q, w2q, tw, ids, **kw)
        finally:
            monkeypatch.undo()
            clear_plans()
    if torch.cuda.get_device_capability()[0] == 9:
        assert _rel(out, ref) < 5e-3
    else:
        assert torch.equal(out, ref)


@pytest.mark.isolated  # a failed capture would break the tests after it (tests/conftest.py)
@pytest.mark.parametrize(
    "shape",
    [(1, 2048, 768, 128, 8), (2, 2048, 768, 128, 8), (3, 264, 200, 16, 4), (1, 7168, 2048, 8, 8)],
    ids=lambda s: "x".join(map(str, s)),
)
@pytest.mark.parametrize("fmt", ["fp8", "fp8_channel", "mxfp4"])
def test_quant_decode_path_matches_sorted(monkeypatch, fmt, shape):
    """Eager inference at decode sizes (up to 16 slots; experts of deepseek-v3's size too, K =
    E) takes the two-launch decode path; a CUDA graph of the same call runs the sorted path
    (maps, GEMM1, GEMM2, finalize): the same bits on MXFP4 (and every format under the
    interpreter, tests/test_quant.py; the last slot to arrive adds the terms in slot order,
    each as the finalize kernel adds it); on FP8 within the format's end-to-end bound (FP8
    MMAs on SM90 accumulate a block with less than float32 precision, in an order the tile
    shape sets); each within that bound of the float64 product of the quantised operands."""
    _decode_path_matches_sorted(monkeypatch, fmt, shape)


@pytest.mark.isolated  # a failed capture would break the tests after it (tests/conftest.py)
@pytest.mark.parametrize("fmt", ["fp8", "fp8_channel"])
def test_quant_decode_path_32_slots(monkeypatch, fmt):
    """FP8 experts of up to 16 MiB take the decode path up to ``min(32, E / 2)`` slots
    (qwen3-30b-a3b's sizes at T = 4), as in :func:`test_quant_decode_path_matches_sorted`."""
    _decode_path_matches_sorted(monkeypatch, fmt, (4, 2048, 768, 128, 8))


def _counting_decode_calls(monkeypatch) -> list:
    """A list that gets an item per call of the quantised decode path's launch."""
    from moe_route.kernels.triton import decode_quant as dk

    monkeypatch.setenv("MOE_ROUTE_COMPILE_AHEAD", "0")  # count only the calls that run
    calls = []
    run = dk.QuantDecodeLaunch.__call__
    monkeypatch.setattr(dk.QuantDecodeLaunch, "__call__",
                        lambda self, *a: calls.append(1) or run(self, *a))  # fmt: skip
    return calls


def _eager_decode_call(monkeypatch, fmt, shape) -> tuple:
    """``(calls, call, out, operands)``: an eager call on ``fmt`` experts of ``shape``, its
    output, the call itself (``call()``) and the decode path's launches counted in ``calls``;
    ``operands`` = ``(x, w1q, s1, w2q, s2, tw, ids)``."""
    calls = _counting_decode_calls(monkeypatch)
    x, w1, w2, tw, ids = _case(*shape)
    w1q, s1, w2q, s2 = _quantised(w1, w2, fmt)
    kw = dict(quant=fmt, w1_scale=s1, w2_scale=s2)

    def call():
        return moe_route.fused_moe(x, w1q, w2q, tw, ids, **kw)

    with torch.no_grad():
        out = call()
    return calls, call, out, (x, w1q, s1, w2q, s2, tw, ids)


def _decode_path_matches_sorted(monkeypatch, fmt, shape):
    from moe_route import tuning
    from moe_route.plan import clear_plans

    calls, call, out, (x, w1q, s1, w2q, s2, tw, ids) = _eager_decode_call(monkeypatch, fmt, shape)
    assert calls == [1]
    # the graph on the sorted path, also where the decode path serves capture
    with torch.no_grad(), monkeypatch.context() as m:
        m.setattr(tuning, "_GRAPH_SLOTS", 0)
        clear_plans()
        try:
            graph, graph_out = capture_cuda_graph(call, warmup=1)
            graph.replay()
            torch.cuda.synchronize()
        finally:
            clear_plans()
    assert len(calls) == 2  # (the warm-up on the side stream; not the capture)
    if fmt == "mxfp4":
        assert torch.equal(graph_out, out)
    assert _rel(graph_out, out) < 2e-2
    ref = _expected64(x, w1q, s1, w2q, s2, tw, ids, Q.as_quant(fmt))
    assert _rel(out, ref) < 2e-2


@pytest.mark.isolated  # a failed capture would break the tests after it (tests/conftest.py)
@pytest.mark.parametrize(
    "shape",
    [(1, 2048, 768, 128, 8), (1, 7168, 2048, 8, 8), (2, 2048, 768, 128, 8)],
    ids=lambda s: "x".join(map(str, s)),
)
@pytest.mark.parametrize("fmt", ["fp8", "fp8_channel"])
def test_quant_decode_path_in_graphs(monkeypatch, fmt, shape):
    """Up to 8 slots FP8's decode path serves CUDA-graph capture too (no slower on the device
    than the sorted path's experts step, and no maps launch): the graph replays the eager
    call's bits; from 9 slots a graph runs the sorted path."""
    calls, call, out, operands = _eager_decode_call(monkeypatch, fmt, shape)
    with torch.no_grad():
        graph, graph_out = capture_cuda_graph(call, warmup=1)
        graph_out.fill_(float("nan"))  # (poisoned: the replay writes every element)
        graph.replay()
        torch.cuda.synchronize()
    in_graphs = operands[-1].numel() <= 8
    assert len(calls) == (3 if in_graphs else 2)  # eager, the warm-up(, the capture)
    if in_graphs:
        assert torch.equal(graph_out, out)
    else:
        assert _rel(graph_out, out) < 2e-2


def _near_midpoints(amax: float) -> torch.Tensor:
    """float32 values whose quotients by ``amax / 448`` fall on, and one ulp either side of,
    the midpoints between neighbouring e4m3 values (where a quotient one ulp off rounds to
    the other code), in groups of 128 each led by ``amax`` (so every group's scale is
    ``amax / 448``)."""
    s = torch.tensor(amax, dtype=torch.float32) / 448
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    v = ((grid[1:] + grid[:-1]) / 2 * s).float()
    v = torch.cat([v, torch.nextafter(v, v + 1), torch.nextafter(v, v - 1)])
    v = torch.cat([v, -v])
    chunks = [torch.cat([torch.tensor([amax]), c]) for c in v.split(127)]
    return torch.cat(chunks)


@pytest.mark.parametrize("group", [128, 0])
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_activation_quantiser_bits(group, ue8m0, dtype):
    """The kernel's codes and scales are the reference quantiser's bits, on random rows (a
    float32 row: every mantissa bit in play) and on quotients at e4m3's rounding midpoints."""
    x = (torch.randn(257, 7168 + 37, device=CUDA) * 50).to(dtype)
    x[3] = 0
    x[5, :6] = torch.tensor([448.0, -448.0, 1e-4, -1e-4, 0.0, 60000.0])
    if dtype == torch.float32:
        for row, amax in ((7, 448.0 * 1.1), (8, 3.3e-3), (9, 1234.567)):
            near = _near_midpoints(amax)
            x[row] = 0
            x[row, : near.numel()] = near.to(CUDA)
    name = {(128, False): "fp8", (128, True): "fp8_ue8m0", (0, False): "fp8_channel",
            (0, True): "fp8_channel_ue8m0"}[(group, ue8m0)]  # fmt: skip
    q, s = moe_route.quantize_activations(x, name)
    rq, rs = Q.quantize_fp8_rows(x.cpu(), group, ue8m0=ue8m0)
    assert torch.equal(s.cpu(), rs)
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.isolated  # a failed capture would break the tests after it (tests/conftest.py)
@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_deterministic_graph_and_compile(fmt):
    x, w1, w2, tw, ids = _case(200, 512, 384, 8, 2)
    w1q, s1, w2q, s2 = _quantised(w1, w2, fmt)
    kw = dict(quant=fmt, w1_scale=s1, w2_scale=s2)
    with torch.no_grad():
        first = moe_route.fused_moe(x, w1q, w2q, tw, ids, **kw)
        for _ in range(20):
            assert torch.equal(moe_route.fused_moe(x, w1q, w2q, tw, ids, **kw), first)
        graph, graph_out = capture_cuda_graph(
            lambda: moe_route.fused_moe(x, w1q, w2q, tw, ids, **kw), warmup=2
        )
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(graph_out, first)
        compiled = torch.compile(
            lambda *a: moe_route.fused_moe(*a, **kw), fullgraph=True, dynamic=False
        )
        assert torch.equal(compiled(x, w1q, w2q, tw, ids), first)


def test_quant_no_tokens_and_all_dropped():
    x, w1, w2, tw, ids = _case(5, 264, 200, 4, 2)
    w1q, s1, w2q, s2 = _quantised(w1, w2, "fp8")
    kw = dict(quant="fp8", w1_scale=s1, w2_scale=s2)
    assert moe_route.fused_moe(x[:0], w1q, w2q, tw[:0], ids[:0], **kw).shape == (0, 264)
    bias = torch.randn(264, device=CUDA).bfloat16()
    out = moe_route.fused_moe(x, w1q, w2q, tw, torch.full_like(ids, -1), bias=bias, **kw)
    assert torch.equal(out, bias.expand(5, 264))


def test_quant_backward_matches_dequantised_layer():
    x, w1, w2, tw, ids = _case(130, 264, 200, 16, 4)
    w1q, s1, w2q, s2 = _quantised(w1, w2, "fp8")
    w1d = Q.dequantize_experts(w1q, s1, "fp8").bfloat16()
    w2d = Q.dequantize_experts(w2q, s2, "fp8").bfloat16()
    dout = torch.randn_like(x)
    grads = []
    for quantised in (True, False):
        xx, tt = x.clone().requires_grad_(), tw.clone().requires_grad_()
        if quantised:
            out = moe_route.fused_moe(xx, w1q, w2q, tt, ids, quant="fp8", w1_scale=s1, w2_scale=s2)
        else:
            out = moe_route.fused_moe(xx, w1d, w2d, tt, ids)
        grads.append(torch.autograd.grad(out, (xx, tt), dout))
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)
