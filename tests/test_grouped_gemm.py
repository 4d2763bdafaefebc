"""grouped_gemm (GEMM1 with fused activation, GEMM2) on the CPU: the Triton kernel through the
interpreter, and the reference backend, against the float64 oracle of ``moe_route.reference``.

Kernel cases call the launcher with 16x16x16 tiles into a NaN-poisoned ``out``, so that tiny
sizes still span several m-, n- and k-tiles, a ragged last k-tile and the row-zeroing tiles past
the last expert, and so that every element (dropped rows included, written as exact zeros)
is proven written. Sizes are odd on purpose (H = 27, I = 19 or 13: no multiple of 16).

bfloat16: ``tl.dot`` with bf16 operands returns garbage under the triton 3.5.1 interpreter, so
bf16 kernels are only tested on a GPU (tests/test_gpu_moe.py); here bf16 goes through
``backend="reference"``.

Tolerance: ``||out - ref|| / ||ref||`` against the float64 reference on the same (rounded)
inputs: fp32 1e-5 (exact "ieee" products; 2e-3 with allow_tf32), fp16 2e-3, bf16 1e-2, plus an
elementwise bound eight times as wide (relative to ``|ref| + rms(ref)``) so that one wrong row
cannot hide in the norm.
"""

from __future__ import annotations

import functools
import importlib

import moe_cases
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from moe_cases import (
    ACT_IDS,
    ACT_LAYOUTS,
    BF16_INTERPRETER,
    NAN,
    TOL,
    assert_dropped_rows_zero,
    make_ids,
    needs_interpreter,
    rand,
    strided_weight,
)
from moe_cases import gemm_case as make_case
from moe_cases import gemm_reference as reference

import moe_route
from moe_route import arch
from moe_route.kernels.triton.gemm_mainloop import GemmConfig

gg_module = importlib.import_module("moe_route.grouped_gemm")  # the attribute is the function

# BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages
SMALL_TILES = GemmConfig(16, 16, 16, 2, 4, 2)
TF32_TOL = 2e-3  # fp32 with allow_tf32 here; tests/test_gpu_moe.py has 5e-3 (tensor cores)

# Kernel launches: 16x16x16 tiles into a NaN-poisoned ``out``, exact "ieee" products.
launch = functools.partial(moe_cases.launch, allow_tf32=False, config=SMALL_TILES)
# The failure message names the first far-off element's values.
assert_matches = functools.partial(moe_cases.assert_matches, verbose=True)


# ----------------------------------------------------------------------------- kernel vs oracle
@needs_interpreter
@pytest.mark.parametrize("gather", [False, True], ids=["perm", "gather"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize(("activation", "layout"), ACT_LAYOUTS, ids=ACT_IDS)
def test_kernel_every_epilogue(activation, layout, bias, gather):
    """fp32, 16x16x16 tiles: T*K = 74 rows over 5 experts (several m-tiles for some), I = 19
    (two n-tiles), H = 27 (a ragged second k-tile), 20 % of the slots dropped."""
    a, w, b, maps = make_case(37, 2, 5, 27, 19, activation, bias=bias, gather=gather, seed=3)
    out = launch(a, w, maps, b, activation=activation, layout=layout, gather=gather)
    ref = reference(a, w, maps, b, activation=activation, layout=layout, gather=gather)
    assert_matches(out, ref, TOL[torch.float32])
    assert_dropped_rows_zero(out, maps)


@needs_interpreter
@pytest.mark.parametrize(("activation", "layout"), ACT_LAYOUTS, ids=ACT_IDS)
def test_public_api_fp16_default_tiles(activation, layout):
    """The public entry point (auto backend = the interpreted kernel, its own tile choice)."""
    assert arch.backend_for("cpu").value == "triton"
    gather = activation in ("swiglu", "silu", "relu")
    a, w, b, maps = make_case(
        29, 2, 4, 27, 13, activation, dtype=torch.float16, bias=True, gather=gather, seed=5
    )
    out = moe_route.grouped_gemm(
        a, w, maps, bias=b, activation=activation, gate_up_layout=layout, gather=gather
    )
    assert out.dtype == torch.float16 and out.shape == (58, 13)
    ref = reference(a, w, maps, b, activation=activation, layout=layout, gather=gather)
    assert_matches(out, ref, TOL[torch.float16])
    assert_dropped_rows_zero(out, maps)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float16,
        pytest.param(torch.bfloat16, marks=pytest.mark.skip(reason=BF16_INTERPRETER)),
    ],
)
@needs_interpreter
def test_public_api_dtypes(dtype):
    a, w, b, maps = make_case(23, 3, 6, 21, 11, "geglu", dtype=dtype, bias=True, seed=8)
    out = moe_route.grouped_gemm(a, w, maps, bias=b, activation="geglu")
    assert out.dtype == dtype
    assert_matches(out, reference(a, w, maps, b, activation="geglu"), TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("gather", [False, True], ids=["perm", "gather"])
def test_reference_backend(dtype, gather):
    """backend="reference" (the CPU fallback; the only bf16 path testable on the CPU)."""
    a, w, b, maps = make_case(
        31, 2, 4, 40, 24, "swiglu", dtype=dtype, bias=True, gather=gather, seed=9
    )
    out = moe_route.grouped_gemm(
        a, w, maps, bias=b, activation="swiglu", gather=gather, backend="reference"
    )
    assert out.dtype == dtype and out.shape == (62, 24)
    ref = reference(a, w, maps, b, activation="swiglu", gather=gather)
    assert_matches(out, ref, TOL[dtype])
    assert_dropped_rows_zero(out, maps)


@needs_interpreter
def test_contract_formula_interleaved():
    """The gate/up split read straight off DESIGN.md, independent of the reference module:
    interleaved W1 rows are gate, up, gate, up, ...; ``h = silu(g) * u``."""
    T, K, E, H, inter = 9, 2, 3, 10, 5
    a, w, b, maps = make_case(T, K, E, H, inter, "swiglu", bias=True, gather=True, seed=11)
    out = launch(a, w, maps, b, activation="swiglu", layout="interleaved", gather=True)
    d2s = maps.expanded_dest_row_to_expanded_source_row.long()
    off = maps.expert_first_token_offset.tolist()
    expected = torch.zeros(T * K, inter, dtype=torch.float64)
    for e in range(E):
        for d in range(off[e], off[e + 1]):
            z = w[e].double() @ a[int(d2s[d]) % T].double() + b[e].double()
            g, u = z[0::2], z[1::2]
            expected[d] = g * torch.sigmoid(g) * u
    assert_matches(out, expected, TOL[torch.float32])


# ----------------------------------------------------------------------------- routing shapes
OCCUPANCY = {
    # only experts 1 and 4 of 6 have rows: the first, middle and last experts are empty
    "empty_experts": lambda T: torch.tensor([[1, 4], [4, 1]]).repeat(T // 2 + 1, 1)[:T],
    # one expert (the first) holds every row, several m-tiles of it
    "all_in_first": lambda T: torch.zeros(T, 1, dtype=torch.int64),
    # one expert (the last) holds every row: the binary search's right edge
    "all_in_last": lambda T: torch.full((T, 1), 5, dtype=torch.int64),
    # most slots dropped, the routed rows in one tile
    "mostly_dropped": lambda T: torch.where(
        torch.arange(T).unsqueeze(1) % 7 == 0, torch.tensor([[2, 3]]), torch.tensor([[-1, -1]])
    ),
    # every slot dropped: nothing routed, the whole output is zero rows
    "all_dropped": lambda T: torch.full((T, 2), -1, dtype=torch.int64),
}


@needs_interpreter
@pytest.mark.parametrize("pattern", list(OCCUPANCY))
def test_expert_occupancy(pattern):
    T, E = 40, 6
    ids = OCCUPANCY[pattern](T)
    a, w, b, maps = make_case(T, ids.shape[1], E, 20, 17, "swiglu", bias=True, gather=True,
                              ids=ids, seed=13)  # fmt: skip
    out = launch(a, w, maps, b, activation="swiglu", gather=True)
    assert_dropped_rows_zero(out, maps)
    if pattern == "all_dropped":
        assert int(maps.expert_first_token_offset[-1]) == 0
        return
    ref = reference(a, w, maps, b, activation="swiglu", gather=True)
    assert_matches(out, ref, TOL[torch.float32])


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.integers(0, 40), min_size=1, max_size=300),
    dropped=st.integers(0, 40),
    bm=st.sampled_from([16, 64, 128]),
)
def test_m_tiles_bound(rows, dropped, bm):
    """The launch's m-tiles cover every routing of ``M`` rows over ``E`` experts: each expert's
    ``cdiv(rows_e, BM)`` tiles plus the dropped rows' (the grid never depends on the routing,
    so the bound must hold for all of them; at decode sizes it is the row count itself)."""
    from moe_route.kernels.triton.gemm_mainloop import _m_tiles

    E, M = len(rows), sum(rows) + dropped
    if M == 0:
        return
    needed = sum(-(-r // bm) for r in rows) + -(-dropped // bm)
    bound = _m_tiles(M, E, bm)
    assert needed <= bound <= M


@needs_interpreter
@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("via", ["launcher", "public"])
def test_single_token(K, via):
    a, w, b, maps = make_case(1, K, 3, 27, 13, "geglu", bias=True, gather=True, drop=0, seed=17)
    if via == "launcher":
        out = launch(a, w, maps, b, activation="geglu", gather=True)
    else:
        out = moe_route.grouped_gemm(a, w, maps, bias=b, activation="geglu", gather=True)
    assert out.shape == (K, 13)
    assert_matches(out, reference(a, w, maps, b, activation="geglu", gather=True), 1e-5)


@needs_interpreter
def test_single_token_dropped_slot():
    ids = torch.tensor([[2, -1]])
    a, w, b, maps = make_case(1, 2, 3, 27, 13, "relu", bias=True, ids=ids, seed=19)
    out = launch(a, w, maps, b, activation="relu")
    assert_matches(out[:1], reference(a, w, maps, b, activation="relu")[:1], 1e-5)
    assert_dropped_rows_zero(out, maps)


@needs_interpreter
@pytest.mark.parametrize(("H", "inter"), [(27, 13), (1, 1), (48, 33), (5, 40)])
@pytest.mark.parametrize(("activation", "layout"), [("swiglu", "interleaved"), ("gelu", "concat")])
def test_odd_sizes(H, inter, activation, layout):
    a, w, b, maps = make_case(19, 2, 3, H, inter, activation, bias=True, gather=True, seed=H)
    out = launch(a, w, maps, b, activation=activation, layout=layout, gather=True)
    ref = reference(a, w, maps, b, activation=activation, layout=layout, gather=True)
    assert_matches(out, ref, TOL[torch.float32])
    assert_dropped_rows_zero(out, maps)


# ----------------------------------------------------------------------------- strided operands
@needs_interpreter
@pytest.mark.parametrize("how", ["transposed", "sliced", "expert_major_last"])
@pytest.mark.parametrize(("activation", "layout"), [("swiglu", "concat"), ("geglu", "interleaved"),
                                                    ("identity", "concat")])  # fmt: skip
def test_noncontiguous_weights(how, activation, layout):
    a, w, b, maps = make_case(26, 2, 4, 27, 19, activation, bias=True, gather=True, seed=23)
    ws = strided_weight(w, how)
    # a strided activation and bias as well: x column-major, bias every other column
    xs = a.t().contiguous().t()
    bs = torch.stack([b, torch.full_like(b, NAN)], dim=-1)[..., 0]
    assert not xs.is_contiguous() and not bs.is_contiguous()
    out = launch(xs, ws, maps, bs, activation=activation, layout=layout, gather=True)
    ref = reference(a, w, maps, b, activation=activation, layout=layout, gather=True)
    assert_matches(out, ref, TOL[torch.float32])
    public = moe_route.grouped_gemm(
        xs, ws, maps, bias=bs, activation=activation, gate_up_layout=layout, gather=True
    )
    assert_matches(public, ref, TOL[torch.float32], what="public grouped_gemm")


@needs_interpreter
def test_weight_view_of_w_t_gemm2():
    """GEMM2 with ``w2`` given as ``w2_t [E, I, H].transpose(1, 2)`` (the layout in DESIGN.md)."""
    T, K, E, H, inter = 21, 2, 3, 27, 19
    ids = make_ids(T, K, E, seed=29)
    maps = moe_route.build_routing_maps(ids, E, backend="reference")
    h = rand(T * K, inter, seed=30)
    w2_t = rand(E, inter, H, scale=inter**-0.5, seed=31)
    w2 = w2_t.transpose(1, 2)
    assert w2.shape == (E, H, inter) and w2.data_ptr() == w2_t.data_ptr()
    out = launch(h, w2, maps)
    assert_matches(out, reference(h, w2, maps), TOL[torch.float32])
    assert_dropped_rows_zero(out, maps)


@needs_interpreter
@pytest.mark.parametrize("allow_tf32", [False, True], ids=["ieee", "tf32"])
def test_fp32_tf32(allow_tf32):
    a, w, b, maps = make_case(33, 2, 4, 45, 30, "swiglu", bias=True, gather=True, seed=37)
    out = moe_route.grouped_gemm(
        a, w, maps, bias=b, activation="swiglu", gather=True, allow_tf32=allow_tf32
    )
    tol = TF32_TOL if allow_tf32 else TOL[torch.float32]
    assert_matches(out, reference(a, w, maps, b, activation="swiglu", gather=True), tol)


@needs_interpreter
@settings(max_examples=8, deadline=None)
@given(
    T=st.integers(1, 24),
    K=st.integers(1, 3),
    E=st.integers(3, 6),
    drop=st.sampled_from([0.0, 0.3, 1.0]),
    act_layout=st.sampled_from(ACT_LAYOUTS),
    gather=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_kernel_random_routings(T, K, E, drop, act_layout, gather, seed):
    activation, layout = act_layout
    a, w, b, maps = make_case(T, K, E, 18, 9, activation, bias=True, gather=gather, drop=drop,
                              seed=seed)  # fmt: skip
    out = launch(a, w, maps, b, activation=activation, layout=layout, gather=gather)
    assert_dropped_rows_zero(out, maps)
    routed = int(maps.expert_first_token_offset[-1])
    if routed > 0:
        ref = reference(a, w, maps, b, activation=activation, layout=layout, gather=gather)
        assert_matches(out, ref, TOL[torch.float32], floor=0.1 * (routed * out.shape[1]) ** 0.5)


# ----------------------------------------------------------------------------- custom op
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_opcheck_grouped_gemm_op(backend):
    """Schema, fake (meta) implementation and autograd registration of moe_route::grouped_gemm."""
    a, w, b, maps = make_case(7, 2, 3, 8, 4, "swiglu", bias=True, gather=True, seed=41)
    a, w, b = (t.requires_grad_(True) for t in (a, w, b))  # exercises the registered backward
    args = (a, w, *maps.tensors(), b, "swiglu", "concat", True, False, backend)
    torch.library.opcheck(gg_module.GEMM.op, args)
    dout = rand(*gg_module.GEMM.op(*args).shape, seed=42)
    plain = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in args[:-2])
    for need in ((True, True, True), (False, True, False)):  # (da, dw, db)
        bwd_args = (dout, *plain, *need, False, backend)
        torch.library.opcheck(gg_module._GEMM_BACKWARD.op, bwd_args)


def test_compile_fullgraph_reference():
    a, w, b, maps = make_case(7, 2, 3, 8, 4, "swiglu", bias=True, gather=True, seed=43)

    def gemm1(x, w, b):
        return moe_route.grouped_gemm(
            x, w, maps, bias=b, activation="swiglu", gather=True, backend="reference"
        )

    torch._dynamo.reset()
    compiled = torch.compile(gemm1, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(a, w, b), gemm1(a, w, b))


# ----------------------------------------------------------------------------- validation
def _operands():
    T, K, E, H, inter = 6, 2, 3, 8, 4
    maps = moe_route.build_routing_maps(make_ids(T, K, E, drop=0, seed=1), E)
    x = torch.randn(T, H)
    return dict(
        maps=maps,
        x=x,
        a=torch.randn(T * K, H),
        w=torch.randn(E, 2 * inter, H),
        b=torch.randn(E, 2 * inter),
        maps4=moe_route.build_routing_maps(make_ids(T, K, 4, drop=0, seed=1), 4),
    )


# (name, call, exception, regex the message must match: the offending argument's name)
BAD_CALLS = [
    ("a_ndim", lambda o: ((o["a"][None], o["w"], o["maps"]), {}), ValueError, r"\ba\b.*2 dim"),
    ("w_ndim", lambda o: ((o["a"], o["w"][0], o["maps"]), {}), ValueError, r"\bw\b.*3 dim"),
    ("a_int", lambda o: ((o["a"].long(), o["w"], o["maps"]), {}), TypeError, r"\ba\b.*dtype"),
    ("dtype_mismatch", lambda o: ((o["a"], o["w"].half(), o["maps"]), {}), TypeError,
     r"\bw\b.*float16.*\ba\b.*float32"),
    ("w_k_mismatch", lambda o: ((o["a"], o["w"][..., :-1], o["maps"]), {}), ValueError,
     r"\bw\b.*K = a\.shape\[1\]"),
    ("odd_gated_n", lambda o: ((o["a"], o["w"][:, :-1], o["maps"]), {"activation": "swiglu"}),
     ValueError, r"\bw\b.*gated.*even"),
    ("bias_shape", lambda o: ((o["a"], o["w"], o["maps"]), {"bias": o["b"][:, :-1]}),
     ValueError, r"bias must be \[E, N\]"),
    ("bias_ndim", lambda o: ((o["a"], o["w"], o["maps"]), {"bias": o["b"][0]}),
     ValueError, r"bias must have 2 dim"),
    ("bias_dtype", lambda o: ((o["a"], o["w"], o["maps"]), {"bias": o["b"].long()}),
     TypeError, r"bias.*dtype"),
    ("activation", lambda o: ((o["a"], o["w"], o["maps"]), {"activation": "tanh"}),
     ValueError, r"activation='tanh'"),
    ("layout", lambda o: ((o["a"], o["w"], o["maps"]), {"gate_up_layout": "split"}),
     ValueError, r"gate_up_layout='split'"),
    ("rows_not_TK", lambda o: ((o["a"][:-1], o["w"], o["maps"]), {}), ValueError,
     r"\ba\b must have T\*K = 12"),
    ("gather_rows_not_T", lambda o: ((o["a"], o["w"], o["maps"]), {"gather": True}),
     ValueError, r"T=6 tokens but a has 12"),
    ("maps_other_E", lambda o: ((o["a"], o["w"], o["maps4"]), {}), ValueError,
     r"maps.*E=4.*\bw\b.*E=3"),
    ("backend", lambda o: ((o["a"], o["w"], o["maps"]), {"backend": "cuda"}), ValueError,
     r"backend='cuda'"),
    ("gather_str", lambda o: ((o["a"], o["w"], o["maps"]), {"gather": "False"}), TypeError,
     r"gather must be a bool, got str 'False'"),
    ("allow_tf32_int", lambda o: ((o["a"], o["w"], o["maps"]), {"allow_tf32": 1}), TypeError,
     r"allow_tf32 must be a bool, got int 1"),
]  # fmt: skip


def _no_launch(*args, **kwargs):
    raise AssertionError("the op ran although the arguments are invalid")


@pytest.mark.parametrize(("call", "exc", "match"), [c[1:] for c in BAD_CALLS],
                         ids=[c[0] for c in BAD_CALLS])  # fmt: skip
def test_validation_errors(monkeypatch, call, exc, match):
    monkeypatch.setattr(gg_module, "GEMM", _no_launch)
    args, kwargs = call(_operands())
    with pytest.raises(exc, match=match):
        moe_route.grouped_gemm(*args, **kwargs)


@pytest.mark.parametrize("gather", [False, True])
def test_maps_not_routing_maps(monkeypatch, gather):
    o = _operands()
    monkeypatch.setattr(gg_module, "GEMM", _no_launch)
    with pytest.raises(TypeError, match=r"maps must be a RoutingMaps, got str"):
        moe_route.grouped_gemm(o["x"] if gather else o["a"], o["w"], "maps", gather=gather)
