"""The grouped sigmoid router kernel (DeepSeek-V3; moe_route/kernels/triton/router_sigmoid.py,
``backend="triton"``) against the torch path (``moe_route.routing.sigmoid_grouped_topk_torch``)
and the float64 loop oracle.

Ids are compared exactly. On the CPU the kernel runs under the interpreter, whose sigmoid is
numpy's ``exp`` where torch's CPU path uses its own (they differ by an ulp on ~17% of random
inputs): two implementations can then order two scores within an ulp of each other
differently. Random logits (fixed seeds) have no such near-ties at these sizes; the tie and
special-value tests use logits whose sigmoid is exact in any implementation (``0 → 1/2``,
``±inf``, ``40 → 1``, ``-200 → 0``, NaN) and dyadic biases, so every sum is exact and ties are
real ties. Weights and gradients within ``helpers.sigmoid_router_rtol`` /
``sigmoid_router_grad_atol``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import (
    DEVICE,
    poisoned,
    requires_triton,
    sigmoid_router_grad_atol,
    sigmoid_router_rtol,
    strided_copy,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import moe_route
from moe_route import reference, routing
from moe_route.kernels.triton.router import MAX_EXPERTS
from moe_route.kernels.triton.router_sigmoid import (
    sigmoid_grouped_topk_triton,
    sigmoid_topk_backward_triton,
)
from moe_route.router_ops import SIGMOID_GROUPED_TOPK

pytestmark = requires_triton

NAN, INF = float("nan"), float("inf")


def _logits(T, E, *, seed=0, scale=2.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, E, generator=g, dtype=torch.float64) * scale).to(dtype).to(DEVICE)


def _kw(n_group, topk_group, bias=None, scale=2.5, renormalize=True):
    return dict(n_group=n_group, topk_group=topk_group, expert_bias=bias,
                routed_scaling_factor=scale, renormalize=renormalize)  # fmt: skip


def _kernel(logits, k, **kw):
    return moe_route.sigmoid_grouped_topk(logits, k, **kw, backend="triton")


def _torch(logits, k, **kw):
    return moe_route.sigmoid_grouped_topk(logits, k, **kw, backend="torch")


def _assert_same_routing(got, want, K):
    (w, ids), (w_ref, ids_ref) = got, want
    assert ids.dtype == torch.int32 and w.dtype == w_ref.dtype
    assert ids.shape == w.shape == ids_ref.shape
    assert torch.equal(ids.cpu(), ids_ref.cpu()), (ids, ids_ref)
    fi = torch.finfo(w.dtype)
    torch.testing.assert_close(w.cpu(), w_ref.cpu(), rtol=sigmoid_router_rtol(w.dtype, K),
                               atol=fi.smallest_normal, equal_nan=True)  # fmt: skip


def _grad(router, logits, g):
    x = logits.detach().clone().requires_grad_(True)
    return torch.autograd.grad(router(x)[0], x, g)[0]


def _assert_grads_close(got, want, g, K, scale):
    sdt = torch.float64 if got.dtype == torch.float64 else torch.float32
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=torch.finfo(got.dtype).eps,
                               atol=sigmoid_router_grad_atol(sdt, K, scale, g),
                               equal_nan=True)  # fmt: skip


# ----------------------------------------------------------------------------- forward
# (T, E, K, n_group, topk_group)
SHAPES = [
    (37, 8, 2, 1, 1),  # no groups
    (5, 16, 4, 4, 2),  # DeepSeek-like
    (9, 60, 8, 3, 2),  # E and G = 20 not powers of two
    (4, 6, 2, 6, 3),  # groups of one expert
    (6, 12, 4, 3, 1),  # one group kept, K = E / n_group: exactly that group
    (3, 12, 12, 3, 3),  # every group kept (no limit), K = E
    (3, 72, 9, 9, 9),  # no limit with n_group > 1: laid out as one group
    (2, 256, 8, 8, 4),  # DeepSeek-V3
    (2, 384, 8, 8, 3),  # G = 48: a padded [8, 64] tile
    (1, 1, 1, 1, 1),
]


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize(("T", "E", "K", "n_group", "topk_group"), SHAPES)
def test_matches_torch_path_and_loop(T, E, K, n_group, topk_group, with_bias):
    logits = _logits(T, E, seed=T * E + K)
    bias = _logits(1, E, seed=E, scale=0.3)[0] if with_bias else None
    for renormalize, scale in ((True, 2.5), (False, 1.0)):
        kw = _kw(n_group, topk_group, bias, scale, renormalize)
        got = _kernel(logits, K, **kw)
        _assert_same_routing(got, _torch(logits, K, **kw), K)
        loop = reference.sigmoid_grouped_topk_reference(
            logits.cpu(), K, **{**kw, "expert_bias": None if bias is None else bias.cpu()}
        )
        _assert_same_routing((got[0].cpu(), got[1].cpu()), loop, K)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_logit_and_bias_dtypes(dtype):
    """float64 logits score in float64; bf16 / fp16 in float32 (upcast exactly: same ids); the
    bias is rounded to the score dtype first, as the torch path does."""
    T, E, K = 11, 24, 5
    logits = _logits(T, E, seed=7, dtype=dtype)
    for bias_dtype in (torch.float64, torch.bfloat16, torch.float32):
        bias = _logits(1, E, seed=8, scale=0.3, dtype=bias_dtype)[0]
        kw = _kw(4, 2, bias, 1.0 / 3.0)  # a factor that float32 does not hold exactly
        w, ids = _kernel(logits, K, **kw)
        assert w.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        _assert_same_routing((w, ids), _torch(logits, K, **kw), K)


def test_ties_go_to_the_lower_index():
    """Groups and experts tie on exact values: lower group, then lower expert first."""
    logits = torch.zeros(3, 8, device=DEVICE)  # every score 1/2
    bias = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.25, 0.25, 0.5, 0.25], device=DEVICE)
    # choices .5 1 1 .5 .75 .75 1 .75; group sums 1.5 1.5 1.5 1.75: g3, then g0 of the tied
    w, ids = _kernel(logits, 3, **_kw(4, 2, bias))
    assert ids.tolist() == [[1, 6, 7]] * 3
    _assert_same_routing((w, ids), _torch(logits, 3, **_kw(4, 2, bias)), 3)
    # all equal: ids 0..K-1 in every layout
    for n_group, topk_group in ((1, 1), (4, 2), (8, 4), (2, 2)):
        _, ids = _kernel(torch.zeros(2, 8, device=DEVICE), 4, **_kw(n_group, topk_group))
        assert ids.tolist() == [[0, 1, 2, 3]] * 2
    # the torch path's rule, written out: the same as the loop oracle's
    g = torch.Generator().manual_seed(3)
    pool = torch.tensor([0.0, 0.25, -0.5, 0.125, 1.0])
    bias = pool[torch.randint(0, 5, (12,), generator=g)].to(DEVICE)
    logits = torch.zeros(4, 12, device=DEVICE)
    for n_group, topk_group in ((1, 1), (3, 1), (4, 2), (6, 4), (12, 5)):
        got = _kernel(logits, 4, **_kw(n_group, topk_group, bias))
        kw = _kw(n_group, topk_group, bias.cpu())
        assert torch.equal(got[1].cpu(), reference.sigmoid_grouped_topk_reference(
            logits.cpu(), 4, **kw)[1])  # fmt: skip
        _assert_same_routing(got, _torch(logits, 4, **_kw(n_group, topk_group, bias)), 4)


def test_masked_experts_still_compete_at_minus_inf():
    """As torch's masked_fill: a kept expert whose choice score is -inf (bias -inf) ties with
    the experts of the groups not kept, and the lower id wins."""
    logits = torch.zeros(1, 6, device=DEVICE)  # scores 1/2
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, -INF], device=DEVICE)
    # groups {0,1,2} = 1.0 and {3,4,5} = 3.0 (top-2 of 1.5, 1.5, -inf): g1 kept
    got = _kernel(logits, 3, **_kw(2, 1, bias))
    assert got[1].tolist() == [[3, 4, 0]]  # then -inf: expert 0 (masked) before 5 (kept)
    _assert_same_routing(got, _torch(logits, 3, **_kw(2, 1, bias)), 3)
    # groups of two: one holding -inf sums to -inf, and the tie keeps the lower group
    bias = torch.tensor([1.0, -INF, 0.0, -INF, 1.0, 1.0], device=DEVICE)
    got = _kernel(logits, 4, **_kw(3, 2, bias))
    assert got[1].tolist() == [[0, 4, 5, 1]]  # 1.5 three times, then the -inf of g0
    _assert_same_routing(got, _torch(logits, 4, **_kw(3, 2, bias)), 4)


EXACT_LOGITS = [0.0, -0.0, 40.0, -200.0, INF, -INF, NAN]
EXACT_BIAS = [0.0, -0.0, 0.25, -0.5, 1.0, 0.125, INF, -INF, NAN]


@st.composite
def _exact_case(draw):
    T = draw(st.integers(0, 5), label="T")
    E = draw(st.integers(1, 16), label="E")
    n_group = draw(st.sampled_from([d for d in range(1, E + 1) if E % d == 0]), label="n_group")
    topk_group = draw(st.integers(1, n_group), label="topk_group")
    K = draw(st.integers(1, topk_group * (E // n_group)), label="K")
    logits = draw(st.lists(st.sampled_from(EXACT_LOGITS), min_size=T * E, max_size=T * E))
    bias = draw(st.none() | st.lists(st.sampled_from(EXACT_BIAS), min_size=E, max_size=E))
    return T, E, K, n_group, topk_group, logits, bias


@settings(max_examples=30, deadline=None)
@given(
    case=_exact_case(),
    renormalize=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    bias_dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_ids_and_gradients_equal_torch_path_on_exact_values(case, renormalize, dtype,
                                                            bias_dtype):  # fmt: skip
    """Many ties, signed zeros, infinities (an inf + -inf group sum is NaN), NaN scores (first,
    lower id first) and NaN biases: the ids always equal, the gradients too (NaN where torch's
    sigmoid backward puts one: at every NaN logit, chosen or not)."""
    T, E, K, n_group, topk_group, values, bias = case
    logits = torch.tensor(values, dtype=torch.float32).reshape(T, E).to(dtype).to(DEVICE)
    if bias is not None:
        bias = torch.tensor(bias, dtype=bias_dtype, device=DEVICE)
    kw = _kw(n_group, topk_group, bias, 1.5, renormalize)
    g = torch.linspace(-1, 1, T * K, device=DEVICE).reshape(T, K)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the interpreter's numpy: exp overflow
        got = _kernel(logits, K, **kw)
        _assert_same_routing(got, _torch(logits, K, **kw), K)
        dl = _grad(lambda x: _kernel(x, K, **kw), logits, g)
    _assert_grads_close(dl, _grad(lambda x: _torch(x, K, **kw), logits, g), g, K, 1.5)


def test_zero_tokens():
    for dtype in (torch.float32, torch.float64):
        logits = torch.zeros(0, 8, dtype=dtype, device=DEVICE, requires_grad=True)
        w, ids = _kernel(logits, 2, **_kw(4, 2, torch.zeros(8, device=DEVICE)))
        assert w.shape == ids.shape == (0, 2) and w.dtype == dtype and ids.dtype == torch.int32
        w.sum().backward()
        assert logits.grad.shape == (0, 8)


@pytest.mark.parametrize("layout", ["transposed", "cols", "rows", "stride0"])
def test_strided_logits_and_bias_give_the_same_bits(layout):
    T, E, K = 9, 20, 4
    dense = _logits(T, E, seed=4)
    if layout == "stride0":
        dense = dense[:1].expand(T, E).contiguous()
        strided = dense[:1].expand(T, E)
    else:
        strided = strided_copy(dense, layout)
    bias = _logits(1, 2 * E, seed=5, scale=0.3)[0]
    for renormalize in (True, False):
        want_kw = _kw(5, 2, bias[::2].contiguous(), 2.5, renormalize)
        got_kw = _kw(5, 2, bias[::2], 2.5, renormalize)
        want = _kernel(dense, K, **want_kw)
        got = _kernel(strided, K, **got_kw)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        g = _logits(T, K, seed=6)
        dl = _grad(lambda x, kw=got_kw: _kernel(x, K, **kw), strided, g)
        assert torch.equal(dl, _grad(lambda x, kw=want_kw: _kernel(x, K, **kw), dense, g))


def test_kernel_writes_every_output():
    """The launchers into NaN / sentinel-poisoned outputs: every element written."""
    T, E, K = 13, 60, 6
    logits = _logits(T, E, seed=12)
    bias = _logits(1, E, seed=13, scale=0.3)[0]
    w, ids = poisoned((T, K), torch.float32, DEVICE), poisoned((T, K), torch.int32, DEVICE)
    sigmoid_grouped_topk_triton(logits, bias, K, 4, 2, True, 2.5, w, ids)
    want = _torch(logits, K, **_kw(4, 2, bias))
    _assert_same_routing((w, ids), want, K)
    g = _logits(T, K, seed=14)
    dl = poisoned((T, E), torch.float32, DEVICE)
    sigmoid_topk_backward_triton(g, ids, logits, True, 2.5, dl)
    assert not dl.isnan().any()
    want_dl = _grad(lambda x: _torch(x, K, **_kw(4, 2, bias)), logits, g)
    _assert_grads_close(dl, want_dl, g, K, 2.5)


# ----------------------------------------------------------------------------- backward
@pytest.mark.parametrize(("T", "E", "K", "n_group", "topk_group"),
                         [(13, 10, 3, 5, 2), (4, 60, 8, 3, 2), (3, 6, 6, 1, 1)])  # fmt: skip
def test_gradients_match_torch_path(T, E, K, n_group, topk_group):
    logits = _logits(T, E, seed=E)
    bias = _logits(1, E, seed=E + 1, scale=0.3)[0]
    for renormalize, scale in ((True, 2.5), (False, 2.5), (True, 1.0)):
        kw = _kw(n_group, topk_group, bias, scale, renormalize)
        for g in (_logits(T, K, seed=1), torch.ones(T, K, device=DEVICE).expand(T, K)):
            got = _grad(lambda x, kw=kw: _kernel(x, K, **kw), logits, g)
            want = _grad(lambda x, kw=kw: _torch(x, K, **kw), logits, g)
            _assert_grads_close(got, want, g, K, scale)
        # the chosen experts' columns only (finite logits): zero elsewhere
        ids = _kernel(logits, K, **kw)[1].long()
        off = torch.ones_like(got, dtype=torch.bool).scatter_(1, ids, False)
        assert (got[off] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gradients_of_low_precision_logits(dtype):
    T, E, K = 7, 12, 3
    logits = _logits(T, E, seed=2, dtype=dtype)
    g = _logits(T, K, seed=3)
    for renormalize in (True, False):
        kw = _kw(4, 2, None, 2.5, renormalize)
        got = _grad(lambda x, kw=kw: _kernel(x, K, **kw), logits, g)
        want = _grad(lambda x, kw=kw: _torch(x, K, **kw), logits, g)
        assert got.dtype == dtype
        _assert_grads_close(got, want, g, K, 2.5)


def test_gradcheck_float64():
    bias = torch.linspace(-0.1, 0.1, 8, dtype=torch.float64, device=DEVICE)
    logits = _logits(5, 8, seed=6, dtype=torch.float64).requires_grad_(True)
    for renormalize in (True, False):
        kw = _kw(4, 2, bias, 1.5, renormalize)
        assert torch.autograd.gradcheck(lambda x, kw=kw: _kernel(x, 3, **kw)[0], (logits,),
                                        fast_mode=True)  # fmt: skip
    t = _logits(8, 5, seed=6, dtype=torch.float64).t().requires_grad_(True)  # transposed
    assert torch.autograd.gradcheck(lambda x: _kernel(x, 3, **_kw(2, 1))[0], (t,), fast_mode=True)


def test_bias_gets_no_gradient():
    logits = _logits(4, 8, seed=7).requires_grad_(True)
    bias = torch.zeros(8, device=DEVICE, requires_grad=True)
    w, _ = _kernel(logits, 2, **_kw(4, 2, bias))
    w.sum().backward()
    assert bias.grad is None and logits.grad is not None


def test_deterministic():
    logits = _logits(33, 40, seed=9)
    g = _logits(33, 6, seed=10)
    kw = _kw(8, 3, _logits(1, 40, seed=11, scale=0.3)[0])
    runs = []
    for _ in range(2):
        x = logits.detach().clone().requires_grad_(True)
        w, ids = _kernel(x, 6, **kw)
        (dl,) = torch.autograd.grad(w, x, g)
        runs.append((w, ids, dl))
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- op, compile
@pytest.mark.parametrize(("with_bias", "requires_grad"), [(False, False), (True, True)])
def test_opcheck(with_bias, requires_grad):
    logits = _logits(6, 12, seed=11).requires_grad_(requires_grad)
    bias = _logits(1, 12, seed=12, scale=0.3)[0] if with_bias else None
    torch.library.opcheck(SIGMOID_GROUPED_TOPK.op, (logits, bias, 3, 4, 2, True, 2.5))
    _, ids = SIGMOID_GROUPED_TOPK.impl(logits.detach(), bias, 3, 4, 2, False, 1.0)
    g = _logits(6, 3, seed=13)
    op = torch.ops.moe_route.sigmoid_grouped_topk_backward.default
    torch.library.opcheck(op, (g, ids, logits.detach(), True, 2.5))


def test_compile_fullgraph_forward_backward():
    logits = _logits(6, 12, seed=13)
    g = _logits(6, 3, seed=14)
    bias = _logits(1, 12, seed=15, scale=0.3)[0]

    def step(x):
        w, ids = moe_route.sigmoid_grouped_topk(x, 3, **_kw(4, 2, bias), backend="triton")
        return (w * g).sum(), ids

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    outs = []
    for fn in (compiled, step):
        x = logits.detach().clone().requires_grad_(True)
        loss, ids = fn(x)
        loss.backward()
        outs.append((loss, ids, x.grad))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- choice, errors
def test_backend_choice(monkeypatch):
    monkeypatch.delenv("MOE_ROUTE_BACKEND", raising=False)
    logits = _logits(3, 8, seed=16).cpu()
    calls = []
    monkeypatch.setattr(routing, "SIGMOID_GROUPED_TOPK", lambda *a: calls.append(a) or (0, 0))
    moe_route.sigmoid_grouped_topk(logits, 2)  # auto on a CPU tensor: the torch path
    moe_route.sigmoid_grouped_topk(logits, 2, backend="torch")
    assert not calls
    moe_route.sigmoid_grouped_topk(logits, 2, n_group=4, topk_group=4, backend="triton")
    assert len(calls) == 1 and calls[0][3:5] == (4, 4)


def test_errors_before_any_launch(monkeypatch):
    def no_launch(*a):
        raise AssertionError("launched")

    monkeypatch.setattr(routing, "SIGMOID_GROUPED_TOPK", no_launch)
    wide = torch.zeros(1, MAX_EXPERTS + 1)
    with pytest.raises(ValueError, match=f"num_experts={MAX_EXPERTS + 1}.*at most {MAX_EXPERTS}"):
        moe_route.sigmoid_grouped_topk(wide, 2, backend="triton")
    logits = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="expert_bias is on meta"):
        moe_route.sigmoid_grouped_topk(logits, 2, expert_bias=torch.zeros(8, device="meta"),
                                       backend="triton")  # fmt: skip
    with pytest.raises(TypeError, match="routed_scaling_factor must be a number, got str"):
        moe_route.sigmoid_grouped_topk(logits, 2, routed_scaling_factor="2", backend="triton")
    with pytest.raises(ValueError, match="topk_group=3"):
        moe_route.sigmoid_grouped_topk(logits, 2, n_group=2, topk_group=3, backend="triton")
    with pytest.raises(ValueError, match="backend='nope'"):
        moe_route.sigmoid_grouped_topk(logits, 2, backend="nope")
    # auto above the limit takes the torch path
    assert moe_route.sigmoid_grouped_topk(wide, 2)[1].tolist() == [[0, 1]]


def test_layer_routes_through_the_kernel():
    torch.manual_seed(0)
    layer = moe_route.MoELayer(8, 4, 8, 2, router="sigmoid_grouped", n_group=4, topk_group=2,
                               routed_scaling_factor=2.5, backend="triton").to(DEVICE)  # fmt: skip
    layer.expert_bias.copy_(torch.linspace(-0.2, 0.2, 8))
    x = _logits(5, 8, seed=15)
    out = layer(x)
    want = _torch(out.router_logits, 2, **_kw(4, 2, layer.expert_bias, 2.5))
    _assert_same_routing((out.topk_weights, out.topk_ids), want, 2)
