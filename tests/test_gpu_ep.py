"""Expert parallelism on one GPU: MoELayer(ep_group=...) over NCCL with W = 1.

The whole expert-parallel path runs (statistics all-gathers, the rank maps, the row and
metadata all-to-alls forward and backward, fused_moe on the received rows with the Triton
kernels, the finalize over the rank maps at the origin), with this process as the only rank,
and is compared with the plain layer built from the same state dict: routing equal, outputs
and every gradient within the dtype's tolerance (bf16: each rank's sum is rounded to bf16
before it travels back). Then: the same bits on a second run, no host synchronisation in the
default mode (and the one documented sync in the exact mode), and the default layer captured
in a CUDA graph, forward and forward + backward, replayed equal to eager. The multi-GPU run is
a separate job (torchrun, bench/bench_ep.py).
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
from helpers import capture_cuda_graph
from moe_cases import assert_matches

import moe_route

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not (dist.is_available() and dist.is_nccl_available()), reason="needs NCCL"),
]

CUDA = "cuda"
H, INTER, E, K = 256, 128, 16, 4
T = 333
CONFIGS = {
    "deepseek": dict(router="sigmoid_grouped", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                     num_shared_experts=1, capacity_factor=1.25, aux_loss_coef=0.01,
                     z_loss_coef=1e-3),
    "qwen2": dict(num_shared_experts=1, shared_expert_gate=True, renormalize=False, bias=True,
                  gate_up_layout="interleaved", aux_loss_coef=0.01),
}  # fmt: skip
MODES = {
    "default": dict(),  # blocks of T rows: nothing dropped, no host sync
    "exact": dict(ep_capacity="exact"),
    "fixed": dict(ep_capacity=T + 5),  # a bound above T: padding tokens, nothing dropped
    "chunks": dict(ep_chunks=3),
    "exact-chunks": dict(ep_capacity="exact", ep_chunks=2),
}
TOL = {torch.float32: 1e-5, torch.bfloat16: 2.5e-2}  # bf16: as tests/test_gpu_layer.py


@pytest.fixture(scope="module")
def group():
    torch.cuda.set_device(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def make_pair(config, mode, group, dtype=torch.bfloat16):
    """``(plain layer, expert-parallel layer)`` with the same parameters."""
    torch.manual_seed(0)
    kw = dict(CONFIGS[config], device=CUDA, dtype=dtype)
    plain = moe_route.MoELayer(H, INTER, E, K, **kw)
    with torch.no_grad():
        if plain.expert_bias is not None:
            plain.expert_bias.copy_(torch.linspace(-0.05, 0.05, E, device=CUDA))
        for b in (plain.b1, plain.b2):
            if b is not None:
                b.normal_(0, 0.1)
    ep = moe_route.MoELayer(H, INTER, E, K, **kw, **MODES[mode], ep_group=group)
    ep.load_state_dict(plain.state_dict())
    return plain, ep


def make_x(dtype, seed=1):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    x = torch.randn(T, H, generator=g, device=CUDA).to(dtype)
    return x, torch.randn(T, H, generator=g, device=CUDA).to(dtype)


def step(layer, x, dout):
    out = layer(x)
    ((out.output.float() * dout.float()).sum() + out.aux_loss).backward()
    return out


def grads_of(layer, x, dout):
    layer.zero_grad(set_to_none=True)
    xl = x.detach().clone().requires_grad_(True)
    out = step(layer, xl, dout)
    return out, {"x": xl.grad, **{n: p.grad for n, p in layer.named_parameters()}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("config", CONFIGS)
def test_w1_over_nccl_matches_the_plain_layer(group, config, mode, dtype):
    plain, ep = make_pair(config, mode, group, dtype)
    x, dout = make_x(dtype)
    want, want_grads = grads_of(plain, x, dout)
    got, got_grads = grads_of(ep, x, dout)
    assert torch.equal(got.topk_ids, want.topk_ids)
    assert torch.equal(got.tokens_per_expert, want.tokens_per_expert)
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-6, atol=1e-7)
    tol = TOL[dtype]
    assert_matches(got.output, want.output, tol, what="output")
    for name, g in want_grads.items():
        assert_matches(got_grads[name], g, tol, what=f"grad of {name}", floor=1e-3)


@pytest.mark.parametrize("mode", ["exact", "chunks"])
def test_two_runs_give_the_same_bits(group, mode):
    _, ep = make_pair("deepseek", mode, group)
    x, dout = make_x(torch.bfloat16)
    first, first_grads = grads_of(ep, x, dout)
    second, second_grads = grads_of(ep, x, dout)
    assert torch.equal(first.output, second.output)
    assert torch.equal(first.aux_loss, second.aux_loss)
    for name, g in first_grads.items():
        assert torch.equal(g, second_grads[name]), name


def test_default_never_waits_on_the_host_and_exact_mode_once(group):
    _, fixed = make_pair("deepseek", "chunks", group)
    _, exact = make_pair("deepseek", "exact", group)
    x, dout = make_x(torch.bfloat16)
    x.requires_grad_(True)
    step(fixed, x, dout)  # warm-up: compile the kernels
    step(exact, x, dout)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(fixed, x, dout)
        with pytest.raises(RuntimeError, match="synchroniz"):
            exact(x)  # the split sizes' .tolist()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_default_forward_in_a_cuda_graph(group):
    _, ep = make_pair("deepseek", "chunks", group)
    x, _ = make_x(torch.bfloat16)
    static_x = x.clone()

    def forward():
        with torch.no_grad():
            return ep(static_x)

    graph, static = capture_cuda_graph(forward)
    for seed in (1, 2):  # new inputs copied in, replayed twice
        x, _ = make_x(torch.bfloat16, seed)
        static_x.copy_(x)
        graph.replay()
        graph.replay()
        torch.cuda.synchronize()
        eager = forward()
        assert torch.equal(static.output, eager.output)
        assert torch.equal(static.aux_loss, eager.aux_loss)
        assert torch.equal(static.topk_ids, eager.topk_ids)


@pytest.mark.isolated  # a failed capture would break the tests after it (tests/conftest.py)
def test_default_forward_backward_in_a_cuda_graph(group):
    """The standard recipe (tests/helpers.capture_cuda_graph): the eager reference keeps no
    autograd graph alive, so no leaf's gradient accumulator is tied to the default stream."""
    _, ep = make_pair("qwen2", "default", group)
    x, dout = make_x(torch.bfloat16)
    x.requires_grad_(True)
    params = [x, *ep.parameters()]

    def train():
        for p in params:
            p.grad = None
        return step(ep, x, dout).output.detach()

    eager_out = train().clone()  # also compiles the kernels
    eager = [p.grad.clone() for p in params]
    graph, static = capture_cuda_graph(train)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, eager_out)
    for p, want in zip(params, eager, strict=True):
        assert torch.equal(p.grad, want)
