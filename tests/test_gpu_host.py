"""No compile at a new token count (issue 11): after one call per token bucket, or after
``moe_route.warmup``, calls at any other ``T`` launch only variants already compiled."""

from __future__ import annotations

import pytest
import torch

import moe_route
from moe_route.kernels import triton as kt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

H, INTER, E, K = 256, 128, 16, 4
LARGE = (1000, 2047, 2048)


def triton_compiles() -> int:
    """Compiled binaries in Triton's own caches of the thin kernels' functions."""
    total = 0
    for k in kt.KERNELS:
        for caches in getattr(k.fn, "device_caches", {}).values():
            total += len(caches[0])
    return total


def weights(dtype=torch.bfloat16, grad=False):
    g = torch.Generator(device="cuda").manual_seed(0)
    w1 = torch.randn(E, 2 * INTER, H, device="cuda", dtype=dtype, generator=g) * H**-0.5
    w2 = torch.randn(E, H, INTER, device="cuda", dtype=dtype, generator=g) * INTER**-0.5
    return w1.requires_grad_(grad), w2.requires_grad_(grad)


def call(w1, w2, T, backward=False):
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, H, device="cuda", dtype=w1.dtype, generator=g, requires_grad=backward)
    tw, ids = torch.randn(T, E, device="cuda", generator=g).softmax(-1).topk(K, dim=-1)
    out = moe_route.fused_moe(x, w1, w2, tw, ids.to(torch.int32))
    if backward:
        torch.autograd.grad(out, [x, w1, w2], torch.ones_like(out))


def test_new_token_counts_compile_nothing_inside_a_warm_bucket():
    w1, w2 = weights()
    for T in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048):  # one call per bucket
        call(w1, w2, T)
    keys, binaries = kt.launch_keys(), triton_compiles()
    for T in (*range(1, 301), *LARGE):
        call(w1, w2, T)
    assert kt.launch_keys() == keys
    assert triton_compiles() == binaries


def test_warmup_then_any_token_count_compiles_nothing_forward_and_backward():
    w1, w2 = weights(torch.float16, grad=True)
    assert moe_route.warmup(w1, w2, K, max(LARGE), backward=True)[-1] == 2048
    keys, binaries = kt.launch_keys(), triton_compiles()
    for T in (*range(1, 301, 7), *LARGE):
        call(w1, w2, T, backward=True)
    assert kt.launch_keys() == keys
    assert triton_compiles() == binaries
    assert w1.grad is None
