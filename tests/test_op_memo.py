"""The public ops' call memos: ``build_routing_maps``, ``expand_rows``,
``finalize_moe_routing`` and ``grouped_gemm`` check and decide once per call signature, and a
later call that differs in anything the checks or decisions read gets its own answer (or its
error), never a stale one.

CPU: the Triton kernels run under the interpreter (fp32/fp16 only, see moe_cases)."""

from __future__ import annotations

import pytest
import torch
from moe_cases import (
    TOL,
    assert_matches,
    expand_reference,
    gemm_case,
    gemm_reference,
    make_ids,
    needs_interpreter,
    rand,
)

import moe_route
from moe_route import _checks, _dispatch, finalize, maps, permute
from moe_route.kernels import triton as kt
from moe_route.reference import finalize_moe_routing_reference, routing_maps_reference

pytestmark = needs_interpreter

T, K, E, H, INTER = 5, 2, 4, 32, 16


@pytest.fixture
def checks(monkeypatch):
    """How many times a public op validated a tensor argument (``check_tensor`` calls); the
    memos are emptied first."""
    moe_route.plan.clear_plans()
    seen = []
    real = _checks.check_tensor
    monkeypatch.setattr(_checks, "check_tensor", lambda *a, **k: seen.append(a[0]) or real(*a, **k))
    return seen


def _maps(tokens=T, seed=0):
    return moe_route.build_routing_maps(make_ids(tokens, K, E, seed=seed), E, backend="triton")


def _finalize_expected(y, tw, m, bias=None):
    return finalize_moe_routing_reference(
        y.double(), tw.double(), m.expanded_source_row_to_expanded_dest_row,
        m.expert_for_source_row, None if bias is None else bias.double(),
    )  # fmt: skip


# --------------------------------------------------------------------------- maps
def test_maps_memo_checks_once_and_follows_what_it_reads(checks):
    ids = make_ids(T, K, E)
    first = moe_route.build_routing_maps(ids, E, backend="triton")
    assert checks == ["topk_ids"]
    again = moe_route.build_routing_maps(ids, E, backend="triton")
    assert checks == ["topk_ids"]
    for a, b, want in zip(first.tensors(), again.tensors(),
                          routing_maps_reference(ids, E), strict=True):  # fmt: skip
        assert torch.equal(a, b) and torch.equal(a, want)
    # a new T in the same bucket: not checked again, right tables
    ids7 = make_ids(7, K, E, seed=3)
    got = moe_route.build_routing_maps(ids7, E, backend="triton")
    assert checks == ["topk_ids"]
    for a, want in zip(got.tensors(), routing_maps_reference(ids7, E), strict=True):
        assert torch.equal(a, want)
    # True is not 1: the bool is refused even after an int call of the same value
    one = make_ids(T, 1, 1, drop=0.0)
    moe_route.build_routing_maps(one, 1, backend="triton")
    with pytest.raises(TypeError, match="num_experts"):
        moe_route.build_routing_maps(one, True, backend="triton")
    # ids out of range raise on every CPU call, memoised or not
    bad = ids.clone()
    bad[1, 0] = E
    for _ in range(2):
        with pytest.raises(ValueError, match="out of range"):
            moe_route.build_routing_maps(bad, E, backend="triton")
    # another E, another K (shape), transposed ids: their own answers
    assert moe_route.build_routing_maps(ids, E + 3, backend="triton").num_experts == E + 3
    ids_t = ids.t().contiguous().t()
    assert ids_t.stride() != ids.stride()
    for a, want in zip(moe_route.build_routing_maps(ids_t, E, backend="triton").tensors(),
                       routing_maps_reference(ids, E), strict=True):  # fmt: skip
        assert torch.equal(a, want)
    with pytest.raises(ValueError, match="K <= E"):
        moe_route.build_routing_maps(make_ids(T, K, E), 1, backend="triton")


def test_maps_memo_follows_the_backend_override(monkeypatch, checks):
    ids = make_ids(T, K, E)
    moe_route.build_routing_maps(ids, E)
    seen = []
    real = maps.routing_maps_tables
    monkeypatch.setattr(maps, "routing_maps_tables", lambda *a: seen.append(a[2]) or real(*a))
    monkeypatch.setenv("MOE_ROUTE_BACKEND", "torch")
    got = moe_route.build_routing_maps(ids, E)
    assert seen == ["torch"]
    for a, want in zip(got.tensors(), routing_maps_reference(ids, E), strict=True):
        assert torch.equal(a, want)


# --------------------------------------------------------------------------- expand
def test_expand_memo_checks_once_and_follows_what_it_reads(checks):
    m = _maps()
    x = rand(T, H)
    first = moe_route.expand_rows(x, m, backend="triton")
    n = len(checks)
    again = moe_route.expand_rows(x, m, backend="triton")
    assert len(checks) == n, "a repeated call validated its arguments again"
    assert torch.equal(first, again) and torch.equal(first, expand_reference(x, m))
    # another dtype, other strides: right answers
    half = x.half()
    assert torch.equal(moe_route.expand_rows(half, m, backend="triton"), expand_reference(half, m))
    x_t = x.t().contiguous().t()
    assert torch.equal(moe_route.expand_rows(x_t, m, backend="triton"), expand_reference(x, m))
    # maps of another T still raise, memo or not
    for _ in range(2):
        with pytest.raises(ValueError, match="tokens"):
            moe_route.expand_rows(rand(T + 1, H), m, backend="triton")
    # a new T: the right rows of its own maps
    m7 = _maps(7, seed=2)
    x7 = rand(7, H, seed=4)
    assert torch.equal(moe_route.expand_rows(x7, m7, backend="triton"), expand_reference(x7, m7))
    # a gradient wanted: autograd's route; under no_grad the same tensor takes the memo
    xg = x.clone().requires_grad_()
    out = moe_route.expand_rows(xg, m, backend="triton")
    assert out.grad_fn is not None
    (dx,) = torch.autograd.grad(out.sum(), xg)
    routed = (m.expert_for_source_row >= 0).view(K, T).sum(0).float()
    assert torch.equal(dx, routed[:, None].expand(T, H))
    with torch.no_grad():
        assert moe_route.expand_rows(xg, m, backend="triton").grad_fn is None
    # a signature first met under no_grad, then with grad enabled: autograd's route then
    wide = rand(T, H + 8).requires_grad_()
    with torch.no_grad():
        assert moe_route.expand_rows(wide, m, backend="triton").grad_fn is None
    assert moe_route.expand_rows(wide, m, backend="triton").grad_fn is not None


# --------------------------------------------------------------------------- finalize
@pytest.mark.parametrize("bias_shape", [None, "H", "TH"])
def test_finalize_memo_checks_once_and_follows_what_it_reads(checks, bias_shape):
    m = _maps()
    y = rand(T * K, H, seed=1)
    tw = torch.softmax(rand(T, K, seed=2), dim=-1)
    bias = {None: None, "H": rand(H, seed=3), "TH": rand(T, H, seed=3)}[bias_shape]
    want = _finalize_expected(y, tw, m, bias)
    first = moe_route.finalize_moe_routing(y, tw, m, bias, backend="triton")
    n = len(checks)
    again = moe_route.finalize_moe_routing(y, tw, m, bias, backend="triton")
    assert len(checks) == n, "a repeated call validated its arguments again"
    assert torch.equal(first, again)
    assert_matches(again, want, TOL[torch.float32])
    if bias is not None:  # a bias of the wrong width raises, after a memoised call too
        with pytest.raises(ValueError, match="bias"):
            moe_route.finalize_moe_routing(y, tw, m, bias[..., :-1], backend="triton")
    # weights of another T raise; y_perm of the wrong row count raises
    with pytest.raises(ValueError, match="tokens"):
        moe_route.finalize_moe_routing(y, tw[:-1], m, None, backend="triton")
    with pytest.raises(ValueError, match="T\\*K"):
        moe_route.finalize_moe_routing(y[:-1], tw, m, None, backend="triton")
    # strided weights, float16 rows: right answers
    tw_t = tw.t().contiguous().t()
    got = moe_route.finalize_moe_routing(y, tw_t, m, bias, backend="triton")
    assert_matches(got, want, TOL[torch.float32])
    got = moe_route.finalize_moe_routing(y.half(), tw, m, None, backend="triton")
    assert got.dtype == torch.float16
    assert_matches(got, _finalize_expected(y.half(), tw, m), TOL[torch.float16])
    # a gradient wanted: autograd's route
    twg = tw.clone().requires_grad_()
    out = moe_route.finalize_moe_routing(y, twg, m, bias, backend="triton")
    assert out.grad_fn is not None


# --------------------------------------------------------------------------- grouped GEMM
@pytest.mark.parametrize("gather", [False, True], ids=["x_perm", "gather"])
def test_gemm_memo_checks_once_and_follows_what_it_reads(checks, gather):
    a, w, b, m = gemm_case(T, K, E, H, INTER, "swiglu", bias=True, gather=gather)
    kw = dict(bias=b, activation="swiglu", gather=gather, backend="triton")
    want = gemm_reference(a, w, m, b, activation="swiglu", gather=gather)
    first = moe_route.grouped_gemm(a, w, m, **kw)
    n = len(checks)
    again = moe_route.grouped_gemm(a, w, m, **kw)
    assert len(checks) == n, "a repeated call validated its arguments again"
    assert torch.equal(first, again)
    assert_matches(again, want, TOL[torch.float32])
    # another activation, another layout: their own epilogue
    got = moe_route.grouped_gemm(a, w, m, **dict(kw, activation="geglu"))
    assert_matches(got, gemm_reference(a, w, m, b, activation="geglu", gather=gather),
                   TOL[torch.float32])  # fmt: skip
    got = moe_route.grouped_gemm(a, w, m, gate_up_layout="interleaved", **kw)
    want_il = gemm_reference(a, w, m, b, activation="swiglu", layout="interleaved",
                             gather=gather)  # fmt: skip
    assert_matches(got, want_il, TOL[torch.float32])
    # transposed weights: the same product
    w_t = w.transpose(1, 2).contiguous().transpose(1, 2)
    assert_matches(moe_route.grouped_gemm(a, w_t, m, **kw), want, TOL[torch.float32])
    # wrong shapes still raise, naming the argument
    with pytest.raises(ValueError, match="bias"):
        moe_route.grouped_gemm(a, w, m, **dict(kw, bias=b[:, :-2]))
    with pytest.raises(ValueError, match="a"):
        moe_route.grouped_gemm(a[:-1], w, m, **kw)
    with pytest.raises(ValueError, match="experts"):
        moe_route.grouped_gemm(a, w[:-1], m, **dict(kw, bias=b[:-1]))
    # a gradient wanted: autograd's route
    wg = w.clone().requires_grad_()
    assert moe_route.grouped_gemm(a, wg, m, **kw).grad_fn is not None


def test_gemm_memo_follows_the_backend_override(monkeypatch, checks):
    a, w, _, m = gemm_case(T, K, E, H, INTER, "identity")
    want = gemm_reference(a, w, m)
    moe_route.grouped_gemm(a, w, m)
    launched = []
    real = kt.ThinKernel.launch
    monkeypatch.setattr(kt.ThinKernel, "launch", lambda *a: launched.append(1) or real(*a))
    moe_route.grouped_gemm(a, w, m)
    assert launched == [1]
    monkeypatch.setenv("MOE_ROUTE_BACKEND", "torch")
    assert_matches(moe_route.grouped_gemm(a, w, m), want, TOL[torch.float32])
    assert launched == [1], "the torch backend launched a kernel"


# --------------------------------------------------------------------------- the memo itself
def test_op_memos_are_bounded_and_cleared(monkeypatch):
    monkeypatch.setattr(_dispatch, "MAX_CALLS", 2)
    moe_route.plan.clear_plans()
    m = _maps()
    for width in (8, 16, 24, 32):
        moe_route.expand_rows(rand(T, width), m, backend="triton")
        assert 1 <= len(permute._CALLS) <= 2
    moe_route.plan.clear_plans()
    assert len(permute._CALLS) == len(maps._CALLS) == 0


def test_op_memo_steps_aside_under_a_dispatch_mode(checks):
    """Under a torch dispatch mode (what opcheck, make_fx and fake tensors run under) a
    memoised signature is checked again and goes through the custom op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    m = _maps()
    y = rand(T * K, H, seed=1)
    tw = torch.softmax(rand(T, K, seed=2), dim=-1)
    first = moe_route.finalize_moe_routing(y, tw, m, backend="triton")
    n = len(checks)
    with Passthrough():
        again = moe_route.finalize_moe_routing(y, tw, m, backend="triton")
    assert len(checks) > n
    assert torch.equal(first, again)
    assert len(finalize._CALLS) == 1


def test_fused_moe_memo_checks_the_width_of_a_shared_bias():
    """A ``[H]`` bias is not a per-token tensor: its width is part of the signature."""
    from moe_cases import moe_case, run_moe

    moe_route.plan.clear_plans()
    case = moe_case(T, K, E, H, INTER, bias="H")
    run_moe(case, backend="triton")
    with pytest.raises(ValueError, match="bias"):
        run_moe(dict(case, bias=case["bias"][:-1]), backend="triton")


def test_hand_built_maps_with_strided_tables_are_read_right():
    ids = make_ids(T, K, E)
    tables = routing_maps_reference(ids, E)
    strided = []
    for t in tables:
        wide = torch.full((t.numel(), 2), -7, dtype=t.dtype)
        wide[:, 0] = t
        strided.append(wide[:, 0])  # stride 2
    m = moe_route.RoutingMaps(*strided, num_tokens=T, top_k=K, num_experts=E)
    assert all(t.is_contiguous() for t in m.tensors())
    x = rand(T, H)
    assert torch.equal(moe_route.expand_rows(x, m, backend="triton"), expand_reference(x, m))
