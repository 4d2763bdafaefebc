"""moe_route.kernels.torch_impl, the pure-PyTorch (CPU) backend, against the oracles of
moe_route.reference on the same inputs.

Integer maps are compared exactly (both routing-map paths: the Python one for a few slots and
the sorted-bins one). Finalize, expand and the finalize backward's ``d y_perm`` compute the
reference's very products and sums in the same order, so they are compared bit for bit. The
GEMMs run through other BLAS calls (``torch._grouped_mm`` or one matmul per expert), so they
get the dtype's tolerance of tests/moe_cases.py (relative Frobenius error: fp32 1e-5, fp16
2e-3, bf16 1e-2, and an elementwise guard), and float64 a near-exact 1e-12. Values the
contract says are never read (router weights and ``y_perm`` rows of dropped slots) are NaN.
"""

from __future__ import annotations

import pytest
import torch
from helpers import strided_copy
from hypothesis import given, settings
from hypothesis import strategies as st
from moe_cases import ACT_IDS, ACT_LAYOUTS, NAN, TOL, assert_matches, make_ids, rand, strided_weight

import moe_route
from moe_route import reference as R
from moe_route.kernels import torch_impl as TI

TOL64 = 1e-12
TOLS = {**TOL, torch.float64: TOL64}


def tables(ids, E):
    return R.routing_maps_reference(ids, E)


def check(actual, expected, dtype, what):
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if expected.numel() == 0 or expected.abs().max() == 0:
        assert torch.equal(actual, expected), f"{what}: expected exact zeros"
        return
    rows = expected.shape[0] if expected.dim() > 1 else 1
    assert_matches(
        actual.reshape(rows, -1), expected.reshape(rows, -1), TOLS[dtype], what=what, device=None
    )


def poisoned_weights(T, K, ids, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(T, K, generator=g, dtype=torch.float64).to(dtype)
    return w.masked_fill(ids < 0, NAN)


# ----------------------------------------------------------------------------- routing maps
@st.composite
def routings(draw, max_tokens=40, max_experts=40, max_k=6):
    E = draw(st.integers(1, max_experts))
    K = draw(st.integers(1, min(E, max_k)))
    T = draw(st.integers(0, max_tokens))
    flat = draw(st.lists(st.integers(-1, E - 1), min_size=T * K, max_size=T * K))
    if draw(st.booleans()) and T * K:  # ids a caller left unchecked: counted as dropped
        flat[draw(st.integers(0, T * K - 1))] = draw(st.sampled_from([E, E + 5, -2, -(2**33)]))
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    if dtype == torch.int32:
        flat = [max(min(v, 2**31 - 1), -(2**31)) for v in flat]
    ids = torch.tensor(flat, dtype=dtype).reshape(T, K)
    layout = draw(st.sampled_from(["contiguous", "transposed", "cols"])) if T > 1 else "contiguous"
    return strided_copy(ids, layout), E


@settings(max_examples=120)
@given(case=routings())
def test_routing_maps_equal_the_reference(case):
    """Every path: Python lists (a few slots), NumPy (CPU tensors, E + K < 2**15) and torch
    ops (any device, any E)."""
    ids, E = case
    want = tables(ids, E)
    paths = (TI._routing_maps_python, TI._routing_maps_numpy, TI._routing_maps_sorted)
    for path in (TI.routing_maps_torch, *paths):
        got = path(ids, E)
        for name, a, b in zip(("s2d", "d2s", "efs", "offsets"), got, want, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), (
                f"{path.__name__} {name}: {a.tolist()} != {b.tolist()}"
            )


@pytest.mark.parametrize(
    ("T", "K", "E"),
    [(300, 2, 256), (2048, 8, 256), (5, 2, 2**15 - 3), (5, 2, 2**15 - 2), (7, 3, 40000)],
)
def test_routing_maps_large(T, K, E):
    """Many slots (NumPy's radix sort), and E + K at and past int16 bins (the torch path)."""
    ids = make_ids(T, K, min(E, 512), drop=0.3, seed=T) * (E // min(E, 512))
    ids[ids < 0] = -1
    got = TI.routing_maps_torch(ids, E)
    for a, b in zip(got, tables(ids, E), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


# ----------------------------------------------------------------------------- expand, finalize
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "cols"])
def test_expand_rows_exact(dtype, layout):
    T, K, E, H = 13, 3, 5, 9
    ids = make_ids(T, K, E, drop=0.3, seed=1)
    _s2d, d2s, _efs, off = tables(ids, E)
    assert off[-1] < T * K
    x = strided_copy(rand(T, H, dtype=dtype, seed=2), layout)
    want = R.expand_rows_reference(x, d2s, off)
    assert torch.equal(TI.expand_rows_torch(x, d2s, off), want)
    assert torch.equal(TI._expand_rows_masked(x, d2s, off), want)  # the GPU path


@pytest.mark.parametrize("bias", [None, "H", "TH"])
@pytest.mark.parametrize(
    ("dtype", "wdtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float16),
        (torch.float64, torch.float64),
    ],
)
def test_finalize_and_backward_exact(dtype, wdtype, bias):
    T, K, E, H = 11, 3, 4, 10
    ids = make_ids(T, K, E, drop=0.3, seed=3)
    s2d, _d2s, efs, off = tables(ids, E)
    routed = int(off[-1])
    y = rand(T * K, H, dtype=dtype, seed=4)
    y[routed:] = NAN  # rows of dropped slots: never read
    w = poisoned_weights(T, K, ids, wdtype, seed=5)
    b = {None: None, "H": rand(H, dtype=dtype, seed=6), "TH": rand(T, H, dtype=dtype, seed=7)}
    args = (y, w, s2d, efs)
    out = TI.finalize_torch(*args, b[bias])
    assert torch.equal(out, R.finalize_moe_routing_reference(*args, b[bias]))
    dout = rand(T, H, dtype=dtype, seed=8)
    dy, dw = TI.finalize_backward_torch(dout, *args)
    ref_dy, ref_dw = R.finalize_moe_routing_backward_reference(dout, *args)
    assert torch.equal(dy, ref_dy)
    check(dw, ref_dw, torch.float32 if wdtype != torch.float64 else wdtype, "d topk_weights")
    assert dw[ids < 0].eq(0).all()
    only_dy = TI.finalize_backward_torch(dout, *args, need_dw=False)
    assert only_dy[1] is None and torch.equal(only_dy[0], dy)


def test_finalize_empty_and_all_dropped():
    E, H = 3, 5
    ids = torch.full((4, 2), -1)
    s2d, d2s, efs, off = tables(ids, E)
    y = torch.full((8, H), NAN)
    w = torch.full((4, 2), NAN)
    bias = rand(H, seed=1)
    assert torch.equal(TI.finalize_torch(y, w, s2d, efs, bias), bias.expand(4, H))
    for expand in (TI.expand_rows_torch, TI._expand_rows_masked):
        assert torch.equal(expand(rand(4, H), d2s, off), torch.zeros(8, H))
    s2d0, d2s0, efs0, off0 = tables(torch.zeros(0, 2, dtype=torch.int64), E)
    out = TI.finalize_torch(torch.zeros(0, H), torch.zeros(0, 2), s2d0, efs0)
    assert out.shape == (0, H)
    for expand in (TI.expand_rows_torch, TI._expand_rows_masked):
        assert expand(torch.zeros(0, H), d2s0, off0).shape == (0, H)


# ----------------------------------------------------------------------------- grouped GEMM
def gemm_case(T, K, E, H, n, *, dtype, bias, drop=0.2, seed=0):
    ids = make_ids(T, K, E, drop=drop, seed=seed)
    maps = tables(ids, E)
    x = rand(T, H, dtype=dtype, seed=seed + 1)
    w = rand(E, n, H, dtype=dtype, scale=H**-0.5, seed=seed + 2)
    b = rand(E, n, dtype=dtype, scale=0.5, seed=seed + 3) if bias else None
    return ids, maps, x, w, b


@pytest.mark.parametrize(("activation", "layout"), ACT_LAYOUTS, ids=ACT_IDS)
@pytest.mark.parametrize("gather", [False, True], ids=["perm", "gather"])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str
)
def test_grouped_gemm_and_backward(activation, layout, gather, dtype):
    # H = 16 and n = 24 keep torch._grouped_mm's 16-byte pitches in float32; odd sizes below.
    T, K, E, H, n = 13, 3, 5, 16, 24
    _, (s2d, d2s, efs, off), x, w, b = gemm_case(T, K, E, H, n, dtype=dtype, bias=True, seed=7)
    x_perm = R.expand_rows_reference(x, d2s, off)
    a = x if gather else x_perm
    out = TI.grouped_gemm_torch(a, w, off, b, activation, layout, d2s if gather else None)
    ref = R.grouped_gemm_reference(x_perm, w, off, b, activation=activation, gate_up_layout=layout)
    check(out, ref, dtype, "out")
    routed = int(off[-1])
    assert out[routed:].eq(0).all()

    dout = rand(*ref.shape, dtype=dtype, seed=9)
    tabs = (s2d, d2s, efs, gather)
    da, dw, db = TI.grouped_gemm_backward_torch(dout, a, w, off, b, activation, layout, *tabs)
    rda, rdw, rdb = R.grouped_gemm_backward_reference(
        dout, x_perm, w, off, b, activation=activation, gate_up_layout=layout
    )
    if gather:  # the op's reference branch: the K copies of each token, summed in k order
        unit = torch.ones(T, K, dtype=rda.dtype)
        rda = R.finalize_moe_routing_reference(rda, unit, s2d, efs)
    check(da, rda, dtype, "da")
    check(dw, rdw, dtype, "dw")
    check(db, rdb, dtype, "db")
    for skip in ("need_da", "need_dw", "need_db"):
        part = TI.grouped_gemm_backward_torch(
            dout, a, w, off, b, activation, layout, *tabs, **{skip: False}
        )
        for name, got, full in zip(
            ("need_da", "need_dw", "need_db"), part, (da, dw, db), strict=True
        ):
            assert got is None if name == skip else torch.equal(got, full), (skip, name)


@pytest.mark.parametrize("how", ["transposed", "sliced", "expert_major_last"])
@pytest.mark.parametrize("sizes", [(16, 24), (9, 14)], ids=["aligned", "odd"])
def test_grouped_gemm_weight_layouts_and_odd_sizes(how, sizes):
    """Odd H / N miss torch._grouped_mm's 16-byte pitches: the per-expert loop runs."""
    H, n = sizes
    _, (_s2d, d2s, _efs, off), x, w, b = gemm_case(
        21, 2, 6, H, n, dtype=torch.float32, bias=True, seed=3
    )
    wv = strided_weight(w, how)
    out = TI.grouped_gemm_torch(x, wv, off, b, "swiglu", "interleaved", d2s)
    x_perm = R.expand_rows_reference(x, d2s, off)
    ref = R.grouped_gemm_reference(
        x_perm, w, off, b, activation="swiglu", gate_up_layout="interleaved"
    )
    check(out, ref, torch.float32, how)


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_grouped_gemm_stride_zero_operands(dim):
    """Broadcast (stride-0) weights and tokens at aligned sizes: torch._grouped_mm takes no
    stride-0 leading dimension, so they go through the per-expert loop, with the reference's
    values, forward and backward."""
    E, H, n = 4, 16, 24
    _, (s2d, d2s, efs, off), x, w, b = gemm_case(
        11, 2, E, H, n, dtype=torch.float32, bias=True, seed=5
    )
    w = w[:, :1].expand(E, n, H) if dim == 1 else w
    w = w[:, :, :1].expand(E, n, H) if dim == 2 else w
    w = w[:1].expand(E, n, H) if dim == 0 else w
    x = x[:, :1].expand(x.shape)  # stride (1, 0)
    assert 0 in w.stride() and 0 in x.stride()
    out = TI.grouped_gemm_torch(x, w, off, b, "silu", "concat", d2s)
    x_perm = R.expand_rows_reference(x, d2s, off)
    w_c = w.contiguous()
    check(out, R.grouped_gemm_reference(x_perm, w_c, off, b, activation="silu"), x.dtype, "out")
    dout = rand(*out.shape, seed=6)
    got = TI.grouped_gemm_backward_torch(dout, x, w, off, b, "silu", "concat", s2d, d2s, efs, True)
    rda, rdw, rdb = R.grouped_gemm_backward_reference(dout, x_perm, w_c, off, b, activation="silu")
    rda = R.finalize_moe_routing_reference(rda, torch.ones(11, 2), s2d, efs)
    for name, g, want in zip(("da", "dw", "db"), got, (rda, rdw, rdb), strict=True):
        check(g, want, torch.float32, name)


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 40])
def test_grouped_gemm_few_rows_and_empty_experts(rows):
    """Below and above the row count where torch._grouped_mm takes over; most experts empty."""
    E, H, n = 8, 16, 16
    ids = torch.full((max(rows, 1), 1), 5)[:rows]
    ids[: rows // 2] = 2
    s2d, d2s, efs, off = tables(ids, E)
    x = rand(rows, H, seed=1)
    w = rand(E, n, H, seed=2)
    out = TI.grouped_gemm_torch(x, w, off, None, "gelu", "concat", d2s)
    x_perm = R.expand_rows_reference(x, d2s, off)
    ref = R.grouped_gemm_reference(x_perm, w, off, activation="gelu")
    check(out, ref, torch.float32, "out")
    dout = rand(rows, n, seed=3)
    da, dw, db = TI.grouped_gemm_backward_torch(
        dout, x_perm, w, off, None, "gelu", "concat", s2d, d2s, efs, False
    )
    rda, rdw, rdb = R.grouped_gemm_backward_reference(dout, x_perm, w, off, activation="gelu")
    for got, want, name in ((da, rda, "da"), (dw, rdw, "dw"), (db, rdb, "db")):
        check(got, want, torch.float32, name)
    empty = [e for e in range(E) if e not in (2, 5)]
    assert dw[empty].eq(0).all() and db[empty].eq(0).all()


# ----------------------------------------------------------------------------- whole chain
def moe_reference(x, w1, w2, tw, b1, b2, bias, maps, activation, layout):
    """The ``moe_route::moe_experts`` op's contract in oracle calls (its torch branch before
    this backend): ``z`` rounded to ``x.dtype``, ``h = act(z)``, GEMM2 and finalize unrounded."""
    s2d, d2s, efs, off = maps
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    x_perm = R.expand_rows_reference(x.to(cdt), d2s, off)
    z = R.grouped_gemm_reference(x_perm, w1, off, b1).to(x.dtype)
    h = R.activation_reference(z.to(cdt), activation, layout)
    y = R.grouped_gemm_reference(h, w2, off, b2)
    return R.finalize_moe_routing_reference(y, tw, s2d, efs, bias).to(x.dtype), z


def moe_case(T, K, E, H, inter, activation, dtype, *, biases, drop=0.2, seed=0):
    ids = make_ids(T, K, E, drop=drop, seed=seed)
    n1 = 2 * inter if activation in ("swiglu", "geglu") else inter
    return dict(
        ids=ids,
        x=rand(T, H, dtype=dtype, seed=seed + 1),
        w1=rand(E, n1, H, dtype=dtype, scale=H**-0.5, seed=seed + 2),
        w2=rand(E, H, inter, dtype=dtype, scale=inter**-0.5, seed=seed + 3),
        tw=poisoned_weights(T, K, ids, torch.float32 if dtype != torch.float64 else dtype),
        b1=rand(E, n1, dtype=dtype, scale=0.5, seed=seed + 4) if biases else None,
        b2=rand(E, H, dtype=dtype, scale=0.5, seed=seed + 5) if biases else None,
        bias=rand(H, dtype=dtype, seed=seed + 6) if biases else None,
    )


def run_and_check(c, E, activation, layout, dtype):
    maps = tables(c["ids"], E)
    args = (c["x"], c["w1"], c["w2"], c["tw"], c["b1"], c["b2"], c["bias"])
    out, z = TI.moe_forward_torch(*args, *maps, activation, layout)
    ref_out, ref_z = moe_reference(*args, maps, activation, layout)
    check(z, ref_z, dtype, "z")
    check(out, ref_out, dtype, "out")
    lean, none = TI.moe_forward_torch(*args, *maps, activation, layout, keep_z=False)
    assert none is None and torch.equal(lean, out)

    T, H = c["x"].shape
    dout = rand(T, H, dtype=dtype, seed=11).to(c["x"].device)
    kw = dict(activation=activation, gate_up_layout=layout, b2=c["b2"])
    core = (c["x"], c["w1"], c["w2"], c["tw"])
    grads = TI.moe_backward_torch(dout, *core, c["b2"], ref_z, *maps, activation, layout)
    want = R.moe_backward_reference(dout, *core, ref_z, maps, **kw)
    for name, got, ref in zip(("dx", "dw1", "dw2", "dtw", "db1", "db2"), grads, want, strict=True):
        check(got, ref, dtype if name != "dtw" else c["tw"].dtype, name)
    assert grads[3][c["ids"] < 0].eq(0).all(), "dropped slots must get a zero weight gradient"
    return grads


@pytest.mark.parametrize(("activation", "layout"), ACT_LAYOUTS, ids=ACT_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_moe_forward_backward(activation, layout, dtype):
    c = moe_case(19, 3, 6, 16, 8, activation, dtype, biases=True, seed=2)
    run_and_check(c, 6, activation, layout, dtype)


@pytest.mark.parametrize(
    ("T", "K", "E", "H", "inter", "drop"),
    [
        (1, 2, 8, 16, 8, 0.0),  # decode: 2 rows, the per-expert loop
        (23, 4, 4, 9, 7, 0.3),  # K = E, odd sizes (no torch._grouped_mm)
        (30, 2, 16, 32, 16, 0.0),  # no dropped slot
        (12, 2, 5, 16, 8, 1.0),  # every slot dropped
        (0, 2, 4, 16, 8, 0.0),  # no tokens
    ],
)
def test_moe_edge_cases(T, K, E, H, inter, drop):
    c = moe_case(T, K, E, H, inter, "swiglu", torch.float32, biases=False, drop=drop, seed=T)
    grads = run_and_check(c, E, "swiglu", "concat", torch.float32)
    used = set(c["ids"][c["ids"] >= 0].tolist())
    idle = [e for e in range(E) if e not in used]
    assert grads[1][idle].eq(0).all() and grads[2][idle].eq(0).all()


def test_moe_backward_skips_what_is_not_asked():
    c = moe_case(9, 2, 4, 16, 8, "swiglu", torch.float32, biases=True, seed=5)
    maps = tables(c["ids"], 4)
    args = (c["x"], c["w1"], c["w2"], c["tw"], c["b1"], c["b2"], c["bias"])
    _, z = TI.moe_forward_torch(*args, *maps)
    dout = rand(9, 16, seed=1)
    core = (c["x"], c["w1"], c["w2"], c["tw"])
    full = TI.moe_backward_torch(dout, *core, c["b2"], z, *maps)
    needs = ("need_dx", "need_dw1", "need_dw2", "need_dtopk")
    covers = {"need_dx": (0,), "need_dw1": (1, 4), "need_dw2": (2, 5), "need_dtopk": (3,)}
    for only in needs:
        part = TI.moe_backward_torch(
            dout, *core, c["b2"], z, *maps, **{n: n == only for n in needs}
        )
        for i, (got, want) in enumerate(zip(part, full, strict=True)):
            assert got is None if i not in covers[only] else torch.equal(got, want), (only, i)


@settings(max_examples=25)
@given(
    T=st.integers(0, 24),
    K=st.integers(1, 3),
    E=st.integers(3, 7),
    drop=st.sampled_from([0.0, 0.3]),
    seed=st.integers(0, 1000),
)
def test_moe_random_routings_float64(T, K, E, drop, seed):
    """float64: the same formulas give the reference's values to 1e-12."""
    c = moe_case(T, K, E, 8, 4, "geglu", torch.float64, biases=True, drop=drop, seed=seed)
    run_and_check(c, E, "geglu", "interleaved", torch.float64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the torch backend on CUDA tensors")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_on_cuda(dtype):
    """On a GPU (when asked for): the torch-op maps (no NumPy, no Python path) and the
    per-expert matmuls, against the reference on the same CUDA tensors."""
    E = 6
    c = moe_case(37, 2, E, 32, 16, "swiglu", dtype, biases=True, seed=4)
    c = {k: None if v is None else v.cuda() for k, v in c.items()}
    maps = TI.routing_maps_torch(c["ids"], E)
    for a, b in zip(maps, tables(c["ids"].cpu(), E), strict=True):
        assert a.is_cuda and a.dtype == b.dtype and torch.equal(a.cpu(), b)
    run_and_check(c, E, "swiglu", "concat", dtype)
    # The public path on CUDA tensors (the "runs anywhere" backend): the bits of the same
    # computation on the CPU copies, forward and backward.
    outs = []
    for device in ("cuda", "cpu"):
        leaves = [c[k].detach().to(device).requires_grad_(True) for k in ("x", "w1", "w2")]
        tw = c["tw"].to(device).nan_to_num(0.0).requires_grad_(True)
        out = moe_route.fused_moe(*leaves, tw, c["ids"].to(device), backend="torch")
        out.float().square().sum().backward()
        outs.append([t.detach().cpu() for t in (out, *[v.grad for v in leaves], tw.grad)])
    for name, got, want in zip(("out", "dx", "dw1", "dw2", "dtw"), *outs, strict=True):
        check(got, want, dtype if name != "dtw" else torch.float32, f"cuda vs cpu {name}")
