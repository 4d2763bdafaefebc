"""fused_moe forward + backward on a CUDA device: compiled Triton kernels against the gradients
of the float64 reference (``torch.autograd`` through ``moe_route.reference``) on the same
(rounded) inputs, in bf16 / fp16 / fp32, at odd sizes, with experts that hold no rows, dropped
slots and ``K = E``; determinism over 20 runs, CUDA graph capture, ``torch.compile``,
no host synchronisation, float64 ``gradcheck``.

Router weights of dropped slots are NaN for the kernels (the contract says they are never
read, so no gradient may be NaN) and zero for the reference (autograd through ``where``
would turn a NaN weight into a NaN gradient).

Tolerances: relative Frobenius error per gradient against float64, with the wide elementwise
guard of ``moe_cases.assert_matches``: fp32 2e-5, fp16 4e-3, bf16 2.5e-2. Low-precision
gradients are looser than the forward's because the backward rounds ``z``, ``h`` and ``dz``
to the input dtype before the next product, as every mixed-precision backward does.
"""

from __future__ import annotations

import pytest
import torch
from helpers import capture_cuda_graph
from moe_cases import PATHS, assert_matches, f64, make_ids, n_rows

import moe_route
from moe_route.reference import moe_forward_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = "cuda"
GRAD_TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DTYPE_IDS = ["bf16", "fp16", "fp32"]
NAMES = ("x", "w1", "w2", "topk_weights", "b1", "b2", "bias")
ACT_LAYOUTS = [
    ("swiglu", "concat"),
    ("swiglu", "interleaved"),
    ("geglu", "concat"),
    ("silu", "concat"),
    ("gelu", "concat"),
    ("relu", "concat"),
    ("identity", "concat"),
]


def make_case(T, K, E, H, inter, *, activation="swiglu", dtype=torch.bfloat16, biases=True,
              bias_shape="TH", ids=None, drop=0.15, seed=0):  # fmt: skip
    g = torch.Generator(device=CUDA).manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=CUDA) * scale).to(dtype)

    ids = make_ids(T, K, E, drop=drop, seed=seed).to(CUDA) if ids is None else ids.to(CUDA)
    n1 = n_rows(activation, inter)
    tw = torch.softmax(torch.randn(T, K, generator=g, device=CUDA), dim=-1)
    bshape = (T, H) if bias_shape == "TH" else (H,)
    return dict(
        x=rnd(T, H),
        w1=rnd(E, n1, H, scale=H**-0.5),
        w2=rnd(E, H, inter, scale=inter**-0.5),
        topk_weights=tw,
        b1=rnd(E, n1, scale=0.5) if biases else None,
        b2=rnd(E, H, scale=0.5) if biases else None,
        bias=rnd(*bshape) if biases else None,
        topk_ids=ids,
    )


def grads_of(case, *, activation="swiglu", layout="concat", dout=None, **kw):
    """(out, {name: grad}) of fused_moe on the kernels; NaN router weights in dropped slots."""
    leaves = {n: case[n].clone().requires_grad_(True) for n in NAMES if case[n] is not None}
    tw = leaves["topk_weights"]
    tw_nan = tw.masked_fill(case["topk_ids"] < 0, float("nan"))
    args = {n: leaves.get(n) for n in NAMES}
    args["topk_weights"] = tw_nan
    out = moe_route.fused_moe(
        args.pop("x"), args.pop("w1"), args.pop("w2"), args.pop("topk_weights"),
        case["topk_ids"], activation=activation, gate_up_layout=layout, **args, **kw,
    )  # fmt: skip
    out.backward(dout)
    return out, {n: t.grad for n, t in leaves.items()}


def reference_grads(case, dout, *, activation="swiglu", layout="concat"):
    leaves = {n: f64(case[n]).requires_grad_(True) for n in NAMES if case[n] is not None}
    tw = leaves["topk_weights"].masked_fill(case["topk_ids"] < 0, 0.0)
    out = moe_forward_reference(
        leaves["x"], leaves["w1"], leaves["w2"], tw, case["topk_ids"], activation=activation,
        gate_up_layout=layout, b1=leaves.get("b1"), b2=leaves.get("b2"), bias=leaves.get("bias"),
    )  # fmt: skip
    out.backward(dout.double())
    return out, {n: t.grad for n, t in leaves.items()}


def check_grads(case, *, activation="swiglu", layout="concat", tol=None, **kw):
    dtype = case["x"].dtype
    tol = tol or GRAD_TOL[dtype]
    g = torch.Generator(device=CUDA).manual_seed(99)
    T, H = case["x"].shape
    dout = torch.randn(T, H, generator=g, device=CUDA).to(dtype)
    out, got = grads_of(case, activation=activation, layout=layout, dout=dout, **kw)
    ref_out, want = reference_grads(case, dout, activation=activation, layout=layout)
    assert_matches(out, ref_out, max(tol, 1e-5), what="output", floor=1.0)
    for name, ref in want.items():
        assert got[name].dtype == case[name].dtype, f"d{name} dtype {got[name].dtype}"
        if name == "topk_weights":
            dropped = case["topk_ids"] < 0
            assert torch.equal(got[name][dropped], torch.zeros_like(got[name][dropped])), (
                "d topk_weights of dropped slots must be exactly zero"
            )
        assert_matches(got[name].reshape(-1, ref.shape[-1]), ref.reshape(-1, ref.shape[-1]),
                       tol, what=f"d{name}", floor=1.0)  # fmt: skip
    return got


# ----------------------------------------------------------------------------- correctness
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("activation", "layout"), ACT_LAYOUTS, ids=lambda v: str(v))
def test_grads_match_reference(dtype, activation, layout):
    case = make_case(67, 2, 5, 200, 136, activation=activation, dtype=dtype)
    check_grads(case, activation=activation, layout=layout)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("T", "K", "E", "H", "inter"), [
    (1, 1, 1, 64, 32),       # one token, one expert
    (37, 8, 8, 72, 40),      # K = E
    (101, 4, 16, 50, 26),    # odd H and I: no TMA (16-byte pitch), masked tails
    (300, 8, 64, 256, 96),   # many experts, most with few rows
    (30, 4, 8, 72, 40),      # 16 rows per expert (bucket): weight grads on expanded rows
    (60, 2, 8, 50, 26),      # the same, odd H and I
])  # fmt: skip
def test_odd_sizes(dtype, T, K, E, H, inter):
    check_grads(make_case(T, K, E, H, inter, dtype=dtype, bias_shape="H"))


def test_experts_without_rows_get_exact_zero_weight_grads():
    E = 12
    ids = make_ids(40, 2, 4, drop=0.1, seed=3)  # experts 4..11 never chosen
    case = make_case(40, 2, E, 128, 64, ids=ids)
    got = check_grads(case)
    for name in ("w1", "w2", "b1", "b2"):
        tail = got[name][4:]
        assert torch.equal(tail, torch.zeros_like(tail)), f"d{name} of empty experts not zero"


def test_every_slot_dropped_and_zero_tokens():
    ids = torch.full((9, 2), -1, dtype=torch.int64)
    case = make_case(9, 2, 3, 64, 32, ids=ids)
    out, got = grads_of(case, dout=torch.ones(9, 64, device=CUDA, dtype=torch.bfloat16))
    for name in ("x", "w1", "w2", "topk_weights", "b1", "b2"):
        assert torch.equal(got[name], torch.zeros_like(got[name])), name
    assert torch.equal(got["bias"], torch.ones_like(got["bias"]))
    empty = make_case(0, 2, 3, 64, 32, ids=torch.zeros(0, 2, dtype=torch.int64))
    out, got = grads_of(empty, dout=torch.zeros(0, 64, device=CUDA, dtype=torch.bfloat16))
    assert out.shape == (0, 64)
    assert torch.equal(got["w1"], torch.zeros_like(got["w1"]))


@pytest.mark.parametrize("gather", [True, False])
@pytest.mark.parametrize("path", list(PATHS))
def test_paths_and_strided_weights(gather, path):
    case = make_case(129, 4, 8, 256, 128)
    # weights held transposed (a [E, H, 2I] model parameter seen as [E, 2I, H]): never copied
    case["w1"] = case["w1"].transpose(1, 2).contiguous().transpose(1, 2)
    case["w2"] = case["w2"].transpose(1, 2).contiguous().transpose(1, 2)
    got = check_grads(case, gather=gather, **PATHS[path])
    assert got["w1"].stride() == case["w1"].stride()


def test_only_some_grads():
    """Frozen weights (e.g. adapters): only dx and d topk_weights are computed."""
    case = make_case(64, 2, 4, 128, 64, biases=False)
    x = case["x"].clone().requires_grad_(True)
    tw = case["topk_weights"].clone().requires_grad_(True)
    out = moe_route.fused_moe(x, case["w1"], case["w2"], tw, case["topk_ids"])
    out.float().square().sum().backward()
    ref = {n: f64(case[n]) for n in NAMES if case[n] is not None}
    rx, rtw = ref["x"].requires_grad_(True), ref["topk_weights"].requires_grad_(True)
    rtw_z = rtw.masked_fill(case["topk_ids"] < 0, 0.0)
    ro = moe_forward_reference(rx, ref["w1"], ref["w2"], rtw_z, case["topk_ids"])
    # same loss on the reference, evaluated at the kernels' (rounded) output
    ro.backward(2 * out.detach().double())
    assert_matches(x.grad, rx.grad, GRAD_TOL[torch.bfloat16], what="dx", floor=1.0)
    assert_matches(tw.grad, rtw.grad, GRAD_TOL[torch.bfloat16], what="dtw", floor=1.0)


def test_gradcheck_float64():
    case = make_case(6, 2, 3, 8, 4, dtype=torch.float64)
    ids = case["topk_ids"]
    leaves = [case[n].double().requires_grad_(True) for n in NAMES]

    def f(x, w1, w2, tw, b1, b2, bias):
        return moe_route.fused_moe(x, w1, w2, tw, ids, b1=b1, b2=b2, bias=bias)

    assert torch.autograd.gradcheck(f, leaves, fast_mode=True)


# ----------------------------------------------------------------------------- determinism
def test_deterministic_20_runs():
    case = make_case(1000, 8, 64, 512, 256)
    dout = torch.randn(1000, 512, device=CUDA).to(torch.bfloat16)
    first_out, first = grads_of(case, dout=dout)
    for _ in range(19):
        out, got = grads_of(case, dout=dout)
        assert torch.equal(out, first_out)
        for n in first:
            assert torch.equal(got[n], first[n]), f"d{n} differs between runs"


# ----------------------------------------------------------------------------- memory
def test_backward_holds_one_pre_activation():
    """Activation memory of forward + backward (bench's ``step_memory``: gradients left out)
    stays within GEMM1's pre-activation ``z``, ``w·h``, a few ``[T*K, H]`` rows and the output:
    the backward writes ``dz`` over ``z`` and gets no zero-filled gradient for ``z`` (before,
    two more ``z``-sized buffers). With ``retain_graph`` the gradients are the same bits."""
    from moe_route.bench.profiling import step_memory

    T, K, E, H, inter = 2048, 2, 8, 512, 4096
    case = make_case(T, K, E, H, inter, biases=False, drop=0.0)
    leaves = [case[n].clone().requires_grad_(True) for n in ("x", "w1", "w2", "topk_weights")]
    dout = torch.randn(T, H, device=CUDA).to(torch.bfloat16)

    def step(**kw):
        out = moe_route.fused_moe(*leaves, case["topk_ids"])
        return torch.autograd.grad(out, leaves, dout, **kw)

    want = step(retain_graph=True)
    got, mem = step_memory(step, CUDA)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    M, es = T * K, 2
    z, wh, rows, tokens = M * 2 * inter * es, M * inter * es, M * H * es, T * H * es
    bound = z + wh + 4 * rows + 2 * tokens
    assert z < mem.activation <= bound, (mem.activation / 2**20, bound / 2**20)


# ----------------------------------------------------------------------------- capture
def _step(x, w1, w2, tw, ids):
    out = moe_route.fused_moe(x, w1, w2, tw, ids)
    out.float().square().mean().backward()
    return out


@pytest.mark.isolated  # a failed capture would break the tests after it (tests/conftest.py)
def test_no_host_sync_and_cuda_graph():
    """Forward + backward captured in a CUDA graph (no host sync inside: the capture runs under
    ``set_sync_debug_mode("error")``) and replayed: the same output and gradients as eager."""
    case = make_case(256, 4, 8, 256, 128, biases=False)
    leaves = [case[n].clone().requires_grad_(True) for n in ("x", "w1", "w2", "topk_weights")]
    ids = case["topk_ids"]

    def fwd_bwd():
        for t in leaves:
            t.grad = None
        return _step(*leaves, ids).detach()  # no autograd graph outlives the call

    want_out = fwd_bwd()  # eager, on the default stream (compiles the kernels)
    want = [t.grad.clone() for t in leaves]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # no host sync in eager mode either
    try:
        fwd_bwd()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph, static_out = capture_cuda_graph(fwd_bwd)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, want_out)
    for t, w in zip(leaves, want, strict=True):
        assert torch.equal(t.grad, w)


def test_compile_fullgraph_forward_backward():
    case = make_case(128, 4, 8, 256, 128)
    leaves = [case[n].clone().requires_grad_(True) for n in NAMES]
    ids = case["topk_ids"]

    def step(x, w1, w2, tw, b1, b2, bias):
        out = moe_route.fused_moe(x, w1, w2, tw, ids, b1=b1, b2=b2, bias=bias)
        return out.float().square().mean()

    eager = torch.autograd.grad(step(*leaves), leaves)
    compiled = torch.compile(step, fullgraph=True)
    got = torch.autograd.grad(compiled(*leaves), leaves)
    for a, b, n in zip(got, eager, NAMES, strict=True):
        assert_matches(a, b, GRAD_TOL[torch.bfloat16], what=f"d{n} compiled vs eager", floor=1e-3)


# ----------------------------------------------------------------------------- step 1's two ways
def _force_act_backward(monkeypatch, split):
    """Plans built from here on run step 1 of the backward fused or split (the tiles stay the
    tuning's)."""
    import dataclasses

    from moe_route import tuning
    from moe_route.plan import clear_plans

    real = tuning.act_backward_config

    def config(*args, **kwargs):
        return dataclasses.replace(real(*args, **kwargs), split=split)

    monkeypatch.setattr(tuning, "act_backward_config", config)
    clear_plans()


@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
def test_activation_backward_ways_match_reference(monkeypatch, split):
    """``fused_moe``'s gradients with step 1 fused or split (a plain GEMM storing ``g`` in bf16,
    then the row pass) at an odd size (T=200, H=264, I=200, E=7, K=3: expert 6 holds no rows,
    15 % of the slots dropped), clamped swiglu in the interleaved layout and plain swiglu,
    against the float64 reference; 5 runs give the same bits."""
    import importlib

    from moe_route.plan import clear_plans

    kt_moe = importlib.import_module("moe_route.kernels.triton.moe")
    monkeypatch.setenv("MOE_ROUTE_COMPILE_AHEAD", "0")  # count only the calls that run
    calls = []
    for cls in (kt_moe.RowPassLaunch, kt_moe.ActBackwardLaunch):
        real = cls.__call__

        def spy(*a, real=real, name=cls.__name__, **kw):
            calls.append(name)
            return real(*a, **kw)

        monkeypatch.setattr(cls, "__call__", spy)
    _force_act_backward(monkeypatch, split)
    try:
        ids = make_ids(200, 3, 6, drop=0.15, seed=11)
        gpt_oss = moe_route.activation("swiglu", alpha=1.702, limit=7.0, up_offset=1.0)
        for activation, layout in (("swiglu", "concat"), (gpt_oss, "interleaved")):
            case = make_case(200, 3, 7, 264, 200, ids=ids, seed=5)
            check_grads(case, activation=activation, layout=layout)
            dout = torch.randn(200, 264, device=CUDA).to(torch.bfloat16)
            _, first = grads_of(case, activation=activation, layout=layout, dout=dout)
            for _ in range(4):
                _, again = grads_of(case, activation=activation, layout=layout, dout=dout)
                for n in first:
                    assert torch.equal(again[n], first[n]), f"d{n} differs between runs"
    finally:
        clear_plans()
    want = "RowPassLaunch" if split else "ActBackwardLaunch"
    assert calls and set(calls) == {want}


@pytest.mark.parametrize("permuted", [False, True], ids=["gathered", "permuted"])
@pytest.mark.parametrize(
    ("activation", "layout"), [("swiglu", "concat"), ("swiglu", "interleaved"), ("gelu", "concat")]
)
def test_activation_backward_split_and_fused_kernels(activation, layout, permuted):
    """The two ways' kernels on NaN-poisoned outputs, ``dout`` gathered through the maps or
    permuted (TMA-fed on Hopper), at the odd size above in bf16: ``w·h``, ``dz`` and the summed
    router partials against float64 (relative Frobenius 1e-2: ``g`` and ``dz`` each rounded to
    bf16 once), dropped rows exactly zero, 5 runs of each the same bits."""
    from moe_cases import TOL

    from moe_route import arch, tuning
    from moe_route.activations import as_activation
    from moe_route.kernels.triton.act_backward import act_backward_rows_triton
    from moe_route.kernels.triton.expand import expand_rows_triton
    from moe_route.kernels.triton.gemm_act_backward import grouped_gemm_act_backward_triton
    from moe_route.kernels.triton.grouped_gemm import grouped_gemm_triton
    from moe_route.plan import epilogue_for
    from moe_route.reference import activation_backward_reference, activation_reference

    T, K, E, H, inter, dt = 200, 3, 7, 264, 200, torch.bfloat16
    M = T * K
    ids = make_ids(T, K, 6, drop=0.15, seed=13).to(CUDA)  # expert 6: no rows
    s2d, d2s, efs, off = moe_route.build_routing_maps(ids, E).tensors()
    g = torch.Generator(device=CUDA).manual_seed(17)
    gated = as_activation(activation).gated
    dout = torch.randn(T, H, generator=g, device=CUDA).to(dt)
    w2 = (torch.randn(E, H, inter, generator=g, device=CUDA) * H**-0.5).to(dt)
    z = (torch.randn(M, 2 * inter if gated else inter, generator=g, device=CUDA) * 2).to(dt)
    tw = torch.softmax(torch.randn(T, K, generator=g, device=CUDA), -1)
    tw = tw.masked_fill(ids < 0, float("nan"))
    epi = epilogue_for(activation, layout)
    cfg = tuning.act_backward_config(tuning.token_bucket(T) * K / E, dt,
                                     arch.compute_capability(torch.device(CUDA)))  # fmt: skip
    rows = dout
    if permuted:
        rows = dout.new_empty(M, H)
        expand_rows_triton(dout, s2d, efs, rows)

    def fused():
        wh, dz = z.new_full((M, inter), float("nan")), torch.full_like(z, float("nan"))
        part = grouped_gemm_act_backward_triton(
            rows, w2.transpose(1, 2), off, d2s, z, tw, wh, dz, cfg.fused, epilogue=epi,
            permuted=permuted,
        )  # fmt: skip
        return wh, dz, part

    def split():
        wh, dz = z.new_full((M, inter), float("nan")), torch.full_like(z, float("nan"))
        grouped_gemm_triton(rows, w2.transpose(1, 2), off, wh, cfg.gemm,
                            dest_to_src=None if permuted else d2s, num_rows=M)  # fmt: skip
        part = act_backward_rows_triton(wh, z, tw, off, d2s, wh, dz, cfg.rows, epilogue=epi)
        return wh, dz, part

    routed = int(off[-1])
    assert 0 < routed < M
    src = d2s[:routed].long()
    t, k = src % T, src // T
    e = torch.searchsorted(off[1:], torch.arange(routed, device=CUDA), right=True)
    g64 = torch.einsum("mh,mhi->mi", dout.double()[t], w2.double()[e])
    w = tw.double()[t, k].unsqueeze(1)
    h = activation_reference(z.double()[:routed], activation, layout).to(dt).double()
    want_wh = w * h
    want_dz = activation_backward_reference(z.double()[:routed], w * g64, activation, layout)
    want_part = (g64 * h).sum(1, keepdim=True)
    for way in (fused, split):
        wh, dz, part = way()
        name = way.__name__
        assert_matches(wh[:routed], want_wh, TOL[dt], what=f"{name} w·h", floor=1.0)
        assert_matches(dz[:routed], want_dz, TOL[dt], what=f"{name} dz", floor=1.0)
        assert_matches(part[:routed].double().sum(1, keepdim=True), want_part, TOL[dt],
                       what=f"{name} router partials", floor=1.0)  # fmt: skip
        assert torch.equal(wh[routed:], torch.zeros_like(wh[routed:])), f"{name}: w·h dropped"
        assert torch.equal(dz[routed:], torch.zeros_like(dz[routed:])), f"{name}: dz dropped"
        for _ in range(4):
            again = way()
            assert torch.equal(again[0], wh) and torch.equal(again[1], dz), name
            assert torch.equal(again[2][:routed], part[:routed]), name
