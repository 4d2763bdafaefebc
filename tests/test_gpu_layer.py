"""MoELayer on a CUDA device: torch.compile(fullgraph=True) of forward + backward, CUDA-graph
capture of forward + backward with no host synchronisation, bitwise determinism over 20 runs,
the Triton kernels' output and gradients in bf16 against the float64 layer (reference
backend), and the training example in bf16.

The float64 oracle is the same layer converted with ``.double()`` and ``backend="reference"``
with its router kept in float32: the bf16 layer's router upcasts its (bf16) inputs and weights
exactly, so both route every token identically and only the experts' arithmetic differs.
"""

from __future__ import annotations

import copy
import importlib.util
import pathlib

import pytest
import torch
from helpers import capture_cuda_graph
from moe_cases import assert_matches

import moe_route

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = "cuda"
ROOT = pathlib.Path(__file__).resolve().parents[1]
H, INTER, E, K = 256, 128, 16, 4
CONFIGS = {
    "deepseek": dict(router="sigmoid_grouped", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                     num_shared_experts=1, capacity_factor=1.25, aux_loss_coef=0.01,
                     z_loss_coef=1e-3),
    "qwen2": dict(num_shared_experts=1, shared_expert_gate=True, renormalize=False, bias=True,
                  gate_up_layout="interleaved", aux_loss_coef=0.01),
}  # fmt: skip
BF16_TOL = 2.5e-2  # as tests/test_gpu_training.py: the backward rounds z, h, dz to bf16


def make_layer(config, *, dtype=torch.bfloat16, seed=0, **kw):
    torch.manual_seed(seed)
    layer = moe_route.MoELayer(H, INTER, E, K, **CONFIGS[config], **kw, device=CUDA, dtype=dtype)
    with torch.no_grad():
        if layer.expert_bias is not None:
            layer.expert_bias.copy_(torch.linspace(-0.05, 0.05, E, device=CUDA))
        for b in (layer.b1, layer.b2):
            if b is not None:
                b.normal_(0, 0.1)
    return layer


def make_x(T, seed=1, dtype=torch.bfloat16):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return torch.randn(T, H, generator=g, device=CUDA).to(dtype)


def step(layer, x, dout):
    out = layer(x)
    ((out.output.float() * dout).sum() + out.aux_loss).backward()
    return out


def grads_of(layer, x, dout):
    layer.zero_grad(set_to_none=True)
    xl = x.detach().clone().requires_grad_(True)
    out = step(layer, xl, dout)
    grads = {"x": xl.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    return out, grads


# ----------------------------------------------------------------------------- accuracy
@pytest.mark.parametrize("config", CONFIGS)
def test_kernels_match_float64_reference_in_bf16(config):
    layer = make_layer(config)
    oracle = copy.deepcopy(layer).double()
    oracle.backend = "reference"
    oracle.router_dtype = torch.float32  # the kernels' router: the same routing and aux loss
    ref_bf16 = copy.deepcopy(layer)
    ref_bf16.backend = "reference"
    x = make_x(333)
    dout = torch.randn(333, H, device=CUDA)
    out, got = grads_of(layer, x, dout)
    out64, want = grads_of(oracle, x.double(), dout.double())
    out_r, got_r = grads_of(ref_bf16, x, dout)
    assert torch.equal(out.topk_ids, out64.topk_ids), "the float64 oracle routed differently"
    assert torch.equal(out.tokens_per_expert, out_r.tokens_per_expert)
    assert (out.topk_ids < 0).any() or config != "deepseek", "capacity should drop slots"
    assert_matches(out.output, out64.output, 1e-2, what="output", device=None)
    torch.testing.assert_close(out.aux_loss, out64.aux_loss)  # same float32 router
    for n, ref in want.items():
        w = ref.shape[-1]
        assert got[n].dtype == torch.bfloat16, n
        assert_matches(got[n].reshape(-1, w), ref.reshape(-1, w), BF16_TOL, what=f"d{n}",
                       floor=1e-3, device=None)  # fmt: skip
        # the reference backend in bf16 (float32 inside, one rounding) as a yardstick
        assert_matches(got_r[n].reshape(-1, w), ref.reshape(-1, w), BF16_TOL,
                       what=f"d{n} (reference backend)", floor=1e-3, device=None)  # fmt: skip


# ----------------------------------------------------------------------------- determinism
def test_deterministic_20_runs():
    layer = make_layer("deepseek")
    x = make_x(1000)
    dout = torch.randn(1000, H, device=CUDA)
    first_out, first = grads_of(layer, x, dout)
    for _ in range(19):
        out, got = grads_of(layer, x, dout)
        assert torch.equal(out.output, first_out.output)
        assert torch.equal(out.aux_loss, first_out.aux_loss)
        assert torch.equal(out.topk_ids, first_out.topk_ids)
        for n in first:
            assert torch.equal(got[n], first[n]), f"d{n} differs between runs"


# ----------------------------------------------------------------------------- capture
@pytest.mark.isolated  # a failed capture would break the tests after it (tests/conftest.py)
@pytest.mark.parametrize("config", CONFIGS)
def test_no_host_sync_and_cuda_graph_forward_backward(config):
    """Forward + backward (router, aux losses, capacity, shared expert) captured in a CUDA graph
    by the standard recipe, with no host sync inside (``set_sync_debug_mode("error")`` during
    the capture), replayed: the same output, aux loss and gradients as eager.

    The eager reference keeps no autograd graph alive (an earlier version of this test kept its
    output, whose graph held the leaves' gradient accumulators made on the default stream: the
    captured backward then made the legacy stream wait on the capture, and the capture failed).
    """
    layer = make_layer(config)
    x = make_x(256).requires_grad_(True)
    dout = torch.randn(256, H, device=CUDA)
    params = [x, *layer.parameters()]

    def fwd_bwd():
        for p in params:
            p.grad = None
        out = step(layer, x, dout)
        return out.output.detach(), out.aux_loss.detach()

    want_out, want_aux = fwd_bwd()  # eager, on the default stream (compiles the kernels)
    want = [p.grad.clone() for p in params]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # no host sync in eager mode either
    try:
        fwd_bwd()
        if layer.expert_bias is not None:  # nor in the aux-loss-free balancing update
            bias = layer.expert_bias.clone()
            with torch.no_grad():
                layer.update_expert_bias(layer(x).tokens_per_expert, 1e-3)
            layer.expert_bias.copy_(bias)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph, (static_out, static_aux) = capture_cuda_graph(fwd_bwd)
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, want_out)
    assert torch.equal(static_aux, want_aux)
    for p, w in zip(params, want, strict=True):
        assert torch.equal(p.grad, w)


# ----------------------------------------------------------------------------- compile
def test_compile_fullgraph_forward_backward():
    layer = make_layer("deepseek")
    x = make_x(128).requires_grad_(True)
    dout = torch.randn(128, H, device=CUDA)
    leaves = [x, *layer.parameters()]

    def loss_fn(x):
        out = layer(x)
        return (out.output.float() * dout).sum() + out.aux_loss, out.tokens_per_expert

    loss_e, counts_e = loss_fn(x)
    want = torch.autograd.grad(loss_e, leaves)
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True)
    loss_c, counts_c = compiled(x)
    got = torch.autograd.grad(loss_c, leaves)
    assert torch.equal(counts_c, counts_e)
    for a, b in zip(got, want, strict=True):
        w = b.shape[-1]
        assert_matches(a.reshape(-1, w), b.reshape(-1, w), BF16_TOL, what="compiled vs eager",
                       floor=1e-3, device=None)  # fmt: skip


# ----------------------------------------------------------------------------- example
def test_training_example_bf16_triton():
    spec = importlib.util.spec_from_file_location(
        "train_moe_lm", ROOT / "examples" / "train_moe_lm.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = ["--device", "cuda", "--steps", "150", "--quiet"]
    assert example.main(args) == 0
    assert example.main([*args, "--router", "sigmoid_grouped", "--capacity-factor", "1.25"]) == 0


def test_update_expert_bias_non_finite_gpu_counts_leave_the_bias():
    """GPU counts are not read (no sync): a NaN or infinite one cancels the update on the
    device instead of writing NaN into the bias; finite float and integer counts update it.

    The poisoned counts are made before the sync check: ``t[3] = nan`` on a CUDA tensor copies
    a CPU scalar into it (a synchronising copy), which the check would report as the layer's.
    tests/test_layer.py::test_update_expert_bias_device_branch_on_cpu runs the same logic on
    the CPU."""
    layer = make_layer("deepseek")
    before = layer.expert_bias.clone()
    counts = torch.arange(E, device=CUDA, dtype=torch.float32)
    poisoned = []
    for bad in (float("nan"), float("inf"), float("-inf")):
        poisoned.append(counts.clone())
        poisoned[-1][3] = bad
    as_int = counts.to(torch.int64)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for p in poisoned:
            layer.update_expert_bias(p, 1e-3)
        unchanged = layer.expert_bias.clone()
        layer.update_expert_bias(counts, 1e-3)
        once = layer.expert_bias.clone()
        layer.update_expert_bias(as_int, 1e-3)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(unchanged, before)
    step = torch.sign(counts.double().mean() - counts.double()).float() * 1e-3
    assert torch.equal(once, before + step)
    assert torch.equal(layer.expert_bias, before + step + step)


@pytest.mark.parametrize("T", [1, 8, 300])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_inference_router_logits_match_the_float32_linear(config, T):
    """Inference routes on one 16-bit matmul with float32 output (no converted copies): the
    products are exact in float32 either way, so the logits sit within float32 summation
    error of the converted linear's and the ids are the training path's."""
    layer = make_layer(config)
    x = make_x(T)
    want = torch.nn.functional.linear(x.float(), layer.gate.weight.float())
    with torch.no_grad():
        got = layer.router_logits(x)
        out = layer(x)
    assert got.dtype == torch.float32
    scale = x.float().abs() @ layer.gate.weight.float().abs().t()
    assert ((got - want).abs() <= 4 * H * torch.finfo(torch.float32).eps * scale).all()
    with torch.enable_grad():
        trained = layer(x.clone().requires_grad_())
    if torch.equal(got, want):  # the same logits: the same routing, bit for bit
        assert torch.equal(out.topk_ids, trained.topk_ids)
    # else only near-ties (logits within a few ulps) may route differently
    assert (out.topk_ids == trained.topk_ids).float().mean() > 0.98
