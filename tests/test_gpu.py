"""CUDA-only tests: compiled Triton kernels against the reference at real sizes, poisoned
outputs, determinism, no host synchronisation (CUDA graphs, sync debug mode), torch.compile,
and 64-bit addressing past 2**31 elements. Skipped on machines without a CUDA device;
``bash scripts/gpu_check.sh`` runs them (``pytest -m gpu``).

The smaller CPU tests run here too (on ``cuda`` tensors, compiled) when the whole suite runs on
a GPU machine; this file adds what the interpreter is too slow or too CPU-bound to show.
"""

import pytest
import torch
from helpers import (
    assert_finalize_close,
    assert_tables_equal,
    capture_cuda_graph,
    check_routing_invariants,
    maps_tables,
    poisoned,
    randn,
    random_topk_ids,
    random_weights,
    strided_copy,
    triton_maps,
)

import moe_route
from moe_route.reference import routing_maps_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
NAN = float("nan")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _case(T, K, E, H, dtype, *, drop_prob=0.1, bias=None, weight_dtype=torch.float32, seed=0):
    """A layer's token path on the GPU; NaN in every value the contract says is never read."""
    ids = random_topk_ids(T, K, E, drop_prob=drop_prob, device=CUDA, seed=seed)
    maps = moe_route.build_routing_maps(ids, E, backend="reference")
    routed = int(maps.expert_first_token_offset[-1])
    x = randn(T, H, dtype=dtype, device=CUDA, seed=seed)
    y = randn(T * K, H, dtype=dtype, device=CUDA, seed=seed + 1)
    y[routed:] = NAN
    w = random_weights(T, K, dtype=weight_dtype, device=CUDA, seed=seed).masked_fill(ids < 0, NAN)
    b = {
        None: None,
        "H": randn(H, dtype=dtype, device=CUDA, seed=seed + 2),
        "TH": randn(T, H, dtype=dtype, device=CUDA, seed=seed + 3),
    }[bias]
    return dict(ids=ids, maps=maps, x=x, y=y, w=w, bias=b, routed=routed)


def _expected_expand(x, maps):
    d2s = maps.expanded_dest_row_to_expanded_source_row.long()
    routed = int(maps.expert_first_token_offset[-1])
    out = torch.zeros(d2s.numel(), x.shape[1], dtype=x.dtype, device=x.device)
    out[:routed] = x[d2s[:routed] % x.shape[0]]
    return out


# ============================================================================= maps
MAPS_SHAPES = [
    (32768, 8, 256),  # the big prefill shape: multi-tile path
    (1, 8, 64),  # decode: one tile
    (8, 8, 128),
    (64, 8, 256),
    (4096, 8, 1000),  # large E
    (2048, 2, 8),  # mixtral-like
    (8192, 8, 128),  # qwen3-like
    (37, 3, 5),
    (999, 1, 1),
]


@pytest.mark.parametrize("drop_prob", [0.0, 0.1])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("T,K,E", MAPS_SHAPES)
def test_maps_triton_equals_reference(T, K, E, id_dtype, drop_prob):
    ids = random_topk_ids(T, K, E, drop_prob=drop_prob, dtype=id_dtype, device=CUDA, seed=T + E)
    ref = routing_maps_reference(ids, E)
    maps = moe_route.build_routing_maps(ids, E)  # auto on CUDA: Triton
    assert_tables_equal(maps_tables(maps), ref, what=f"T={T} K={K} E={E}: ")
    assert_tables_equal(triton_maps(ids, E), ref, what="poisoned launcher: ")
    check_routing_invariants(ref, ids, E)


@pytest.mark.parametrize("tile", [16, 64, 256, 1024, 4096])
def test_maps_forced_tiles(tile):
    T, K, E = 3000, 8, 200
    ids = random_topk_ids(T, K, E, drop_prob=0.05, distinct=False, device=CUDA, seed=tile)
    assert_tables_equal(triton_maps(ids, E, tile=tile), routing_maps_reference(ids, E))


def test_maps_non_contiguous_and_empty():
    ids = random_topk_ids(4096, 8, 256, drop_prob=0.1, device=CUDA, seed=1)
    view = ids.t().contiguous().t()
    assert_tables_equal(triton_maps(view, 256), routing_maps_reference(ids, 256))
    sliced = strided_copy(ids, "cols")  # same values, column stride 2
    assert_tables_equal(triton_maps(sliced, 256), routing_maps_reference(ids, 256))
    empty = moe_route.build_routing_maps(torch.empty(0, 8, dtype=torch.int64, device=CUDA), 64)
    assert empty.expert_first_token_offset.tolist() == [0] * 65


@pytest.mark.parametrize("T", [64, 4096], ids=["one-tile", "multi-tile"])
def test_maps_gpu_at_the_expert_limit(T, capsys):
    """The largest E the Triton kernels accept on this GPU (E + K + 1 bins staged in shared
    memory, see kernels/triton/routing_maps.py) compiles, runs and equals the reference; one
    more expert is refused before any launch. Prints the first call's time (compile included),
    the number that says whether the limit is practical."""
    import time

    from moe_route.kernels.triton import routing_maps as triton_maps_module

    K = 8
    E = triton_maps_module.max_num_experts(K, CUDA)
    ids = torch.randint(0, E, (T, K), device=CUDA)
    ids[0] = torch.arange(E - K, E, device=CUDA)  # the last bins are used
    start = time.perf_counter()
    maps = moe_route.build_routing_maps(ids, E, backend="triton", check_ids=False)
    torch.cuda.synchronize()
    with capsys.disabled():
        print(f"\nrouting maps at E={E}, T={T}: first call {time.perf_counter() - start:.1f} s")
    assert_tables_equal(maps_tables(maps), routing_maps_reference(ids, E))
    with pytest.raises(ValueError, match=rf"num_experts={E + 1} with K=8"):
        moe_route.build_routing_maps(ids, E + 1, backend="triton")


def test_maps_unchecked_ids_on_gpu_are_dropped(monkeypatch):
    E = 16
    ids = random_topk_ids(512, 4, E, device=CUDA, seed=2)
    ids[0, 0], ids[5, 3], ids[7, 1] = E, -9, 2**40
    as_dropped = torch.where((ids >= 0) & (ids < E), ids, -1)
    # GPU default: no value check (it would sync); out-of-range ids count as dropped.
    maps = moe_route.build_routing_maps(ids, E)
    assert_tables_equal(maps_tables(maps), routing_maps_reference(as_dropped, E))
    monkeypatch.setenv("MOE_ROUTE_CHECK_IDS", "1")
    with pytest.raises(ValueError, match=r"topk_ids\[0, 0\] = 16 is out of range"):
        moe_route.build_routing_maps(ids, E)
    monkeypatch.delenv("MOE_ROUTE_CHECK_IDS")
    with pytest.raises(ValueError, match=r"topk_ids\[0, 0\]"):
        moe_route.build_routing_maps(ids, E, check_ids=True)


# ============================================================================= expand / finalize
@pytest.mark.parametrize("H", [13, 4096, 7168])
@pytest.mark.parametrize("T", [1, 37, 199, 4096])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_expand_gpu(dtype, T, H):
    c = _case(T, 8, 64, H, dtype, seed=T + H)
    out = moe_route.expand_rows(c["x"], c["maps"])
    assert torch.equal(out, _expected_expand(c["x"], c["maps"]))
    from moe_route.kernels.triton.expand import expand_rows_triton

    buf = poisoned((T * 8, H + 8), dtype, CUDA)
    m = c["maps"]
    expand_rows_triton(
        c["x"], m.expanded_source_row_to_expanded_dest_row, m.expert_for_source_row, buf[:, :H]
    )
    assert torch.equal(buf[:, :H], out), "poisoned launcher output differs (unwritten rows?)"
    assert buf[:, H:].isnan().all()


@pytest.mark.parametrize("bias", [None, "H", "TH"])
@pytest.mark.parametrize("H", [13, 4096, 7168])
@pytest.mark.parametrize("T", [1, 37, 199, 4096])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_finalize_gpu(dtype, T, H, bias):
    wdt = dtype if (T + H) % 2 else torch.float32  # both weight dtypes across the grid
    c = _case(T, 8, 64, H, dtype, bias=bias, weight_dtype=wdt, seed=T * H)
    out = moe_route.finalize_moe_routing(c["y"], c["w"], c["maps"], c["bias"])
    assert not out.isnan().any()
    assert_finalize_close(out, c["y"], c["w"], c["maps"], c["bias"])
    from moe_route.kernels.triton.finalize import finalize_triton

    buf = poisoned((T, H + 8), dtype, CUDA)
    m = c["maps"]
    finalize_triton(
        c["y"],
        c["w"],
        m.expanded_source_row_to_expanded_dest_row,
        m.expert_for_source_row,
        c["bias"],
        buf[:, :H],
    )
    assert torch.equal(buf[:, :H], out), "poisoned launcher output differs (unwritten rows?)"
    assert buf[:, H:].isnan().all()


def test_finalize_gpu_strided_inputs():
    T, K, E, H = 4096, 8, 64, 4096
    c = _case(T, K, E, H, torch.bfloat16, bias="TH", seed=5)
    y = c["y"].t().contiguous().t()
    w = c["w"].t().contiguous().t()
    bias = c["bias"].t().contiguous().t()
    out = moe_route.finalize_moe_routing(y, w, c["maps"], bias)
    assert torch.equal(out, moe_route.finalize_moe_routing(c["y"], c["w"], c["maps"], c["bias"]))
    x_t = c["x"].t().contiguous().t()
    assert torch.equal(
        moe_route.expand_rows(x_t, c["maps"]), moe_route.expand_rows(c["x"], c["maps"])
    )


# ============================================================================= determinism
def test_determinism_20_runs():
    T, K, E, H = 4096, 8, 256, 4096
    c = _case(T, K, E, H, torch.bfloat16, bias="H", seed=7)
    first = None
    for _ in range(20):
        maps = moe_route.build_routing_maps(c["ids"], E)
        x_perm = moe_route.expand_rows(c["x"], maps)
        out = moe_route.finalize_moe_routing(c["y"], c["w"], maps, c["bias"])
        now = (*maps_tables(maps), x_perm, out)
        if first is None:
            first = now
        else:
            for a, b in zip(now, first, strict=True):
                assert torch.equal(a, b)


# ============================================================================= no host sync
def _chain(x, ids, w, bias, E):
    maps = moe_route.build_routing_maps(ids, E)
    x_perm = moe_route.expand_rows(x, maps)
    y = x_perm * 2  # stands in for the expert GEMMs
    return moe_route.finalize_moe_routing(y, w, maps, bias), x_perm, maps.expert_first_token_offset


def test_no_sync_debug_mode():
    c = _case(2048, 8, 64, 512, torch.bfloat16, bias="H", seed=8)
    _chain(c["x"], c["ids"], c["w"], c["bias"], 64)  # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _chain(c["x"], c["ids"], c["w"], c["bias"], 64)
    finally:
        torch.cuda.set_sync_debug_mode("default")


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
    for case in (b, a):  # new inputs copied into the captured buffers, then replay
        for k in static:
            static[k].copy_(case[k])
        graph.replay()
        torch.cuda.synchronize()
        want = _chain(case["x"], case["ids"], case["w"], case["bias"], E)
        for g, w in zip(out, want, strict=True):
            assert torch.equal(g, w)


def test_torch_compile_fullgraph_cuda():
    torch._dynamo.reset()
    E = 64
    compiled = torch.compile(lambda x, ids, w, bias: _chain(x, ids, w, bias, E), fullgraph=True)
    for T in (37, 4096):
        c = _case(T, 8, E, 256, torch.bfloat16, bias="TH", seed=T)
        got = compiled(c["x"], c["ids"], c["w"], c["bias"])
        want = _chain(c["x"], c["ids"], c["w"], c["bias"], E)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)


# ============================================================================= 64-bit offsets
def test_int64_offsets_past_2_31_elements():
    # T*K*H = 2**19 * 4224 > 2**31: the last ~16k dest rows start past element 2**31, where
    # an int32 row offset would wrap (T=65536, K=8, H=4096 is exactly 2**31: not past it).
    T, K, E, H = 65536, 8, 64, 4224
    need = T * K * H * 2 * 2 + T * H * 2 * 3
    free, _ = torch.cuda.mem_get_info()
    if free < need + (2 << 30):
        pytest.skip(f"needs ~{need / 2**30:.0f} GiB free on the GPU, {free / 2**30:.0f} GiB free")
    ids = random_topk_ids(T, K, E, drop_prob=0.01, device=CUDA, seed=11)
    maps = moe_route.build_routing_maps(ids, E)
    x = randn(T, H, dtype=torch.bfloat16, device=CUDA, seed=11)
    x_perm = moe_route.expand_rows(x, maps)
    N = T * K
    routed = int(maps.expert_first_token_offset[-1])
    d2s = maps.expanded_dest_row_to_expanded_source_row.long()
    # Rows whose first element sits past 2**31: routed ones gathered right, dropped ones zero.
    first_big = (2**31) // H
    rows = torch.cat([torch.arange(first_big - 4, first_big + 4), torch.arange(routed - 8, N)]).to(
        CUDA
    )
    rows = rows[(rows >= 0) & (rows < N)].unique()
    want = torch.where(
        (rows < routed).unsqueeze(1), x[d2s[rows] % T], torch.zeros((), dtype=x.dtype, device=CUDA)
    )
    assert torch.equal(x_perm[rows], want)
    assert routed < N, "the seed should drop some slots"
    # finalize reading those rows: tokens whose slots live past 2**31 elements.
    w = random_weights(T, K, device=CUDA, seed=11)
    out = moe_route.finalize_moe_routing(x_perm, w, maps)
    s2d = maps.expanded_source_row_to_expanded_dest_row.long().view(K, T)
    far = (s2d.max(0).values * H >= 2**31).nonzero().squeeze(1)[:64]
    assert far.numel() > 0, "no token has a slot past element 2**31"
    routed_slots = (maps.expert_for_source_row.view(K, T) >= 0).t()[far]  # [n, K]
    w_far = torch.where(routed_slots, w[far], 0.0)
    exact = (w_far.double().sum(1, keepdim=True) * x[far].double()).float()
    torch.testing.assert_close(out[far].float(), exact, rtol=2**-7, atol=1e-6)
