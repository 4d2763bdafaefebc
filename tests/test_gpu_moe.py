"""grouped_gemm and fused_moe on a CUDA device: compiled Triton kernels against the float64
reference (``moe_route.reference``), at odd and realistic sizes, in bf16 / fp16 / fp32.

Covers what the CPU interpreter cannot: bf16 kernels, TF32 versus exact float32 products,
concurrency in the fused finalize (the ordered epilogue's arrival counters, the atomic one's
adds), many programs per launch, CUDA graph capture (which also proves that nothing syncs with
the host), ``torch.compile(fullgraph=True)`` and row offsets past 2**31 elements.

Tolerances: relative Frobenius error against the float64 reference on the same (rounded)
inputs: fp32 1e-5 (exact "ieee" products; 2e-3 with allow_tf32), fp16 2e-3, bf16 1e-2, plus an
elementwise guard eight times as wide relative to ``|ref| + rms(ref)``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import moe_cases
import pytest
import torch
from helpers import capture_cuda_graph
from moe_cases import (
    ACT_IDS,
    ACT_LAYOUTS,
    ARG_ORDER,
    BIASES,
    NAN,
    PATHS,
    TOL,
    finalize_scale,
    gemm_reference,
    launch,
    moe_expected,
    run_moe,
    strided_weight,
)

import moe_route
from moe_route import arch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

launches = importlib.import_module("moe_route.kernels.triton.moe")  # fused_moe's launches

CUDA = "cuda"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DTYPE_IDS = ["bf16", "fp16", "fp32"]
# TF32 keeps 10 of float32's 23 mantissa bits, and the tensor cores drop the rest (truncate),
# so each product is biased low by ~2**-11 relative; a gated output multiplies two such GEMM
# results. Measured on an H200: 2.3e-3 for swiglu at K = 1024. (The CPU tests use 2e-3.)
TF32_TOL = 5e-3
TOKENS = [1, 37, 199, 1000]
SHAPES = [(200, 136), (1024, 768)]  # (H, I)
SHAPE_IDS = ["H200-I136", "H1024-I768"]


# ----------------------------------------------------------------------------- helpers
def make_ids(T, K, E, *, drop=0.1, seed=0):
    return moe_cases.make_ids(T, K, E, drop=drop, seed=seed).to(CUDA)


def rand(*shape, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=CUDA) * scale).to(dtype)


# The shared builders on CUDA: float32 draws from a CUDA generator, 10 % of the slots dropped,
# maps and expansion through the default (auto) backend; the layer in bf16 unless told.
gemm_case = functools.partial(moe_cases.gemm_case, drop=0.1, device=CUDA, rand=rand,
                              maps_backend="auto", expand=moe_route.expand_rows)  # fmt: skip
moe_case = functools.partial(moe_cases.moe_case, dtype=torch.bfloat16, drop=0.1, device=CUDA,
                             rand=rand)  # fmt: skip
# Compared on the device, with the shorter failure messages.
assert_matches = functools.partial(moe_cases.assert_matches, device=None)
assert_dropped_rows_zero = functools.partial(moe_cases.assert_dropped_rows_zero, verbose=False)
assert_paths_agree = functools.partial(moe_cases.assert_paths_agree, verbose=False)


# ----------------------------------------------------------------------------- grouped_gemm
@pytest.mark.parametrize(("H", "inter"), SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grouped_gemm_sizes(dtype, T, H, inter):
    a, w, b, maps = gemm_case(T, 4, 8, H, inter, "swiglu", dtype=dtype, bias=True, gather=True,
                              seed=T)  # fmt: skip
    out = moe_route.grouped_gemm(a, w, maps, bias=b, activation="swiglu", gather=True)
    assert out.dtype == dtype and out.shape == (4 * T, inter)
    assert_matches(out, gemm_reference(a, w, maps, b, activation="swiglu", gather=True),
                   TOL[dtype])  # fmt: skip
    assert_dropped_rows_zero(out, maps)
    # GEMM2 of the same rows (no activation, N = H)
    w2 = rand(8, H, inter, dtype=dtype, scale=inter**-0.5, seed=T + 9)
    y = moe_route.grouped_gemm(out, w2, maps)
    assert_matches(y, gemm_reference(out, w2, maps), TOL[dtype], what="GEMM2")
    assert_dropped_rows_zero(y, maps)


EPILOGUE_CASES = [
    pytest.param(dtype, act, lay, id=f"{did}-{aid}")
    for dtype, did in zip(DTYPES, DTYPE_IDS, strict=True)
    for (act, lay), aid in zip(ACT_LAYOUTS, ACT_IDS, strict=True)
    if dtype != torch.float32 or act in ("swiglu", "gelu", "identity")
]


@pytest.mark.parametrize("bias_gather", [(False, False), (True, True)],
                         ids=["plain", "bias-gather"])  # fmt: skip
@pytest.mark.parametrize(("dtype", "activation", "layout"), EPILOGUE_CASES)
def test_grouped_gemm_epilogues(dtype, activation, layout, bias_gather):
    bias, gather = bias_gather
    a, w, b, maps = gemm_case(199, 2, 8, 200, 136, activation, dtype=dtype, bias=bias,
                              gather=gather, seed=3)  # fmt: skip
    out = moe_route.grouped_gemm(
        a, w, maps, bias=b, activation=activation, gate_up_layout=layout, gather=gather
    )
    ref = gemm_reference(a, w, maps, b, activation=activation, layout=layout, gather=gather)
    assert_matches(out, ref, TOL[dtype])
    assert_dropped_rows_zero(out, maps)


@pytest.mark.parametrize(
    "config",
    [None, (16, 16, 16, 2, 4, 2), (64, 64, 32, 4, 4, 3), (128, 128, 64, 8, 8, 3)],
    ids=["auto", "16x16x16", "64x64x32", "128x128x64"],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_launcher_poisoned_out(dtype, config):
    """Every element of a NaN-poisoned ``out`` is written: routed rows with results, the rows of
    dropped slots with exact zeros; whatever the tile shape."""
    a, w, b, maps = gemm_case(199, 4, 8, 200, 136, "geglu", dtype=dtype, bias=True, gather=True,
                              drop=0.3, seed=5)  # fmt: skip
    out = launch(a, w, maps, b, activation="geglu", gather=True, config=config)
    assert_matches(out, gemm_reference(a, w, maps, b, activation="geglu", gather=True),
                   TOL[dtype])  # fmt: skip
    assert_dropped_rows_zero(out, maps)


@pytest.mark.parametrize("use_tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize(("H", "inter"), [(200, 136), (1024, 768), (72, 40)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_launcher_tma_and_pointer_loads(dtype, H, inter, use_tma):
    """Both load paths of the kernel (TMA tensor descriptors on SM90+, masked pointer loads) on
    permuted rows, GEMM1 (concat swiglu) and GEMM2, into NaN-poisoned outputs."""
    if use_tma and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA tensor descriptors need SM90+")
    a, w, b, maps = gemm_case(199, 4, 8, H, inter, "swiglu", dtype=dtype, bias=True,
                              drop=0.2, seed=H)  # fmt: skip
    out = launch(a, w, maps, b, activation="swiglu", use_tma=use_tma)
    assert_matches(out, gemm_reference(a, w, maps, b, activation="swiglu"), TOL[dtype])
    assert_dropped_rows_zero(out, maps)
    w2 = rand(8, H, inter, dtype=dtype, scale=inter**-0.5, seed=H + 1)
    y = launch(out, w2, maps, use_tma=use_tma)
    assert_matches(y, gemm_reference(out, w2, maps), TOL[dtype], what="GEMM2")
    assert_dropped_rows_zero(y, maps)


OCCUPANCY = {
    "empty_experts": lambda T: torch.tensor([[1, 6], [6, 1]]).repeat(T // 2 + 1, 1)[:T],
    "all_in_first": lambda T: torch.zeros(T, 1, dtype=torch.int64),
    "all_in_last": lambda T: torch.full((T, 1), 7, dtype=torch.int64),
    "mostly_dropped": lambda T: torch.where(
        torch.arange(T).unsqueeze(1) % 97 == 0, torch.tensor([[2, 3]]), torch.tensor([[-1, -1]])
    ),
    "all_dropped": lambda T: torch.full((T, 2), -1, dtype=torch.int64),
}


@pytest.mark.parametrize("pattern", list(OCCUPANCY))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_expert_occupancy(dtype, pattern):
    T, E = 1000, 8
    ids = OCCUPANCY[pattern](T)
    a, w, b, maps = gemm_case(T, ids.shape[1], E, 200, 136, "swiglu", dtype=dtype, bias=True,
                              gather=True, ids=ids, seed=7)  # fmt: skip
    out = launch(a, w, maps, b, activation="swiglu", gather=True)
    assert_dropped_rows_zero(out, maps)
    if pattern != "all_dropped":
        ref = gemm_reference(a, w, maps, b, activation="swiglu", gather=True)
        assert_matches(out, ref, TOL[dtype])
    # the same routing through the whole layer, both finalize paths
    case = moe_case(T, ids.shape[1], E, 200, 136, dtype=dtype, b2=True, bias="H", ids=ids,
                    seed=8)  # fmt: skip
    ref = moe_expected(case)
    dead = (case["topk_ids"] < 0).all(dim=1)
    for path, kw in PATHS.items():
        out = run_moe(case, **kw)
        assert torch.equal(out[dead], case["bias"].expand(T, -1)[dead]), path
        if not dead.all():
            assert_matches(out[~dead], ref[~dead], TOL[dtype], what=path)


@pytest.mark.parametrize("how", ["transposed", "sliced", "expert_major_last"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_noncontiguous_weights(dtype, how):
    a, w, b, maps = gemm_case(199, 2, 8, 200, 136, "swiglu", dtype=dtype, bias=True,
                              gather=True, seed=9)  # fmt: skip
    ws = strided_weight(w, how)
    xs = a.t().contiguous().t()
    out = moe_route.grouped_gemm(xs, ws, maps, bias=b, activation="swiglu", gather=True)
    assert_matches(out, gemm_reference(a, w, maps, b, activation="swiglu", gather=True),
                   TOL[dtype])  # fmt: skip
    # the whole layer with both weights as views
    case = moe_case(199, 2, 8, 200, 136, dtype=dtype, b1=True, b2=True, seed=10)
    ref = moe_expected(case)
    case["w1"] = strided_weight(case["w1"], how)
    case["w2"] = strided_weight(case["w2"], how)
    for path, kw in PATHS.items():
        assert_matches(run_moe(case, **kw), ref, TOL[dtype], what=path)


@pytest.mark.parametrize("allow_tf32", [False, True], ids=["ieee", "tf32"])
def test_fp32_tf32(allow_tf32):
    """Exact float32 products unless allowed: 1e-5 at K = 1024 fails if TF32 sneaks in."""
    a, w, b, maps = gemm_case(1000, 2, 8, 1024, 768, "swiglu", dtype=torch.float32, bias=True,
                              gather=True, seed=11)  # fmt: skip
    out = moe_route.grouped_gemm(
        a, w, maps, bias=b, activation="swiglu", gather=True, allow_tf32=allow_tf32
    )
    ref = gemm_reference(a, w, maps, b, activation="swiglu", gather=True)
    assert_matches(out, ref, TF32_TOL if allow_tf32 else TOL[torch.float32])
    case = moe_case(199, 2, 8, 1024, 768, dtype=torch.float32, seed=12)
    out = run_moe(case, allow_tf32=allow_tf32)
    assert_matches(out, moe_expected(case), TF32_TOL if allow_tf32 else TOL[torch.float32])


# ----------------------------------------------------------------------------- fused_moe
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(("H", "inter"), SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_fused_moe_sizes(dtype, T, H, inter, path):
    case = moe_case(T, 4, 16, H, inter, dtype=dtype, b1=True, b2=True, bias="TH", seed=T + H)
    out = run_moe(case, **PATHS[path])
    assert out.dtype == dtype and out.shape == (T, H)
    assert_matches(out, moe_expected(case), TOL[dtype])


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(("activation", "layout"), ACT_LAYOUTS, ids=ACT_IDS)
def test_fused_moe_activations(activation, layout, path):
    case = moe_case(199, 2, 8, 200, 136, activation=activation, b1=True, b2=True, bias="H",
                    seed=13)  # fmt: skip
    out = run_moe(case, activation=activation, layout=layout, **PATHS[path])
    assert_matches(out, moe_expected(case, activation=activation, layout=layout),
                   TOL[torch.bfloat16])  # fmt: skip


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("gather", [True, False, None], ids=["gather", "expand", "auto"])
@pytest.mark.parametrize("biases", list(BIASES))
def test_fused_moe_biases_gather(biases, gather, path):
    case = moe_case(37, 4, 8, 200, 136, dtype=torch.float16, seed=14, **BIASES[biases])
    out = run_moe(case, gather=gather, **PATHS[path])
    assert_matches(out, moe_expected(case), TOL[torch.float16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paths_agree(dtype):
    """The ordered fused epilogue gives the standalone path's bits (same GEMM2 tiles, the same
    k-ordered float32 sum); the atomic one agrees to the rounding of that sum."""
    K = 4
    case = moe_case(1000, K, 16, 1024, 768, dtype=dtype, b1=True, b2=True, bias="TH", seed=15)
    outs = {path: run_moe(case, **args) for path, args in PATHS.items()}
    ref = moe_expected(case)
    for path, out in outs.items():
        assert_matches(out, ref, TOL[dtype], what=path)
    assert torch.equal(outs["fused"], outs["standalone"]), "ordered fused != standalone bits"
    if dtype == torch.float32:
        assert_paths_agree(outs["standalone"], outs["fused_atomic"], finalize_scale(case), K)


ORDERED_STRESS = [  # (T, K, E, H, I, drop): many tiles racing for each token's counter
    pytest.param(4096, 8, 64, 1024, 256, 0.1, id="T4096-K8-E64"),
    pytest.param(3001, 6, 6, 520, 136, 0.3, id="K=E-odd"),
    pytest.param(2048, 1, 1, 4096, 512, 0.0, id="one-expert"),
    pytest.param(999, 4, 256, 2048, 64, 0.5, id="E256-sparse"),
]


@pytest.mark.parametrize(("T", "K", "E", "H", "inter", "drop"), ORDERED_STRESS)
def test_ordered_fused_races(T, K, E, H, inter, drop):
    """The ordered epilogue under real concurrency: thousands of tiles bump the counters, the
    last row of each (token, column tile) reduces it. 20 runs, each bitwise equal to the
    standalone path. Before each run a NaN block of the output's size is freed, which the
    caching allocator hands to the output: an element left unwritten would show."""
    case = moe_case(T, K, E, H, inter, b2=True, bias="H", drop=drop, seed=T + E)
    case["topk_ids"][::97] = -1  # some tokens with every slot dropped: out[t] = bias
    want = run_moe(case, finalize="standalone")
    assert_matches(want, moe_expected(case), TOL[torch.bfloat16])
    for i in range(20):
        torch.full_like(want, NAN)  # poison: freed at once, reused for the next [T, H]
        got = run_moe(case, finalize="fused")
        assert torch.equal(got, want), f"run {i + 1}: ordered fused != standalone"
        del got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nondeterministic_within_rounding(dtype):
    """The fused path's atomics may reorder the K-term sum: runs agree to float32 rounding of
    that sum, plus one rounding to the output dtype."""
    K = 8
    case = moe_case(1000, K, 32, 1024, 768, dtype=dtype, b2=True, bias="H", seed=17)
    scale = finalize_scale(case)
    runs = [run_moe(case, finalize="fused", deterministic=False) for _ in range(10)]
    eps_out = torch.finfo(dtype).eps
    for i, out in enumerate(runs[1:], 2):
        diff = (out.double() - runs[0].double()).abs()
        bound = 2 * (K + 2) * torch.finfo(torch.float32).eps * scale + eps_out * out.double().abs()
        assert not (diff > bound).any(), f"run {i}: max diff {diff.max().item():.3g}"
    assert_matches(runs[-1], moe_expected(case), TOL[dtype])


# ----------------------------------------------------------------------------- path choice
def test_auto_path_follows_arch(monkeypatch):
    """fused_moe takes the path that arch.finalize_path_for names for the tensors' device; the
    policy's fixed points: below SM90 "auto" is standalone, and it never takes the atomics."""
    dev = torch.device(CUDA)
    case = moe_case(37, 2, 8, 200, 136, b2=True, seed=18)
    ref = moe_expected(case)
    monkeypatch.setenv("MOE_ROUTE_COMPILE_AHEAD", "0")  # count only the calls that run
    calls = []
    real_finalize = launches.FinalizeLaunch.__call__
    monkeypatch.setattr(launches.FinalizeLaunch, "__call__",
                        _recording(real_finalize, "finalize_triton", calls))  # fmt: skip
    real_fused = launches.grouped_gemm_finalize_triton
    monkeypatch.setattr(launches, "grouped_gemm_finalize_triton",
                        _recording(real_fused, "grouped_gemm_finalize_triton", calls))  # fmt: skip
    for forced in (None, "80", "89", "90", "100"):
        if forced is None:
            monkeypatch.delenv("MOE_ROUTE_ARCH", raising=False)
        else:
            monkeypatch.setenv("MOE_ROUTE_ARCH", forced)
        for deterministic in (True, False):
            choice = arch.finalize_path_for(dev, "auto", deterministic)
            assert choice.value in ("fused", "standalone"), choice
            if forced in ("80", "89"):
                assert choice.value == "standalone", choice
            calls.clear()
            out = run_moe(case, finalize="auto", deterministic=deterministic)
            want = "grouped_gemm_finalize_triton" if choice.value == "fused" else "finalize_triton"
            assert calls == [want], (forced, deterministic, choice, calls)
            assert_matches(out, ref, TOL[torch.bfloat16])


def _recording(fn, name, calls):
    def wrapped(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)

    return wrapped


# ----------------------------------------------------------------------------- no host sync
@pytest.mark.parametrize("path", list(PATHS))
def test_no_host_sync(path):
    case = moe_case(199, 4, 16, 200, 136, b1=True, b2=True, bias="TH", seed=19)
    run_moe(case, **PATHS[path])  # compile first: Triton's JIT may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_moe(case, **PATHS[path])
        maps = moe_route.build_routing_maps(case["topk_ids"], 16)
        moe_route.grouped_gemm(case["x"], case["w1"], maps, activation="swiglu", gather=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.isolated  # a failed capture would break the tests after it (tests/conftest.py)
@pytest.mark.parametrize("gather", [True, False], ids=["gather", "expand"])
@pytest.mark.parametrize("path", list(PATHS))
def test_cuda_graph(path, gather):
    """Capture fused_moe once, then replay it on new tokens *and new routing* copied into the
    captured buffers: the grid does not depend on the routing and nothing syncs (a sync
    inside capture raises)."""
    T, K, E, H, inter = 199, 4, 16, 200, 136
    kw = dict(gather=gather, **PATHS[path])
    static = moe_case(T, K, E, H, inter, b1=True, b2=True, bias="TH", seed=20)

    def step():
        return run_moe(static, **kw)

    graph, static_out = capture_cuda_graph(step, warmup=2)

    for seed in (21, 22):
        fresh = moe_case(T, K, E, H, inter, b1=True, b2=True, bias="TH", drop=0.3, seed=seed)
        for key, value in fresh.items():
            if value is not None:
                static[key].copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        eager = run_moe(fresh, **kw)
        if path != "fused_atomic":
            assert torch.equal(static_out, eager), "graph replay differs from eager"
        else:
            assert_matches(static_out, eager.double(), TOL[torch.bfloat16], what="replay")
        assert_matches(static_out, moe_expected(fresh), TOL[torch.bfloat16])


@pytest.mark.parametrize("path", list(PATHS))
def test_compile_fullgraph(path):
    kw = PATHS[path]

    def layer(x, w1, w2, tw, ids, b1, b2, bias):
        return moe_route.fused_moe(x, w1, w2, tw, ids, b1=b1, b2=b2, bias=bias, **kw)

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    for seed in (23, 24):  # a second routing: no recompilation needed, same answer
        case = moe_case(199, 4, 16, 200, 136, b1=True, b2=True, bias="TH", seed=seed)
        args = [case[k] for k in (*ARG_ORDER, "b1", "b2", "bias")]
        out, eager = compiled(*args), layer(*args)
        if path != "fused_atomic":
            assert torch.equal(out, eager), "compiled differs from eager"
        else:
            assert_matches(out, eager.double(), TOL[torch.bfloat16], what="compiled")
        assert_matches(out, moe_expected(case), TOL[torch.bfloat16])


# ----------------------------------------------------------------------------- 64-bit offsets
def test_offsets_past_int32():
    """Row and expert strides whose products pass 2**31 elements: x rows (gather), W1 experts
    and ``out`` rows all live more than 2**31 elements from their base pointer."""
    need = 20 * 2**30
    free, _ = torch.cuda.mem_get_info()
    if free < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB free GPU memory, {free / 2**30:.1f} GiB free")
    T, K, E, H, inter = 600, 2, 5, 64, 48
    row = 2**22 + 64  # x and out row stride: T*row > 2**31
    expert = 2**29 + 128  # W1 expert stride: E*expert > 2**31
    dtype = torch.bfloat16
    x_dense = rand(T, H, dtype=dtype, seed=25)
    w_dense = rand(E, 2 * inter, H, dtype=dtype, scale=H**-0.5, seed=26)
    x_store = torch.empty(T * row, dtype=dtype, device=CUDA)
    x = x_store.as_strided((T, H), (row, 1))
    x.copy_(x_dense)
    w_store = torch.empty(E * expert, dtype=dtype, device=CUDA)
    w = w_store.as_strided((E, 2 * inter, H), (expert, H, 1))
    w.copy_(w_dense)
    assert (T - 1) * row > 2**31 and (E - 1) * expert > 2**31
    maps = moe_route.build_routing_maps(make_ids(T, K, E, seed=27), E)
    out_store = torch.full((T * K * 2**21,), NAN, dtype=dtype, device=CUDA)
    out = out_store.as_strided((T * K, inter), (2**21, 1))
    assert (T * K - 1) * 2**21 > 2**31
    launch(x, w, maps, activation="swiglu", gather=True, out=out)
    ref = gemm_reference(x_dense, w_dense, maps, activation="swiglu", gather=True)
    assert_matches(out, ref, TOL[dtype])
    assert_dropped_rows_zero(out, maps)
    del x_store, w_store, out_store
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- persistent GEMM
PERSISTENT_CONFIGS = {  # GemmConfig fields (group_m: the m-tiles of one expert group at most),
    # programs per SM, warp specialisation, TMA stores
    "128x128x64": ((128, 128, 64, 8, 8, 3), 1, False, False),
    "64x64x64-2perSM": ((64, 64, 64, 4, 4, 4), 2, False, False),
    "128x128x64-ws": ((128, 128, 64, 8, 8, 3), 1, True, False),
    "128x128x64-tma-store": ((128, 128, 64, 8, 8, 3), 1, False, True),
    "64x64x64-2perSM-tma-store": ((64, 64, 64, 4, 4, 4), 2, False, True),
    "128x128x64-groups16": ((128, 128, 64, 16, 8, 3), 1, False, False),
    "64x64x64-2perSM-tma-store-groups3": ((64, 64, 64, 3, 4, 4), 2, False, True),
}


def persistent_config(name):
    """The persistent config ``name``, TMA-fed on SM90+ (the gathered ``A`` by pointers)."""
    from moe_route.kernels.triton.gemm_mainloop import GemmConfig

    fields, programs, ws, store = PERSISTENT_CONFIGS[name]
    tma = torch.cuda.get_device_capability()[0] >= 9
    if (ws or store) and not tma:
        pytest.skip("warp specialisation and TMA stores want SM90+")
    return GemmConfig(*fields, use_tma=tma, persistent=programs, warp_specialize=ws,
                      tma_store=store)  # fmt: skip


@pytest.mark.parametrize("config", list(PERSISTENT_CONFIGS))
@pytest.mark.parametrize("layout", ["concat", "interleaved"])
@pytest.mark.parametrize("gather", [False, True], ids=["perm", "gather"])
@pytest.mark.parametrize(("H", "inter"), [(200, 136), (1024, 768), (72, 40)])
@pytest.mark.parametrize("T", [1, 1000])
def test_persistent_odd_sizes(T, H, inter, gather, layout, config):
    """bf16: GEMM1 (swiglu, bias; gate and up rows in one TMA box on SM90) and GEMM2 through
    the persistent kernel into NaN-poisoned outputs, against float64 and against the per-tile
    kernel of the same tiles."""
    cfg = persistent_config(config)
    per_tile = dataclasses.replace(cfg, persistent=0, warp_specialize=False)
    dtype = torch.bfloat16
    a, w, b, maps = gemm_case(T, 4, 8, H, inter, "swiglu", dtype=dtype, bias=True,
                              gather=gather, drop=0.2, seed=T + H)  # fmt: skip
    kw = dict(activation="swiglu", layout=layout, gather=gather)
    h = launch(a, w, maps, b, config=cfg, **kw)
    assert_matches(h, gemm_reference(a, w, maps, b, **kw), TOL[dtype])
    assert_dropped_rows_zero(h, maps)
    assert_matches(h, launch(a, w, maps, b, config=per_tile, **kw).double(), TOL[dtype],
                   what="persistent vs per-tile")  # fmt: skip
    w2 = rand(8, H, inter, dtype=dtype, scale=inter**-0.5, seed=T + H + 1)
    y = launch(h, w2, maps, config=cfg)
    assert_matches(y, gemm_reference(h, w2, maps), TOL[dtype], what="GEMM2")
    assert_dropped_rows_zero(y, maps)


PERSISTENT_OCCUPANCY = {**OCCUPANCY, "E=1": lambda T: torch.zeros(T, 1, dtype=torch.int64)}


@pytest.mark.parametrize("pattern", list(PERSISTENT_OCCUPANCY))
@pytest.mark.parametrize(
    "config",
    ["128x128x64", "64x64x64-2perSM", "128x128x64-tma-store", "64x64x64-2perSM-tma-store",
     "128x128x64-groups16", "64x64x64-2perSM-tma-store-groups3"],
)  # fmt: skip
def test_persistent_occupancy_store_pre(config, pattern):
    """Empty experts, all rows in one expert (of 8, and E = 1), mostly and wholly dropped
    routings; with the pre-activation stored (training): ``z`` (zero in dropped rows) and
    ``act(z)``."""
    cfg = persistent_config(config)
    T, E, dtype = 1000, 1 if pattern == "E=1" else 8, torch.bfloat16
    ids = PERSISTENT_OCCUPANCY[pattern](T)
    a, w, b, maps = gemm_case(T, ids.shape[1], E, 200, 136, "swiglu", dtype=dtype, bias=True,
                              gather=True, ids=ids, seed=7)  # fmt: skip
    z = torch.full((maps.num_expanded_rows, w.shape[1]), NAN, dtype=dtype, device=CUDA)
    out = launch(a, w, maps, b, activation="swiglu", gather=True, config=cfg, pre_activation=z)
    assert_dropped_rows_zero(out, maps)
    assert_dropped_rows_zero(z, maps)
    if pattern != "all_dropped":
        ref = gemm_reference(a, w, maps, b, activation="swiglu", gather=True)
        assert_matches(out, ref, TOL[dtype])
        assert_matches(z, gemm_reference(a, w, maps, b, gather=True), TOL[dtype], what="z")


@pytest.mark.parametrize("config", list(PERSISTENT_CONFIGS))
def test_persistent_deterministic(config):
    """Many tiles per program (E = 64, K = 8, T = 3001): 20 runs, the same bits, every element
    written (a NaN block of the output's size freed before each run is what the allocator hands
    the next output)."""
    cfg = persistent_config(config)
    a, w, b, maps = gemm_case(3001, 8, 64, 520, 264, "swiglu", dtype=torch.bfloat16, bias=True,
                              drop=0.1, seed=31)  # fmt: skip
    first = launch(a, w, maps, b, activation="swiglu", config=cfg)
    assert_matches(first, gemm_reference(a, w, maps, b, activation="swiglu"), TOL[torch.bfloat16])
    for i in range(20):
        torch.full_like(first, NAN)
        again = launch(a, w, maps, b, activation="swiglu", config=cfg)
        assert torch.equal(again, first), f"run {i + 1} differs"
        del again


@pytest.mark.isolated  # a failed capture would break the tests after it (tests/conftest.py)
def test_persistent_cuda_graph(monkeypatch):
    """fused_moe forward + backward with every GEMM1 / GEMM2 / dX launch persistent
    (``MOE_ROUTE_PERSISTENT=1``): captured once, replayed on new routing, equal to eager and to
    float64; gradients equal to the per-tile kernels' within bf16 rounding."""
    monkeypatch.setenv("MOE_ROUTE_PERSISTENT", "1")
    T, K, E, H, inter = 199, 4, 16, 200, 136
    static = moe_case(T, K, E, H, inter, b1=True, b2=True, bias="TH", seed=32)

    def step():
        return run_moe(static)

    graph, static_out = capture_cuda_graph(step, warmup=2)
    fresh = moe_case(T, K, E, H, inter, b1=True, b2=True, bias="TH", drop=0.3, seed=33)
    for key, value in fresh.items():
        if value is not None:
            static[key].copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, run_moe(fresh)), "graph replay differs from eager"
    assert_matches(static_out, moe_expected(fresh), TOL[torch.bfloat16])

    def grads():
        case = {k: (v.detach().clone().requires_grad_(k in ("x", "w1", "w2")) if v is not None
                    and v.is_floating_point() else v) for k, v in fresh.items()}  # fmt: skip
        run_moe(case).float().square().sum().backward()
        return [case[k].grad for k in ("x", "w1", "w2")]

    persistent = grads()
    monkeypatch.setenv("MOE_ROUTE_PERSISTENT", "0")
    for name, got, want in zip(("dx", "dw1", "dw2"), persistent, grads(), strict=True):
        assert_matches(got, want.double(), TOL[torch.bfloat16], what=name)
