"""The softmax top-k router kernel (moe_route/kernels/triton/router_softmax.py,
``backend="triton"``) against the torch path (``moe_route.routing.softmax_topk_torch``) and the
float64 loop oracle.

Ids are compared exactly, ties, NaN and infinities included (both rank the logits, ties to the
lower id, NaN first as ``torch.sort``); weights and gradients within the bound that
``helpers.router_weight_rtol`` derives from the dtype, ``E`` and ``K``. On the CPU the kernel
runs under the interpreter; ``auto`` on a CPU tensor is the torch path.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import DEVICE, requires_triton, router_weight_rtol, strided_copy
from hypothesis import given, settings
from hypothesis import strategies as st

import moe_route
from moe_route import reference, routing
from moe_route.kernels.triton.router import MAX_EXPERTS
from moe_route.router_ops import SOFTMAX_TOPK
from moe_route.routing import softmax_topk_torch

pytestmark = requires_triton

NAN, INF = float("nan"), float("inf")


def _logits(T, E, *, seed=0, scale=2.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, E, generator=g, dtype=torch.float64) * scale).to(dtype).to(DEVICE)


def _kernel(logits, k, renormalize=True):
    return moe_route.softmax_topk(logits, k, renormalize, backend="triton")


def _assert_same_routing(got, want, E, K):
    (w, ids), (w_ref, ids_ref) = got, want
    assert ids.dtype == torch.int32 and w.dtype == w_ref.dtype
    assert ids.shape == w.shape == ids_ref.shape
    assert torch.equal(ids.cpu(), ids_ref.cpu()), (ids, ids_ref)
    fi = torch.finfo(w.dtype)
    torch.testing.assert_close(w.cpu(), w_ref.cpu(), rtol=router_weight_rtol(w.dtype, E, K),
                               atol=fi.smallest_normal, equal_nan=True)  # fmt: skip


def _grad(router, logits, g):
    x = logits.detach().clone().requires_grad_(True)
    return torch.autograd.grad(router(x)[0], x, g)[0]


def _assert_grads_close(got, want, g, E, K):
    """``dlogits = w ⊙ (g - Σ w g)``: a weight error of ``rtol`` moves it by at most
    ``4 rtol max|g|`` (see :func:`helpers.router_weight_rtol`), plus one rounding to the logits'
    dtype."""
    scale = g.abs().max().item() if g.numel() else 0.0
    atol = 4 * router_weight_rtol(torch.float64 if g.dtype == torch.float64 else torch.float32,
                                  E, K) * scale  # fmt: skip
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=torch.finfo(got.dtype).eps,
                               atol=atol, equal_nan=True)  # fmt: skip


# ----------------------------------------------------------------------------- forward
SHAPES = [(37, 8, 2), (5, 16, 8), (3, 4, 4), (1, 1, 1), (9, 60, 8), (4, 130, 3), (2, 384, 8)]


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(("T", "E", "K"), SHAPES)
def test_matches_torch_path_and_loop(T, E, K, renormalize):
    logits = _logits(T, E, seed=T * E + K)
    got = _kernel(logits, K, renormalize)
    _assert_same_routing(got, softmax_topk_torch(logits, K, renormalize), E, K)
    w_loop, ids_loop = reference.softmax_topk_reference(logits.cpu(), K, renormalize)
    _assert_same_routing((got[0].cpu(), got[1].cpu()), (w_loop, ids_loop), E, K)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_logit_dtypes(dtype, renormalize):
    """float64 logits score in float64; bf16 / fp16 in float32 (upcast exactly: same ids)."""
    T, E, K = 11, 24, 5
    logits = _logits(T, E, seed=7, dtype=dtype)
    w, ids = _kernel(logits, K, renormalize)
    assert w.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    _assert_same_routing((w, ids), softmax_topk_torch(logits, K, renormalize), E, K)


def _tie_cases():
    g = torch.Generator().manual_seed(3)
    return {
        "integers": torch.randint(-2, 3, (16, 12), generator=g).float(),
        "all-equal": torch.full((4, 9), 3.5),
        "all-zero": torch.zeros(3, 7),
        "repeated": torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0, 3.0, 3.0, 2.0]] * 3),
        "signed-zeros": torch.tensor([[0.0, -0.0, 0.0, -0.0, 1.0, 1.0, -1.0, -0.0]] * 2),
        "bf16-rounded": torch.randn(16, 40, generator=g).bfloat16().float(),
    }


@pytest.mark.parametrize("case", _tie_cases().keys())
def test_ties_go_to_the_lower_id(case):
    logits = _tie_cases()[case].to(DEVICE)
    E = logits.shape[1]
    for K in sorted({1, min(3, E), E}):
        got = _kernel(logits, K, True)
        _assert_same_routing(got, softmax_topk_torch(logits, K, True), E, K)
        rule = [sorted(range(E), key=lambda e, r=row: (-r[e], e))[:K] for row in logits.tolist()]
        assert got[1].tolist() == rule


NAN_ROWS = torch.tensor([
    [1.0, NAN, 3.0, INF, NAN, -0.0, 0.0, -INF],  # NaN first (by id), then +inf, then the rest
    [INF, 1.0, 2.0, INF, 0.0, 0.0, 0.0, 0.0],  # +inf: the softmax is NaN
    [-INF] * 8,  # only -inf: NaN as well
    [0.5, -INF, 2.0, -INF, -INF, 1.0, -INF, -INF],  # some -inf: weight 0, grad 0
    [NAN] * 8,
    [3.0, 1.0, 2.0, 0.0, 5.0, 4.0, 7.0, 6.0],  # a finite row is untouched by its neighbours
])  # fmt: skip


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, interp.
@pytest.mark.parametrize("renormalize", [True, False])
def test_nan_and_inf_logits_follow_the_torch_path(renormalize):
    logits = NAN_ROWS.to(DEVICE)
    for K in (1, 3, 6, 8):
        w, ids = _kernel(logits, K, renormalize)
        _assert_same_routing((w, ids), softmax_topk_torch(logits, K, renormalize), 8, K)
        assert w[:3].isnan().all() and w[4].isnan().all() and not w[5].isnan().any()
        g = _logits(6, K, seed=K)
        got = _grad(lambda x, K=K: _kernel(x, K, renormalize), logits, g)
        want = _grad(lambda x, K=K: softmax_topk_torch(x, K, renormalize), logits, g)
        _assert_grads_close(got, want, g, 8, K)
    assert ids[0].tolist() == [1, 4, 3, 2, 0, 5, 6, 7]


def test_zero_tokens():
    for dtype in (torch.float32, torch.float64):
        logits = torch.zeros(0, 6, dtype=dtype, device=DEVICE, requires_grad=True)
        w, ids = _kernel(logits, 2)
        assert w.shape == ids.shape == (0, 2) and w.dtype == dtype and ids.dtype == torch.int32
        w.sum().backward()
        assert logits.grad.shape == (0, 6)


@pytest.mark.parametrize("layout", ["transposed", "cols", "rows", "stride0"])
def test_strided_logits_give_the_same_bits(layout):
    T, E, K = 9, 20, 4
    dense = _logits(T, E, seed=4)
    if layout == "stride0":
        dense = dense[:1].expand(T, E).contiguous()
        strided = dense[:1].expand(T, E)
    else:
        strided = strided_copy(dense, layout)
    for renormalize in (True, False):
        want = _kernel(dense, K, renormalize)
        got = _kernel(strided, K, renormalize)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        g = _logits(T, K, seed=5)
        router = lambda x, r=renormalize: _kernel(x, K, r)
        assert torch.equal(_grad(router, strided, g), _grad(router, dense, g))


@settings(max_examples=30)
@given(
    T=st.integers(0, 6),
    E=st.integers(1, 20),
    data=st.data(),
    renormalize=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_ids_equal_torch_path_on_any_values(T, E, data, renormalize, dtype):
    """Few distinct values (many ties), signed zeros, infinities, NaN: ids always equal."""
    K = data.draw(st.integers(1, E), label="K")
    pool = [0.0, -0.0, 1.0, -1.0, 2.5, 1e-30, -1e4, INF, -INF, NAN]
    values = data.draw(st.lists(st.sampled_from(pool), min_size=T * E, max_size=T * E))
    logits = torch.tensor(values, dtype=torch.float32).reshape(T, E).to(dtype).to(DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the interpreter's numpy: inf - inf
        got = _kernel(logits, K, renormalize)
    _assert_same_routing(got, softmax_topk_torch(logits, K, renormalize), E, K)


# ----------------------------------------------------------------------------- backward
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(("T", "E", "K"), [(13, 10, 3), (4, 60, 8), (3, 5, 5)])
def test_gradients_match_torch_path(T, E, K, renormalize):
    logits = _logits(T, E, seed=E)
    for g in (_logits(T, K, seed=1), torch.ones(T, K, device=DEVICE).expand(T, K)):
        got = _grad(lambda x: _kernel(x, K, renormalize), logits, g)
        want = _grad(lambda x: softmax_topk_torch(x, K, renormalize), logits, g)
        _assert_grads_close(got, want, g, E, K)
    # a stride-0 gradient, as from weights.sum()
    x = logits.detach().clone().requires_grad_(True)
    _kernel(x, K, renormalize)[0].sum().backward()
    _assert_grads_close(x.grad, _grad(lambda x: softmax_topk_torch(x, K, renormalize), logits,
                                      torch.ones(T, K, device=DEVICE)), g, E, K)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gradients_of_low_precision_logits(dtype):
    T, E, K = 7, 12, 3
    logits = _logits(T, E, seed=2, dtype=dtype)
    g = _logits(T, K, seed=3)
    for renormalize in (True, False):
        got = _grad(lambda x, r=renormalize: _kernel(x, K, r), logits, g)
        want = _grad(lambda x, r=renormalize: softmax_topk_torch(x, K, r), logits, g)
        assert got.dtype == dtype
        _assert_grads_close(got, want, g, E, K)


@pytest.mark.parametrize("renormalize", [True, False])
def test_gradcheck_float64(renormalize):
    logits = _logits(5, 9, seed=6, dtype=torch.float64).requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda x: _kernel(x, 3, renormalize)[0], (logits,), fast_mode=True
    )
    t = _logits(9, 5, seed=6, dtype=torch.float64).t().requires_grad_(True)  # transposed
    assert torch.autograd.gradcheck(lambda x: _kernel(x, 4, renormalize)[0], (t,), fast_mode=True)


def test_deterministic():
    logits = _logits(33, 40, seed=9)
    g = _logits(33, 6, seed=10)
    for renormalize in (True, False):
        runs = []
        for _ in range(2):
            x = logits.detach().clone().requires_grad_(True)
            w, ids = _kernel(x, 6, renormalize)
            (dl,) = torch.autograd.grad(w, x, g)
            runs.append((w, ids, dl))
        for a, b in zip(*runs, strict=True):
            assert torch.equal(a, b)


# ----------------------------------------------------------------------------- op, compile
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("renormalize", [True, False])
def test_opcheck(renormalize, requires_grad):
    logits = _logits(6, 10, seed=11).requires_grad_(requires_grad)
    torch.library.opcheck(SOFTMAX_TOPK.op, (logits, 3, renormalize))
    w, ids = SOFTMAX_TOPK.impl(logits.detach(), 3, renormalize)
    g = _logits(6, 3, seed=12)
    op = torch.ops.moe_route.softmax_topk_backward.default
    torch.library.opcheck(op, (g, w, ids, logits.detach(), renormalize))


def test_compile_fullgraph_forward_backward():
    logits = _logits(6, 10, seed=13)
    g = _logits(6, 3, seed=14)

    def step(x):
        w, ids = moe_route.softmax_topk(x, 3, False, backend="triton")
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


# ----------------------------------------------------------------------------- choice
def test_backend_choice(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("MOE_ROUTE_BACKEND", raising=False)
    assert routing.router_backend(cpu, "auto", 8) == "torch"  # the interpreter only if asked
    assert routing.router_backend(cpu, "triton", 8) == "triton"
    assert routing.router_backend(cpu, "reference", 8) == "torch"
    monkeypatch.setenv("MOE_ROUTE_BACKEND", "triton")
    assert routing.router_backend(cpu, "auto", 8) == "triton"
    assert routing.router_backend(cpu, "auto", MAX_EXPERTS + 1) == "torch"  # auto falls back
    monkeypatch.setenv("MOE_ROUTE_BACKEND", "torch")
    assert routing.router_backend(cpu, "auto", 8) == "torch"
    logits = torch.zeros(1, 6)
    with pytest.raises(ValueError, match="backend='nope'"):
        moe_route.softmax_topk(logits, 2, backend="nope")


def test_too_many_experts_for_the_kernel_raises_before_launch():
    logits = torch.zeros(1, MAX_EXPERTS + 1)
    with pytest.raises(ValueError, match=f"num_experts={MAX_EXPERTS + 1}.*at most {MAX_EXPERTS}"):
        moe_route.softmax_topk(logits, 2, backend="triton")
    # auto takes the torch path (on a CPU tensor it would anyway): still the contract's ids
    assert moe_route.softmax_topk(logits, 2)[1].tolist() == [[0, 1]]


def test_layer_routes_through_the_kernel():
    torch.manual_seed(0)
    layer = moe_route.MoELayer(8, 4, 6, 2, renormalize=False, routed_scaling_factor=1.5,
                               backend="triton").to(DEVICE)  # fmt: skip
    x = _logits(5, 8, seed=15)
    out = layer(x)
    w_ref, ids_ref = softmax_topk_torch(out.router_logits, 2, False)
    assert torch.equal(out.topk_ids, ids_ref)
    torch.testing.assert_close(out.topk_weights, 1.5 * w_ref,
                               rtol=router_weight_rtol(torch.float32, 6, 2), atol=0)  # fmt: skip
