"""The softmax top-k router kernel compiled for the GPU (``backend="auto"`` on CUDA): ids equal
to the torch path bit for bit at odd sizes (E = 1..8192, K up to 8, T up to 10000), ties and
NaN included; weights and gradients within ``helpers.router_weight_rtol``; determinism, no new
compile at a new token count, CUDA-graph capture with no host sync, fullgraph compile, and the
layer's outputs against the same layer routed by the torch path. Skipped without CUDA.

The ids' oracle is the torch path on a CPU copy of the logits: the contract (descending logit,
ties to the lower id, NaN first) is the same on every device, and CUDA's ``torch.sort`` is a
radix sort above 128 keys, whose treatment of ``-0.0`` / NaN bit patterns the CPU's comparison
sort leaves no doubt about.
"""

from __future__ import annotations

import pytest
import torch
from helpers import capture_cuda_graph, router_weight_rtol

import moe_route
from moe_route import routing
from moe_route.kernels import triton as kt
from moe_route.kernels.triton.router import MAX_EXPERTS
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
