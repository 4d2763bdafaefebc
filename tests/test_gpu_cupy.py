"""The CuPy/NVRTC kernels on a GPU: the same bits as the Triton kernels and the reference, CuPy
arrays in and out without copies, no host synchronisation, CUDA graphs, torch.compile.

Skipped without a CUDA device or without CuPy (``pip install 'moe_route[cupy]'``).
"""

import importlib.util

import pytest
import torch
from helpers import (
    assert_finalize_close,
    assert_tables_equal,
    capture_cuda_graph,
    check_routing_invariants,
    maps_tables,
    poisoned,
    poisoned_maps_outputs,
    random_topk_ids,
    random_weights,
    strided_copy,
    triton_maps,
)

import moe_route
from moe_route import arch
from moe_route.reference import routing_maps_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        importlib.util.find_spec("cupy") is None,
        reason="needs CuPy (pip install 'moe_route[cupy]')",
    ),
]

CUDA = torch.device("cuda")
NAN = float("nan")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def cupy_maps(ids, E):
    """The CuPy launcher into poisoned outputs: every entry must be written."""
    from moe_route.kernels.cupy.routing_maps import routing_maps_cupy

    outs = poisoned_maps_outputs(ids.numel(), E, ids.device)
    routing_maps_cupy(ids, E, *outs)
    return outs


def gpu_randn(*shape, dtype, seed):
    """Normal samples drawn on the GPU (the CPU float64 draws of ``helpers.randn`` take seconds
    at these sizes)."""
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=CUDA).to(dtype)


def _case(T, K, E, H, dtype, *, drop_prob=0.1, bias=None, weight_dtype=torch.float32, seed=0):
    """A layer's token path on the GPU; NaN in every value the contract says is never read."""
    ids = random_topk_ids(T, K, E, drop_prob=drop_prob, device=CUDA, seed=seed)
    maps = moe_route.build_routing_maps(ids, E, backend="reference")
    routed = int(maps.expert_first_token_offset[-1])
    x = gpu_randn(T, H, dtype=dtype, seed=seed)
    y = gpu_randn(T * K, H, dtype=dtype, seed=seed + 1)
    y[routed:] = NAN
    w = random_weights(T, K, dtype=weight_dtype, device=CUDA, seed=seed).masked_fill(ids < 0, NAN)
    b = {
        None: None,
        "H": gpu_randn(H, dtype=dtype, seed=seed + 2),
        "TH": gpu_randn(T, H, dtype=dtype, seed=seed + 3),
    }[bias]
    return dict(ids=ids, maps=maps, x=x, y=y, w=w, bias=b)


def _tables(maps):
    return (
        maps.expanded_source_row_to_expanded_dest_row,
        maps.expert_for_source_row,
    )


# ============================================================================= maps
MAPS_SHAPES = [
    (1, 8, 64),  # decode: one tile
    (8, 8, 128),
    (64, 8, 256),
    (256, 8, 256),  # exactly one full tile (2048 slots)
    (257, 8, 256),  # one slot past it
    (4096, 8, 256),  # deepseek
    (16384, 8, 256),
    (32768, 8, 256),
    (4096, 8, 1000),  # large E, not a power of two
    (2048, 2, 8),  # mixtral-like
    (8192, 8, 128),  # qwen3-like
    (37, 3, 5),
    (999, 1, 1),
    (300, 7, 7),  # K = E
]


@pytest.mark.parametrize("drop_prob", [0.0, 0.1])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("T,K,E", MAPS_SHAPES)
def test_maps_cupy_equals_triton_and_reference(T, K, E, id_dtype, drop_prob):
    ids = random_topk_ids(T, K, E, drop_prob=drop_prob, dtype=id_dtype, device=CUDA, seed=T + E)
    ref = routing_maps_reference(ids, E)
    assert_tables_equal(cupy_maps(ids, E), ref, what=f"T={T} K={K} E={E}: ")
    assert_tables_equal(cupy_maps(ids, E), triton_maps(ids, E), what="cupy vs triton: ")
    maps = moe_route.build_routing_maps(ids, E, backend="cupy")
    assert_tables_equal(maps_tables(maps), ref)


@pytest.mark.parametrize("T,K,E", [(3000, 8, 200), (5000, 4, 64), (700, 16, 16)])
def test_maps_repeated_ids_and_all_dropped(T, K, E):
    ids = random_topk_ids(T, K, E, drop_prob=0.05, distinct=False, device=CUDA, seed=K)
    assert_tables_equal(cupy_maps(ids, E), routing_maps_reference(ids, E))
    check_routing_invariants(cupy_maps(ids, E), ids, E)
    dropped = torch.full((T, K), -1, dtype=torch.int64, device=CUDA)
    assert_tables_equal(cupy_maps(dropped, E), routing_maps_reference(dropped, E))


@pytest.mark.parametrize("E", [4000, 20000])  # fewer warps; opt-in shared memory
def test_maps_many_experts(E):
    ids = random_topk_ids(6000, 8, E, drop_prob=0.05, distinct=False, device=CUDA, seed=E)
    assert_tables_equal(cupy_maps(ids, E), routing_maps_reference(ids, E))


def test_maps_strided_empty_and_out_of_range_ids():
    ids = random_topk_ids(4096, 8, 256, drop_prob=0.1, device=CUDA, seed=1)
    want = routing_maps_reference(ids, 256)
    assert_tables_equal(cupy_maps(ids.t().contiguous().t(), 256), want)
    assert_tables_equal(cupy_maps(strided_copy(ids, "cols"), 256), want)
    empty = moe_route.build_routing_maps(
        torch.empty(0, 8, dtype=torch.int64, device=CUDA), 64, backend="cupy"
    )
    assert empty.expert_first_token_offset.tolist() == [0] * 65
    E = 16
    bad = random_topk_ids(512, 4, E, device=CUDA, seed=2)
    bad[0, 0], bad[5, 3], bad[7, 1] = E, -9, 2**40  # unchecked on the GPU: count as dropped
    as_dropped = torch.where((bad >= 0) & (bad < E), bad, -1)
    assert_tables_equal(cupy_maps(bad, E), routing_maps_reference(as_dropped, E))


# ============================================================================= expand
@pytest.mark.parametrize("H", [13, 4096, 7168])
@pytest.mark.parametrize("T", [1, 37, 199, 1024])
@pytest.mark.parametrize("dtype", (*DTYPES, torch.float64), ids=str)
def test_expand_equals_triton(dtype, T, H):
    from moe_route.kernels.cupy.expand import expand_rows_cupy

    c = _case(T, 8, 64, H, dtype, seed=T + H)
    m = c["maps"]
    want = moe_route.expand_rows(c["x"], m, backend="triton")
    assert torch.equal(moe_route.expand_rows(c["x"], m, backend="cupy"), want)
    buf = poisoned((T * 8, H + 8), dtype, CUDA)
    expand_rows_cupy(c["x"], *_tables(m), buf[:, :H])
    assert torch.equal(buf[:, :H], want), "poisoned launcher output differs (unwritten rows?)"
    assert buf[:, H:].isnan().all()


@pytest.mark.parametrize("layout", ["transposed", "cols", "rows", "offset"])
def test_expand_strided(layout):
    c = _case(512, 8, 64, 256, torch.bfloat16, seed=4)
    x = c["x"]
    view = torch.cat([x[:, :1], x], 1)[:, 1:] if layout == "offset" else strided_copy(x, layout)
    want = moe_route.expand_rows(x, c["maps"], backend="triton")
    assert torch.equal(moe_route.expand_rows(view, c["maps"], backend="cupy"), want)


# ============================================================================= finalize
@pytest.mark.parametrize("bias", [None, "H", "TH"])
@pytest.mark.parametrize("H", [13, 4096, 7168])
@pytest.mark.parametrize("T", [1, 37, 199, 1024])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_finalize_bits_equal_triton(dtype, T, H, bias):
    from moe_route.kernels.cupy.finalize import finalize_cupy
    from moe_route.kernels.triton.finalize import finalize_triton

    wdt = dtype if (T + H) % 2 else torch.float32  # both weight dtypes across the grid
    c = _case(T, 8, 64, H, dtype, bias=bias, weight_dtype=wdt, seed=T * H)
    m = c["maps"]
    out = moe_route.finalize_moe_routing(c["y"], c["w"], m, c["bias"], backend="cupy")
    assert not out.isnan().any()
    assert_finalize_close(out, c["y"], c["w"], m, c["bias"])
    want = poisoned((T, H), dtype, CUDA)
    finalize_triton(c["y"], c["w"], *_tables(m), c["bias"], want)
    assert torch.equal(out, want), "not the Triton kernel's bits"
    # Launch settings: rows in flight, and threads x units per thread (the column loop, with a
    # partial last round where the row is not a multiple of the block's stride).
    for rows_in_flight, threads, units in ((4, 64, 1), (8, 64, 1), (4, 128, 3), (8, 32, 4)):
        buf = poisoned((T, H + 8), dtype, CUDA)
        finalize_cupy(
            c["y"], c["w"], *_tables(m), c["bias"], buf[:, :H], rows_in_flight=rows_in_flight,
            threads=threads, units_per_thread=units,
        )  # fmt: skip
        assert torch.equal(buf[:, :H], want), "poisoned launcher output differs (unwritten rows?)"
        assert buf[:, H:].isnan().all()


@pytest.mark.parametrize(
    "y_dtype,w_dtype,b_dtype",
    [
        (torch.float64, torch.float64, torch.float64),
        (torch.bfloat16, torch.float64, torch.bfloat16),  # float64 sums rounded to bf16 once
        (torch.float16, torch.float32, torch.float64),  # a float64 bias into float32 sums
        (torch.bfloat16, torch.float32, torch.float32),
    ],
    ids=str,
)
def test_finalize_mixed_dtypes(y_dtype, w_dtype, b_dtype):
    c = _case(199, 8, 64, 4096, y_dtype, weight_dtype=w_dtype, seed=6)
    bias = gpu_randn(4096, dtype=b_dtype, seed=6)
    out = moe_route.finalize_moe_routing(c["y"], c["w"], c["maps"], bias, backend="cupy")
    assert out.dtype == y_dtype
    assert_finalize_close(out, c["y"], c["w"], c["maps"], bias)
    if torch.float64 not in (y_dtype, w_dtype):  # float32 sums: the Triton kernel's bits
        triton = moe_route.finalize_moe_routing(c["y"], c["w"], c["maps"], bias, backend="triton")
        assert torch.equal(out, triton)


def test_finalize_strided_and_subnormal_inputs():
    T, K, E, H = 4096, 8, 64, 4096
    c = _case(T, K, E, H, torch.bfloat16, bias="TH", seed=5)
    args = [c["y"].t().contiguous().t(), c["w"].t().contiguous().t(), c["maps"]]
    bias = c["bias"].t().contiguous().t()
    want = moe_route.finalize_moe_routing(c["y"], c["w"], c["maps"], c["bias"], backend="triton")
    assert torch.equal(moe_route.finalize_moe_routing(*args, bias, backend="cupy"), want)
    # float32 subnormal products and sums are kept, not flushed (CuPy compiles with -ftz=true).
    y = torch.full((T * K, 64), 2.0**-140, device=CUDA)
    w = torch.full((T, K), 0.5, device=CUDA)
    got = moe_route.finalize_moe_routing(y, w, c["maps"], backend="cupy")
    assert torch.equal(got, moe_route.finalize_moe_routing(y, w, c["maps"], backend="triton"))
    assert (got[moe_route.finalize_moe_routing(y, w, c["maps"], backend="reference") > 0] > 0).all()


# ============================================================================= CuPy arrays
def test_cupy_arrays_in_cupy_arrays_out_no_copy(monkeypatch):
    import cupy

    from moe_route.kernels.cupy import expand as expand_module

    T, K, E, H = 1000, 8, 64, 512
    c = _case(T, K, E, H, torch.float16, bias="H", seed=7)
    ids_cp = cupy.from_dlpack(c["ids"])
    x_cp = cupy.from_dlpack(c["x"])
    maps = moe_route.build_routing_maps(ids_cp, E, backend="cupy")
    assert_tables_equal(maps_tables(maps), maps_tables(c["maps"]))

    seen = {}

    def spy(x, src_to_dest, expert_for_src, out):
        seen.update(x=x.data_ptr(), out=out.data_ptr())
        real(x, src_to_dest, expert_for_src, out)

    real = expand_module.expand_rows_cupy
    monkeypatch.setattr(expand_module, "expand_rows_cupy", spy)
    y_cp = moe_route.expand_rows(x_cp, maps, backend="cupy")
    assert isinstance(y_cp, cupy.ndarray)
    assert seen["x"] == x_cp.data.ptr, "the CuPy input was copied"
    assert seen["out"] == y_cp.data.ptr, "the result was copied on its way out"
    assert torch.equal(torch.from_dlpack(y_cp), moe_route.expand_rows(c["x"], c["maps"]))

    for backend in ("cupy", "triton"):
        out = moe_route.finalize_moe_routing(
            y_cp, cupy.from_dlpack(c["w"]), maps, cupy.from_dlpack(c["bias"]), backend=backend
        )
        assert isinstance(out, cupy.ndarray) and out.dtype == cupy.float16
        want = moe_route.finalize_moe_routing(
            torch.from_dlpack(y_cp), c["w"], maps, c["bias"], backend="triton"
        )
        assert torch.equal(torch.from_dlpack(out), want)


# ============================================================================= selection
def test_selection(monkeypatch):
    assert arch.backend_for(CUDA).value == "triton"  # auto keeps Triton (see arch)
    from moe_route.kernels.cupy import routing_maps as maps_module

    picked = []
    real_maps = maps_module.routing_maps_cupy
    monkeypatch.setattr(
        maps_module, "routing_maps_cupy", lambda *a: picked.append(a[0].shape) or real_maps(*a)
    )
    # auto: CuPy only from arch.CUPY_MAPS_MIN_LARGE_SLOTS (131072) slots, where it measured
    # faster and the device time outweighs its launch path's host time (arch's note)
    for T in (64, 4096, 16384):
        ids = random_topk_ids(T, 8, 256, device=CUDA, seed=T)
        maps = moe_route.build_routing_maps(ids, 256)
        assert_tables_equal(maps_tables(maps), routing_maps_reference(ids, 256))
    assert picked == [(16384, 8)]
    monkeypatch.setenv("MOE_ROUTE_BACKEND", "cupy")
    assert arch.backend_for(CUDA).value == "cupy"
    from moe_route.kernels.cupy import finalize as finalize_module

    calls = []
    real = finalize_module.finalize_cupy
    monkeypatch.setattr(finalize_module, "finalize_cupy", lambda *a: calls.append(1) or real(*a))
    c = _case(64, 8, 64, 256, torch.bfloat16, seed=8)
    moe_route.finalize_moe_routing(c["y"], c["w"], c["maps"])
    assert calls == [1]
    info = arch.describe(CUDA)
    assert info["  cupy"].startswith("yes") and "NVRTC" in info["  cupy"], info


# ============================================================================= host sync, graphs
def _chain(x, ids, w, bias, E):
    maps = moe_route.build_routing_maps(ids, E, backend="cupy")
    x_perm = moe_route.expand_rows(x, maps, backend="cupy")
    y = x_perm * 2  # stands in for the expert GEMMs
    out = moe_route.finalize_moe_routing(y, w, maps, bias, backend="cupy")
    return out, x_perm, maps.expert_first_token_offset


def test_no_sync_and_deterministic():
    c = _case(4096, 8, 256, 512, torch.bfloat16, bias="H", seed=8)
    first = _chain(c["x"], c["ids"], c["w"], c["bias"], 256)  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        runs = [_chain(c["x"], c["ids"], c["w"], c["bias"], 256) for _ in range(5)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for run in runs:
        for a, b in zip(run, first, strict=True):
            assert torch.equal(a, b)


@pytest.mark.isolated  # a failed capture would break the tests after it (tests/conftest.py)
@pytest.mark.parametrize("T", [64, 4096])  # one-tile and multi-tile maps
def test_cuda_graph_capture_and_replay(T):
    K, E, H = 8, 64, 512
    a = _case(T, K, E, H, torch.bfloat16, bias="H", seed=9, drop_prob=0.1)
    b = _case(T, K, E, H, torch.bfloat16, bias="H", seed=10, drop_prob=0.2)
    static = {k: a[k].clone() for k in ("x", "ids", "w", "bias")}
    graph, out = capture_cuda_graph(
        lambda: _chain(static["x"], static["ids"], static["w"], static["bias"], E), warmup=2
    )
    for case in (b, a):
        for k in static:
            static[k].copy_(case[k])
        graph.replay()
        torch.cuda.synchronize()
        want = _chain(case["x"], case["ids"], case["w"], case["bias"], E)
        for g, w in zip(out, want, strict=True):
            assert torch.equal(g, w)


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    E = 64
    compiled = torch.compile(lambda x, ids, w, bias: _chain(x, ids, w, bias, E), fullgraph=True)
    for T in (37, 4096):
        c = _case(T, 8, E, 256, torch.bfloat16, bias="TH", seed=T)
        got = compiled(c["x"], c["ids"], c["w"], c["bias"])
        want = _chain(c["x"], c["ids"], c["w"], c["bias"], E)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
