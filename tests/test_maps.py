"""Routing maps: contract invariants (hypothesis) on the reference and on the Triton kernels,
both the one-launch rank kernel and the 3-kernel multi-tile path (forced at small N with
``tile=``), and exact agreement of the kernels with the reference."""

import importlib

import pytest
import torch
from helpers import (
    DEVICE,
    assert_tables_equal,
    check_routing_invariants,
    maps_tables,
    random_topk_ids,
    requires_triton,
    strided_copy,
    triton_maps,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import moe_route
from moe_route.kernels.triton import routing_maps as triton_maps_module
from moe_route.reference import routing_maps_reference

ID_LAYOUTS = ("contiguous", "transposed", "cols", "rows")


@st.composite
def routings(draw, *, max_tokens, max_experts, max_k=4, distinct):
    """``(topk_ids [T, K] on DEVICE, E)``: distinct ids per token (top-k) or arbitrary ids
    with repeats, some slots dropped, int32 or int64, contiguous or a strided view."""
    E = draw(st.integers(1, max_experts))
    K = draw(st.integers(1, min(E, max_k)))
    T = draw(st.integers(0, max_tokens))
    if distinct:
        # The first K entries of a random permutation of range(E): the first K steps of the
        # Fisher-Yates shuffle that st.permutations runs (its later steps never move them),
        # so the same rows for K draws a token instead of E - 1.
        flat = []
        for _ in range(T):
            row = list(range(E))
            for i in range(min(K, E - 1)):
                j = draw(st.integers(i, E - 1))
                row[i], row[j] = row[j], row[i]
            flat += row[:K]
    else:
        flat = draw(st.lists(st.integers(0, E - 1), min_size=T * K, max_size=T * K))
    drop_every = draw(st.sampled_from([0, 0, 2, 3, 7, 1]))  # 0: no drops, 1: all dropped
    if drop_every:
        drops = draw(st.lists(st.integers(0, drop_every - 1), min_size=T * K, max_size=T * K))
        flat = [-1 if d == 0 else e for e, d in zip(flat, drops, strict=True)]
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    ids = torch.tensor(flat, dtype=dtype).reshape(T, K)
    layout = draw(st.sampled_from(ID_LAYOUTS)) if T > 1 else "contiguous"
    return strided_copy(ids, layout).to(DEVICE), E


# ----------------------------------------------------------------------------- reference
@settings(max_examples=60)
@given(case=routings(max_tokens=200, max_experts=300, max_k=8, distinct=True))
def test_reference_invariants_topk(case):
    ids, E = case
    check_routing_invariants(routing_maps_reference(ids, E), ids, E)


@settings(max_examples=60)
@given(case=routings(max_tokens=100, max_experts=20, max_k=8, distinct=False))
def test_reference_invariants_repeats(case):
    ids, E = case
    check_routing_invariants(routing_maps_reference(ids, E), ids, E)


# ----------------------------------------------------------------------------- triton
def _check_triton_against_reference(ids, E, tile):
    ref = routing_maps_reference(ids, E)
    check_routing_invariants(ref, ids, E)
    # Public path (the default: one rank launch at these sizes).
    maps = moe_route.build_routing_maps(ids, E, backend="triton")
    check_routing_invariants(maps_tables(maps), ids, E)
    assert_tables_equal(maps_tables(maps), ref, what="build_routing_maps(triton): ")
    # Launcher with a forced tile into poisoned outputs: N > tile runs the 3-kernel path.
    got = triton_maps(ids, E, tile=tile)
    check_routing_invariants(got, ids, E)
    assert_tables_equal(got, ref, what=f"routing_maps_triton(tile={tile}): ")


@requires_triton
@settings(max_examples=30)
@given(
    case=routings(max_tokens=32, max_experts=12, distinct=True),
    tile=st.sampled_from([16, 32]),
)
def test_triton_maps_topk(case, tile):
    _check_triton_against_reference(*case, tile)


@requires_triton
@settings(max_examples=25)
@given(
    case=routings(max_tokens=32, max_experts=6, distinct=False),
    tile=st.sampled_from([16, 32]),
)
def test_triton_maps_repeats(case, tile):
    _check_triton_against_reference(*case, tile)


# Hand-picked shapes around the kernels' edges. (T, K, E, drop_prob, distinct)
EDGE_CASES = {
    "E=1": (33, 1, 1, 0.3, True),
    "K=E": (21, 4, 4, 0.0, True),
    "K=E drops": (21, 4, 4, 0.4, True),
    "E=5": (37, 3, 5, 0.1, True),
    "E=7 repeats": (37, 3, 7, 0.1, False),
    "E+K pow2": (30, 2, 14, 0.2, True),  # E + K bins exactly fill a power of two
    "E+K+1 pow2": (30, 2, 13, 0.2, True),  # multi-tile NUM_BINS = E + K + 1 (padding bin)
    "E=40 two scan programs": (30, 2, 40, 0.2, True),  # 64 bins, 32 per scan program
    "E+1 pow2": (30, 1, 15, 0.2, True),  # single-tile OFFSET_BINS = E + 1 exactly
    "E=16": (30, 2, 16, 0.0, True),
    "E=1000 decode": (3, 4, 1000, 0.0, True),
    "E=1000": (40, 2, 1000, 0.2, True),
    "E=1023 K=1": (20, 1, 1023, 0.1, True),
    "all dropped": (24, 2, 6, 1.0, True),
    "one expert for all": (24, 1, 1, 0.0, True),
    "N = 2 tiles exactly": (16, 2, 8, 0.2, True),
    "N = tile + 1": (17, 1, 8, 0.2, True),
    "ranks: 16 programs, 8 chunks": (250, 4, 37, 0.2, True),
    "ranks: N = RANK_MAX, repeats": (256, 4, 8, 0.1, False),
}


@requires_triton
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("case", list(EDGE_CASES))
def test_triton_maps_edge_cases(case, id_dtype):
    T, K, E, p, distinct = EDGE_CASES[case]
    ids = random_topk_ids(T, K, E, drop_prob=p, distinct=distinct, dtype=id_dtype, device=DEVICE)
    ref = routing_maps_reference(ids, E)
    check_routing_invariants(ref, ids, E)
    for tile in (None, 16, 64):  # the rank launch, then tiles of 16 and of 64 slots
        got = triton_maps(ids, E, tile=tile)
        check_routing_invariants(got, ids, E)
        assert_tables_equal(got, ref, what=f"[{case}, tile={tile}] ")


@requires_triton
def test_triton_maps_scan_over_many_tiles():
    # 65 tiles of 16 slots: the bin scan walks the tiles in steps of 64 (TILES_PER_STEP), so
    # this is the smallest input whose carry crosses a step. ~5 s under the interpreter.
    T, K, E = 1040, 1, 5
    ids = random_topk_ids(T, K, E, drop_prob=0.1, device=DEVICE, seed=21)
    assert_tables_equal(triton_maps(ids, E, tile=16), routing_maps_reference(ids, E))


@requires_triton
def test_triton_maps_same_expert_everywhere():
    # Every slot of every token is expert 3 (repeats allowed): one bin holds all N rows and
    # the order must be plain (t, k) token-major order.
    T, K, E = 20, 3, 5
    ids = torch.full((T, K), 3, dtype=torch.int64, device=DEVICE)
    ref = routing_maps_reference(ids, E)
    t = torch.arange(T).repeat_interleave(K)
    k = torch.arange(K).repeat(T)
    assert torch.equal(ref[1].cpu(), (k * T + t).to(torch.int32))
    assert ref[3].tolist() == [0, 0, 0, 0, T * K, T * K]
    for tile in (None, 16):
        assert_tables_equal(triton_maps(ids, E, tile=tile), ref, what=f"tile={tile}: ")


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=requires_triton)])
@pytest.mark.parametrize("K", [1, 3])
def test_empty_batch(backend, K):
    E = 5
    ids = torch.empty(0, K, dtype=torch.int64, device=DEVICE)
    maps = moe_route.build_routing_maps(ids, E, backend=backend)
    for t in maps_tables(maps)[:3]:
        assert t.shape == (0,) and t.dtype == torch.int32
    assert maps.expert_first_token_offset.tolist() == [0] * (E + 1)
    assert maps.num_expanded_rows == 0


@requires_triton
@pytest.mark.parametrize("tile", [None, 16])
def test_empty_batch_launcher_zeroes_poisoned_offsets(tile):
    got = triton_maps(torch.empty(0, 2, dtype=torch.int32, device=DEVICE), 7, tile=tile)
    assert got[3].tolist() == [0] * 8


@requires_triton
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda ids: ids.t().contiguous().t(), id="transposed"),
        pytest.param(lambda ids: torch.cat([ids, ids], 1)[:, ::2], id="cols-stride-2"),
        pytest.param(lambda ids: torch.cat([ids, ids], 0)[1::2], id="rows-stride-2"),
        pytest.param(lambda ids: ids[:1].expand(ids.shape[0], -1), id="stride-0-rows"),
        pytest.param(
            lambda ids: torch.stack([ids, -ids], 2)[:, :, 0], id="inner-stride-2-last-dim"
        ),
    ],
)
def test_triton_maps_non_contiguous_ids(make):
    T, K, E = 27, 3, 9
    ids = make(random_topk_ids(T, K, E, drop_prob=0.2, device=DEVICE, seed=3))
    assert not ids.is_contiguous()
    ref = routing_maps_reference(ids.contiguous(), E)
    assert_tables_equal(routing_maps_reference(ids, E), ref, what="reference(view): ")
    for tile in (None, 16):
        assert_tables_equal(triton_maps(ids, E, tile=tile), ref, what=f"tile={tile}: ")


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=requires_triton)])
def test_unchecked_out_of_range_ids_are_dropped(backend):
    # check_ids=False: ids outside [-1, E) are treated as dropped, never read out of bounds.
    E = 4
    ids = torch.tensor(
        [[0, 4], [2**40, 1], [-5, -(2**40)], [3, -1]], dtype=torch.int64, device=DEVICE
    )
    as_dropped = torch.where((ids >= 0) & (ids < E), ids, -1)
    maps = moe_route.build_routing_maps(ids, E, backend=backend, check_ids=False)
    assert_tables_equal(maps_tables(maps), routing_maps_reference(as_dropped, E))
    # k-major: column k=0 is [0, 2**40, -5, 3], column k=1 is [4, 1, -2**40, -1].
    assert maps.expert_for_source_row.tolist() == [0, -1, -1, 3, -1, 1, -1, -1]
    if backend == "triton":
        assert_tables_equal(triton_maps(ids, E, tile=16), routing_maps_reference(as_dropped, E))


@requires_triton
@pytest.mark.parametrize("tile", [None, 16])
def test_triton_maps_deterministic(tile):
    ids = random_topk_ids(30, 3, 11, drop_prob=0.1, distinct=False, device=DEVICE, seed=5)
    first = triton_maps(ids, 11, tile=tile)
    for _ in range(2):
        assert_tables_equal(triton_maps(ids, 11, tile=tile), first)


def test_reference_deterministic_and_dtype_independent():
    ids = random_topk_ids(300, 4, 64, drop_prob=0.1, device=DEVICE, seed=9)
    a = routing_maps_reference(ids, 64)
    assert_tables_equal(routing_maps_reference(ids, 64), a)
    assert_tables_equal(routing_maps_reference(ids.to(torch.int32), 64), a)


@requires_triton
def test_auto_backend_runs_triton_where_available():
    ids = random_topk_ids(9, 2, 4, drop_prob=0.2, device=DEVICE, seed=1)
    assert moe_route.arch.backend_for(ids.device).value == "triton"
    maps = moe_route.build_routing_maps(ids, 4)
    assert_tables_equal(maps_tables(maps), routing_maps_reference(ids, 4))
    assert maps.device == ids.device


# ----------------------------------------------------------------------------- expert limit
@requires_triton
@pytest.mark.parametrize("tile", [None, 16], ids=["one-tile", "multi-tile"])
def test_triton_maps_just_under_the_expert_limit(tile):
    """E = the largest the kernels hold (E + K + 1 bins = Triton's 2**20-element cap under the
    interpreter): exact maps, experts at both ends used, one or several tiles."""
    K = 2
    E = triton_maps_module.max_num_experts(K, DEVICE)
    ids = torch.tensor([[E - 1, 0], [3, E - 1], [-1, E - 2], [0, 5]], device=DEVICE)
    assert_tables_equal(triton_maps(ids, E, tile=tile), routing_maps_reference(ids, E))
    if tile is None:
        maps = moe_route.build_routing_maps(ids, E, backend="triton")
        assert_tables_equal(maps_tables(maps), routing_maps_reference(ids, E))


@requires_triton
def test_triton_maps_over_the_expert_limit_raises_before_launch(monkeypatch):
    K = 2
    E = triton_maps_module.max_num_experts(K, DEVICE) + 1
    bins = triton_maps_module.max_bins(DEVICE)
    # (the name the launcher is called by: moe_route.maps imports it)
    monkeypatch.setattr(importlib.import_module("moe_route.maps"), "routing_maps_triton",
                        _no_launch)  # fmt: skip
    with pytest.raises(ValueError, match=rf"num_experts={E} with K=2: .* at most {bins} on "):
        moe_route.build_routing_maps(torch.zeros(3, K, dtype=torch.int64, device=DEVICE), E,
                                     backend="triton")  # fmt: skip
    # the reference has no such limit
    ids = torch.tensor([[E - 1, 0]], device=DEVICE)
    maps = moe_route.build_routing_maps(ids, E, backend="reference")
    assert maps.expert_first_token_offset[-1] == 2


def test_triton_expert_limit_follows_the_shared_memory_of_the_gpu(monkeypatch):
    """On a GPU the histogram stages 4 bytes per bin in shared memory: 2**15 bins fit an
    H100's 227 KiB, 2**14 a 99 KiB GPU; under the interpreter only Triton's tensor cap."""
    for optin, bins in ((227 * 1024, 2**15), (163 * 1024, 2**15), (99 * 1024, 2**14)):
        monkeypatch.setattr(triton_maps_module, "shared_memory_optin", lambda i, b=optin: b)
        assert triton_maps_module.max_bins("cuda:0") == bins
        assert triton_maps_module.max_num_experts(8, "cuda:0") == bins - 9
        triton_maps_module.check_num_experts_supported(bins - 9, 8, "cuda:0")
        with pytest.raises(ValueError, match=rf"\(so E <= {bins - 9}\); use backend='reference'"):
            triton_maps_module.check_num_experts_supported(bins - 8, 8, "cuda:0")
    assert triton_maps_module.max_bins("cpu") == triton_maps_module.MAX_TENSOR_BINS == 2**20


def _no_launch(*args, **kwargs):
    raise AssertionError("the routing-maps kernels were launched although E is too large")


def test_built_maps_equal_the_checked_constructor():
    """``RoutingMaps._built`` fills the fields in directly: every field of the dataclass, the
    same values as the (checking) constructor."""
    import dataclasses

    ids = torch.tensor([[0, 2], [1, -1], [2, 2]], dtype=torch.int32)
    maps = moe_route.build_routing_maps(ids, 3, backend="torch")
    fast = moe_route.RoutingMaps._built(maps.tensors(), 3, 2, 3)
    checked = moe_route.RoutingMaps(*maps.tensors(), 3, 2, 3)
    for f in dataclasses.fields(moe_route.RoutingMaps):
        assert getattr(fast, f.name) is getattr(checked, f.name), f.name
    assert fast == checked
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.num_tokens = 4
