"""No compile at a new token count: after one call per token bucket, or after
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


def test_unaligned_views_get_their_own_variant_and_right_values():
    """The thin launch keys the variant on each address modulo 16: an expand and a finalize
    over views 2 bytes off alignment, between calls over aligned tensors, give the reference's
    values (conftest's MOE_ROUTE_CHECK_LAUNCHES also checks each launch against Triton's own
    choice of variant)."""
    from moe_route import reference as R

    g = torch.Generator(device="cuda").manual_seed(1)
    T, H = 37, 256
    base = torch.randn(T, H + 8, device="cuda", dtype=torch.bfloat16, generator=g)
    tw, ids = torch.randn(T, E, device="cuda", generator=g).softmax(-1).topk(K, dim=-1)
    maps = moe_route.build_routing_maps(ids.to(torch.int32), E)
    s2d, d2s, efs, off = (t.cpu() for t in maps.tensors())
    for shift in (0, 1, 0, 1):
        x = base[:, shift : shift + H]
        assert x.data_ptr() % 16 == 2 * shift
        got = moe_route.expand_rows(x, maps)
        want = R.expand_rows_reference(x.cpu(), d2s, off)
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)
        y = got[:, shift:]
        assert y.data_ptr() % 16 == 2 * shift
        out = moe_route.finalize_moe_routing(y, tw, maps)
        want_out = R.finalize_moe_routing_reference(y.cpu(), tw.cpu(), s2d, efs)
        torch.testing.assert_close(out.cpu(), want_out, rtol=2**-7, atol=2**-7)


def test_memoised_public_ops_give_the_custom_ops_bits_at_any_token_count():
    """The public ops' call memos (prepared launches, one signature per token bucket) against
    the same ops through ``torch.ops.moe_route`` (the dispatcher and the plain launchers):
    the same bits for the maps, the expand, both GEMMs (gathering and not, with a bias) and
    the finalize, at new token counts inside seen buckets too."""

    ops = torch.ops.moe_route
    w1, w2 = weights()
    g = torch.Generator(device="cuda").manual_seed(2)
    b1 = torch.randn(E, 2 * INTER, device="cuda", dtype=torch.bfloat16, generator=g)
    moe_route.plan.clear_plans()
    for T in (1, 5, 8, 7, 64, 37, 300, 2):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
        tw, ids = torch.randn(T, E, device="cuda", generator=g).softmax(-1).topk(K, dim=-1)
        ids = ids.to(torch.int32)
        bias = torch.randn(H, device="cuda", dtype=torch.bfloat16, generator=g)
        for _ in range(2):  # the first call of a signature fills its memo, the second uses it
            maps = moe_route.build_routing_maps(ids, E)
            tables = maps.tensors()
            for got, want in zip(tables, ops.routing_maps(ids, E, "triton"), strict=True):
                assert torch.equal(got, want)
            xp = moe_route.expand_rows(x, maps)
            assert torch.equal(xp, ops.expand_rows(x, *tables, "triton"))
            for a, gather in ((x, True), (xp, False)):
                h = moe_route.grouped_gemm(a, w1, maps, bias=b1, activation="swiglu",
                                           gather=gather)  # fmt: skip
                want = ops.grouped_gemm(a, w1, *tables, b1, "swiglu", "concat", gather, False,
                                        "triton")  # fmt: skip
                assert torch.equal(h, want)
            y = moe_route.grouped_gemm(h, w2, maps)
            assert torch.equal(y, ops.grouped_gemm(h, w2, *tables, None, "identity", "concat",
                                                   False, False, "triton"))  # fmt: skip
            out = moe_route.finalize_moe_routing(y, tw, maps, bias)
            assert torch.equal(out, ops.finalize_moe_routing(y, tw, tables[0], tables[2], bias,
                                                             "triton"))  # fmt: skip
