"""Constants, case builders and checks shared by tests/test_grouped_gemm.py,
tests/test_fused_moe.py (both on the CPU) and tests/test_gpu_moe.py (CUDA).

The builders default to the CPU cases (float64 draws from a CPU generator, 20 % of the slots
dropped, the torch backend); the GPU file binds its own device, generator, drop rate and
dtype (see its ``gemm_case`` / ``moe_case``). Values that differ between the files (TF32_TOL,
tile sizes, occupancy patterns) stay in them.

Imported by the test modules only, so tests/conftest.py (which sets TRITON_INTERPRET before
anything imports moe_route or triton) has already run.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import moe_route
from moe_route import arch
from moe_route.activations import as_activation
from moe_route.reference import (
    expand_rows_reference,
    finalize_moe_routing_reference,
    grouped_gemm_reference,
    moe_forward_reference,
    routing_maps_reference,
)

NAN = float("nan")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
GATED = ("swiglu", "geglu")
ACT_LAYOUTS = [
    ("swiglu", "concat"),
    ("swiglu", "interleaved"),
    ("geglu", "concat"),
    ("geglu", "interleaved"),
    ("silu", "concat"),
    ("gelu", "concat"),
    ("relu", "concat"),
    ("identity", "concat"),
]
ACT_IDS = [f"{a}-{lay}" if a in GATED else a for a, lay in ACT_LAYOUTS]
# The activation variants beyond ACT_LAYOUTS: name -> (spec, gate/up layout). The limits bite at
# O(1) values and are exact in fp16 and bf16 (a bound in the kernel's dtype is the same number as
# in float64, so kernel and oracle agree on what lies exactly on it).
ACT_VARIANTS = {
    "clamped-swiglu": (moe_route.activation("swiglu", alpha=1.702, limit=0.75, up_offset=1.0),
                       "interleaved"),
    "swiglu-limit": (moe_route.activation("swiglu", limit=0.5), "concat"),
    "geglu_tanh": (as_activation("geglu_tanh"), "concat"),
    "geglu_tanh-limit-offset": (as_activation("geglu_tanh(limit=0.625, up_offset=-0.25)"),
                                "interleaved"),
    "relu2": (as_activation("relu2"), "concat"),
    "gelu_tanh": (as_activation("gelu_tanh"), "concat"),
    # Inkling2's soft-capped SwiGLU, with caps that bend O(1) values; then every parameter at
    # once (the clamp before the caps, alpha in the sigmoid, the offset after the up cap).
    "softcapped-swiglu": (moe_route.activation("swiglu", gate_softcap=0.75, up_softcap=1.5),
                          "concat"),
    "softcapped-swiglu-clamped": (
        as_activation("swiglu(alpha=1.702, limit=1.25, up_offset=1.0, gate_softcap=1.0, "
                      "up_softcap=0.5)"), "interleaved"),
}  # fmt: skip
# finalize path -> the fused_moe arguments that select it
PATHS = {
    "standalone": dict(finalize="standalone"),
    "fused": dict(finalize="fused"),  # ordered epilogue reduction, deterministic
    "fused_atomic": dict(finalize="fused", deterministic=False),
}
BIASES = {
    "none": dict(),
    "b1": dict(b1=True),
    "b2": dict(b2=True),
    "bias_H": dict(bias="H"),
    "all_TH": dict(b1=True, b2=True, bias="TH"),
}
BIAS_SHAPES = {"H": lambda T, H: (H,), "TH": lambda T, H: (T, H)}
ARG_ORDER = ("x", "w1", "w2", "topk_weights", "topk_ids")

INTERPRETED = arch.triton_interpreter_enabled() and not torch.cuda.is_available()
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED,
    reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1 (conftest sets it when there "
    "is no CUDA device); tests/test_gpu_moe.py covers the compiled kernels",
)
BF16_INTERPRETER = (
    "tl.dot with bf16 operands returns garbage under the triton 3.5.1 interpreter; "
    "bf16 kernels are tested on CUDA in tests/test_gpu_moe.py"
)


# ----------------------------------------------------------------------------- random inputs
def make_ids(T, K, E, *, drop=0.2, seed=0):
    """``[T, K]`` int64 ids on the CPU, distinct per token (as top-k gives), each slot dropped
    with probability ``drop``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]
    if drop:
        ids = ids.masked_fill(torch.rand(T, K, generator=g) < drop, -1)
    return ids


def rand(*shape, dtype=torch.float32, scale=1.0, seed=0):
    """CPU normal draws in float64, scaled, then rounded to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def f64(t):
    return None if t is None else t.double()


def n_rows(activation, inter):
    return 2 * inter if as_activation(activation).gated else inter


def expand_reference(x, maps):
    return expand_rows_reference(
        x, maps.expanded_dest_row_to_expanded_source_row, maps.expert_first_token_offset
    )


# ----------------------------------------------------------------------------- grouped GEMM
def gemm_case(T, K, E, H, inter, activation, *, dtype=torch.float32, bias=False, gather=False,
              drop=0.2, ids=None, seed=0, device="cpu", rand=rand, maps_backend="torch",
              expand=expand_reference):  # fmt: skip
    """Operands of one grouped GEMM1: ``a`` is ``x [T, H]`` (gather) or ``x_perm [T*K, H]``."""
    ids = make_ids(T, K, E, drop=drop, seed=seed).to(device) if ids is None else ids.to(device)
    maps = moe_route.build_routing_maps(ids, E, backend=maps_backend)
    x = rand(T, H, dtype=dtype, seed=seed + 1)
    w = rand(E, n_rows(activation, inter), H, dtype=dtype, scale=H**-0.5, seed=seed + 2)
    b = rand(E, n_rows(activation, inter), dtype=dtype, scale=0.5, seed=seed + 3) if bias else None
    a = x if gather else expand(x, maps)
    return a, w, b, maps


def gemm_reference(a, w, maps, bias=None, *, activation="identity", layout="concat",
                   gather=False):  # fmt: skip
    """float64 oracle: ``act(a_perm[d] @ w[e].T + bias[e])``, dropped rows zero."""
    off = maps.expert_first_token_offset
    a64 = a.double()
    if gather:
        a64 = expand_rows_reference(a64, maps.expanded_dest_row_to_expanded_source_row, off)
    return grouped_gemm_reference(
        a64, w.double(), off, f64(bias), activation=activation, gate_up_layout=layout
    )


def launch(a, w, maps, bias=None, *, activation="identity", layout="concat", gather=False,
           config=None, use_tma=None, out=None, **kw):  # fmt: skip
    """Run the Triton launcher into a NaN-poisoned (or given) ``out`` and return it.

    ``config``: a ``GemmConfig``, or its tile fields ``(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
    num_warps, num_stages)``; ``None`` takes the library's choice for this shape
    (:func:`moe_route.tuning.gemm_config`). ``use_tma``: ``None`` keeps the library's choice
    (SM90+ and 16-bit), a bool forces it."""
    from moe_route import tuning
    from moe_route.kernels.triton.gemm_mainloop import GemmConfig
    from moe_route.kernels.triton.grouped_gemm import grouped_gemm_triton
    from moe_route.plan import epilogue_for

    M = maps.num_expanded_rows
    epilogue = epilogue_for(activation, layout)
    n_out = w.shape[1] // 2 if epilogue.gated else w.shape[1]
    rows_per_expert = tuning.token_bucket(M) / w.shape[0]
    cc = arch.compute_capability(a.device)
    chosen = tuning.gemm_config(rows_per_expert, epilogue.gated, a.dtype, cc)
    if config is None:
        config = chosen
    elif not isinstance(config, GemmConfig):
        config = GemmConfig(*config, use_tma=chosen.use_tma)
    if use_tma is not None:
        config = dataclasses.replace(config, use_tma=use_tma)
    if out is None:
        out = torch.full((M, n_out), NAN, dtype=a.dtype, device=a.device)
    grouped_gemm_triton(
        a, w, maps.expert_first_token_offset, out, config, epilogue=epilogue, bias=bias,
        dest_to_src=maps.expanded_dest_row_to_expanded_source_row if gather else None,
        num_rows=M, **kw,
    )  # fmt: skip
    return out


def strided_weight(w, how):
    """The values of ``w [E, N, Kd]`` as a non-contiguous view (never a copy of ``w`` itself)."""
    E, N, Kd = w.shape
    if how == "transposed":  # [E, Kd, N] storage, as a model that keeps W.T would hold it
        view = w.transpose(1, 2).contiguous().transpose(1, 2)
    elif how == "sliced":  # a window of a bigger tensor: every stride and the offset are odd
        big = torch.full((E + 2, 2 * N + 1, Kd + 3), NAN, dtype=w.dtype, device=w.device)
        big[1 : E + 1, 1 : 2 * N + 1 : 2, 2 : Kd + 2] = w
        view = big[1 : E + 1, 1 : 2 * N + 1 : 2, 2 : Kd + 2]
    elif how == "expert_major_last":  # [N, Kd, E] storage, permuted
        view = w.permute(1, 2, 0).contiguous().permute(2, 0, 1)
    else:
        raise ValueError(how)
    assert not view.is_contiguous()
    assert torch.equal(view, w)
    return view


# ----------------------------------------------------------------------------- MoE layer
def moe_case(T, K, E, H, inter, *, activation="swiglu", dtype=torch.float32, b1=False,
             b2=False, bias=None, drop=0.2, ids=None, seed=0, device="cpu", rand=rand):  # fmt: skip
    """Inputs of one MoE layer; ``bias`` is None, ``"H"`` or ``"TH"``. Dropped slots get NaN
    router weights (never read)."""
    ids = make_ids(T, K, E, drop=drop, seed=seed).to(device) if ids is None else ids.to(device)
    n1 = n_rows(activation, inter)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    tw = torch.softmax(torch.randn(T, K, generator=g, device=device), dim=-1)
    tw = tw.masked_fill(ids < 0, NAN)
    return dict(
        x=rand(T, H, dtype=dtype, seed=seed + 2),
        w1=rand(E, n1, H, dtype=dtype, scale=H**-0.5, seed=seed + 3),
        w2=rand(E, H, inter, dtype=dtype, scale=inter**-0.5, seed=seed + 4),
        topk_weights=tw,
        topk_ids=ids,
        b1=rand(E, n1, dtype=dtype, scale=0.5, seed=seed + 5) if b1 else None,
        b2=rand(E, H, dtype=dtype, scale=0.5, seed=seed + 6) if b2 else None,
        bias=None if bias is None else rand(*BIAS_SHAPES[bias](T, H), dtype=dtype, seed=seed + 7),
    )


def run_moe(case, *, activation="swiglu", layout="concat", **kw):
    c = dict(case)
    args = [c.pop(k) for k in ARG_ORDER]
    return moe_route.fused_moe(*args, activation=activation, gate_up_layout=layout, **c, **kw)


def moe_expected(case, *, activation="swiglu", layout="concat"):
    """float64 reference of the whole chain (no intermediate rounding)."""
    c = case
    return moe_forward_reference(
        f64(c["x"]), f64(c["w1"]), f64(c["w2"]), f64(c["topk_weights"]), c["topk_ids"],
        activation=activation, gate_up_layout=layout, b1=f64(c["b1"]), b2=f64(c["b2"]),
        bias=f64(c["bias"]),
    )  # fmt: skip


def finalize_scale(case, *, activation="swiglu", layout="concat"):
    """``|bias[t]| + sum_k |w[t,k]| |y[dest]|`` in float64: the scale of finalize's rounding."""
    c = case
    s2d, d2s, efs, off = routing_maps_reference(c["topk_ids"], c["w1"].shape[0])
    x_perm = expand_rows_reference(f64(c["x"]), d2s, off)
    h = grouped_gemm_reference(x_perm, f64(c["w1"]), off, f64(c["b1"]), activation=activation,
                               gate_up_layout=layout)  # fmt: skip
    y = grouped_gemm_reference(h, f64(c["w2"]), off, f64(c["b2"]))
    babs = None if c["bias"] is None else f64(c["bias"]).abs()
    return finalize_moe_routing_reference(y.abs(), f64(c["topk_weights"]).abs(), s2d, efs, babs)


def pin_at_the_bounds(case, spec, layout):
    """Pin some pre-activation columns of every expert exactly on a clamped activation's bounds:
    zero rows of ``w1`` and a ``b1`` of ``limit`` (gate), ``±limit`` (up), or beyond them.

    Returns ``(rows of z on the bounds, rows beyond)``: the gradient passes at the first and is
    zero at the second (torch.clamp's convention)."""
    inter = case["w2"].shape[2]
    rows = {"gate": lambda j: j, "up": lambda j: inter + j}
    if layout == "interleaved":
        rows = {"gate": lambda j: 2 * j, "up": lambda j: 2 * j + 1}
    lim = spec.limit
    for part, j, value in (("gate", 0, lim), ("up", 1, lim), ("up", 2, -lim),
                           ("gate", 3, lim + 1.0), ("up", 3, -lim - 1.0)):  # fmt: skip
        r = rows[part](j)
        case["w1"][:, r] = 0.0
        case["b1"][:, r] = value
    return [rows["gate"](0), rows["up"](1), rows["up"](2)], [rows["gate"](3), rows["up"](3)]


# ----------------------------------------------------------------------------- checks
def assert_matches(out, ref, tol, *, what="output", floor=0.0, device="cpu", verbose=False):
    """Relative Frobenius error <= tol and no element off by more than 8*tol*(|ref| + rms).

    ``floor`` bounds the reference norm from below, for random cases whose reference may
    nearly vanish (e.g. relu of mostly negative values) while the inputs are O(1). Compared on
    ``device`` (None: ``out``'s own); ``verbose`` puts the first far-off pair in the message."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    dev = out.device if device is None else device
    o, r = out.detach().double().to(dev), ref.detach().double().to(dev)
    bad_rows = (~torch.isfinite(o)).any(dim=1).nonzero().flatten()[:8].tolist()
    assert not bad_rows, f"{what}: non-finite values in rows {bad_rows}"
    rnorm = max(r.norm().item(), floor)
    assert rnorm > 0, f"{what}: degenerate all-zero reference"
    rel = (o - r).norm().item() / rnorm
    assert rel <= tol, f"{what}: relative error {rel:.3g} > {tol:.3g}"
    rms = rnorm / max(r.numel(), 1) ** 0.5
    over = (o - r).abs() > 8 * tol * (r.abs() + rms)
    if verbose:
        assert not over.any(), (
            f"{what}: {int(over.sum())} elements far off, e.g. at {over.nonzero()[0].tolist()}: "
            f"{o[tuple(over.nonzero()[0])].item()!r} vs {r[tuple(over.nonzero()[0])].item()!r}"
        )
    assert not over.any(), f"{what}: {int(over.sum())} elements far off, first at " + str(
        over.nonzero()[0].tolist()
    )


def assert_dropped_rows_zero(out, maps, *, verbose=True):
    routed = int(maps.expert_first_token_offset[-1])
    tail = out[routed:]
    if verbose:
        assert torch.equal(tail, torch.zeros_like(tail)), (
            f"dropped rows [{routed}, {out.shape[0]}) are not exact zeros: {tail}"
        )
    assert torch.equal(tail, torch.zeros_like(tail)), f"dropped rows [{routed}:] not all zero"


def assert_paths_agree(a, b, scale, K, *, what="standalone vs fused", verbose=True):
    """float32 rounding of a K-term sum plus a bias, elementwise."""
    bound = (K + 2) * torch.finfo(torch.float32).eps * scale
    diff = (a.double() - b.double()).abs()
    over = diff > bound
    where = (
        f" (bound there {bound.reshape(-1)[diff.argmax()].item():.3g})" if verbose and over.any()
        else ""
    )  # fmt: skip
    assert not over.any(), (
        f"{what}: {int(over.sum())} elements differ by more than float32 rounding, max "
        f"{diff.max().item():.3g}{where}"
    )
