"""fused_moe backward on the CPU: the torch backend's explicit formulas and the Triton
kernels (through the interpreter) against ``torch.autograd`` through
``moe_route.reference.moe_forward_reference`` in float64, plus float64 ``gradcheck``,
``opcheck`` of the training ops, and ``torch.compile`` of forward + backward.

Router weights of dropped slots are NaN for the code under test (never read, so no gradient
may be NaN) and zero for the autograd oracle (autograd through ``where`` would turn a NaN
weight into a NaN gradient). bf16 kernels are covered on CUDA (tests/test_gpu_training.py):
the triton 3.5.1 interpreter's ``tl.dot`` on bf16 returns garbage.

Tolerances (relative Frobenius error per gradient, ``moe_cases.assert_matches``): float32
1e-5, float16 4e-3 (the backward rounds ``z``, ``h``, ``dz`` to float16 before the next
product).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from moe_cases import ACT_IDS, ACT_LAYOUTS, assert_matches, f64, make_ids, needs_interpreter
from moe_cases import moe_case as make_moe

import moe_route
from moe_route.reference import (
    activation_backward_reference,
    activation_reference,
    moe_forward_reference,
    routing_maps_reference,
)

moe_module = importlib.import_module("moe_route.moe")

NAMES = ("x", "w1", "w2", "topk_weights", "b1", "b2", "bias")
GRAD_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 4e-3}
BACKENDS = ["torch", pytest.param("triton", marks=needs_interpreter)]


def _case(T=9, K=2, E=4, H=16, inter=8, *, activation="swiglu", dtype=torch.float32,
          biases=True, bias="TH", ids=None, seed=0):  # fmt: skip
    c = make_moe(T, K, E, H, inter, activation=activation, dtype=dtype, b1=biases, b2=biases,
                 bias=bias if biases else None, ids=ids, seed=seed)  # fmt: skip
    c["topk_weights"] = c["topk_weights"].to(dtype)
    return c


def _grads(case, dout, *, backend, activation="swiglu", layout="concat", wanted=NAMES, **kw):
    leaves = {n: case[n].clone().requires_grad_(n in wanted) for n in NAMES if case[n] is not None}
    out = moe_route.fused_moe(
        leaves["x"], leaves["w1"], leaves["w2"], leaves["topk_weights"], case["topk_ids"],
        activation=activation, gate_up_layout=layout, b1=leaves.get("b1"), b2=leaves.get("b2"),
        bias=leaves.get("bias"), backend=backend, **kw,
    )  # fmt: skip
    out.backward(dout)
    return out, {n: t.grad for n, t in leaves.items()}


def _oracle(case, dout, *, activation="swiglu", layout="concat"):
    leaves = {n: f64(case[n]).requires_grad_(True) for n in NAMES if case[n] is not None}
    tw = leaves["topk_weights"].nan_to_num(0.0)
    out = moe_forward_reference(
        leaves["x"], leaves["w1"], leaves["w2"], tw, case["topk_ids"], activation=activation,
        gate_up_layout=layout, b1=leaves.get("b1"), b2=leaves.get("b2"), bias=leaves.get("bias"),
    )  # fmt: skip
    out.backward(dout.double())
    return {n: t.grad for n, t in leaves.items()}


def _check(case, *, backend, activation="swiglu", layout="concat", **kw):
    dtype = case["x"].dtype
    g = torch.Generator().manual_seed(7)
    dout = torch.randn(case["x"].shape, generator=g, dtype=torch.float64).to(dtype)
    _, got = _grads(case, dout, backend=backend, activation=activation, layout=layout, **kw)
    want = _oracle(case, dout, activation=activation, layout=layout)
    for name, ref in want.items():
        assert got[name].dtype == case[name].dtype, name
        assert got[name].shape == ref.shape, name
        if name == "topk_weights":
            dropped = case["topk_ids"] < 0
            assert torch.equal(got[name][dropped], torch.zeros_like(got[name][dropped]))
        w = ref.shape[-1]
        assert_matches(got[name].reshape(-1, w), ref.reshape(-1, w), GRAD_TOL[dtype],
                       what=f"d{name}", floor=1.0)  # fmt: skip
    return got


# ----------------------------------------------------------------------------- activations
@pytest.mark.parametrize(("activation", "layout"), ACT_LAYOUTS, ids=ACT_IDS)
def test_activation_backward_matches_autograd(activation, layout):
    g = torch.Generator().manual_seed(1)
    width = 12 if activation in ("swiglu", "geglu") else 6
    z = (torch.randn(5, width, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    dh = torch.randn(5, 6, generator=g, dtype=torch.float64)
    (want,) = torch.autograd.grad(activation_reference(z, activation, layout), z, dh)
    got = activation_backward_reference(z.detach(), dh, activation, layout)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("activation", "layout"), ACT_LAYOUTS, ids=ACT_IDS)
def test_grads_match_autograd(backend, activation, layout):
    _check(_case(activation=activation), backend=backend, activation=activation, layout=layout)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float64], ids=["fp16", "fp64"])
def test_grads_other_dtypes(backend, dtype):
    _check(_case(11, 3, 5, 24, 12, dtype=dtype, bias="H", seed=2), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("T", "K", "E"), [(1, 1, 1), (6, 4, 4), (13, 2, 9)], ids=["one-expert", "K=E", "sparse"]
)
def test_edge_routings(backend, T, K, E):
    _check(_case(T, K, E, 16, 8, seed=T), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_experts_get_exact_zero_weight_grads(backend):
    ids = make_ids(10, 2, 3, drop=0.1, seed=4)  # experts 3..6 hold no rows
    got = _check(_case(10, 2, 7, 16, 8, ids=ids), backend=backend)
    for n in ("w1", "w2", "b1", "b2"):
        assert torch.equal(got[n][3:], torch.zeros_like(got[n][3:])), n


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_dropped_and_zero_tokens(backend):
    ids = torch.full((5, 2), -1, dtype=torch.int64)
    case = _case(5, 2, 3, 16, 8, ids=ids)
    _, got = _grads(case, torch.ones(5, 16), backend=backend)
    for n in ("x", "w1", "w2", "topk_weights", "b1", "b2"):
        assert torch.equal(got[n], torch.zeros_like(got[n])), n
    assert torch.equal(got["bias"], torch.ones(5, 16))
    empty = _case(0, 2, 3, 16, 8, ids=torch.zeros(0, 2, dtype=torch.int64))
    out, got = _grads(empty, torch.zeros(0, 16), backend=backend)
    assert out.shape == (0, 16) and torch.equal(got["w2"], torch.zeros_like(got["w2"]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("wanted", [("x",), ("topk_weights",), ("w1", "b1"), ("w2", "b2")])
def test_only_requested_grads(backend, wanted):
    case = _case()
    dout = torch.randn(case["x"].shape, generator=torch.Generator().manual_seed(3))
    _, got = _grads(case, dout, backend=backend, wanted=wanted)
    want = _oracle(case, dout)
    for n in NAMES:
        if n in wanted:
            w = want[n].shape[-1]
            assert_matches(got[n].reshape(-1, w), want[n].reshape(-1, w), 1e-5, floor=1.0)
        else:
            assert got[n] is None, n


@needs_interpreter
@pytest.mark.parametrize(("activation", "layout"), [("swiglu", "concat"), ("gelu", "concat")])
def test_backward_consumes_z_only_when_graph_is_not_kept(activation, layout):
    """The eager backward writes dz over the saved z (its largest buffer) unless
    ``retain_graph`` keeps the graph: two kept backwards give the bits of a last one, and that
    last one's result equals a fresh graph's; a backward after z was consumed raises."""
    case = _case(11, 2, 4, 16, 8, activation=activation)
    leaves = [case[n].clone().requires_grad_(True) for n in NAMES]
    dout = torch.randn(case["x"].shape, generator=torch.Generator().manual_seed(2))

    def forward():
        x, w1, w2, tw, b1, b2, bias = leaves
        return moe_route.fused_moe(x, w1, w2, tw, case["topk_ids"], activation=activation,
                                   gate_up_layout=layout, b1=b1, b2=b2, bias=bias,
                                   backend="triton")  # fmt: skip

    out = forward()
    kept1 = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    kept2 = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    last = torch.autograd.grad(out, leaves, dout)  # consumes z
    fresh = torch.autograd.grad(forward(), leaves, dout)
    for name, a, b, c, d in zip(NAMES, kept1, kept2, last, fresh, strict=True):
        for other in (b, c, d):
            assert torch.equal(a, other), name
    with pytest.raises(RuntimeError, match=r"second time|modified by an inplace"):
        torch.autograd.grad(out, leaves, dout)


@needs_interpreter
def test_backward_consumes_z_in_place(monkeypatch):
    """The consuming backward really reuses z (no [T*K, 2I] buffer of its own) and bumps its
    version; with ``retain_graph`` it writes elsewhere and leaves z as the forward stored it."""
    experts = importlib.import_module("moe_route.experts")
    seen = []
    real = experts.moe_backward_triton

    def spy(*args, dz_out=None, **kw):
        z = args[7]
        seen.append((dz_out is z, z._version, z.clone()))
        return real(*args, dz_out=dz_out, **kw)

    monkeypatch.setattr(experts, "moe_backward_triton", spy)
    case = _case(9, 2, 3, 16, 8)
    leaves = [case[n].clone().requires_grad_(True) for n in NAMES]
    x, w1, w2, tw, b1, b2, bias = leaves
    out = moe_route.fused_moe(x, w1, w2, tw, case["topk_ids"], b1=b1, b2=b2, bias=bias,
                              backend="triton")  # fmt: skip
    dout = torch.ones_like(out)
    torch.autograd.grad(out, leaves, dout, retain_graph=True)
    torch.autograd.grad(out, leaves, dout)
    (kept_reused, v0, z0), (last_reused, v1, z1) = seen
    assert not kept_reused and last_reused
    assert v1 == v0 and torch.equal(z0, z1)  # the kept backward left z untouched


@needs_interpreter
@pytest.mark.parametrize("gather", [True, False])
def test_gather_and_strided_weights(gather):
    case = _case(12, 2, 3, 16, 8)
    case["w1"] = case["w1"].transpose(1, 2).contiguous().transpose(1, 2)
    got = _check(case, backend="triton", gather=gather)
    assert got["w1"].stride() == case["w1"].stride()


@needs_interpreter
def test_fused_finalize_path_backward():
    _check(_case(), backend="triton", finalize="fused", deterministic=False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("activation", "layout"), [("swiglu", "interleaved"), ("gelu", "concat")])
def test_gradcheck_float64(backend, activation, layout):
    case = _case(5, 2, 3, 6, 4, activation=activation, dtype=torch.float64)
    ids = case["topk_ids"]
    leaves = [case[n].nan_to_num(0.0).clone().requires_grad_(True) for n in NAMES]

    def f(x, w1, w2, tw, b1, b2, bias):
        return moe_route.fused_moe(x, w1, w2, tw, ids, activation=activation,
                                   gate_up_layout=layout, b1=b1, b2=b2, bias=bias,
                                   backend=backend)  # fmt: skip

    assert torch.autograd.gradcheck(f, leaves, fast_mode=True)


# ----------------------------------------------------------------------------- registration
def _train_op_args(backend, requires_grad):
    case = _case(7, 2, 3, 8, 4, bias="TH", seed=5)
    s2d, d2s, efs, off = routing_maps_reference(case["topk_ids"], 3)
    floats = [case[n].nan_to_num(0.0).requires_grad_(requires_grad) for n in NAMES]
    return (*floats, s2d, d2s, efs, off, "swiglu", "concat", "standalone", True, False, backend,
            True)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck_training_ops(backend):
    torch.library.opcheck(moe_route.experts.MOE.op, _train_op_args(backend, True))
    args = _train_op_args(backend, False)
    out, z = moe_route.experts.MOE.op(*args)
    assert z.shape == (args[8].numel(), args[1].shape[1])  # GEMM1's pre-activation, stored
    x, w1, w2, tw, b1, b2, _bias, s2d, d2s, efs, off = args[:11]
    bwd_args = (torch.ones_like(out), x, w1, w2, tw, b1, b2, z, s2d, d2s, efs, off, "swiglu",
                "concat", "standalone", True, True, True, True, True, False, backend)  # fmt: skip
    torch.library.opcheck(moe_route.experts._MOE_BACKWARD.op, bwd_args)


def test_compile_fullgraph_forward_backward():
    case = _case(8, 2, 3, 16, 8, seed=9)
    ids = case["topk_ids"]
    leaves = [case[n].nan_to_num(0.0).clone().requires_grad_(True) for n in NAMES]

    def loss(x, w1, w2, tw, b1, b2, bias):
        out = moe_route.fused_moe(x, w1, w2, tw, ids, b1=b1, b2=b2, bias=bias,
                                  backend="reference")  # fmt: skip
        return out.square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True)
    got = torch.autograd.grad(compiled(*leaves), leaves)
    want = torch.autograd.grad(loss(*leaves), leaves)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- stage by stage
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gather", [True, False])
@pytest.mark.parametrize(
    ("activation", "layout"),
    [("swiglu", "interleaved"), ("gelu", "concat"), ("identity", "concat")],
    ids=["swiglu-interleaved", "gelu", "identity"],
)
def test_grouped_gemm_grads(backend, gather, activation, layout):
    """moe_route.grouped_gemm's own autograd against autograd through the float64 reference."""
    from moe_cases import gemm_case

    from moe_route.reference import expand_rows_reference, grouped_gemm_reference

    a, w, b, maps = gemm_case(9, 2, 4, 12, 6, activation, bias=True, gather=gather, seed=5)
    leaves = [a.clone().requires_grad_(True), w.clone().requires_grad_(True),
              b.clone().requires_grad_(True)]  # fmt: skip
    out = moe_route.grouped_gemm(leaves[0], leaves[1], maps, bias=leaves[2], activation=activation,
                                 gate_up_layout=layout, gather=gather, backend=backend)  # fmt: skip
    g = torch.Generator().manual_seed(6)
    dout = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [f64(t).requires_grad_(True) for t in (a, w, b)]
    off = maps.expert_first_token_offset
    rows = ref_leaves[0]
    if gather:
        rows = expand_rows_reference(rows, maps.expanded_dest_row_to_expanded_source_row, off)
    ref = grouped_gemm_reference(rows, ref_leaves[1], off, ref_leaves[2], activation=activation,
                                 gate_up_layout=layout)  # fmt: skip
    want = torch.autograd.grad(ref, ref_leaves, dout.double())
    for name, x, y in zip(("da", "dw", "db"), got, want, strict=True):
        width = y.shape[-1]
        assert_matches(x.reshape(-1, width), y.reshape(-1, width), 1e-5, what=name, floor=1.0)


@needs_interpreter
def test_weight_grads_from_permuted_rows_equal_gathered(monkeypatch):
    """``WeightGradConfig.permuted`` (the launch sequence expands the token rows, the pointer
    kernel reads them in order) gives the bits of the gathered route: the same rows, summed
    in the same order; bias gradients, dropped slots and an empty expert included."""
    import dataclasses

    from moe_route import tuning
    from moe_route.plan import clear_plans

    real = tuning.weight_grad_config
    launch_cls = importlib.import_module("moe_route.kernels.triton.moe").ExpandLaunch
    real_expand = launch_cls.__call__
    expands = []

    def counting_expand(*args, **kw):
        expands[-1] += 1
        return real_expand(*args, **kw)

    monkeypatch.setattr(launch_cls, "__call__", counting_expand)
    grads = []
    for permuted in (False, True):
        expands.append(0)

        def config(*args, permuted=permuted):
            return dataclasses.replace(real(*args), permuted=permuted)

        monkeypatch.setattr(tuning, "weight_grad_config", config)
        clear_plans()
        # experts 0-4 only of 6: expert 5 has no rows
        case = _case(13, 3, 6, 16, 8, ids=make_ids(13, 3, 5, drop=0.2, seed=4))
        leaves = [case[n].clone().requires_grad_(True) for n in NAMES]
        x, w1, w2, tw, b1, b2, bias = leaves
        out = moe_route.fused_moe(x, w1, w2, tw, case["topk_ids"], b1=b1, b2=b2, bias=bias,
                                  backend="triton")  # fmt: skip
        grads.append(torch.autograd.grad(out, leaves, torch.ones_like(out)))
    clear_plans()
    assert expands[1] == expands[0] + 2  # dout for dW2, x for dW1
    for name, a, b in zip(NAMES, *grads, strict=True):
        assert torch.equal(a, b), name


@needs_interpreter
@pytest.mark.parametrize(
    ("finalize", "split", "gather"),
    # every value of each option, and each pair of two options' values, at half the product's
    # cost (each case runs about 40 launches of the interpreter per call)
    [
        ("standalone", False, True),
        ("standalone", True, False),
        ("fused", False, False),
        ("fused", True, True),
    ],
    ids=["standalone-fused_act-gather", "standalone-split_act-expand", "fused-fused_act-expand",
         "fused-split_act-gather"],
)  # fmt: skip
def test_prepared_route_matches_op_route(monkeypatch, finalize, split, gather):
    """fused_moe's eager route (its ``MoEProgram`` run directly: the launch sequences'
    prepared launches, autograd through ``_ExpertsFunction``) gives the bits of the op's route
    (the same program through the custom op and its registered autograd, what compiled code
    runs) for the output and every gradient: at a
    signature's first call, and at a later call with a new T of the same bucket, which
    prepares no launch again; for a contiguous, a stride-0 and a transposed ``dout``; with
    dropped slots and an expert without rows."""
    import dataclasses

    from moe_route import tuning
    from moe_route.kernels.triton.grouped_gemm import GemmLaunch

    real_config = tuning.act_backward_config

    def config(*args, **kwargs):
        return dataclasses.replace(real_config(*args, **kwargs), split=split)

    monkeypatch.setattr(tuning, "act_backward_config", config)
    moe_route.plan.clear_plans()
    taken, prepared = [], []
    real_call, real_init = moe_route.experts.MoEProgram.__call__, GemmLaunch.__init__
    monkeypatch.setattr(
        moe_route.experts.MoEProgram,
        "__call__",
        lambda *a, **k: taken.append(k["direct"]) or real_call(*a, **k),
    )
    monkeypatch.setattr(GemmLaunch, "__init__",
                        lambda *a, **k: prepared.append(1) or real_init(*a, **k))  # fmt: skip
    E, H = 5, 16
    opts = dict(finalize=finalize, gather=gather, backend="triton")
    # The first call of the signature; a new T of its bucket; that T again, with the one dout
    # layout that call prepared anew (a transposed [T, H] dout's strides hold T).
    every = ("contiguous", "stride-0", "transposed")
    calls = ((13, 1, every), (11, 2, every), (11, 3, ("transposed",)))
    try:
        for T, seed, kinds in calls:
            ids = make_ids(T, 2, E - 1, drop=0.2, seed=seed)  # expert E-1 gets no rows
            case = _case(T, 2, E, H, 8, ids=ids, seed=seed)
            g = torch.Generator().manual_seed(seed)
            douts = {
                "contiguous": torch.randn(T, H, generator=g),
                "stride-0": torch.randn(1, H, generator=g).expand(T, H),
                "transposed": torch.randn(H, T, generator=g).t(),
            }
            for i, kind in enumerate(kinds):
                dout = douts[kind]
                leaves = [case[n].clone().requires_grad_(True) for n in NAMES]
                x, w1, w2, tw, b1, b2, bias = leaves
                taken.clear()
                prepared.clear()
                out = moe_route.fused_moe(x, w1, w2, tw, case["topk_ids"], b1=b1, b2=b2,
                                          bias=bias, **opts)  # fmt: skip
                got = torch.autograd.grad(out, leaves, dout)
                assert taken == [True], "fused_moe did not run its program directly"
                if T == 11 and (seed, kind) != (2, "transposed"):
                    assert not prepared, f"T={T} {kind}: launches prepared again"
                if i == 0:  # the op's route, with the same plan and maps: one forward
                    op_leaves = [case[n].clone().requires_grad_(True) for n in NAMES]
                    x, w1, w2, tw, b1, b2, bias = op_leaves
                    plan = moe_route.plan.moe_plan(x, w1, w2, 2, "swiglu", "concat", finalize,
                                                   True, gather, False, "triton")  # fmt: skip
                    maps = moe_route.build_routing_maps(case["topk_ids"], E, backend="triton")
                    program = moe_route.experts.program_for(
                        x, w1, w2, tw, b1, b2, bias, "swiglu", "concat", plan.path, plan.gather,
                        False, "triton",
                    )  # fmt: skip
                    want_out = program(x, w1, w2, tw, maps.tensors(), b1, b2, bias, direct=False)
                # a backward per dout, the graph kept for all but the last (which consumes z)
                keep = i < len(kinds) - 1
                want = torch.autograd.grad(want_out, op_leaves, dout, retain_graph=keep)
                assert torch.equal(out, want_out), (T, kind)
                for name, a, b in zip(NAMES, got, want, strict=True):
                    assert torch.equal(a, b), (T, kind, name)
    finally:
        moe_route.plan.clear_plans()
