"""expand_rows and finalize_moe_routing: Triton (compiled on CUDA, interpreted on the CPU)
against the reference, odd sizes, strided inputs, NaN in everything that must not be read,
poisoned outputs, and hypothesis properties (identity pipeline, linearity, token permutation).

Tolerances come from ``helpers`` (one ulp of the output dtype plus the float32 accumulation
bound); they are ulp-exact, not loosened to pass. bf16 needs the full ulp only because the
triton 3.5.1 interpreter truncates float32 -> bfloat16 (a GPU rounds to nearest).
"""

import pytest
import torch
from helpers import (
    DEVICE,
    FLOAT_DTYPES,
    TRITON_OK,
    accumulation_rtol,
    assert_close_to_reference,
    assert_finalize_close,
    finalize_expected,
    poisoned,
    randn,
    random_topk_ids,
    random_weights,
    requires_triton,
    strided_copy,
    subnormal_atol,
    ulp_rtol,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import moe_route
from moe_route.reference import expand_rows_reference, finalize_moe_routing_reference

NAN = float("nan")
BACKENDS = ["reference", pytest.param("triton", marks=requires_triton)]


def make_case(
    T,
    K,
    E,
    H,
    dtype,
    *,
    weight_dtype=torch.float32,
    bias=None,
    drop_prob=0.25,
    seed=0,
    maps_backend="reference",
):
    """Inputs of one MoE layer's token path on DEVICE. Every value that the contract says is
    never read is NaN: the ``y_perm`` rows of dropped slots (``d >= offset[E]``) and the router
    weights of dropped slots."""
    ids = random_topk_ids(T, K, E, drop_prob=drop_prob, device=DEVICE, seed=seed)
    maps = moe_route.build_routing_maps(ids, E, backend=maps_backend)
    routed = int(maps.expert_first_token_offset[-1])
    x = randn(T, H, dtype=dtype, device=DEVICE, seed=seed)
    y_perm = randn(T * K, H, dtype=dtype, device=DEVICE, seed=seed + 10)
    y_perm[routed:] = NAN
    w = random_weights(T, K, dtype=weight_dtype, device=DEVICE, seed=seed)
    w = w.masked_fill(ids < 0, NAN)
    b = {
        None: None,
        "H": randn(H, dtype=dtype, device=DEVICE, seed=seed + 20),
        "TH": randn(T, H, dtype=dtype, device=DEVICE, seed=seed + 30),
    }[bias]
    return dict(ids=ids, maps=maps, x=x, y_perm=y_perm, w=w, bias=b, routed=routed)


def expected_expand(x, maps):
    """x_perm from the contract directly: x[dest_to_src[d] mod T] for routed d, zero after."""
    T = x.shape[0]
    d2s = maps.expanded_dest_row_to_expanded_source_row.long()
    out = torch.zeros(d2s.numel(), x.shape[1], dtype=x.dtype, device=x.device)
    routed = int(maps.expert_first_token_offset[-1])
    out[:routed] = x[d2s[:routed] % T]
    return out


# ============================================================================= expand
EXPAND_SHAPES = [(1, 2, 13), (1, 2, 67), (37, 3, 13), (37, 3, 67), (45, 2, 13)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T,K,H", EXPAND_SHAPES)
@pytest.mark.parametrize("dtype", [*FLOAT_DTYPES, torch.float64], ids=str)
def test_expand_rows(backend, T, K, H, dtype):
    c = make_case(T, K, 5, H, dtype, seed=T + H)
    out = moe_route.expand_rows(c["x"], c["maps"], backend=backend)
    assert out.dtype == dtype and out.shape == (T * K, H) and out.is_contiguous()
    # A gather is exact: bitwise equal, dropped rows exactly zero.
    assert torch.equal(out, expected_expand(c["x"], c["maps"]))
    assert torch.equal(out[c["routed"] :], torch.zeros_like(out[c["routed"] :]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["transposed", "cols", "rows"])
def test_expand_rows_strided_x(backend, layout):
    c = make_case(37, 2, 6, 13, torch.bfloat16, seed=4)
    x = strided_copy(c["x"], layout)
    assert not x.is_contiguous()
    out = moe_route.expand_rows(x, c["maps"], backend=backend)
    assert torch.equal(out, expected_expand(c["x"], c["maps"]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_expand_rows_never_reads_fully_dropped_tokens(backend):
    T, K, E, H = 9, 2, 4, 13
    ids = random_topk_ids(T, K, E, device=DEVICE, seed=2)
    ids[[0, 4, 8]] = -1  # these tokens reach no expert: their rows of x are never gathered
    maps = moe_route.build_routing_maps(ids, E, backend="reference")
    x = randn(T, H, device=DEVICE, seed=2)
    x[[0, 4, 8]] = NAN
    out = moe_route.expand_rows(x, maps, backend=backend)
    assert not out.isnan().any()
    assert torch.equal(out, expected_expand(x, maps))


@requires_triton
@pytest.mark.parametrize("block_h", [None, 16])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_expand_launcher_writes_every_element(block_h, dtype):
    """Poison a wider buffer, expand into a [N, H] window of it: every element of the window
    is written (routed rows copied, dropped rows zeroed) and nothing beyond a row's end.
    The kernel scatters token rows, so a dest row no program owns would stay NaN."""
    from moe_route.kernels.triton.expand import expand_rows_triton

    T, K, E, H = 23, 3, 5, 67  # block_h=16: 5 column blocks, the last one partial
    c = make_case(T, K, E, H, dtype, drop_prob=0.3, seed=7)
    maps = c["maps"]
    buf = poisoned((T * K, H + 5), dtype, DEVICE)
    out = buf[:, :H]
    expand_rows_triton(
        c["x"],
        maps.expanded_source_row_to_expanded_dest_row,
        maps.expert_for_source_row,
        out,
        block_h=block_h,
    )
    assert not out.isnan().any(), f"{int(out.isnan().sum())} elements of out never written"
    assert torch.equal(out, expected_expand(c["x"], maps))
    assert buf[:, H:].isnan().all(), "expand wrote past the end of a row"


@pytest.mark.parametrize("backend", BACKENDS)
def test_expand_rows_empty(backend):
    maps = moe_route.build_routing_maps(
        torch.empty(0, 2, dtype=torch.int64, device=DEVICE), 3, backend="reference"
    )
    out = moe_route.expand_rows(torch.empty(0, 13, device=DEVICE), maps, backend=backend)
    assert out.shape == (0, 13)


# ============================================================================= finalize
def _finalize_params():
    cases = []
    for dtype in FLOAT_DTYPES:
        for T, K, H in [(1, 2, 13), (37, 3, 67)]:
            for bias in (None, "H", "TH"):
                for wdt in ("float32", "act"):
                    cases.append((dtype, T, K, H, bias, wdt))
        # Many tokens at K = 2 (one program per token and column block: no tile spans tokens,
        # so T = 45 reaches what a larger T would): two configurations per dtype.
        cases += [(dtype, 45, 2, 13, None, "float32"), (dtype, 45, 2, 13, "TH", "act")]
    return [
        pytest.param(*c, id=f"{str(c[0])[6:]}-T{c[1]}-K{c[2]}-H{c[3]}-bias{c[4]}-w{c[5]}")
        for c in cases
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,T,K,H,bias,wdt", _finalize_params())
def test_finalize(backend, dtype, T, K, H, bias, wdt):
    weight_dtype = torch.float32 if wdt == "float32" else dtype
    c = make_case(T, K, 6, H, dtype, weight_dtype=weight_dtype, bias=bias, seed=T * 7 + H)
    out = moe_route.finalize_moe_routing(c["y_perm"], c["w"], c["maps"], c["bias"], backend=backend)
    assert out.dtype == dtype and out.shape == (T, H)
    # NaN sits in every dropped y row and dropped weight: none may reach the output.
    assert not out.isnan().any()
    assert_finalize_close(out, c["y_perm"], c["w"], c["maps"], c["bias"])


@requires_triton
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_finalize_triton_vs_reference_backend(dtype):
    """Both backends round the same float32 sum once; allow one ulp between them (the
    interpreter truncates bf16, and a GPU may contract w*y+acc into an FMA)."""
    c = make_case(37, 3, 6, 67, dtype, bias="H", seed=11)
    args = (c["y_perm"], c["w"], c["maps"], c["bias"])
    tri = moe_route.finalize_moe_routing(*args, backend="triton")
    ref = moe_route.finalize_moe_routing(*args, backend="reference")
    _, scale = finalize_expected(*args)
    atol = 2 * accumulation_rtol(3) * scale.cpu() + subnormal_atol(dtype)
    assert_close_to_reference(tri, ref.double(), rtol=ulp_rtol(dtype), atol=atol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias", [None, "H", "TH"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_finalize_fully_dropped_tokens_get_bias_or_zero(backend, bias, dtype):
    T, K, E, H = 7, 2, 4, 13
    c = make_case(T, K, E, H, dtype, bias=bias, drop_prob=0.0, seed=5)
    ids = c["ids"].clone()
    ids[[0, 3, 6]] = -1
    maps = moe_route.build_routing_maps(ids, E, backend="reference")
    routed = int(maps.expert_first_token_offset[-1])
    y = c["y_perm"].clone()
    y[routed:] = NAN
    w = c["w"].masked_fill(ids < 0, NAN)
    out = moe_route.finalize_moe_routing(y, w, maps, c["bias"], backend=backend)
    want = torch.zeros(T, H, dtype=dtype, device=DEVICE)
    if c["bias"] is not None:
        want = want + c["bias"]
    # Exact: nothing is added to the bias of a token without routed slots.
    assert torch.equal(out[[0, 3, 6]], want[[0, 3, 6]])
    assert not out.isnan().any()
    assert_finalize_close(out, y, w, maps, c["bias"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "y_layout,w_layout,bias_kind",
    [
        ("transposed", "contiguous", None),
        ("rows", "transposed", "H-strided"),
        ("cols", "cols", "TH-transposed"),
        ("contiguous", "rows", "TH-rows"),
    ],
)
def test_finalize_strided_inputs(backend, y_layout, w_layout, bias_kind):
    T, K, E, H = 37, 3, 5, 13
    dtype = torch.float16
    c = make_case(T, K, E, H, dtype, bias="TH" if bias_kind else None, seed=13)
    y = strided_copy(c["y_perm"], y_layout)
    w = strided_copy(c["w"], w_layout)
    bias = c["bias"]
    if bias_kind == "H-strided":
        wide = torch.full((H, 2), NAN, dtype=dtype, device=DEVICE)  # column 1 is never read
        wide[:, 0] = bias[0]
        bias = wide[:, 0]  # [H], stride 2
        assert bias.shape == (H,) and bias.stride() == (2,)
    elif bias_kind == "TH-transposed":
        bias = strided_copy(bias, "transposed")
    elif bias_kind == "TH-rows":
        bias = strided_copy(bias, "rows")
    out = moe_route.finalize_moe_routing(y, w, c["maps"], bias, backend=backend)
    assert_finalize_close(out, c["y_perm"], c["w"], c["maps"], bias)
    contiguous = moe_route.finalize_moe_routing(
        c["y_perm"], c["w"], c["maps"], None if bias is None else bias.contiguous(), backend=backend
    )
    assert torch.equal(out, contiguous)  # strides change addresses, never values


@requires_triton
@pytest.mark.parametrize("bias", [None, "H", "TH"])
@pytest.mark.parametrize("block_h", [None, 16])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_finalize_launcher_writes_every_element(dtype, block_h, bias):
    from moe_route.kernels.triton.finalize import finalize_triton

    T, K, E, H = 19, 3, 5, 67
    c = make_case(T, K, E, H, dtype, bias=bias, drop_prob=0.4, seed=17)
    maps = c["maps"]
    buf = poisoned((T, H + 5), dtype, DEVICE)
    out = buf[:, :H]
    finalize_triton(
        c["y_perm"],
        c["w"],
        maps.expanded_source_row_to_expanded_dest_row,
        maps.expert_for_source_row,
        c["bias"],
        out,
        block_h=block_h,
    )
    assert not out.isnan().any(), f"{int(out.isnan().sum())} elements of out never written"
    assert buf[:, H:].isnan().all(), "finalize wrote past the end of a row"
    assert_finalize_close(out, c["y_perm"], c["w"], maps, c["bias"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64], ids=str)
def test_finalize_launcher_unit_weights(dtype):
    """``topk_weights=None`` (the backward of an expand) sums the routed rows: the bits of
    explicit weights of one (a product by 1.0 is exact), dropped slots left out."""
    from moe_route.kernels.triton.finalize import finalize_triton

    T, K, E, H = 13, 3, 5, 37
    c = make_case(T, K, E, H, dtype, drop_prob=0.3, seed=23)
    maps = c["maps"]
    tables = (maps.expanded_source_row_to_expanded_dest_row, maps.expert_for_source_row)
    ones = torch.ones(T, K, dtype=torch.float32, device=DEVICE)
    want = torch.empty(T, H, dtype=dtype, device=DEVICE)
    finalize_triton(c["y_perm"], ones, *tables, None, want)
    buf = poisoned((T, H + 3), dtype, DEVICE)
    out = buf[:, :H]
    finalize_triton(c["y_perm"], None, *tables, None, out)
    assert torch.equal(out, want)
    assert buf[:, H:].isnan().all(), "finalize wrote past the end of a row"
    assert_finalize_close(out, c["y_perm"], ones, maps, None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_finalize_empty(backend):
    maps = moe_route.build_routing_maps(
        torch.empty(0, 2, dtype=torch.int64, device=DEVICE), 3, backend="reference"
    )
    y = torch.empty(0, 13, device=DEVICE)
    w = torch.empty(0, 2, device=DEVICE)
    out = moe_route.finalize_moe_routing(y, w, maps, torch.ones(13, device=DEVICE), backend=backend)
    assert out.shape == (0, 13)


@pytest.mark.parametrize("backend", BACKENDS)
def test_finalize_mixed_precision_weights(backend):
    # float64 router weights with float32 activations: accumulate at least in float32.
    c = make_case(37, 3, 6, 13, torch.float32, weight_dtype=torch.float64, bias="H", seed=19)
    out = moe_route.finalize_moe_routing(c["y_perm"], c["w"], c["maps"], c["bias"], backend=backend)
    assert out.dtype == torch.float32
    assert_finalize_close(out, c["y_perm"], c["w"], c["maps"], c["bias"])


def test_finalize_reference_float64_is_float64_exact():
    c = make_case(37, 3, 6, 13, torch.float64, weight_dtype=torch.float64, bias="TH", seed=23)
    out = moe_route.finalize_moe_routing(
        c["y_perm"], c["w"], c["maps"], c["bias"], backend="reference"
    )
    assert_finalize_close(out, c["y_perm"], c["w"], c["maps"], c["bias"])  # ulp of float64
    # The accumulation itself must be float64: tighter than any float32 sum could be.
    exact, scale = finalize_expected(c["y_perm"], c["w"], c["maps"], c["bias"])
    eps64 = torch.finfo(torch.float64).eps
    assert_close_to_reference(out, exact, rtol=eps64, atol=(3 + 2) * eps64 * scale.cpu())


@requires_triton
def test_finalize_triton_float64_accumulates_in_float64():
    # Regression: summing float64 inputs in float32 gives ~1e-7 relative error where the
    # docstring promises a float64 accumulation.
    c = make_case(37, 3, 6, 13, torch.float64, weight_dtype=torch.float64, bias="TH", seed=23)
    out = moe_route.finalize_moe_routing(
        c["y_perm"], c["w"], c["maps"], c["bias"], backend="triton"
    )
    exact, scale = finalize_expected(c["y_perm"], c["w"], c["maps"], c["bias"])
    eps64 = torch.finfo(torch.float64).eps
    assert_close_to_reference(out, exact, rtol=eps64, atol=(3 + 2) * eps64 * scale.cpu())


# ============================================================================= properties
@st.composite
def small_layers(draw, *, dtypes=FLOAT_DTYPES, drops=True):
    T = draw(st.integers(1, 12))
    E = draw(st.integers(1, 6))
    K = draw(st.integers(1, min(E, 3)))
    H = draw(st.integers(1, 24))
    dtype = draw(st.sampled_from(dtypes))
    drop_prob = draw(st.sampled_from([0.0, 0.3])) if drops else 0.0
    seed = draw(st.integers(0, 2**16))
    backend = draw(st.sampled_from(["reference", "triton"] if TRITON_OK else ["reference"]))
    return dict(T=T, E=E, K=K, H=H, dtype=dtype, drop_prob=drop_prob, seed=seed, backend=backend)


@settings(max_examples=30)
@given(p=small_layers(drops=False))
def test_property_identity_pipeline_returns_x(p):
    """No drops, weights summing to 1: finalize(expand(x)) == x within rounding."""
    T, K, E, H, dtype, b = p["T"], p["K"], p["E"], p["H"], p["dtype"], p["backend"]
    ids = random_topk_ids(T, K, E, device=DEVICE, seed=p["seed"])
    w = random_weights(T, K, device=DEVICE, seed=p["seed"])
    x = randn(T, H, dtype=dtype, device=DEVICE, seed=p["seed"])
    maps = moe_route.build_routing_maps(ids, E, backend=b)
    out = moe_route.finalize_moe_routing(
        moe_route.expand_rows(x, maps, backend=b), w, maps, backend=b
    )
    # Σ_k w = 1 up to K float32 roundings; the sum adds K+2 more; one final rounding.
    rtol = ulp_rtol(dtype) + 2 * accumulation_rtol(K)
    assert_close_to_reference(out, x.double(), rtol=rtol, atol=subnormal_atol(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "dtype,K", [(torch.float32, 1), (torch.float32, 2), (torch.float16, 4), (torch.bfloat16, 4)]
)
def test_identity_pipeline_dyadic_weights_is_exact(backend, dtype, K):
    """Weights 1/K (K a power of two) make every step exact: out must be x bit for bit."""
    T, E, H = 29, 6, 13
    ids = random_topk_ids(T, K, E, device=DEVICE, seed=K)
    x = randn(T, H, dtype=dtype, device=DEVICE, seed=K)
    w = torch.full((T, K), 1.0 / K, device=DEVICE)
    maps = moe_route.build_routing_maps(ids, E, backend=backend)
    x_perm = moe_route.expand_rows(x, maps, backend=backend)
    assert torch.equal(moe_route.finalize_moe_routing(x_perm, w, maps, backend=backend), x)


@settings(max_examples=25)
@given(
    p=small_layers(dtypes=(torch.float32, torch.float64)),
    a=st.floats(-4, 4, allow_nan=False, width=32),
    b=st.floats(-4, 4, allow_nan=False, width=32),
)
def test_property_finalize_is_linear_in_weights(p, a, b):
    """f(a*w1 + b*w2) == a*f(w1) + b*f(w2) up to float rounding (no bias)."""
    T, K, E, H, dtype, backend = p["T"], p["K"], p["E"], p["H"], p["dtype"], p["backend"]
    c = make_case(T, K, E, H, dtype, weight_dtype=dtype, drop_prob=p["drop_prob"], seed=p["seed"])
    w1 = c["w"]
    w2 = randn(T, K, dtype=dtype, device=DEVICE, seed=p["seed"] + 1).masked_fill(c["ids"] < 0, NAN)

    def f(w):
        return moe_route.finalize_moe_routing(c["y_perm"], w, c["maps"], backend=backend).double()

    lhs = f(a * w1 + b * w2)
    rhs = a * f(w1) + b * f(w2)
    # Each of the three sums is within (K+2) roundings of its scale; a*w1+b*w2 adds one more.
    # Near zero a rounding loses up to a subnormal spacing instead of eps relative (hypothesis
    # found b = 7e-45, a subnormal float32 weight: an error of 1.3 spacings), so the absolute
    # floor counts the same roundings.
    eps = torch.finfo(dtype).eps
    s1 = finalize_expected(c["y_perm"], w1, c["maps"])[1]
    s2 = finalize_expected(c["y_perm"], w2, c["maps"])[1]
    bound = 2 * (K + 3) * eps * (abs(a) * s1 + abs(b) * s2).cpu()
    floor = 2 * (K + 3) * subnormal_atol(dtype)
    assert_close_to_reference(lhs, rhs, rtol=0.0, atol=bound + floor)


@settings(max_examples=25)
@given(p=small_layers(), perm_seed=st.integers(0, 2**16), bias_kind=st.sampled_from([None, "TH"]))
def test_property_token_permutation_equivariance(p, perm_seed, bias_kind):
    """Reordering the tokens (x, topk_ids, topk_weights, a [T, H] bias) reorders the output
    the same way, bit for bit: each token's sum sees the same values in the same k order."""
    T, K, E, H, dtype, backend = p["T"], p["K"], p["E"], p["H"], p["dtype"], p["backend"]
    c = make_case(T, K, E, H, dtype, bias=bias_kind, drop_prob=p["drop_prob"], seed=p["seed"])
    expert_scale = randn(E + 1, dtype=torch.float32, device=DEVICE, seed=p["seed"] + 3)

    def layer(x, ids, w, bias):
        maps = moe_route.build_routing_maps(ids, E, backend=backend)
        x_perm = moe_route.expand_rows(x, maps, backend=backend)
        expert = maps.expert_for_source_row.long()[
            maps.expanded_dest_row_to_expanded_source_row.long()
        ]  # -1 for dropped rows picks the extra scale E (any value; it is never read)
        y_perm = (x_perm.float() * expert_scale[expert].unsqueeze(1)).to(dtype)
        return moe_route.finalize_moe_routing(y_perm, w, maps, bias, backend=backend)

    perm = torch.randperm(T, generator=torch.Generator().manual_seed(perm_seed)).to(DEVICE)
    bias = c["bias"]
    out = layer(c["x"], c["ids"], c["w"], bias)
    out_p = layer(c["x"][perm], c["ids"][perm], c["w"][perm], None if bias is None else bias[perm])
    assert torch.equal(out_p, out[perm])
    assert not out.isnan().any()


def test_reference_expand_matches_contract_formula():
    # The oracle itself, against the formula written independently here.
    c = make_case(37, 3, 5, 13, torch.float32, seed=29)
    d2s = c["maps"].expanded_dest_row_to_expanded_source_row
    off = c["maps"].expert_first_token_offset
    assert torch.equal(expand_rows_reference(c["x"], d2s, off), expected_expand(c["x"], c["maps"]))
    m = c["maps"]
    out = finalize_moe_routing_reference(
        c["y_perm"], c["w"], m.expanded_source_row_to_expanded_dest_row, m.expert_for_source_row
    )
    # out[t] = Σ_k w[t,k] y[dest(k*T+t)] over routed slots, by an explicit loop.
    T, K = c["w"].shape
    s2d = m.expanded_source_row_to_expanded_dest_row.tolist()
    efs = m.expert_for_source_row.tolist()
    want = torch.zeros(T, 13, dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            s = k * T + t
            if efs[s] >= 0:
                want[t] += float(c["w"][t, k]) * c["y_perm"][s2d[s]].double().cpu()
    assert_close_to_reference(out, want, rtol=1e-6, atol=1e-6)
