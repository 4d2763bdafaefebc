"""The router's matmul fused with the softmax top-k (``gate_softmax_topk_triton`` in
moe_route/kernels/triton/router_gate.py; ``routing.route_softmax_fused``, which an inference
``MoELayer`` takes at small T).

The kernel's ids must be exactly those of the standalone softmax top-k kernel run on the logits
the fused kernel stored (the same selection code on the same values), its weights within the
bound ``helpers.router_weight_rtol`` derives (the sums run in the order of another register
layout, the MMA's); the stored logits are ``x @ G^T`` within float32 summation error (the
order differs from a matmul library's). Which calls take the one launch is checked exactly. On
the CPU the kernels run under the interpreter in float32 / float16 (its bf16 ``tl.dot`` is
wrong); bf16 on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, requires_triton, router_weight_rtol, strided_copy

import moe_route
from moe_route import routing
from moe_route.kernels.triton.router_gate import (
    GATE_MAX_BYTES,
    GateLaunch,
    gate_softmax_topk_triton,
)
from moe_route.kernels.triton.router_softmax import softmax_topk_triton

pytestmark = requires_triton

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def _inputs(T, H, E, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, dtype=torch.float64).to(dtype).to(DEVICE)
    w = (torch.randn(E, H, generator=g, dtype=torch.float64) / H**0.5).to(dtype).to(DEVICE)
    return x, w


def _fused(x, w, k, renormalize, logits_dtype):
    T, E = x.shape[0], w.shape[0]
    logits = torch.full((T, E), float("nan"), dtype=logits_dtype, device=DEVICE)  # poisoned
    weights = torch.full((T, k), float("nan"), dtype=torch.float32, device=DEVICE)
    ids = torch.full((T, k), -7, dtype=torch.int32, device=DEVICE)
    gate_softmax_topk_triton(x, w, k, renormalize, logits, weights, ids)
    return logits, weights, ids


def _summation_atol(x, w):
    """float32 summation error of ``x @ w^T`` (``H`` terms): ``H * eps * Σ|x||w|`` per entry."""
    bound = x.abs().double() @ w.abs().double().t()
    return x.shape[1] * torch.finfo(torch.float32).eps * bound


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("T", "H", "E", "k"),
    [(1, 64, 16, 4), (5, 200, 60, 8), (17, 37, 7, 7), (64, 96, 128, 8), (3, 130, 256, 1)],
    ids=["T=1", "odd-E", "K=E", "T=64", "E=256"],
)  # fmt: skip
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "plain"])
def test_matches_the_router_on_its_logits(dtype, T, H, E, k, renormalize):
    x, w = _inputs(T, H, E, dtype, seed=T + E)
    for logits_dtype in {torch.float32, dtype}:
        logits, weights, ids = _fused(x, w, k, renormalize, logits_dtype)
        want = x.double() @ w.double().t()
        err = (logits.double() - want).abs()
        tol = _summation_atol(x, w) + (want.abs() * torch.finfo(logits_dtype).eps)
        assert bool((err <= tol).all()), f"logits off by {float((err - tol).max())}"
        w_ref = torch.empty_like(weights)
        ids_ref = torch.empty_like(ids)
        softmax_topk_triton(logits, k, renormalize, w_ref, ids_ref)
        assert torch.equal(ids, ids_ref)
        torch.testing.assert_close(weights, w_ref, rtol=router_weight_rtol(torch.float32, E, k),
                                   atol=torch.finfo(torch.float32).smallest_normal)  # fmt: skip


@pytest.mark.parametrize("layout", ["transposed", "cols"])
def test_strided_tokens_and_gate(layout):
    x, w = _inputs(9, 48, 24, torch.float32, seed=3)
    want = _fused(x, w, 4, True, torch.float32)
    got = _fused(strided_copy(x, layout), strided_copy(w, layout), 4, True, torch.float32)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_which_calls_take_it():
    """One launch only for eager inference at up to 64 tokens and 256 MiB of expert weights
    to read, with a small gate, the logits in float32 or the tokens' dtype, on the Triton
    backend."""
    x, w = _inputs(4, 32, 16, torch.float32, seed=4)

    def fused(x=x, w=w, logits_dtype=torch.float32, backend="triton", expert_bytes=1 << 20):
        with torch.no_grad():
            return routing.route_softmax_fused(x, w, 2, True, logits_dtype, expert_bytes, backend)

    assert fused() is not None
    assert fused(logits_dtype=torch.float16) is None  # neither float32 nor x's dtype
    assert fused(x=x.double(), w=w.double(), logits_dtype=torch.float64) is None
    assert fused(x=x.half()) is None  # x and the gate in different dtypes
    assert fused(x=x.new_zeros(0, 32)) is None
    assert fused(x=torch.randn(65, 32, device=DEVICE)) is None
    assert fused(backend="torch") is None
    # 4 tokens x 2 slots: the experts' weights past 256 MiB (a device-bound call)
    assert fused(expert_bytes=32 << 20) is not None
    assert fused(expert_bytes=(32 << 20) + 1) is None
    too_big = GATE_MAX_BYTES // (4 * 64) + 1  # experts of a 64-wide float32 gate past the limit
    assert fused(x=torch.randn(2, 64, device=DEVICE), w=torch.randn(too_big, 64, device=DEVICE)) \
        is None  # fmt: skip
    wg = w.clone().requires_grad_(True)
    assert routing.route_softmax_fused(x, wg, 2, True, torch.float32, 0, "triton") is None
    with torch.no_grad():
        assert routing.route_softmax_fused(x, wg, 2, True, torch.float32, 0, "triton") is not None


def test_layer_inference_routes_in_one_launch(monkeypatch):
    """An inference MoELayer takes the fused router: the logits it returns are the kernel's,
    its routing that of softmax_topk on them, and the output that of the two-step router."""
    torch.manual_seed(5)
    layer = moe_route.MoELayer(48, 24, 16, 4, dtype=torch.float32, device=DEVICE,
                               backend="triton", routed_scaling_factor=2.0).eval()  # fmt: skip
    x = torch.randn(3, 48, device=DEVICE)
    calls = []
    real = GateLaunch.fill
    monkeypatch.setattr(GateLaunch, "fill", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        fast = layer(x)
        assert calls == [1]
        w_ref, ids_ref = moe_route.softmax_topk(fast.router_logits, 4, backend="triton")
        assert torch.equal(fast.topk_ids, ids_ref)
        rtol = router_weight_rtol(torch.float32, 16, 4)
        torch.testing.assert_close(fast.topk_weights, w_ref * 2.0, rtol=rtol, atol=0)
        monkeypatch.setattr("moe_route.layer_call.fused_router", lambda *a: None)
        layer._calls.clear()  # (the layer keeps its decisions per call signature)
        slow = layer(x)
    assert calls == [1]
    torch.testing.assert_close(fast.router_logits, slow.router_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(fast.topk_ids, slow.topk_ids)
    torch.testing.assert_close(fast.output, slow.output, rtol=1e-5, atol=1e-5)
    out = layer(x)  # gradients wanted (the gate's weight): the two-step router, differentiable
    assert calls == [1] and out.router_logits.requires_grad
