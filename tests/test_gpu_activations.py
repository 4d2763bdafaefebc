"""The activation variants (clamped SwiGLU family, tanh GELU, squared ReLU) on a CUDA device:
compiled Triton epilogues against the float64 reference at odd sizes, in bf16 / fp16 / fp32,
forward (grouped_gemm, fused_moe on every finalize path) and backward (the activation-backward
epilogue of fused_moe's training path), with pre-activations pinned exactly on the clamp
bounds, float64 gradcheck, and gpt-oss's own parameters at realistic magnitudes.

The CPU side (tests/test_activations.py) runs the same math through the interpreter, except
bf16 (the interpreter's bf16 ``tl.dot`` is wrong) and the compiled code generation.

Tolerances as tests/test_gpu_moe.py (forward: relative Frobenius error fp32 1e-5, fp16 2e-3,
bf16 1e-2) and tests/test_gpu_training.py (gradients: fp32 2e-5, fp16 4e-3, bf16 2.5e-2), with
the wide elementwise guard of ``moe_cases.assert_matches``.
"""

from __future__ import annotations

import functools

import moe_cases
import pytest
import torch
from moe_cases import ACT_VARIANTS, PATHS, TOL, f64, gemm_reference, moe_expected, run_moe

import moe_route
from moe_route.reference import moe_forward_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = "cuda"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DTYPE_IDS = ["bf16", "fp16", "fp32"]
GRAD_TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}
VARIANT_IDS = list(ACT_VARIANTS)
CLAMPED = [v for v in VARIANT_IDS if ACT_VARIANTS[v][0].limit is not None]
NAMES = ("x", "w1", "w2", "topk_weights", "b1", "b2")
GPT_OSS = moe_route.activation("swiglu", alpha=1.702, limit=7.0, up_offset=1.0)


def rand(*shape, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=CUDA) * scale).to(dtype)


gemm_case = functools.partial(moe_cases.gemm_case, drop=0.1, device=CUDA, rand=rand,
                              maps_backend="auto", expand=moe_route.expand_rows)  # fmt: skip
moe_case = functools.partial(moe_cases.moe_case, drop=0.1, device=CUDA, rand=rand)
assert_matches = functools.partial(moe_cases.assert_matches, device=None)


# ----------------------------------------------------------------------------- forward
@pytest.mark.parametrize("T", [1, 37, 199])
@pytest.mark.parametrize("variant", VARIANT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grouped_gemm_variants(dtype, variant, T):
    spec, layout = ACT_VARIANTS[variant]
    a, w, b, maps = gemm_case(T, 2, 8, 200, 136, spec, dtype=dtype, bias=True, gather=True,
                              seed=T)  # fmt: skip
    out = moe_route.grouped_gemm(a, w, maps, bias=b, activation=spec, gate_up_layout=layout,
                                 gather=True)  # fmt: skip
    ref = gemm_reference(a, w, maps, b, activation=spec, layout=layout, gather=True)
    assert_matches(out, ref, TOL[dtype])


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("variant", VARIANT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_fused_moe_variants(dtype, variant, path):
    spec, layout = ACT_VARIANTS[variant]
    case = moe_case(199, 4, 8, 200, 136, activation=spec, dtype=dtype, b1=True, b2=True,
                    bias="H", seed=3)  # fmt: skip
    out = run_moe(case, activation=spec, layout=layout, **PATHS[path])
    assert_matches(out, moe_expected(case, activation=spec, layout=layout), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gpt_oss_parameters_at_scale(dtype):
    """gpt-oss's constants with pre-activations of O(10), so that limit 7 clamps."""
    case = moe_case(257, 4, 16, 256, 192, activation=GPT_OSS, dtype=dtype, b1=True, b2=True,
                    seed=5)  # fmt: skip
    case["x"] = case["x"] * 8
    ref = moe_expected(case, activation=GPT_OSS, layout="interleaved")
    out = run_moe(case, activation=GPT_OSS, layout="interleaved")
    assert_matches(out, ref, TOL[dtype])


# ----------------------------------------------------------------------------- backward
def _grads(case, dout, spec, layout, **kw):
    leaves = {n: case[n].clone().requires_grad_(True) for n in NAMES}
    out = moe_route.fused_moe(
        leaves["x"], leaves["w1"], leaves["w2"], leaves["topk_weights"], case["topk_ids"],
        activation=spec, gate_up_layout=layout, b1=leaves["b1"], b2=leaves["b2"], **kw,
    )  # fmt: skip
    return dict(zip(NAMES, torch.autograd.grad(out, list(leaves.values()), dout), strict=True))


def _oracle(case, dout, spec, layout, monkeypatch=None, round_to=None):
    """float64 gradients; with ``round_to``, the pre-activation is rounded to that dtype before
    the activation (value only, the gradient passes straight through), as the kernel saves it:
    a clamp's gradient mask then comes from the same ``z`` as the kernel's. Without that, a
    ``z`` within half an ulp of a bound can sit inside in float64 and on/outside in bf16, and
    each such flip moves one ``dz`` element by the full local gradient."""
    if round_to is not None:
        from moe_route.reference import experts as ref_experts

        real = ref_experts.activation_reference

        def rounded(z, *args, **kw):
            return real(z + (z.to(round_to).to(z.dtype) - z).detach(), *args, **kw)

        # where moe_forward_reference's GEMM1 (grouped_gemm_reference) looks it up
        monkeypatch.setattr(ref_experts, "activation_reference", rounded)
    leaves = {n: f64(case[n]).nan_to_num(0.0).requires_grad_(True) for n in NAMES}
    out = moe_forward_reference(
        leaves["x"], leaves["w1"], leaves["w2"], leaves["topk_weights"], case["topk_ids"],
        activation=spec, gate_up_layout=layout, b1=leaves["b1"], b2=leaves["b2"],
    )  # fmt: skip
    return dict(zip(NAMES, torch.autograd.grad(out, list(leaves.values()), dout.double()),
                    strict=True))  # fmt: skip


@pytest.mark.parametrize("variant", VARIANT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_training_gradients(dtype, variant, monkeypatch):
    spec, layout = ACT_VARIANTS[variant]
    case = moe_case(199, 4, 8, 200, 136, activation=spec, dtype=dtype, b1=True, b2=True,
                    seed=7)  # fmt: skip
    beyond = []
    if spec.limit is not None:
        on, beyond = moe_cases.pin_at_the_bounds(case, spec, layout)
    dout = rand(199, 200, dtype=dtype, seed=8)
    got = _grads(case, dout, spec, layout)
    want = _oracle(case, dout, spec, layout, monkeypatch, dtype if spec.limit is not None else None)
    for name in NAMES:
        w = want[name].shape[-1]
        assert_matches(got[name].reshape(-1, w), want[name].reshape(-1, w), GRAD_TOL[dtype],
                       what=f"d{name}", floor=1.0)  # fmt: skip
    if beyond:
        assert (want["b1"][:, on] != 0).all()
        assert (got["b1"][:, beyond] == 0).all()


@pytest.mark.parametrize("variant", [*CLAMPED, "relu2", "gelu_tanh"])
def test_gradcheck_float64(variant):
    spec, layout = ACT_VARIANTS[variant]
    case = moe_case(7, 2, 3, 10, 6, activation=spec, dtype=torch.float64, b1=True, b2=True,
                    seed=9)  # fmt: skip
    ids = case["topk_ids"]
    leaves = [case[n].double().nan_to_num(0.0).requires_grad_(True) for n in NAMES]

    def f(x, w1, w2, tw, b1, b2):
        return moe_route.fused_moe(x, w1, w2, tw, ids, activation=spec, gate_up_layout=layout,
                                   b1=b1, b2=b2)  # fmt: skip

    assert torch.autograd.gradcheck(f, leaves, fast_mode=True)
