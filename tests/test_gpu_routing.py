"""The router kernels compiled for the GPU (``backend="auto"`` on CUDA), softmax top-k and the
grouped sigmoid (DeepSeek-V3): ids equal to the torch path bit for bit at odd sizes (E = 1..8192,
K up to 8, T up to 10000), ties and NaN included; weights and gradients within
``helpers.router_weight_rtol`` / ``sigmoid_router_rtol``; determinism, no new compile at a new
token count, CUDA-graph capture with no host sync, fullgraph compile, and the layer's outputs
against the same layer routed by the torch path. Skipped without CUDA.

The ids' oracle is the torch path on a CPU copy of the logits: the contract (descending logit,
ties to the lower id, NaN first) is the same on every device, and CUDA's ``torch.sort`` is a
radix sort above 128 keys, whose treatment of ``-0.0`` / NaN bit patterns the CPU's comparison
sort leaves no doubt about.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    capture_cuda_graph,
    poisoned,
    router_weight_rtol,
    sigmoid_router_grad_atol,
    sigmoid_router_rtol,
)

import moe_route
from moe_route import routing
from moe_route.kernels import triton as kt
from moe_route.kernels.triton.router import MAX_EXPERTS
from moe_route.kernels.triton.router_sigmoid import (
    sigmoid_grouped_topk_triton,
    sigmoid_topk_backward_triton,
)
from moe_route.routing import softmax_topk_torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
NAN, INF = float("nan"), float("inf")
EXPERTS = (1, 2, 3, 7, 8, 16, 60, 64, 100, 128, 129, 160, 256, 384)
TOKENS = (1, 7, 333, 10000)


def _logits(T, E, *, seed=0, scale=2.0, dtype=torch.float32):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return (torch.randn(T, E, generator=g, device=CUDA) * scale).to(dtype)


def _assert_matches_cpu_torch_path(logits, K, renormalize, got=None):
    w, ids = moe_route.softmax_topk(logits, K, renormalize) if got is None else got
    w_ref, ids_ref = softmax_topk_torch(logits.cpu(), K, renormalize)
    assert ids.dtype == torch.int32 and w.dtype == w_ref.dtype
    assert torch.equal(ids.cpu(), ids_ref), f"ids differ at {(ids.cpu() != ids_ref).nonzero()[:5]}"
    fi = torch.finfo(w.dtype)
    E = logits.shape[1]
    torch.testing.assert_close(w.cpu(), w_ref, rtol=router_weight_rtol(w.dtype, E, K),
                               atol=fi.smallest_normal, equal_nan=True)  # fmt: skip


@pytest.mark.parametrize("E", EXPERTS)
def test_ids_exact_at_odd_sizes(E):
    """Three kernel variants per E (each compiles): K = min(8, E) with and without
    renormalisation on float32 logits, K = 1 on bf16 logits."""
    assert routing.router_backend(CUDA, "auto", E) == "triton"
    variants = [(min(8, E), torch.float32, True), (min(8, E), torch.float32, False),
                (1, torch.bfloat16, True)]  # fmt: skip
    for T in TOKENS:
        for K, dtype, renormalize in variants:
            logits = _logits(T, E, seed=T + E + K, dtype=dtype)
            got = moe_route.softmax_topk(logits, K, renormalize)
            _assert_matches_cpu_torch_path(logits, K, renormalize, got)
            # the GPU's own torch path agrees too (finite logits, no signed zeros)
            assert torch.equal(got[1], softmax_topk_torch(logits, K, renormalize)[1])


@pytest.mark.parametrize("E", (8, 128, 256, 384))
def test_ties_at_size(E):
    g = torch.Generator(device=CUDA).manual_seed(E)
    ints = torch.randint(-2, 3, (10000, E), generator=g, device=CUDA).float()
    equal = torch.full((64, E), 0.25, device=CUDA)
    for logits in (ints, equal, ints.bfloat16()):
        for K in (1, min(8, E)):
            _assert_matches_cpu_torch_path(logits, K, True)


def test_nan_inf_and_signed_zeros():
    rows = torch.tensor([
        [1.0, NAN, 3.0, INF, NAN, -0.0, 0.0, -INF],
        [INF, 1.0, 2.0, INF, 0.0, 0.0, 0.0, 0.0],
        [-INF] * 8,
        [0.5, -INF, 2.0, -INF, -INF, 1.0, -INF, -INF],
        [0.0, -0.0, -0.0, 0.0, 1.0, -0.0, 1.0, 0.0],
        [3.0, 1.0, 2.0, 0.0, 5.0, 4.0, 7.0, 6.0],
    ], device=CUDA).repeat(50, 1)  # fmt: skip
    wide = torch.zeros(300, 200, device=CUDA)  # above torch's 128-key warp sort on CUDA
    wide[:, ::3] = -0.0
    wide[::7, 5] = NAN
    for logits in (rows, wide):
        for K in (1, 3, 8):
            for renormalize in (True, False):
                _assert_matches_cpu_torch_path(logits, K, renormalize)


@pytest.mark.parametrize("E", (1000, 4096, MAX_EXPERTS))
def test_many_experts(E):
    for T in (1, 37):
        logits = _logits(T, E, seed=E)
        _assert_matches_cpu_torch_path(logits, 8, True)
        _assert_matches_cpu_torch_path(logits, 8, False)


def test_above_the_limit_auto_takes_the_torch_path_and_triton_raises():
    logits = _logits(3, MAX_EXPERTS + 1)
    assert routing.router_backend(CUDA, "auto", MAX_EXPERTS + 1) == "torch"
    _assert_matches_cpu_torch_path(logits, 8, True)
    with pytest.raises(ValueError, match=f"at most {MAX_EXPERTS}"):
        moe_route.softmax_topk(logits, 8, backend="triton")


def _grads(router, logits, g):
    x = logits.detach().clone().requires_grad_(True)
    w, _ = router(x)
    return torch.autograd.grad(w, x, g)[0]


@pytest.mark.parametrize(("T", "E", "K"), [(1, 128, 8), (333, 60, 2), (10000, 384, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_match_the_torch_path(T, E, K, dtype):
    logits = _logits(T, E, seed=T, dtype=dtype)
    g = _logits(T, K, seed=T + 1)
    for renormalize in (True, False):
        got = _grads(lambda x, r=renormalize: moe_route.softmax_topk(x, K, r), logits, g)
        want = _grads(lambda x, r=renormalize: softmax_topk_torch(x, K, r), logits, g)
        atol = 4 * router_weight_rtol(torch.float32, E, K) * g.abs().max().item()
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=torch.finfo(dtype).eps, atol=atol)


def test_deterministic_forward_backward():
    logits = _logits(10000, 256, seed=3)
    g = _logits(10000, 8, seed=4)
    runs = []
    for _ in range(5):
        x = logits.clone().requires_grad_(True)
        w, ids = moe_route.softmax_topk(x, 8, False)
        runs.append((w, ids, torch.autograd.grad(w, x, g)[0]))
    for run in runs[1:]:
        for a, b in zip(run, runs[0], strict=True):
            assert torch.equal(a, b)


def test_new_token_counts_compile_nothing():
    def call(T):
        x = _logits(T, 128, seed=T).requires_grad_(True)
        w, _ = moe_route.softmax_topk(x, 8, True)
        torch.autograd.grad(w, x, torch.ones_like(w))

    call(1)
    keys, binaries = kt.launch_keys(), _triton_binaries()
    for T in (*range(2, 301), 4096, 10000):
        call(T)
    assert kt.launch_keys() == keys
    assert _triton_binaries() == binaries


def _triton_binaries() -> int:
    return sum(
        len(caches[0]) for k in kt.KERNELS for caches in getattr(k.fn, "device_caches", {}).values()
    )


@pytest.mark.isolated  # a failed capture would break the tests after it (tests/conftest.py)
@pytest.mark.parametrize("renormalize", [True, False])
def test_cuda_graph_forward_backward(renormalize):
    logits = _logits(64, 128, seed=5)
    g = _logits(64, 8, seed=6)
    x = logits.clone().requires_grad_(True)

    def fwd_bwd():
        w, ids = moe_route.softmax_topk(x, 8, renormalize)
        (dl,) = torch.autograd.grad(w, x, g)
        return w.detach(), ids, dl

    want = fwd_bwd()
    graph, static = capture_cuda_graph(fwd_bwd)
    with torch.no_grad():
        x.copy_(_logits(64, 128, seed=7))  # new inputs, replayed
    graph.replay()
    torch.cuda.synchronize()
    fresh = fwd_bwd()
    for a, b in zip(static, fresh, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(static[1], want[1])  # the replay did route the new logits


def test_compile_fullgraph_forward_backward():
    logits = _logits(333, 128, seed=8)
    g = _logits(333, 8, seed=9)

    def step(x):
        w, ids = moe_route.softmax_topk(x, 8, False)
        return (w * g).sum(), ids

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    outs = []
    for fn in (compiled, step):
        x = logits.clone().requires_grad_(True)
        loss, ids = fn(x)
        (dl,) = torch.autograd.grad(loss, x)
        outs.append((ids, dl))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("renormalize", [True, False])
def test_layer_unchanged_by_the_kernel(renormalize, monkeypatch):
    """The bf16 layer routed by the kernel against the same layer routed by the torch path:
    the same ids, weights within the bound, the output within bf16 rounding of the experts."""
    torch.manual_seed(0)
    layer = moe_route.MoELayer(256, 128, 128, 8, renormalize=renormalize, device=CUDA,
                               dtype=torch.bfloat16)  # fmt: skip
    x = torch.randn(300, 256, device=CUDA, dtype=torch.bfloat16)
    with torch.no_grad():
        got = layer(x)
        monkeypatch.setattr(routing, "router_backend", lambda *a: "torch")
        want = layer(x)
    assert torch.equal(got.topk_ids, want.topk_ids)
    torch.testing.assert_close(got.topk_weights, want.topk_weights,
                               rtol=router_weight_rtol(torch.float32, 128, 8), atol=0)  # fmt: skip
    torch.testing.assert_close(got.output, want.output, rtol=1.6e-2, atol=1e-3)


# ----------------------------------------------------------------------------- grouped sigmoid
# The DeepSeek-V3 router kernel (routing.sigmoid_grouped_topk). Its oracle is the torch path on
# the same GPU: the kernel computes the sigmoid as torch's CUDA kernel does (1 / (1 + expf(-x)),
# the division rounded to nearest), so the choice scores and group sums are the same bits and
# the ids are exact even on near-ties (test_grouped_sigmoid_is_torchs_bit_for_bit checks the
# premise). On values whose sigmoid is exact anywhere, the CPU torch path is the oracle too.
GROUPED = [  # (E, K, n_group, topk_group)
    (256, 8, 8, 4),  # DeepSeek-V3
    (160, 6, 8, 3),  # G = 20: a padded [8, 32] tile
    (60, 4, 3, 2),
    (384, 8, 8, 4),
    (72, 8, 9, 9),  # every group kept: laid out as one group
    (8, 2, 1, 1),
    (64, 8, 64, 8),  # groups of one expert
    (7, 7, 7, 7),  # K = E
]
WIDE = [(4096, 8, 1, 1), (8192, 8, 64, 4), (8000, 8, 5, 2)]  # the last: a [8, 2048] tile


def _grouped(n_group, topk_group, bias=None, scale=2.5, renormalize=True, **kw):
    return dict(n_group=n_group, topk_group=topk_group, expert_bias=bias,
                routed_scaling_factor=scale, renormalize=renormalize, **kw)  # fmt: skip


def _assert_grouped_matches(logits, K, kw, got=None, *, cpu=False):
    w, ids = moe_route.sigmoid_grouped_topk(logits, K, **kw) if got is None else got
    ref_kw = {**kw, "backend": "torch"}
    if cpu:
        ref_kw["expert_bias"] = None if kw["expert_bias"] is None else kw["expert_bias"].cpu()
        logits = logits.cpu()
    w_ref, ids_ref = moe_route.sigmoid_grouped_topk(logits, K, **ref_kw)
    assert ids.dtype == torch.int32 and w.dtype == w_ref.dtype
    bad = (ids.cpu() != ids_ref.cpu()).nonzero()
    assert not bad.numel(), f"ids differ at {bad[:5].tolist()}"
    torch.testing.assert_close(w.cpu(), w_ref.cpu(), rtol=sigmoid_router_rtol(w.dtype, K),
                               atol=torch.finfo(w.dtype).smallest_normal,
                               equal_nan=True)  # fmt: skip


@pytest.mark.parametrize(("E", "K", "n_group", "topk_group"), GROUPED)
def test_grouped_ids_exact_at_odd_sizes(E, K, n_group, topk_group):
    assert routing.router_backend(CUDA, "auto", E) == "triton"
    bias = _logits(1, E, seed=E, scale=0.3)[0]
    for T in TOKENS:
        for dtype in (torch.float32, torch.bfloat16):
            logits = _logits(T, E, seed=T + E, dtype=dtype)
            _assert_grouped_matches(logits, K, _grouped(n_group, topk_group, bias))
        logits = _logits(T, E, seed=T + E + 1)
        kw = _grouped(n_group, topk_group, None, 1.0, False)
        _assert_grouped_matches(logits, K, kw)


@pytest.mark.parametrize(("E", "K", "n_group", "topk_group"), WIDE)
def test_grouped_many_experts(E, K, n_group, topk_group):
    bias = _logits(1, E, seed=E, scale=0.3)[0]
    for T in (1, 37):
        logits = _logits(T, E, seed=E + T)
        _assert_grouped_matches(logits, K, _grouped(n_group, topk_group, bias))


def test_grouped_sigmoid_is_torchs_bit_for_bit():
    """The premise of exact ids: without renormalisation and scaling the weights are the
    chosen experts' sigmoid, here equal to torch's CUDA sigmoid in every bit, over the range
    the logits take (scale 30: saturation at both ends), and where every chosen score is
    subnormal (logits near -95: the kernel's division must not flush them to zero, as a
    ``div.rn.ftz`` would, or equal subnormal scores would tie at 0)."""
    for dtype in (torch.float32, torch.bfloat16):
        for scale, shift in ((2.0, 0.0), (30.0, 0.0), (3.0, -95.0)):
            logits = (_logits(10000, 256, seed=int(scale), scale=scale) + shift).to(dtype)
            w, ids = moe_route.sigmoid_grouped_topk(logits, 8, renormalize=False)
            want = torch.sigmoid(logits.float()).gather(1, ids.long())
            assert torch.equal(w, want), f"shift {shift}: {(w != want).sum().item()} differ"
            _assert_grouped_matches(logits, 8, _grouped(8, 4, None, 1.0, False))


def test_grouped_ties_and_near_ties_at_size():
    """Integer logits: s(1) + s(-1) and s(0) + s(0) are within an ulp of 1, so group sums
    tie or nearly tie everywhere; dyadic biases make exact ties of the choice scores."""
    g = torch.Generator(device=CUDA).manual_seed(1)
    for E, K, n_group, topk_group in ((256, 8, 8, 4), (160, 6, 8, 3), (64, 8, 64, 8)):
        ints = torch.randint(-2, 3, (10000, E), generator=g, device=CUDA).float()
        bias = torch.randint(-2, 3, (E,), generator=g, device=CUDA).float() / 8
        for logits in (ints, ints.bfloat16(), torch.zeros(64, E, device=CUDA)):
            for b in (None, bias):
                _assert_grouped_matches(logits, K, _grouped(n_group, topk_group, b))


def test_grouped_special_values_against_the_cpu_torch_path():
    """Logits whose sigmoid is exact anywhere (0, ±40, ±200, ±inf, NaN) and dyadic biases with
    ±inf: NaN first, inf + -inf group sums, -inf ties; the CPU torch path's ids and weights."""
    g = torch.Generator(device=CUDA).manual_seed(2)
    pool = torch.tensor([0.0, -0.0, 40.0, -200.0, INF, -INF, NAN], device=CUDA)
    bias_pool = torch.tensor([0.0, 0.25, -0.5, 1.0, INF, -INF], device=CUDA)
    for E, K, n_group, topk_group in ((256, 8, 8, 4), (60, 4, 3, 2), (8, 3, 4, 2)):
        for p_nan in (0.0, 0.01):
            idx = torch.randint(0, 6, (3000, E), generator=g, device=CUDA)
            logits = pool[idx]
            logits[torch.rand(3000, E, generator=g, device=CUDA) < p_nan] = NAN
            bias = bias_pool[torch.randint(0, 6, (E,), generator=g, device=CUDA)]
            for b in (None, bias):
                kw = _grouped(n_group, topk_group, b)
                _assert_grouped_matches(logits, K, kw, cpu=True)
                _assert_grouped_matches(logits, K, kw)


GRAD_SHAPES = [(1, 256, 8, 8, 4), (333, 60, 4, 3, 2), (10000, 384, 8, 8, 4)]


@pytest.mark.parametrize(("T", "E", "K", "n_group", "topk_group"), GRAD_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gradients_match_the_torch_path(T, E, K, n_group, topk_group, dtype):
    logits = _logits(T, E, seed=T, dtype=dtype)
    bias = _logits(1, E, seed=E, scale=0.3)[0]
    g = _logits(T, K, seed=T + 1)
    for renormalize, scale in ((True, 2.5), (False, 2.5), (True, 1.0)):
        kw = _grouped(n_group, topk_group, bias, scale, renormalize)
        got = _grads(lambda x, kw=kw: moe_route.sigmoid_grouped_topk(x, K, **kw), logits, g)
        want = _grads(lambda x, kw=kw: moe_route.sigmoid_grouped_topk(x, K, **kw,
                                                                      backend="torch"),
                      logits, g)  # fmt: skip
        assert got.dtype == dtype
        atol = sigmoid_router_grad_atol(torch.float32, K, scale, g)
        torch.testing.assert_close(got, want, rtol=torch.finfo(dtype).eps, atol=atol)


def test_grouped_float64_and_a_factor_float32_does_not_hold():
    """float64 logits score in float64 and the factor 1/3 multiplies in float64 (a float32
    constant would be 3e-8 off: far outside the float64 bound)."""
    logits = _logits(333, 256, seed=5).double()
    bias = _logits(1, 256, seed=6, scale=0.3)[0].double()
    g = _logits(333, 8, seed=7).double()
    for renormalize in (True, False):
        kw = _grouped(8, 4, bias, 1.0 / 3.0, renormalize)
        _assert_grouped_matches(logits, 8, kw)
        got = _grads(lambda x, kw=kw: moe_route.sigmoid_grouped_topk(x, 8, **kw), logits, g)
        want = _grads(lambda x, kw=kw: moe_route.sigmoid_grouped_topk(x, 8, **kw,
                                                                      backend="torch"),
                      logits, g)  # fmt: skip
        atol = sigmoid_router_grad_atol(torch.float64, 8, 1.0 / 3.0, g)
        torch.testing.assert_close(got, want, rtol=torch.finfo(torch.float64).eps, atol=atol)


def test_grouped_kernels_write_every_output():
    T, E, K = 10000, 256, 8
    logits = _logits(T, E, seed=8)
    bias = _logits(1, E, seed=9, scale=0.3)[0]
    w, ids = poisoned((T, K), torch.float32, CUDA), poisoned((T, K), torch.int32, CUDA)
    sigmoid_grouped_topk_triton(logits, bias, K, 8, 4, True, 2.5, w, ids)
    _assert_grouped_matches(logits, K, _grouped(8, 4, bias), (w, ids))
    g = _logits(T, K, seed=10)
    dl = poisoned((T, E), torch.float32, CUDA)
    sigmoid_topk_backward_triton(g, ids, logits, True, 2.5, dl)
    kw = _grouped(8, 4, bias, backend="torch")
    want = _grads(lambda x: moe_route.sigmoid_grouped_topk(x, K, **kw), logits, g)
    torch.testing.assert_close(dl, want, rtol=torch.finfo(torch.float32).eps,
                               atol=sigmoid_router_grad_atol(torch.float32, K, 2.5, g))  # fmt: skip


def test_grouped_deterministic_and_no_compile_at_new_token_counts():
    bias = _logits(1, 256, seed=11, scale=0.3)[0]

    def call(T):
        x = _logits(T, 256, seed=T).requires_grad_(True)
        w, ids = moe_route.sigmoid_grouped_topk(x, 8, **_grouped(8, 4, bias))
        return w, ids, torch.autograd.grad(w, x, torch.ones_like(w))[0]

    first = call(1)
    keys, binaries = kt.launch_keys(), _triton_binaries()
    for T in (*range(2, 301), 4096, 10000):
        call(T)
    assert kt.launch_keys() == keys
    assert _triton_binaries() == binaries
    for a, b in zip(call(1), first, strict=True):
        assert torch.equal(a, b)
    runs = [call(10000) for _ in range(3)]
    for run in runs[1:]:
        for a, b in zip(run, runs[0], strict=True):
            assert torch.equal(a, b)


@pytest.mark.isolated  # a failed capture would break the tests after it (tests/conftest.py)
def test_grouped_cuda_graph_forward_backward():
    logits = _logits(64, 256, seed=12)
    bias = _logits(1, 256, seed=13, scale=0.3)[0]
    g = _logits(64, 8, seed=14)
    x = logits.clone().requires_grad_(True)

    def fwd_bwd():
        w, ids = moe_route.sigmoid_grouped_topk(x, 8, **_grouped(8, 4, bias))
        (dl,) = torch.autograd.grad(w, x, g)
        return w.detach(), ids, dl

    want = fwd_bwd()
    graph, static = capture_cuda_graph(fwd_bwd)
    with torch.no_grad():
        x.copy_(_logits(64, 256, seed=15))
    graph.replay()
    torch.cuda.synchronize()
    fresh = fwd_bwd()
    for a, b in zip(static, fresh, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(static[1], want[1])


def test_grouped_compile_fullgraph_forward_backward():
    logits = _logits(333, 256, seed=16)
    bias = _logits(1, 256, seed=17, scale=0.3)[0]
    g = _logits(333, 8, seed=18)

    def step(x):
        w, ids = moe_route.sigmoid_grouped_topk(x, 8, **_grouped(8, 4, bias))
        return (w * g).sum(), ids

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    outs = []
    for fn in (compiled, step):
        x = logits.clone().requires_grad_(True)
        loss, ids = fn(x)
        (dl,) = torch.autograd.grad(loss, x)
        outs.append((ids, dl))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


def test_grouped_above_the_limit_auto_takes_the_torch_path_and_triton_raises():
    logits = _logits(3, MAX_EXPERTS + 1)
    kw = _grouped(1, 1)
    ids = moe_route.sigmoid_grouped_topk(logits, 8, **kw)[1]
    assert torch.equal(ids, moe_route.sigmoid_grouped_topk(logits, 8, **kw, backend="torch")[1])
    with pytest.raises(ValueError, match=f"at most {MAX_EXPERTS}"):
        moe_route.sigmoid_grouped_topk(logits, 8, **kw, backend="triton")


def test_grouped_layer_unchanged_by_the_kernel(monkeypatch):
    """A DeepSeek-like bf16 layer routed by the kernel against the same layer routed by the
    torch path: the same ids, weights within the bound, the output within bf16 rounding."""
    torch.manual_seed(0)
    layer = moe_route.MoELayer(256, 128, 64, 6, router="sigmoid_grouped", n_group=8,
                               topk_group=3, routed_scaling_factor=2.5, num_shared_experts=1,
                               device=CUDA, dtype=torch.bfloat16)  # fmt: skip
    with torch.no_grad():
        layer.expert_bias.copy_(torch.linspace(-0.05, 0.05, 64))
    x = torch.randn(300, 256, device=CUDA, dtype=torch.bfloat16)
    with torch.no_grad():
        got = layer(x)
        monkeypatch.setattr(routing, "router_backend", lambda *a: "torch")
        want = layer(x)
    assert torch.equal(got.topk_ids, want.topk_ids)
    torch.testing.assert_close(got.topk_weights, want.topk_weights,
                               rtol=sigmoid_router_rtol(torch.float32, 6), atol=0)  # fmt: skip
    torch.testing.assert_close(got.output, want.output, rtol=1.6e-2, atol=1e-3)
