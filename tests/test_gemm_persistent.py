"""The persistent grouped GEMM kernel (``GemmConfig.persistent``) on the CPU, through the Triton
interpreter, against the float64 oracle and against the per-tile kernel.

The interpreter runs the programs one after the other, so the persistent kernel's schedule is
exercised by its grid: ``num_sms`` off CUDA is :data:`CPU_SMS`, patched here to 1-3 programs
per launch, so that each program's tile loop wraps many times (T*K = 74 rows over 5 experts
with 16x16x16 tiles: ~9 routed m-tiles x 2 n-tiles, plus the dropped rows' zero tiles). Each
tile runs the per-tile kernel's own code (``_gemm_tile``), so the two kernels must agree bit for
bit here; against the oracle the tolerances of tests/test_grouped_gemm.py apply. bf16 is
tested on CUDA only (tests/test_gpu_moe.py): the interpreter's bf16 ``tl.dot`` is wrong.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import itertools

import moe_cases
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st
from moe_cases import (
    NAN,
    TOL,
    assert_dropped_rows_zero,
    gemm_case,
    gemm_reference,
    make_ids,
    needs_interpreter,
    rand,
)

import moe_route
from moe_route import tuning
from moe_route.kernels.triton import gemm_mainloop as gm
from moe_route.kernels.triton import grouped_gemm as gk

pytestmark = needs_interpreter

PER_TILE = gm.GemmConfig(16, 16, 16, 2, 4, 2)
PERSISTENT = dataclasses.replace(PER_TILE, persistent=1)
launch = functools.partial(moe_cases.launch, allow_tf32=False)
assert_matches = functools.partial(moe_cases.assert_matches, verbose=True)
gg_module = importlib.import_module("moe_route.grouped_gemm")


@pytest.fixture
def spy(monkeypatch):
    """Counts the launches of each GEMM kernel."""
    calls = {"per_tile": 0, "persistent": 0, "grids": []}

    def wrap(kernel, name):
        launch_orig = kernel.launch

        def counted(key, grid, args, constexprs):
            calls[name] += 1
            calls["grids"].append(grid[0])
            return launch_orig(key, grid, args, constexprs)

        monkeypatch.setattr(kernel, "launch", counted)

    wrap(gk._GEMM, "per_tile")
    wrap(gk._GEMM_PERSISTENT, "persistent")
    return calls


def both(monkeypatch, sms, *args, config=PER_TILE, **kw):
    """``(per-tile out, persistent out)`` of one launch, ``sms`` stand-in SMs."""
    monkeypatch.setattr(gm, "CPU_SMS", sms)
    ref = launch(*args, config=config, **kw)
    out = launch(*args, config=dataclasses.replace(config, persistent=1), **kw)
    return ref, out


# ----------------------------------------------------------------------------- vs oracle
EPILOGUES = [("swiglu", "concat"), ("swiglu", "interleaved"), ("gelu", "concat"),
             ("identity", "concat")]  # fmt: skip
# Every kernel variant (epilogue, bias, gather); the number of programs is no constexpr, so
# the variants take one program and three in turn (each count with every epilogue).
PERSISTENT_CASES = [(act, lay, bias, gather, (1, 3)[(i + bias + gather) % 2])
                    for i, (act, lay) in enumerate(EPILOGUES)
                    for bias in (False, True) for gather in (False, True)]  # fmt: skip
PERSISTENT_IDS = [f"{act}-{lay}-{'bias' if b else 'nobias'}-{'gather' if g else 'perm'}-{s}"
                  for act, lay, b, g, s in PERSISTENT_CASES]  # fmt: skip


@pytest.mark.parametrize(("activation", "layout", "bias", "gather", "sms"), PERSISTENT_CASES,
                         ids=PERSISTENT_IDS)  # fmt: skip
def test_persistent_epilogues(monkeypatch, spy, activation, layout, bias, gather, sms):
    """fp32: T*K = 74 rows over 5 experts (20 % dropped), I = 19 (two n-tiles), H = 27 (a
    ragged k-tile): plain and gated epilogues, gathered and permuted rows, with and without
    bias, on one program (every tile in one loop) and three."""
    a, w, b, maps = gemm_case(37, 2, 5, 27, 19, activation, bias=bias, gather=gather, seed=3)
    kw = dict(activation=activation, layout=layout, gather=gather)
    per_tile, out = both(monkeypatch, sms, a, w, maps, b, **kw)
    assert spy["persistent"] == 1 and spy["grids"][-1] == sms
    assert_matches(out, gemm_reference(a, w, maps, b, **kw), TOL[torch.float32])
    assert_dropped_rows_zero(out, maps)
    assert torch.equal(out, per_tile)


@pytest.mark.parametrize("layout", ["concat", "interleaved"])
@pytest.mark.parametrize("gather", [False, True], ids=["perm", "gather"])
def test_persistent_fp16_tma(monkeypatch, gather, layout):
    """fp16 with the TMA descriptors forced on (the interpreter emulates them; it wants row
    strides in multiples of 16 elements): ``A`` tiles that run past their expert's rows (and
    past ``M``) are read and never stored; a gated ``W1``'s gate and up rows come in one box
    (``ONE_DOT``; concat through the ``[E, 2, I, H]`` view; I = 48 with 32-wide n-tiles, so
    that the last n-tile's gate rows run past I into zero fill, not into the up rows); GEMM2
    reads ``W2`` stored k-major (``w2_t.transpose(1, 2)``)."""
    inter, cfg = 48, dataclasses.replace(PER_TILE, block_n=32)
    a, w, b, maps = gemm_case(37, 2, 5, 32, inter, "swiglu", dtype=torch.float16, bias=True,
                              gather=gather, seed=4)  # fmt: skip
    kw = dict(activation="swiglu", layout=layout, gather=gather, use_tma=True, config=cfg)
    seen = []
    launch_persistent = gk._GEMM_PERSISTENT.launch

    def spy(key, grid, args, constexprs):
        seen.append(constexprs())
        return launch_persistent(key, grid, args, constexprs)

    monkeypatch.setattr(gk._GEMM_PERSISTENT, "launch", spy)
    per_tile, h = both(monkeypatch, 2, a, w, maps, b, **kw)
    assert seen[-1]["ONE_DOT"] == (2 if layout == "interleaved" else 1)
    assert seen[-1]["W_DESC"] and seen[-1]["A_DESC"] == (not gather)
    ref = gemm_reference(a, w, maps, b, activation="swiglu", layout=layout, gather=gather)
    assert_matches(h, ref, TOL[torch.float16])
    assert_dropped_rows_zero(h, maps)
    assert torch.equal(h, per_tile)
    w2 = rand(5, inter, 32, dtype=torch.float16, scale=inter**-0.5, seed=5).transpose(1, 2)
    y_tile, y = both(monkeypatch, 2, h, w2, maps, use_tma=True, config=cfg)
    assert_matches(y, gemm_reference(h, w2, maps), TOL[torch.float16], what="GEMM2")
    assert_dropped_rows_zero(y, maps)
    assert torch.equal(y, y_tile)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(("activation", "layout"), [("swiglu", "interleaved"), ("relu", "concat")])
def test_persistent_store_pre(monkeypatch, dtype, activation, layout):
    """STORE_PRE: the pre-activation ``z`` (gate and up columns in ``W1``'s layout, zero in the
    dropped rows) is the per-tile kernel's, and ``out = act(z)`` from those rounded bits."""
    a, w, b, maps = gemm_case(29, 2, 4, 27, 13, activation, dtype=dtype, bias=True, gather=True,
                              seed=6)  # fmt: skip
    M = maps.num_expanded_rows
    zs = [torch.full((M, w.shape[1]), NAN, dtype=dtype) for _ in range(2)]
    kw = dict(activation=activation, layout=layout, gather=True)
    monkeypatch.setattr(gm, "CPU_SMS", 2)
    per_tile = launch(a, w, maps, b, config=PER_TILE, pre_activation=zs[0], **kw)
    out = launch(a, w, maps, b, config=PERSISTENT, pre_activation=zs[1], **kw)
    assert torch.equal(zs[1], zs[0]) and torch.equal(out, per_tile)
    z_ref = gemm_reference(a, w, maps, b, gather=True)  # identity: the pre-activation
    assert_matches(zs[1], z_ref, TOL[dtype], what="z")
    assert_dropped_rows_zero(zs[1], maps)
    assert_matches(out, gemm_reference(a, w, maps, b, **kw), TOL[dtype])
    assert_dropped_rows_zero(out, maps)


# ----------------------------------------------------------------------------- routing shapes
OCCUPANCY = {
    # experts 1 and 4 of 6 only: the first, middle and last experts own no tile
    "empty_experts": (6, lambda T: torch.tensor([[1, 4], [4, 1]]).repeat(T // 2 + 1, 1)[:T]),
    "all_in_first": (6, lambda T: torch.zeros(T, 1, dtype=torch.int64)),
    "all_in_last": (6, lambda T: torch.full((T, 1), 5, dtype=torch.int64)),
    "one_expert": (1, lambda T: torch.zeros(T, 1, dtype=torch.int64)),
    "one_expert_dropped": (1, lambda T: torch.where(torch.arange(T).unsqueeze(1) % 3 == 0, -1, 0)),
    "mostly_dropped": (6, lambda T: torch.where(
        torch.arange(T).unsqueeze(1) % 7 == 0, torch.tensor([[2, 3]]), torch.tensor([[-1, -1]])
    )),
    # nothing routed: no GEMM tile at all, only the zero tiles of the second loop
    "all_dropped": (6, lambda T: torch.full((T, 2), -1, dtype=torch.int64)),
}  # fmt: skip


@pytest.mark.parametrize("pattern", list(OCCUPANCY))
def test_persistent_occupancy(monkeypatch, pattern):
    T, (E, ids_of) = 41, OCCUPANCY[pattern]
    ids = ids_of(T)
    a, w, b, maps = gemm_case(T, ids.shape[1], E, 20, 17, "swiglu", bias=True, gather=True,
                              ids=ids, seed=13)  # fmt: skip
    per_tile, out = both(monkeypatch, 3, a, w, maps, b, activation="swiglu", gather=True)
    assert_dropped_rows_zero(out, maps)
    assert torch.equal(out, per_tile)
    if int(maps.expert_first_token_offset[-1]) > 0:
        ref = gemm_reference(a, w, maps, b, activation="swiglu", gather=True)
        assert_matches(out, ref, TOL[torch.float32])


def test_persistent_more_programs_than_tiles(monkeypatch, spy):
    """A grid capped at the tile bound, larger than the routed tiles: programs with no GEMM tile
    only zero dropped rows (or nothing)."""
    a, w, b, maps = gemm_case(5, 2, 3, 20, 9, "gelu", bias=True, gather=True, seed=21)
    per_tile, out = both(monkeypatch, 64, a, w, maps, b, activation="gelu", gather=True)
    assert spy["grids"][-1] == spy["grids"][0] < 64  # min(tile bound, programs)
    assert_dropped_rows_zero(out, maps)
    assert torch.equal(out, per_tile)


@settings(max_examples=6, deadline=None)
@given(
    T=st.integers(1, 30),
    K=st.integers(1, 3),
    E=st.integers(1, 6),
    drop=st.sampled_from([0.0, 0.3, 1.0]),
    programs=st.integers(1, 5),
    group_m=st.sampled_from([1, 2, 8]),
    seed=st.integers(0, 2**16),
)
def test_persistent_random_routings(T, K, E, drop, programs, group_m, seed):
    """Any routing, any program count and group size (the per-tile kernel's fixed groups, the
    persistent kernel's expert groups): the persistent kernel writes what the per-tile kernel
    writes, every element (NaN-poisoned outputs)."""
    K = min(K, E)
    cfg = dataclasses.replace(PER_TILE, group_m=group_m)
    ids = make_ids(T, K, E, drop=drop, seed=seed)
    a, w, b, maps = gemm_case(T, K, E, 18, 9, "swiglu", bias=True, gather=True, ids=ids,
                              seed=seed)  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        per_tile, out = both(mp, programs, a, w, maps, b, activation="swiglu", gather=True,
                             config=cfg)  # fmt: skip
    assert torch.equal(out, per_tile)
    assert_dropped_rows_zero(out, maps)


# ----------------------------------------------------------------------------- tile order
@triton.jit
def _order_kernel(offsets_ptr, out_ptr, E, n_tiles, BLOCK_M: tl.constexpr,
                  GROUP_M: tl.constexpr, E_POW2: tl.constexpr):  # fmt: skip
    """Row ``tile`` of ``out``: ``(e, first_row, row_end, n_tile)`` of that routed tile."""
    tile = tl.program_id(0)
    ex = tl.arange(0, E_POW2)
    ends = gm._expert_ends(offsets_ptr, E, ex, BLOCK_M)
    e, first_row, row_end, n_tile = gm._expert_grouped_tile(
        offsets_ptr, ends, tile, n_tiles, E, ex, BLOCK_M, GROUP_M, E_POW2
    )
    tl.store(out_ptr + 4 * tile, e)
    tl.store(out_ptr + 4 * tile + 1, first_row)
    tl.store(out_ptr + 4 * tile + 2, row_end)
    tl.store(out_ptr + 4 * tile + 3, n_tile)


def expected_order(counts, n_tiles, block_m, group_m):
    """The expert-grouped order, written out: expert after expert, its m-tiles in
    ``cdiv(m_e, group_m)`` groups of near-equal size (the larger ones first), each group's
    m-tiles sweeping every n-tile, the group's m-tiles fastest."""
    order, lo = [], 0
    for e, rows in enumerate(counts):
        m_e = -(-rows // block_m)
        if m_e:
            groups = -(-m_e // group_m)
            sizes = [m_e // groups + (g < m_e % groups) for g in range(groups)]
            first = 0
            for size in sizes:
                for n in range(n_tiles):
                    for m in range(first, first + size):
                        order.append((e, lo + m * block_m, lo + rows, n))
                first += size
        lo += rows
    return order


@settings(max_examples=25, deadline=None)
@given(
    counts=st.lists(st.integers(0, 80), min_size=1, max_size=9),
    n_tiles=st.integers(1, 4),
    group_m=st.sampled_from([1, 2, 3, 8]),
)
def test_expert_grouped_order(counts, n_tiles, group_m):
    """``_expert_grouped_tile`` over every routed tile gives exactly the order written out in
    Python: each (m-tile, n-tile) once, a group never mixing experts, at most ``group_m``
    m-tiles in a group (empty experts own no tile)."""
    block_m, E = 16, len(counts)
    offsets = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int64)
    want = expected_order(counts, n_tiles, block_m, group_m)
    if not want:
        return
    out = torch.full((len(want), 4), -1, dtype=torch.int64)
    _order_kernel[(len(want),)](offsets, out, E, n_tiles, BLOCK_M=block_m, GROUP_M=group_m,
                                E_POW2=gk.next_pow2(E + 1))  # fmt: skip
    assert [tuple(r) for r in out.tolist()] == want


# ----------------------------------------------------------------------------- selection
def test_env_selects_persistent(monkeypatch, spy):
    """``MOE_ROUTE_PERSISTENT=2``: the public grouped_gemm and its backward's two GEMMs (the
    pre-activation recomputed; dX, ``W`` read k-major) run the persistent kernel with 2 programs
    per SM, the same bits as without."""
    a, w, b, maps = gemm_case(23, 2, 4, 21, 11, "geglu", dtype=torch.float16, bias=True,
                              gather=True, seed=8)  # fmt: skip

    def run():
        x = a.clone().requires_grad_(True)
        out = moe_route.grouped_gemm(x, w, maps, bias=b, activation="geglu", gather=True)
        out.backward(rand(*out.shape, dtype=out.dtype, seed=9))
        return out.detach(), x.grad

    monkeypatch.setattr(gm, "CPU_SMS", 2)
    out0, da0 = run()
    assert spy["persistent"] == 0 and spy["per_tile"] == 3
    monkeypatch.setenv("MOE_ROUTE_PERSISTENT", "2")
    out1, da1 = run()
    assert spy["persistent"] == 3 and spy["per_tile"] == 3
    assert spy["grids"][-3:] == [4, 4, 4]
    assert torch.equal(out1, out0) and torch.equal(da1, da0)
    assert_matches(out1, gemm_reference(a, w, maps, b, activation="geglu", gather=True),
                   TOL[torch.float16])  # fmt: skip


def test_env_fused_moe(monkeypatch, spy):
    """The whole forward under ``MOE_ROUTE_PERSISTENT=1``: GEMM1 (gathered, swiglu) and GEMM2
    persistent, the same bits as the per-tile kernels."""
    case = moe_cases.moe_case(19, 2, 4, 24, 12, b1=True, b2=True, bias="H", seed=10)
    ref = moe_cases.run_moe(case)
    monkeypatch.setenv("MOE_ROUTE_PERSISTENT", "1")
    spy["persistent"] = 0
    out = moe_cases.run_moe(case)
    assert spy["persistent"] == 2
    assert torch.equal(out, ref)
    assert_matches(out, moe_cases.moe_expected(case), TOL[torch.float32])


@pytest.mark.parametrize("value", ["yes", "-1", "1.5"])
def test_env_bad_value(monkeypatch, spy, value):
    monkeypatch.setenv("MOE_ROUTE_PERSISTENT", value)
    a, w, _, maps = gemm_case(6, 2, 3, 8, 4, "identity", seed=1)
    with pytest.raises(ValueError, match=rf"MOE_ROUTE_PERSISTENT='{value}'.*integer >= 0"):
        moe_route.grouped_gemm(a, w, maps)
    assert spy["per_tile"] == spy["persistent"] == 0


def test_tuning_defaults_and_override(monkeypatch):
    """The tables choose the persistent kernel (one program per SM) for TMA-fed tiles past 64
    rows per expert on SM90 (the H100 sweep, tuning.py), the per-tile kernel everywhere else;
    the override changes GEMM1 / GEMM2 configs only, the split activation backward's plain GEMM
    included (the fused activation backward has no persistent kernel)."""
    rows = [1, 16, 64, 512, 8192]
    dtypes = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
    for rpe in rows:
        for dtype in dtypes:
            for cc in (None, 80, 90):
                want = int(rpe > 64 and cc == 90 and dtype in (torch.bfloat16, torch.float16))
                assert tuning.gemm_config(rpe, True, dtype, cc).persistent == want
                assert tuning.gemm_config(rpe, False, dtype, cc).persistent == want
    monkeypatch.setenv("MOE_ROUTE_PERSISTENT", "3")
    base = dataclasses.replace(tuning.gemm_config(512, True, torch.bfloat16, 90), persistent=1)
    monkeypatch.delenv("MOE_ROUTE_PERSISTENT")
    assert base == tuning.gemm_config(512, True, torch.bfloat16, 90)
    monkeypatch.setenv("MOE_ROUTE_PERSISTENT", "3")
    assert tuning.gemm_config(512, True, torch.bfloat16, 90).persistent == 3
    assert tuning.act_backward_config(32, torch.bfloat16, 90).fused.persistent == 0
    assert tuning.act_backward_config(512, torch.bfloat16, 90).fused.persistent == 0
    assert tuning.act_backward_config(512, torch.bfloat16, 90).gemm.persistent == 3
    monkeypatch.setenv("MOE_ROUTE_PERSISTENT", "0")
    assert tuning.gemm_config(512, False, torch.bfloat16, 90).persistent == 0


def test_tuning_stages_and_tma_stores():
    """From 512 rows per expert on SM90 (16-bit): GEMM1 storing z takes 4 stages, the plain
    GEMMs with a reduction of at most 2048 store through TMA (tuning.py's H100 note); nowhere
    else, and never without a known reduction length."""
    bf16 = torch.bfloat16
    for rpe in (128, 511, 512, 8192):
        for cc in (None, 80, 90):
            far = cc == 90 and rpe >= 512
            stages = tuning.gemm_config(rpe, True, bf16, cc, store_z=True).num_stages
            assert stages == (4 if far else 3)
            assert tuning.gemm_config(rpe, True, bf16, cc).num_stages == 3
            assert not tuning.gemm_config(rpe, True, bf16, cc, kd=768).tma_store
            for kd, want in ((768, far), (2048, far), (2049, False), (None, False)):
                assert tuning.gemm_config(rpe, False, bf16, cc, kd=kd).tma_store == want
                # the split activation backward's plain GEMM reduces over H the same way
                step1 = tuning.act_backward_config(rpe, bf16, cc, kd=kd)
                assert step1.gemm.tma_store == want
                assert not step1.fused.tma_store
    assert not tuning.gemm_config(8192, False, torch.float32, 90, kd=768).tma_store


@pytest.mark.parametrize(("inter", "stores"), [(768, True), (2048, False)])
def test_plan_takes_the_training_and_store_configs(monkeypatch, inter, stores):
    """An MoE with H = 2048, E = 128, K = 8 at T = 8192 (512 rows per expert) on an SM90
    (faked): the training GEMM1 has 4 stages, the inference one 3; GEMM2 (K = I) and dX
    (K = 2I) store through TMA at I = 768 (qwen3-30b-a3b), GEMM2 alone at I = 2048; the
    backward's ``g = dout @ W2[e]`` (K = H = 2048) at both."""
    grouped_gemm = importlib.import_module("moe_route.grouped_gemm")  # the module, not the op
    monkeypatch.setattr(grouped_gemm.arch, "compute_capability", lambda device: 90)
    tuning.gemm_configs.cache_clear()
    try:
        cfg = moe_route.plan._plan.__wrapped__(
            torch.device("cpu"), torch.bfloat16, (128, 2 * inter, 2048), (128, 2048, inter),
            128, 8, 8192, "swiglu", "concat", "standalone", True, False, "triton", (),
        ).configs  # fmt: skip
    finally:
        tuning.gemm_configs.cache_clear()
    assert (cfg.gemm1.num_stages, cfg.gemm1_z.num_stages) == (3, 4)
    assert not cfg.gemm1.tma_store and not cfg.gemm1_z.tma_store
    assert cfg.gemm2.tma_store
    assert cfg.dx.tma_store == stores
    assert cfg.act_bwd.split and cfg.act_bwd.gemm.tma_store


def test_store_descriptors_fit_shared_memory(monkeypatch):
    """The TMA stores are taken only where their staging fits beside the main loop (an
    H100's 232448 B: 3 stages of 128x256x64, not 4), for 16-bit tensors TMA can address, and
    for z only in the concat layout ([M, 2, N] boxes: a partial column tile stops at N)."""
    from moe_route.kernels.triton import grouped_gemm as gg

    monkeypatch.setattr(gg, "_smem_per_block", lambda device: 232448)
    bf16 = torch.bfloat16
    plain = gm.GemmConfig(128, 256, 64, 8, 8, 3, True, 1, tma_store=True)
    out = torch.empty(1000, 2048, dtype=bf16)
    stage = (128 + 256) * 64 * 2
    got_out, got_z = gg._store_descriptors(out, None, gm.IDENTITY, plain, 2048, stage)
    assert got_out is not None and got_z is None
    assert got_out.block_shape == (1, 1, 128, 256)
    four = dataclasses.replace(plain, num_stages=4)
    assert gg._store_descriptors(out, None, gm.IDENTITY, four, 2048, stage) == (None, None)
    assert gg._store_descriptors(out.float(), None, gm.IDENTITY, plain, 2048, stage) == (
        None, None,
    )  # fmt: skip
    odd = torch.empty(1000, 2047, dtype=bf16)[:, :2040]  # rows 4094 bytes apart
    assert gg._store_descriptors(odd, None, gm.IDENTITY, plain, 2040, stage) == (None, None)
    gated = gm.GemmConfig(128, 128, 64, 8, 8, 3, True, 1, tma_store=True)
    swiglu = gm.GemmEpilogue(act=1, gated=True)
    h, z = torch.empty(1000, 136, dtype=bf16), torch.empty(1000, 272, dtype=bf16)
    got_out, got_z = gg._store_descriptors(h, z, swiglu, gated, 136, stage)
    assert got_z.shape[-2:] == (2, 136) and got_z.block_shape == (1, 1, 128, 1, 128)
    assert got_z.strides[-3:] == (272, 136, 1)  # [M, 2, N] over the [M, 2N] rows
    inter = dataclasses.replace(swiglu, interleaved=True)
    assert gg._store_descriptors(h, z, inter, gated, 136, stage) == (None, None)
    # rows 400 bytes apart (aligned), but the up half starts 200 bytes in: no z descriptor
    h, z = torch.empty(1000, 100, dtype=bf16), torch.empty(1000, 200, dtype=bf16)
    assert gg._store_descriptors(h, z, swiglu, gated, 100, stage) == (None, None)
