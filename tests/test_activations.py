"""Activation variants (moe_route.activations) on the CPU: the spec, the reference oracles, the
Triton math of ``moe_route/kernels/triton/activation.py`` on its own, GEMM1's epilogue and the
training backward through the interpreter, float64 ``gradcheck``, and MoELayer.

The variants are the clamped SwiGLU family (``f(min(g, limit)) · (clamp(u, ±limit) +
up_offset)`` with ``f(x) = x·sigmoid(alpha·x)``), the soft-capped SwiGLU of Inkling2
(``c·tanh(g/c) · sigmoid(g) · c'·tanh(u/c')``), tanh-approximated GELU (gated and plain) and
squared ReLU. The oracle of every gradient is ``torch.autograd`` through
``moe_route.reference.activation_reference``, which is written with torch ops (``clamp``
included), so the gradient at ``gate == limit`` and ``up == ±limit`` is torch's: the bounds
pass the gradient, values beyond get zero. The tests put values exactly on the bounds.

Tolerances: the Triton math against float64 on the same inputs, ``32 eps(dtype)`` relative to
each value plus ``32 eps(dtype)`` of the largest (a few roundings of a handful of operations);
GEMM results as in tests/test_grouped_gemm.py and gradients as in tests/test_training.py
(relative Frobenius error fp32 1e-5, fp16 2e-3 forward and 4e-3 backward, with the wide
elementwise guard of ``moe_cases.assert_matches``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pickle

import moe_cases
import pytest
import torch
import triton
import triton.language as tl
from helpers import DEVICE, TRITON_OK
from hypothesis import given
from hypothesis import strategies as st
from moe_cases import ACT_VARIANTS as VARIANTS
from moe_cases import (
    TOL,
    f64,
    gemm_case,
    gemm_reference,
    moe_case,
    needs_interpreter,
    pin_at_the_bounds,
)

import moe_route
from moe_route.activations import NAMES, Activation, as_activation
from moe_route.kernels.triton.activation import (
    gated_backward,
    gated_forward,
    plain_backward,
    plain_forward,
)
from moe_route.reference import (
    activation_backward_reference,
    activation_reference,
    moe_forward_reference,
)

GPT_OSS = moe_route.activation("swiglu", alpha=1.702, limit=7.0, up_offset=1.0)
INKLING2 = moe_route.activation("swiglu", gate_softcap=4.0, up_softcap=25.0)
IDS = list(VARIANTS)
SMALL_TILES = (16, 16, 16, 2, 4, 2)
launch = functools.partial(moe_cases.launch, allow_tf32=False, config=SMALL_TILES)


# ----------------------------------------------------------------------------- the spec
def test_constructor_and_canonical_string():
    assert Activation("silu", gated=True, alpha=1.702, limit=7.0, up_offset=1.0) == GPT_OSS
    assert str(GPT_OSS) == "swiglu(alpha=1.702, limit=7.0, up_offset=1.0)"
    assert as_activation(str(GPT_OSS)) == GPT_OSS
    assert str(as_activation("swiglu")) == "swiglu" and as_activation("swiglu").gated
    assert moe_route.activation(GPT_OSS, limit=3.0).limit == 3.0  # overrides one parameter
    assert moe_route.activation("swiglu", limit=math.inf).limit is None  # no clamp
    assert str(as_activation("geglu_tanh( limit = 2 )")) == "geglu_tanh(limit=2.0)"
    assert Activation("silu", gated=True, gate_softcap=4, up_softcap=25.0) == INKLING2
    assert str(INKLING2) == "swiglu(gate_softcap=4.0, up_softcap=25.0)"
    assert as_activation(str(INKLING2)) == INKLING2
    assert moe_route.activation(INKLING2, up_softcap=math.inf).up_softcap is None  # no cap
    assert str(moe_route.activation("swiglu", up_softcap=2)) == "swiglu(up_softcap=2.0)"
    for name in NAMES:
        assert str(as_activation(name)) == name


def test_derived_fields_follow_the_parameters():
    """The canonical string and the constexprs are derived once per spec (the public functions
    read them on every call): equality, hash, replace and pickle see only the parameters."""
    assert GPT_OSS.triton_constexprs() == (1, 1.702, 7.0, 1.0, 0.0, 0.0)
    # 0.0: no clamp, no cap
    assert as_activation("swiglu").triton_constexprs() == (1, 1.0, 0.0, 0.0, 0.0, 0.0)
    assert INKLING2.triton_constexprs() == (1, 1.0, 0.0, 0.0, 4.0, 25.0)
    narrower = dataclasses.replace(GPT_OSS, limit=3.0)
    assert str(narrower) == "swiglu(alpha=1.702, limit=3.0, up_offset=1.0)"
    assert narrower.triton_constexprs() == (1, 1.702, 3.0, 1.0, 0.0, 0.0)
    capped = dataclasses.replace(INKLING2, gate_softcap=2.0)
    assert str(capped) == "swiglu(gate_softcap=2.0, up_softcap=25.0)"
    assert capped.triton_constexprs() == (1, 1.0, 0.0, 0.0, 2.0, 25.0)
    assert len({GPT_OSS, as_activation(str(GPT_OSS)), narrower}) == 2
    back = pickle.loads(pickle.dumps(GPT_OSS))
    assert back == GPT_OSS and str(back) == str(GPT_OSS)
    assert as_activation(str(GPT_OSS)) is as_activation(str(GPT_OSS))  # each string parsed once


def test_epilogue_and_plan_carry_the_spec():
    """The spec reaches GEMM1's GemmEpilogue (the kernels' constexprs and launch keys) and the
    fused_moe plan, which is cached per canonical string."""
    from moe_route.kernels.triton.gemm_mainloop import GemmEpilogue
    from moe_route.plan import epilogue_for
    from moe_route.plan import plan_for as _plan_for

    want = GemmEpilogue(act=1, gated=True, interleaved=True, alpha=1.702, limit=7.0, up_offset=1.0)
    assert epilogue_for(GPT_OSS, "interleaved") == want
    assert epilogue_for(str(GPT_OSS), "interleaved") == want
    assert epilogue_for("swiglu", "concat") == GemmEpilogue(act=1, gated=True)
    assert epilogue_for("geglu_tanh(limit=2)", "concat") == GemmEpilogue(act=4, gated=True,
                                                                         limit=2.0)  # fmt: skip
    assert epilogue_for("relu2", "interleaved") == GemmEpilogue(act=5)  # layout: gated only
    assert epilogue_for(str(INKLING2), "concat") == GemmEpilogue(
        act=1, gated=True, gate_softcap=4.0, up_softcap=25.0
    )
    if not TRITON_OK:
        return
    case = moe_case(5, 2, 3, 8, 4)
    x, w1, w2 = case["x"], case["w1"], case["w2"]
    plans = {
        act: _plan_for(x, w1, w2, 2, act, "concat", "standalone", True, False, "triton")
        for act in ("swiglu", str(moe_route.activation("swiglu", limit=0.5)), str(INKLING2))
    }
    assert plans["swiglu"].configs.epilogue.limit == 0.0
    assert plans["swiglu(limit=0.5)"].configs.epilogue.limit == 0.5
    assert plans["swiglu"].configs.epilogue.up_softcap == 0.0
    assert plans[str(INKLING2)].configs.epilogue.up_softcap == 25.0


@given(
    name=st.sampled_from(["swiglu", "geglu", "geglu_tanh"]),
    alpha=st.floats(0.01, 100),
    limit=st.none() | st.floats(1e-3, 1e6),
    up_offset=st.floats(-10, 10),
    caps=st.tuples(st.none() | st.floats(1e-3, 1e6), st.none() | st.floats(1e-3, 1e6)),
)
def test_canonical_string_round_trips(name, alpha, limit, up_offset, caps):
    swiglu = name == "swiglu"
    spec = moe_route.activation(name, alpha=alpha if swiglu else None, limit=limit,
                                up_offset=up_offset, gate_softcap=caps[0] if swiglu else None,
                                up_softcap=caps[1] if swiglu else None)  # fmt: skip
    assert as_activation(str(spec)) == spec


@pytest.mark.parametrize(
    ("value", "exc", "match"),
    [
        ("tanh", ValueError, r"activation='tanh': expected one of"),
        ("relu(limit=1)", ValueError, "gated activations"),
        ("relu2(up_offset=1)", ValueError, "gated activations"),
        ("geglu(alpha=2)", ValueError, "alpha applies to 'swiglu' only"),
        ("geglu(up_softcap=2)", ValueError, "gate_softcap and up_softcap apply to 'swiglu' only"),
        ("silu(gate_softcap=2)", ValueError, "apply to 'swiglu' only"),
        ("swiglu(gate_softcap=0)", ValueError, r"gate_softcap=0.0: expected a number > 0"),
        ("swiglu(up_softcap=-25)", ValueError, r"up_softcap=-25.0: expected a number > 0"),
        ("swiglu(up_softcap=nan)", ValueError, "expected a number"),
        ("swiglu(limit=0)", ValueError, r"limit=0.0: expected a number > 0"),
        ("swiglu(limit=nan)", ValueError, "expected a number"),
        ("swiglu(alpha=inf)", ValueError, "finite"),
        ("swiglu(beta=1)", ValueError, "'beta=1' is not one of"),
        ("swiglu(limit=1, limit=2)", ValueError, "given once"),
        ("swiglu(limit=seven)", ValueError, "'seven' is not a number"),
        ("swiglu(limit=1", ValueError, "expected 'name"),
        (1.702, TypeError, "activation must be an activation name"),
    ],
)
def test_bad_specs_name_the_argument(value, exc, match):
    with pytest.raises(exc, match=match):
        as_activation(value)


def test_public_functions_reject_bad_specs_before_running():
    case = moe_case(5, 2, 3, 8, 4)
    with pytest.raises(ValueError, match=r"activation='relu\(limit=1\)'"):
        moe_route.fused_moe(case["x"], case["w1"], case["w2"], case["topk_weights"],
                            case["topk_ids"], activation="relu(limit=1)")  # fmt: skip
    maps = moe_route.build_routing_maps(case["topk_ids"], 3)
    with pytest.raises(ValueError, match="activation='swish'"):
        moe_route.grouped_gemm(case["x"], case["w1"], maps, activation="swish", gather=True)
    with pytest.raises(ValueError, match=r"limit=-1.0"):
        moe_route.MoELayer(8, 4, 3, 2, activation="swiglu(limit=-1)")


# ----------------------------------------------------------------------------- the reference
def _gate_up_grid(spec, dtype=torch.float64):
    """``(gate, up)`` covering both sides of the bounds, the bounds exactly, and zero."""
    lim = spec.limit if spec.limit is not None else 2.0
    pts = [-2 * lim, -lim, -lim / 2, -1e-3, 0.0, 1e-3, lim / 3, lim, 1.5 * lim, 3.0]
    gate = torch.tensor(pts, dtype=dtype).repeat_interleave(len(pts))
    up = torch.tensor(pts, dtype=dtype).repeat(len(pts))
    return gate, up


def _join(gate, up, layout):
    if layout == "concat":
        return torch.cat([gate[None], up[None]], dim=-1)
    return torch.stack([gate, up], dim=-1).reshape(1, -1)


@pytest.mark.parametrize("layout", ["concat", "interleaved"])
@pytest.mark.parametrize("spec", [GPT_OSS, *(v[0] for v in VARIANTS.values())],
                         ids=["gpt-oss", *IDS])  # fmt: skip
def test_reference_backward_is_autograd_at_the_bounds(spec, layout):
    gate, up = _gate_up_grid(spec)
    z = _join(gate, up, layout) if spec.gated else gate[None]
    dh = torch.randn(1, gate.numel(), generator=torch.Generator().manual_seed(1),
                     dtype=torch.float64)  # fmt: skip
    z = z.requires_grad_(True)
    (want,) = torch.autograd.grad(activation_reference(z, spec, layout), z, dh)
    got = activation_backward_reference(z.detach(), dh, spec, layout)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-14)


def test_reference_is_the_formula_of_gpt_oss():
    """The issue's formula, scalar by scalar in Python floats (not torch's clamp)."""
    gate, up = _gate_up_grid(GPT_OSS)
    h = activation_reference(_join(gate, up, "interleaved"), GPT_OSS, "interleaved")[0]
    for g, u, got in zip(gate.tolist(), up.tolist(), h.tolist(), strict=True):
        g, u = min(g, 7.0), max(-7.0, min(u, 7.0))
        want = (u + 1.0) * g / (1.0 + math.exp(-1.702 * g))
        assert got == pytest.approx(want, rel=1e-14, abs=1e-300)


def _inkling2_formula(gate, up, gate_cap=4.0, up_cap=25.0):
    """transformers' Inkling2SoftcappedSwiGLU.forward, written out with torch ops."""
    return (torch.tanh(gate / gate_cap) * gate_cap * torch.sigmoid(gate)
            * (torch.tanh(up / up_cap) * up_cap))  # fmt: skip


@pytest.mark.parametrize("layout", ["concat", "interleaved"])
def test_reference_is_the_formula_of_inkling2(layout):
    """The soft-capped SwiGLU against its formula in float64 (values through both caps, far
    beyond them, and zero), forward and, by autograd through the formula, backward."""
    pts = [-80.0, -30.0, -6.0, -1.0, -1e-3, 0.0, 1e-3, 0.5, 2.5, 4.0, 9.0, 25.0, 60.0]
    gate = torch.tensor(pts, dtype=torch.float64).repeat_interleave(len(pts))
    up = torch.tensor(pts, dtype=torch.float64).repeat(len(pts))
    z = _join(gate, up, layout).requires_grad_(True)
    g, u = (z[0, : gate.numel()], z[0, gate.numel() :]) if layout == "concat" else (
        z[0, 0::2], z[0, 1::2])  # fmt: skip
    want = _inkling2_formula(g, u)
    got = activation_reference(z, INKLING2, layout)[0]
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)
    dh = torch.randn(gate.numel(), generator=torch.Generator().manual_seed(3),
                     dtype=torch.float64)  # fmt: skip
    (dz,) = torch.autograd.grad(want, z, dh)
    got_dz = activation_backward_reference(z.detach(), dh[None], INKLING2, layout)
    torch.testing.assert_close(got_dz, dz, rtol=1e-13, atol=1e-14)
    assert (dz[0, :] != 0).float().mean() > 0.5  # not a grid of saturated zeros


def test_reference_matches_transformers_inkling2_module():
    """The spec's reference against transformers' own Inkling2SoftcappedSwiGLU (which computes
    in float32): the formula moe_route implements is the one transformers runs."""
    modeling = pytest.importorskip("transformers.models.inkling2.modeling_inkling2")
    import types

    config = types.SimpleNamespace(mlp_gate_softcap=4.0, mlp_up_softcap=25.0)
    act = modeling.Inkling2SoftcappedSwiGLU(config)
    g = torch.Generator().manual_seed(4)
    gate, up = (torch.randn(2, 64, generator=g, dtype=torch.float64) * 12 for _ in range(2))
    with torch.no_grad():
        theirs = act(gate, up)  # float32 inside, float64 out
    ours = activation_reference(torch.cat([gate, up], dim=-1), INKLING2, "concat")
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-5)
    ours_other = activation_reference(torch.cat([gate, up], dim=-1), GPT_OSS, "concat")
    assert not torch.allclose(ours_other, theirs, rtol=1e-3)  # the check can fail


def test_reference_gradient_convention_at_the_bounds():
    """torch.clamp's: the gradient passes at gate == limit and up == ±limit, not beyond."""
    spec = moe_route.activation("swiglu", limit=1.0)
    gate = torch.tensor([1.0, 1.0 + 2**-40, 0.5, 0.5, 0.5, 0.5], dtype=torch.float64)
    up = torch.tensor([0.5, 0.5, 1.0, -1.0, 1.0 + 2**-40, -1.0 - 2**-40], dtype=torch.float64)
    dz = activation_backward_reference(_join(gate, up, "concat"), torch.ones(1, 6), spec)[0]
    d_gate, d_up = dz[:6], dz[6:]
    assert d_gate[0] > 0 and d_gate[1] == 0  # at and beyond the gate's bound
    assert (d_up[2:4] != 0).all() and (d_up[4:] == 0).all()  # at and beyond ±limit


# ----------------------------------------------------------------------------- Triton math alone
@triton.jit
def _math_kernel(gate_ptr, up_ptr, dh_ptr, h_ptr, dg_ptr, du_ptr, N, ACT: tl.constexpr,
                 ALPHA: tl.constexpr, LIMIT: tl.constexpr, UP_OFFSET: tl.constexpr,
                 GATE_SOFTCAP: tl.constexpr, UP_SOFTCAP: tl.constexpr, GATED: tl.constexpr,
                 BLOCK: tl.constexpr):  # fmt: skip
    i = tl.arange(0, BLOCK)
    m = i < N
    g = tl.load(gate_ptr + i, mask=m, other=0.0)
    dh = tl.load(dh_ptr + i, mask=m, other=0.0)
    if GATED:
        u = tl.load(up_ptr + i, mask=m, other=0.0)
        h = gated_forward(g, u, ACT, ALPHA, LIMIT, UP_OFFSET, GATE_SOFTCAP, UP_SOFTCAP)
        dg, du = gated_backward(g, u, dh, ACT, ALPHA, LIMIT, UP_OFFSET, GATE_SOFTCAP, UP_SOFTCAP)
        tl.store(du_ptr + i, du, mask=m)
    else:
        h = plain_forward(g, ACT)
        dg = plain_backward(g, dh, ACT)
    tl.store(h_ptr + i, h, mask=m)
    tl.store(dg_ptr + i, dg, mask=m)


def _assert_close_to(got, want, dtype, what):
    eps = torch.finfo(dtype).eps
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got.double()), nan), f"{what}: NaN pattern differs"
    err = (got.double() - want).abs()[~nan]
    bound = 32 * eps * (want.abs()[~nan] + want.abs()[~nan].max())
    assert (err <= bound).all(), f"{what}: max error {err.max():.3g} over the bound"
    exact_zero = want == 0
    assert (got[exact_zero] == 0).all(), f"{what}: not exactly zero where torch's is"


@pytest.mark.skipif(not TRITON_OK, reason="Triton kernels need a CUDA device or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("spec", [GPT_OSS, INKLING2, *(v[0] for v in VARIANTS.values())],
                         ids=["gpt-oss", "inkling2", *IDS])  # fmt: skip
def test_triton_math_matches_autograd(spec, dtype):
    """The four entry points on a grid through the bounds (and NaN), against autograd; the
    soft caps' tanh on both sides of its polynomial's range (``|x/c| < 0.625``) and beyond
    saturation."""
    gate, up = _gate_up_grid(spec)
    if spec.up_softcap is not None:
        # Points scaled by the caps: tanh's two ranges and saturation in float32 (not beyond
        # |x/c| = 19, where float64's tanh rounds to 1 and the oracle's 1 - tanh² to 0).
        r = torch.tensor([-15.0, -3.0, -0.7, -0.6, 0.01, 0.3, 0.62, 0.63, 1.5, 12.0],
                         dtype=gate.dtype)  # fmt: skip
        gate = torch.cat([gate, (r * (spec.gate_softcap or 1.0)).repeat_interleave(len(r))])
        up = torch.cat([up, (r * spec.up_softcap).repeat(len(r))])
    gate, up = (
        torch.cat([gate, gate.new_tensor([math.nan, 0.5])]),
        torch.cat([up, up.new_tensor([0.5, math.nan])]),
    )
    gate, up = gate.to(dtype), up.to(dtype)  # the grid is exact in float32 too
    dh = torch.randn(gate.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    n = gate.numel()
    dev = [t.to(DEVICE) for t in (gate, up, dh)]
    h, dg, du = (torch.full((n,), 123.0, dtype=dtype, device=DEVICE) for _ in range(3))
    act, alpha, limit, off, gate_cap, up_cap = spec.triton_constexprs()
    _math_kernel[(1,)](*dev, h, dg, du, n, ACT=act, ALPHA=alpha, LIMIT=limit, UP_OFFSET=off,
                       GATE_SOFTCAP=gate_cap, UP_SOFTCAP=up_cap, GATED=spec.gated,
                       BLOCK=triton.next_power_of_2(n))  # fmt: skip
    z = torch.stack([gate, up], 1).reshape(1, -1) if spec.gated else gate[None]
    z = z.double().requires_grad_(True)
    ref = activation_reference(z, spec, "interleaved")
    (dz,) = torch.autograd.grad(ref, z, dh.double()[None])
    _assert_close_to(h.cpu(), ref.detach()[0], dtype, "h")
    if spec.gated:
        _assert_close_to(dg.cpu(), dz[0, 0::2], dtype, "d gate")
        _assert_close_to(du.cpu(), dz[0, 1::2], dtype, "d up")
    else:
        _assert_close_to(dg.cpu(), dz[0], dtype, "dx")


# ----------------------------------------------------------------------------- GEMM1 epilogue
@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("variant", IDS)
def test_gemm1_epilogue(variant, dtype):
    spec, layout = VARIANTS[variant]
    a, w, b, maps = gemm_case(21, 2, 4, 27, 13, spec, dtype=dtype, bias=True, gather=True,
                              seed=7)  # fmt: skip
    out = launch(a, w, maps, b, activation=spec, layout=layout, gather=True)
    ref = gemm_reference(a, w, maps, b, activation=spec, layout=layout, gather=True)
    moe_cases.assert_matches(out, ref, TOL[dtype], verbose=True)
    moe_cases.assert_dropped_rows_zero(out, maps)
    z = gemm_reference(a, w, maps, b, gather=True)
    for bound in (spec.limit, spec.gate_softcap, spec.up_softcap):
        if bound is not None:  # the case reaches the clamp and the caps, or it tests nothing
            assert (z.abs() > bound).float().mean() > 0.1


# ----------------------------------------------------------------------------- training
BACKENDS = ["reference", pytest.param("triton", marks=needs_interpreter)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("variant", ["softcapped-swiglu", "softcapped-swiglu-clamped"])
def test_fused_moe_forward(variant, dtype, backend):
    """fused_moe's forward (GEMM1's epilogue in the chain, biases, dropped slots) against the
    float64 reference of the whole chain."""
    spec, layout = VARIANTS[variant]
    case = moe_case(11, 2, 3, 16, 8, activation=spec, dtype=dtype, b1=True, b2=True, seed=12)
    out = moe_cases.run_moe(case, activation=spec, layout=layout, backend=backend)
    want = moe_cases.moe_expected(case, activation=spec, layout=layout)
    moe_cases.assert_matches(out, want, TOL[dtype], verbose=True)


@needs_interpreter
@pytest.mark.parametrize("variant", ["softcapped-swiglu", "softcapped-swiglu-clamped"])
def test_decode_path(variant, monkeypatch):
    """One token: fused_moe's decode path, whose own GEMM1 kernel applies the activation
    (``moe_route/kernels/triton/decode.py``)."""
    from moe_route.kernels.triton.decode import DecodeLaunch

    calls, real = [], DecodeLaunch.__call__
    monkeypatch.setattr(DecodeLaunch, "__call__",
                        lambda *a, **k: calls.append(1) or real(*a, **k))  # fmt: skip
    spec, layout = VARIANTS[variant]
    case = moe_case(1, 4, 6, 40, 24, activation=spec, b1=True, b2=True, bias="TH", drop=0.25,
                    seed=3)  # fmt: skip
    out = moe_cases.run_moe(case, activation=spec, layout=layout, backend="triton")
    assert calls  # the decode path ran
    want = moe_cases.moe_expected(case, activation=spec, layout=layout)
    moe_cases.assert_matches(out, want, TOL[torch.float32], verbose=True)


@needs_interpreter
def test_fp8_experts_forward():
    """The quantised GEMM1's epilogue (``moe_route/kernels/triton/quant.py``) on FP8 experts
    against the torch backend on the same codes and scales (one algorithm, so float32
    rounding apart; the float64 reference of unquantised weights is 6 % away)."""
    spec, layout = VARIANTS["softcapped-swiglu"]
    case = moe_case(9, 2, 3, 128, 128, activation=spec, seed=13)
    q1, s1 = moe_route.quantize_experts(case["w1"], "fp8")
    q2, s2 = moe_route.quantize_experts(case["w2"], "fp8")
    args = (case["x"], q1, q2, case["topk_weights"], case["topk_ids"])
    kw = dict(activation=spec, gate_up_layout=layout, quant="fp8", w1_scale=s1, w2_scale=s2)
    got = moe_route.fused_moe(*args, **kw, backend="triton")
    want = moe_route.fused_moe(*args, **kw, backend="torch")
    moe_cases.assert_matches(got, want, 1e-5, verbose=True)


NAMES_GRAD = ("x", "w1", "w2", "topk_weights", "b1", "b2")
# As tests/test_training.py: the backward rounds z, h and dz to float16 before the next product.
GRAD_TOL = {torch.float32: 1e-5, torch.float16: 4e-3}


def _oracle_grads(case, dout, spec, layout):
    """autograd through the float64 reference; dropped slots' NaN weights zeroed for it."""
    leaves = {n: f64(case[n]).nan_to_num(0.0).requires_grad_(True) for n in NAMES_GRAD}
    out = moe_forward_reference(
        leaves["x"], leaves["w1"], leaves["w2"], leaves["topk_weights"], case["topk_ids"],
        activation=spec, gate_up_layout=layout, b1=leaves["b1"], b2=leaves["b2"],
    )  # fmt: skip
    return dict(zip(NAMES_GRAD, torch.autograd.grad(out, list(leaves.values()), dout.double()),
                    strict=True))  # fmt: skip


def _grads(case, dout, spec, layout, backend):
    leaves = {n: case[n].clone().requires_grad_(True) for n in NAMES_GRAD}
    out = moe_route.fused_moe(
        leaves["x"], leaves["w1"], leaves["w2"], leaves["topk_weights"], case["topk_ids"],
        activation=spec, gate_up_layout=layout, b1=leaves["b1"], b2=leaves["b2"],
        backend=backend,
    )  # fmt: skip
    return dict(zip(NAMES_GRAD, torch.autograd.grad(out, list(leaves.values()), dout),
                    strict=True))  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("variant", ["clamped-swiglu", "swiglu-limit", "geglu_tanh-limit-offset",
                                     "softcapped-swiglu-clamped"])  # fmt: skip
def test_training_gradients_at_the_bounds(variant, dtype, backend):
    """Gradients (the activation-backward epilogue on the Triton path) against autograd, with
    pre-activations exactly on the bounds: there the gradient passes, beyond it is 0."""
    spec, layout = VARIANTS[variant]
    case = moe_case(9, 2, 3, 16, 8, activation=spec, dtype=dtype, b1=True, b2=True, seed=3)
    on, beyond = pin_at_the_bounds(case, spec, layout)
    dout = torch.randn(9, 16, generator=torch.Generator().manual_seed(4)).to(dtype)
    got, want = _grads(case, dout, spec, layout, backend), _oracle_grads(case, dout, spec, layout)
    assert (want["b1"][:, on] != 0).all() and (want["b1"][:, beyond] == 0).all()
    for name in NAMES_GRAD:
        w = want[name].shape[-1]
        moe_cases.assert_matches(got[name].reshape(-1, w), want[name].reshape(-1, w),
                                 GRAD_TOL[dtype], what=f"d{name}", floor=1.0)  # fmt: skip
    assert (got["b1"][:, beyond] == 0).all()
    moe_cases.assert_matches(got["b1"][:, on], want["b1"][:, on], GRAD_TOL[dtype], what="on")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["relu2", "gelu_tanh", "geglu_tanh", "softcapped-swiglu"])
def test_training_gradients(variant, backend):
    spec, layout = VARIANTS[variant]
    case = moe_case(9, 2, 3, 16, 8, activation=spec, b1=True, b2=True, seed=5)
    dout = torch.randn(9, 16, generator=torch.Generator().manual_seed(6))
    got, want = _grads(case, dout, spec, layout, backend), _oracle_grads(case, dout, spec, layout)
    for name in NAMES_GRAD:
        w = want[name].shape[-1]
        moe_cases.assert_matches(got[name].reshape(-1, w), want[name].reshape(-1, w), 1e-5,
                                 what=f"d{name}", floor=1.0)  # fmt: skip


# Every variant on the reference; on the interpreter (about 3.5 s each) one gated variant of
# each kind with its parameters, and a plain one (test_training_gradients* cover the rest there).
GRADCHECK = [(v, "reference") for v in IDS] + [
    pytest.param(v, "triton", marks=needs_interpreter)
    for v in ("clamped-swiglu", "geglu_tanh-limit-offset", "relu2", "softcapped-swiglu")
]


@pytest.mark.parametrize(("variant", "backend"), GRADCHECK)
def test_gradcheck_float64(variant, backend):
    """float64 gradcheck of fused_moe (the fused training backward) and of grouped_gemm alone
    (its own backward recomputes z). Random values stay far from the kinks."""
    spec, layout = VARIANTS[variant]
    case = moe_case(5, 2, 3, 6, 4, activation=spec, dtype=torch.float64, b1=True, b2=True,
                    seed=11)  # fmt: skip
    ids = case["topk_ids"]
    leaves = [case[n].double().nan_to_num(0.0).requires_grad_(True) for n in NAMES_GRAD]

    def moe(x, w1, w2, tw, b1, b2):
        return moe_route.fused_moe(x, w1, w2, tw, ids, activation=spec, gate_up_layout=layout,
                                   b1=b1, b2=b2, backend=backend)  # fmt: skip

    assert torch.autograd.gradcheck(moe, leaves, fast_mode=True)
    maps = moe_route.build_routing_maps(ids, 3)

    def gemm1(x, w1, b1):
        return moe_route.grouped_gemm(x, w1, maps, bias=b1, activation=spec, gather=True,
                                      gate_up_layout=layout, backend=backend)  # fmt: skip

    assert torch.autograd.gradcheck(gemm1, [leaves[0], leaves[1], leaves[4]], fast_mode=True)


# ----------------------------------------------------------------------------- MoELayer
@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_with_a_spec(backend):
    """MoELayer with gpt-oss's clamped SwiGLU (routed and shared experts) against the layer's
    math written out with the reference ops."""
    spec = moe_route.activation("swiglu", alpha=1.702, limit=0.8, up_offset=1.0)
    torch.manual_seed(0)
    layer = moe_route.MoELayer(12, 6, 4, 2, activation=spec, gate_up_layout="interleaved",
                               bias=True, num_shared_experts=1, backend=backend)  # fmt: skip
    assert layer.activation == str(spec) and str(spec) in repr(layer)
    assert layer.w1.shape == (4, 12, 12) and layer.shared_w1.shape == (12, 12)
    with torch.no_grad():
        layer.b1.normal_(0, 0.5)
    x = torch.randn(7, 12)
    out = layer(x)
    h = activation_reference(x @ layer.shared_w1.T, spec, "interleaved")
    want = moe_forward_reference(
        x.double(), layer.w1.double(), layer.w2.double(), out.topk_weights.double(),
        out.topk_ids, activation=spec, gate_up_layout="interleaved", b1=layer.b1.double(),
        b2=layer.b2.double(), bias=(h @ layer.shared_w2.T).double(),
    )  # fmt: skip
    moe_cases.assert_matches(out.output, want, 1e-5)
    out.output.square().sum().backward()
    assert all(p.grad is not None for p in (layer.w1, layer.b1, layer.shared_w1))


def test_variants_and_the_older_tests_cover_every_name():
    older = {"swiglu", "geglu", "silu", "gelu", "relu", "identity"}  # moe_cases.ACT_LAYOUTS
    assert {spec.name for spec, _ in VARIANTS.values()} | older == set(NAMES)


def test_layer_loads_per_expert_modules_with_biases():
    """load_experts_ with a clamped SwiGLU spec (gpt-oss-like biases, interleaved rows)."""
    spec = moe_route.activation("swiglu", alpha=1.702, limit=0.8, up_offset=1.0)
    torch.manual_seed(1)

    def mlp():
        lin = torch.nn.Linear
        return torch.nn.ModuleDict(
            dict(gate_proj=lin(12, 6), up_proj=lin(12, 6), down_proj=lin(6, 12))
        )

    mlps = [mlp() for _ in range(4)]
    layer = moe_route.MoELayer.from_experts(mlps, 2, activation=spec, backend="reference",
                                            gate_up_layout="interleaved")  # fmt: skip
    x = torch.randn(5, 12)
    for e, m in enumerate(mlps):
        gate, up = m["gate_proj"](x).clamp(max=0.8), m["up_proj"](x).clamp(-0.8, 0.8)
        want = m["down_proj"]((up + 1) * gate * torch.sigmoid(1.702 * gate))
        z = x @ layer.w1[e].T + layer.b1[e]
        got = activation_reference(z, spec, "interleaved") @ layer.w2[e].T + layer.b2[e]
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_compile_fullgraph_with_a_spec():
    """The spec crosses the custom ops as its string: one graph, forward and backward."""
    spec, layout = VARIANTS["clamped-swiglu"]
    case = moe_case(8, 2, 3, 16, 8, activation=spec, seed=9)
    ids = case["topk_ids"]
    leaves = [case[n].nan_to_num(0.0).clone().requires_grad_(True) for n in NAMES_GRAD[:4]]

    def loss(x, w1, w2, tw):
        return moe_route.fused_moe(x, w1, w2, tw, ids, activation=spec, gate_up_layout=layout,
                                   backend="reference").square().sum()  # fmt: skip

    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(loss, fullgraph=True)(*leaves), leaves)
    want = torch.autograd.grad(loss(*leaves), leaves)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
