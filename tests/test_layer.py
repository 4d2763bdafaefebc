"""MoELayer on the CPU against a naive per-token PyTorch implementation of the same parameters.

The oracle (``naive_forward``) reads the documented parameter layout and does everything one
token and one slot at a time: the router through the loop oracles of ``moe_route.reference``
(ids) and plain autograd ops (weights), capacity through ``apply_capacity_reference``, each
expert as two matmuls on its own slice of ``w1`` / ``w2``. Forward: the layer in float32
against the oracle in float64. Backward: the layer in float64 (reference backend) against
autograd through the oracle, every parameter and ``x``; one tiny case runs the Triton kernels
under the interpreter.
"""

from __future__ import annotations

import importlib.util
import math
import pathlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from moe_cases import assert_matches, needs_interpreter
from torch import nn

import moe_route
from moe_route import reference

ROOT = pathlib.Path(__file__).resolve().parents[1]
H, INTER, E, K = 16, 8, 6, 2

CASES = {
    "mixtral": dict(),
    "qwen3-no-norm-aux": dict(renormalize=False, gate_up_layout="interleaved",
                              aux_loss_coef=0.1, z_loss_coef=0.01),
    "deepseek": dict(router="sigmoid_grouped", n_group=3, topk_group=2,
                     routed_scaling_factor=2.5, num_shared_experts=2,
                     shared_intermediate_size=4, capacity_factor=1.0, aux_loss_coef=0.05),
    "qwen2-shared-gate-bias": dict(num_shared_experts=1, shared_expert_gate=True, bias=True,
                                   activation="geglu", capacity_factor=0.6, z_loss_coef=0.1),
    "plain-gelu": dict(activation="gelu", bias=True, routed_scaling_factor=0.5),
}  # fmt: skip


# ----------------------------------------------------------------------------- the oracle
def _act(name, z, layout, width):
    """The activations of DESIGN.md, written out (not moe_route.reference's)."""
    if name in ("swiglu", "geglu"):
        if layout == "concat":
            gate, up = z[..., :width], z[..., width:]
        else:
            gate, up = z[..., 0::2], z[..., 1::2]
        return (F.silu(gate) if name == "swiglu" else F.gelu(gate)) * up
    return {"silu": F.silu, "gelu": F.gelu, "relu": F.relu, "identity": lambda v: v}[name](z)


def naive_forward(layer, x, p):
    """``(out [..., H], aux_loss, ids)`` for parameters ``p`` (name → tensor) of ``layer``."""
    x2 = x.reshape(-1, layer.hidden_size)
    T, n_exp, k = x2.shape[0], layer.num_experts, layer.top_k
    logits = x2 @ p["gate.weight"].t()
    if layer.router == "softmax":
        probs = torch.softmax(logits, -1)
        _, ids = reference.softmax_topk_reference(logits.detach(), k, layer.renormalize)
        scores, eps = probs, 0.0
    else:
        scores = torch.sigmoid(logits)
        probs = scores / scores.sum(-1, keepdim=True)
        _, ids = reference.sigmoid_grouped_topk_reference(
            logits.detach(), k, n_group=layer.n_group, topk_group=layer.topk_group,
            expert_bias=layer.expert_bias,
        )  # fmt: skip
        eps = 1e-20
    ids = ids.long()
    weights = scores.gather(1, ids)  # the router's weights, renormalised before any capacity
    if layer.renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + eps)
    weights = weights * layer.routed_scaling_factor
    aux = torch.zeros((), dtype=x.dtype)
    if layer.aux_loss_coef:
        rows = ids.tolist()
        f = torch.tensor([sum(e in r for r in rows) / T for e in range(n_exp)], dtype=x.dtype)
        aux = aux + layer.aux_loss_coef * n_exp * (f * probs.mean(0)).sum()
    if layer.z_loss_coef:
        aux = aux + layer.z_loss_coef * torch.logsumexp(logits, -1).square().mean()
    if layer.capacity_factor is not None:
        cap = math.ceil(layer.capacity_factor * T * k / n_exp)
        ids = reference.apply_capacity_reference(ids, n_exp, cap)
    inter = layer.intermediate_size
    rows = []
    for t in range(T):
        xt = x2[t]
        acc = torch.zeros_like(xt)
        if "shared_w1" in p:
            S = p["shared_w2"].shape[1]
            h = _act(layer.activation, p["shared_w1"] @ xt, layer.gate_up_layout, S)
            sh = p["shared_w2"] @ h
            if "shared_gate.weight" in p:
                sh = torch.sigmoid(p["shared_gate.weight"] @ xt) * sh
            acc = acc + sh
        for slot, e in enumerate(ids[t].tolist()):
            if e < 0:
                continue
            z = p["w1"][e] @ xt + (p["b1"][e] if "b1" in p else 0)
            y = p["w2"][e] @ _act(layer.activation, z, layer.gate_up_layout, inter)
            if "b2" in p:
                y = y + p["b2"][e]
            acc = acc + weights[t, slot] * y
        rows.append(acc)
    out = torch.stack(rows) if rows else x2.new_zeros(0, layer.hidden_size)
    return out.reshape(x.shape), aux, ids


def make_layer(dtype=torch.float32, seed=0, **kw):
    torch.manual_seed(seed)
    kw.setdefault("backend", "reference")
    kw.setdefault("router_dtype", None)
    layer = moe_route.MoELayer(H, INTER, E, K, dtype=dtype, **kw)
    with torch.no_grad():  # non-trivial biases and router bias (zero after reset_parameters)
        for name in ("b1", "b2"):
            if getattr(layer, name) is not None:
                getattr(layer, name).normal_(0, 0.3)
        if layer.expert_bias is not None:
            layer.expert_bias.copy_(torch.linspace(-0.2, 0.3, E))
        layer.gate.weight.mul_(3)  # a peaked router: the choice matters
    return layer


def _x(shape, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _params(layer, dtype=torch.float64, grad=False):
    return {n: t.detach().to(dtype).requires_grad_(grad) for n, t in layer.named_parameters()}


# ----------------------------------------------------------------------------- forward
@pytest.mark.parametrize("name", CASES)
def test_forward_matches_naive(name):
    layer = make_layer(**CASES[name])
    x = _x((3, 7, H), torch.float32)
    out = layer(x)
    want, aux, ids = naive_forward(layer, x.double(), _params(layer))
    assert out.output.shape == x.shape and out.output.dtype == torch.float32
    assert_matches(out.output.reshape(-1, H), want.reshape(-1, H), 1e-5)
    assert torch.equal(out.topk_ids.long(), ids)
    assert torch.equal(out.tokens_per_expert, moe_route.tokens_per_expert(ids, E))
    assert out.tokens_per_expert.dtype == torch.int64
    assert out.router_logits.shape == (21, E)
    assert out.aux_loss.dtype == torch.float32 and out.aux_loss.dim() == 0
    torch.testing.assert_close(out.aux_loss.double(), aux, rtol=1e-5, atol=1e-7)
    if CASES[name].get("capacity_factor"):
        assert (out.topk_ids < 0).any(), "the case should drop slots"
        cap = math.ceil(CASES[name]["capacity_factor"] * 21 * K / E)
        assert int(out.tokens_per_expert.max()) <= cap


def test_aux_losses_reported_unscaled_and_zero_when_disabled():
    layer = make_layer(aux_loss_coef=0.5, z_loss_coef=0.25)
    x = _x((10, H), torch.float32)
    out = layer(x)
    probs = torch.softmax(out.router_logits, -1)
    _, ids = moe_route.softmax_topk(out.router_logits, K)
    lb = reference.load_balancing_loss_reference(probs, ids, E)
    z = reference.router_z_loss_reference(out.router_logits)
    assert math.isclose(out.load_balancing_loss.item(), lb, rel_tol=1e-5)
    assert math.isclose(out.z_loss.item(), z, rel_tol=1e-5)
    assert math.isclose(out.aux_loss.item(), 0.5 * lb + 0.25 * z, rel_tol=1e-5)
    plain = make_layer()(x)
    assert plain.aux_loss.item() == 0 and not plain.aux_loss.requires_grad
    assert plain.load_balancing_loss.item() == 0 and plain.z_loss.item() == 0


def test_switched_off_losses_are_one_zero_that_writes_do_not_leak_into():
    """The switched-off losses are one zero made once per layer (no fill per call); written
    into, the next call makes a new one; under inference_mode it is still a normal tensor."""
    layer = make_layer()
    x = _x((4, H), torch.float32)
    first, again = layer(x), layer(x)
    assert again.aux_loss is first.aux_loss and again.z_loss is first.aux_loss
    first.aux_loss.add_(3.0)  # a caller accumulating into it
    later = layer(x)
    assert later.aux_loss is not first.aux_loss and later.aux_loss.item() == 0
    assert first.aux_loss.item() == 3.0  # the caller's tensor, as the caller left it
    with torch.inference_mode():
        served = layer(x)
        assert not served.aux_loss.is_inference()
        served.aux_loss.add_(1.0)
    assert layer(x).aux_loss.item() == 0
    assert layer.double()(x.double()).aux_loss.dtype == torch.float64  # one zero per dtype
    assert "_zeros" not in layer.state_dict() and not any("zero" in k for k in layer.state_dict())


# ----------------------------------------------------------------------------- backward
def _grads_vs_naive(layer, x, tol):
    leaves = dict(layer.named_parameters())
    xg = x.clone().requires_grad_(True)
    g = torch.Generator().manual_seed(5)
    dout = torch.randn(x.shape, generator=g, dtype=torch.float64)
    out = layer(xg)
    ((out.output.double() * dout).sum() + out.aux_loss.double()).backward()
    p = _params(layer, grad=True)
    x64 = x.double().requires_grad_(True)
    want, aux, _ = naive_forward(layer, x64, p)
    ((want * dout).sum() + aux).backward()
    got = {n: t.grad for n, t in leaves.items()}
    got["x"], p["x"] = xg.grad, x64
    for n, ref in p.items():
        assert got[n] is not None, f"no gradient for {n}"
        width = ref.shape[-1]
        assert_matches(got[n].reshape(-1, width), ref.grad.reshape(-1, width), tol,
                       what=f"d{n}", floor=1e-3)  # fmt: skip


@pytest.mark.parametrize("name", CASES)
def test_backward_matches_autograd_through_naive(name):
    layer = make_layer(torch.float64, **CASES[name])
    _grads_vs_naive(layer, _x((2, 9, H), torch.float64), 1e-10)


@needs_interpreter
def test_backward_triton_interpreter_tiny():
    kw = dict(CASES["deepseek"], backend="triton")
    layer = make_layer(torch.float32, **kw)
    _grads_vs_naive(layer, _x((7, H), torch.float32), 1e-5)


def test_gradcheck_float64_router_and_experts():
    layer = make_layer(torch.float64, **CASES["qwen2-shared-gate-bias"])
    names = [n for n, _ in layer.named_parameters()]
    x = _x((5, H), torch.float64).requires_grad_(True)

    def f(x, *params):
        out = torch.func.functional_call(layer, dict(zip(names, params, strict=True)), (x,))
        return out.output, out.aux_loss

    leaves = [p.detach().clone().requires_grad_(True) for p in layer.parameters()]
    assert torch.autograd.gradcheck(f, (x, *leaves), fast_mode=True)


# ----------------------------------------------------------------------------- shared expert
def test_shared_expert_and_gate_add_through_bias():
    layer = make_layer(num_shared_experts=2, shared_intermediate_size=3, shared_expert_gate=True)
    assert layer.shared_w1.shape == (12, H) and layer.shared_w2.shape == (H, 6)
    assert layer.shared_gate.weight.shape == (1, H)
    x = _x((9, H), torch.float32)
    with torch.no_grad():
        full = layer(x).output
        routed_only = moe_route.fused_moe(
            x, layer.w1, layer.w2, *moe_route.softmax_topk(layer.gate(x), K),
            backend="reference",
        )  # fmt: skip
        gate, up = (x @ layer.shared_w1.t()).chunk(2, -1)
        shared = (F.silu(gate) * up) @ layer.shared_w2.t()
        shared = torch.sigmoid(x @ layer.shared_gate.weight.t()) * shared
    torch.testing.assert_close(full, routed_only + shared, rtol=1e-5, atol=1e-6)


def test_every_slot_dropped_leaves_the_shared_expert():
    layer = make_layer(num_shared_experts=1, capacity_factor=1e-9)  # capacity 1 per expert
    x = _x((30, H), torch.float32)
    out = layer(x)
    assert int(out.tokens_per_expert.sum()) == E  # one slot per expert kept
    dropped = (out.topk_ids < 0).all(1)
    assert dropped.sum() >= 30 - E
    with torch.no_grad():
        shared = layer.shared_expert(x)
    torch.testing.assert_close(out.output[dropped], shared[dropped])


# ----------------------------------------------------------------------------- expert bias
def test_expert_bias_update_and_steering():
    layer = make_layer(router="sigmoid_grouped")
    layer.expert_bias.zero_()
    layer.update_expert_bias(torch.tensor([10, 2, 4, 4, 5, 5]), rate=0.01)
    torch.testing.assert_close(layer.expert_bias, torch.tensor([-1.0, 1, 1, 1, 0, 0]) * 0.01)
    # a large bias sends every token to expert 3, and the weights stay the unbiased scores
    layer.expert_bias.copy_(torch.tensor([0, 0, 0, 100.0, 0, 0]))
    out = layer(_x((8, H), torch.float32))
    assert (out.topk_ids[:, 0] == 3).all() and out.tokens_per_expert[3] == 8
    assert (out.topk_weights <= 1).all()
    # bf16 conversion keeps the bias in float32 (updates of 1e-3 would vanish in bf16)
    layer.expert_bias.copy_(torch.full((E,), 1e-3 + 1e-5))
    layer.to(torch.bfloat16)
    assert layer.w1.dtype == torch.bfloat16 and layer.expert_bias.dtype == torch.float32
    assert layer.expert_bias[0].item() == pytest.approx(1e-3 + 1e-5, rel=1e-6)
    assert "expert_bias" in layer.state_dict()


# ----------------------------------------------------------------------------- loading
class LlamaMLP(nn.Module):
    def __init__(self, h, i, act=F.silu, bias=False):
        super().__init__()
        self.gate_proj = nn.Linear(h, i, bias=bias, dtype=torch.float64)
        self.up_proj = nn.Linear(h, i, bias=bias, dtype=torch.float64)
        self.down_proj = nn.Linear(i, h, bias=bias, dtype=torch.float64)
        self.act = act

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class MixtralExpert(nn.Module):
    def __init__(self, h, i):
        super().__init__()
        self.w1 = nn.Linear(h, i, bias=False, dtype=torch.float64)
        self.w3 = nn.Linear(h, i, bias=False, dtype=torch.float64)
        self.w2 = nn.Linear(i, h, bias=False, dtype=torch.float64)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class PlainMLP(nn.Module):
    def __init__(self, h, i):
        super().__init__()
        self.up_proj = nn.Linear(h, i, dtype=torch.float64)
        self.down_proj = nn.Linear(i, h, dtype=torch.float64)

    def forward(self, x):
        return self.down_proj(F.gelu(self.up_proj(x)))


def _modules_reference(experts, gate, x, shared=None, shared_gate=None):
    w, ids = reference.softmax_topk_reference(gate(x).detach(), K)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(K):
            out[t] += w[t, k].double() * experts[int(ids[t, k])](x[t])
        if shared is not None:
            s = shared(x[t])
            out[t] += s * torch.sigmoid(shared_gate(x[t])) if shared_gate is not None else s
    return out


LOAD_CASES = {
    "llama-concat": (lambda: LlamaMLP(H, INTER), dict(gate_up_layout="concat")),
    "llama-interleaved": (lambda: LlamaMLP(H, INTER), dict(gate_up_layout="interleaved")),
    "mixtral-w1w3w2": (lambda: MixtralExpert(H, INTER), dict(gate_up_layout="interleaved")),
    "llama-bias-geglu": (lambda: LlamaMLP(H, INTER, F.gelu, bias=True), dict(activation="geglu")),
    "plain-gelu-bias": (lambda: PlainMLP(H, INTER), dict(activation="gelu")),
}


@pytest.mark.parametrize("name", LOAD_CASES)
def test_from_experts_roundtrip(name):
    torch.manual_seed(3)
    build, kw = LOAD_CASES[name]
    experts = nn.ModuleList(build() for _ in range(E))
    gate = nn.Linear(H, E, bias=False, dtype=torch.float64)
    layer = moe_route.MoELayer.from_experts(experts, K, gate=gate, backend="reference", **kw)
    assert layer.w1.dtype == torch.float64 and (layer.b1 is not None) == ("bias" in name)
    x = _x((11, H), torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x).output, _modules_reference(experts, gate, x))
    if kw.get("gate_up_layout") == "interleaved":
        first = experts[0].gate_proj if hasattr(experts[0], "gate_proj") else experts[0].w1
        assert torch.equal(layer.w1[0, 0::2], first.weight)


def test_load_experts_with_shared_expert_and_gate():
    torch.manual_seed(4)
    experts = [LlamaMLP(H, INTER) for _ in range(E)]
    shared = LlamaMLP(H, 12)
    shared_gate = nn.Linear(H, 1, bias=False, dtype=torch.float64)
    gate = nn.Linear(H, E, bias=False, dtype=torch.float64)
    layer = moe_route.MoELayer.from_experts(
        experts, K, gate=gate, shared_expert=shared, shared_expert_gate=shared_gate,
        backend="reference",
    )  # fmt: skip
    assert layer.shared_intermediate_size == 12 and layer.shared_gate is not None
    x = _x((6, H), torch.float64)
    with torch.no_grad():
        want = _modules_reference(experts, gate, x, shared, shared_gate)
        torch.testing.assert_close(layer(x).output, want)
    # load_experts_ into an existing float32 layer converts
    other = moe_route.MoELayer(H, INTER, E, K, backend="reference")
    other.load_experts_(experts, gate=gate.weight)
    assert other.w1.dtype == torch.float32
    torch.testing.assert_close(other.w2[2], experts[2].down_proj.weight.float())


def test_load_experts_errors():
    layer = moe_route.MoELayer(H, INTER, E, K)
    with pytest.raises(ValueError, match="experts has 2 modules, expected num_experts = 6"):
        layer.load_experts_([LlamaMLP(H, INTER)] * 2)
    with pytest.raises(ValueError, match=r"experts\[0\] gate_proj.weight must be \[8, 16\]"):
        layer.load_experts_([LlamaMLP(H, 5)] * E)
    with pytest.raises(ValueError, match="has a bias but the layer has bias=False"):
        layer.load_experts_([LlamaMLP(H, INTER, bias=True)] * E)
    with pytest.raises(ValueError, match="has none of"):
        layer.load_experts_([nn.Linear(H, H)] * E)
    with pytest.raises(ValueError, match="gate weight must be"):
        layer.load_experts_([LlamaMLP(H, INTER)] * E, gate=torch.zeros(E, H + 1))
    with pytest.raises(ValueError, match="num_shared_experts=0"):
        layer.load_experts_([LlamaMLP(H, INTER)] * E, shared_expert=LlamaMLP(H, INTER))


# ----------------------------------------------------------------------------- compile etc.
# Inductor takes ~20 s on a small CPU box: one case with it, the other with aot_eager (the same
# Dynamo capture and AOT autograd, so the same test of "no graph break", without code generation).
@pytest.mark.parametrize(("name", "compiler"), [("mixtral", "aot_eager"), ("deepseek", "inductor")])
def test_compile_fullgraph_forward_backward(name, compiler):
    kw = dict(CASES[name], aux_loss_coef=0.05, z_loss_coef=0.01)
    layer = make_layer(**kw)
    x = _x((2, 6, H), torch.float32).requires_grad_(True)
    leaves = [x, *layer.parameters()]

    def step(x):
        out = layer(x)
        return out.output.square().sum() + out.aux_loss, out.tokens_per_expert

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=compiler)
    loss_c, counts_c = compiled(x)
    got = torch.autograd.grad(loss_c, leaves)
    loss_e, counts_e = step(x)
    want = torch.autograd.grad(loss_e, leaves)
    assert torch.equal(counts_c, counts_e)
    torch.testing.assert_close(loss_c, loss_e)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_deterministic_and_shapes():
    layer = make_layer(**CASES["deepseek"])
    x = _x((4, 5, H), torch.float32).requires_grad_(True)
    runs = []
    for _ in range(2):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out = layer(x)
        (out.output.sum() + out.aux_loss).backward()
        runs.append([out.output, x.grad, *(p.grad for p in layer.parameters())])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)
    empty = layer(torch.zeros(0, H))
    assert empty.output.shape == (0, H) and empty.tokens_per_expert.sum() == 0
    assert layer(torch.zeros(H)).output.shape == (H,)


def test_extra_repr_and_reset_parameters():
    layer = moe_route.MoELayer(32, 24, 8, 2, router="sigmoid_grouped", n_group=4, topk_group=2,
                               capacity_factor=1.25, num_shared_experts=1, bias=True)  # fmt: skip
    text = repr(layer)
    for part in ("hidden_size=32", "num_experts=8", "router='sigmoid_grouped'", "n_group=4",
                 "capacity_factor=1.25", "num_shared_experts=1", "bias=True"):  # fmt: skip
        assert part in text, part
    assert layer.b1.abs().sum() == 0 and layer.expert_bias.abs().sum() == 0
    assert layer.w1.abs().max() <= 1 / math.sqrt(32) and layer.w2.abs().max() <= 1 / math.sqrt(24)
    assert layer.w1.std() > 0.5 / math.sqrt(3 * 32)  # U(-b, b) has std b/√3


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("dtype", "router_dtype", "logits"),
    [
        (torch.float64, "auto", torch.float64),
        (torch.float32, "auto", torch.float32),
        (torch.float16, "auto", torch.float32),
        (torch.float64, torch.float32, torch.float32),  # an explicit choice is kept
        (torch.float32, torch.float64, torch.float64),
        (torch.float64, None, torch.float64),
    ],
)
def test_default_router_dtype_never_lowers_the_layers_precision(dtype, router_dtype, logits):
    kw = {} if router_dtype == "auto" else dict(router_dtype=router_dtype)
    layer = moe_route.MoELayer(H, INTER, E, K, backend="reference", dtype=dtype, **kw)
    assert layer.router_dtype == router_dtype
    x = torch.randn(5, H, dtype=dtype)
    out = layer(x)
    assert out.router_logits.dtype == logits
    if logits == torch.float64 and dtype == torch.float64:
        exact = x @ layer.gate.weight.T
        assert torch.equal(out.router_logits, exact)


def test_default_router_dtype_follows_a_converted_layer():
    layer = moe_route.MoELayer(H, INTER, E, K, backend="reference").double()
    x = torch.randn(5, H, dtype=torch.float64)
    assert layer(x).router_logits.dtype == torch.float64
    assert "router_dtype='auto'" in repr(layer)


def test_huge_capacity_factor_drops_nothing():
    """A capacity factor past ``E`` (even ``1e308``) keeps every slot: the layer equals one
    without capacity, and the first forward does not overflow."""
    torch.manual_seed(0)
    free = make_layer()
    capped = make_layer(capacity_factor=1e308)
    capped.load_state_dict(free.state_dict())
    x = torch.randn(7, H)
    assert torch.equal(capped(x).output, free(x).output)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(top_k=7), "top_k=7 > num_experts=6"),
        (dict(top_k=0), "top_k=0"),
        (dict(router="sigmoid_grouped", n_group=4), "n_group=4 does not divide num_experts=6"),
        (dict(router="sigmoid_grouped", n_group=3, topk_group=4), "topk_group=4"),
        (dict(n_group=2), "n_group=2, topk_group=None: group-limited routing needs"),
        (dict(router="topk"), "router='topk'"),
        (dict(activation="tanh"), "activation='tanh'"),
        (dict(gate_up_layout="mixed"), "gate_up_layout='mixed'"),
        (dict(capacity_factor=0.0), "capacity_factor=0.0"),
        (dict(aux_loss_coef=-1.0), "aux_loss_coef=-1.0"),
        (dict(shared_expert_gate=True), "shared_expert_gate=True needs num_shared_experts"),
        (dict(finalize="fast"), "finalize='fast'"),
        (dict(backend="cuda"), "backend='cuda'"),
        (dict(dtype=torch.int32), "dtype=torch.int32"),
        (dict(router_dtype=torch.int8), "router_dtype=torch.int8"),
        (dict(renormalize="False"), "renormalize must be a bool, got str 'False'"),
        (dict(deterministic="no"), "deterministic must be a bool, got str 'no'"),
        (dict(bias=1), "bias must be a bool, got int 1"),
        (dict(num_shared_experts=1, shared_expert_gate="yes"), "shared_expert_gate must be a"),
        (dict(renormalize=None), "renormalize must be a bool, got NoneType"),
    ],
)
def test_bad_arguments_name_the_argument(kw, match):
    args = dict(hidden_size=H, intermediate_size=INTER, num_experts=E, top_k=K)
    args.update(kw)
    with pytest.raises((ValueError, TypeError), match=match):
        moe_route.MoELayer(**args)


@pytest.mark.parametrize("branch", ["read", "device"])
def test_update_expert_bias_float_counts_exact_and_non_finite_leave_the_bias(monkeypatch, branch):
    """The logic of tests/test_gpu_layer.py::test_update_expert_bias_non_finite_gpu_counts_...
    on the CPU. ``read``: CPU counts are checked, a non-finite one raises. ``device``: the
    branch GPU counts take (no host read), forced here: a non-finite count cancels the update.
    Either way the bias stays bit for bit, and finite float or integer counts move it by
    exactly ``rate · sign(mean - count)`` in float32."""
    layer_module = importlib.import_module("moe_route.layer_router")
    if branch == "device":
        monkeypatch.setattr(layer_module, "_counts_read_on_host", lambda counts: False)
    layer = make_layer(router="sigmoid_grouped")
    before = layer.expert_bias.clone()
    counts = torch.tensor([0.0, 1.5, 2, 3, 4.25, 5])
    for bad in (float("nan"), float("inf"), float("-inf"), -1.0, -1):
        poisoned = counts.clone() if isinstance(bad, float) else counts.long()
        poisoned[3] = bad
        if branch == "read":
            with pytest.raises(ValueError, match=r"tokens_per_expert\[3\] = .*: expected finite"):
                layer.update_expert_bias(poisoned, 1e-3)
        else:
            layer.update_expert_bias(poisoned, 1e-3)
        assert torch.equal(layer.expert_bias, before), f"a count of {bad} changed the bias"
    layer.update_expert_bias(counts, 1e-3)
    step = torch.sign(counts.double().mean() - counts.double()).float() * 1e-3
    assert torch.equal(layer.expert_bias, before + step)
    layer.update_expert_bias(torch.tensor([5, 4, 3, 2, 1, 0]), 1e-3)  # integer counts
    second = torch.tensor([-1.0, -1, -1, 1, 1, 1]) * 1e-3
    assert torch.equal(layer.expert_bias, before + step + second)


def test_bad_inputs_name_the_argument():
    layer = moe_route.MoELayer(H, INTER, E, K, backend="reference")
    with pytest.raises(ValueError, match=r"x must be \[..., hidden_size\] = \[..., 16\]"):
        layer(torch.zeros(3, H + 1))
    with pytest.raises(TypeError, match=r"x has dtype torch\.float64 but the layer"):
        layer(torch.zeros(3, H, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
        layer([[0.0] * H])
    with pytest.raises(ValueError, match="update_expert_bias needs router='sigmoid_grouped'"):
        layer.update_expert_bias(torch.zeros(E), 0.1)
    grouped = moe_route.MoELayer(H, INTER, E, K, router="sigmoid_grouped")
    with pytest.raises(ValueError, match=r"tokens_per_expert must be \[E\] = \[6\]"):
        grouped.update_expert_bias(torch.zeros(E + 1), 0.1)


@pytest.mark.parametrize(
    ("counts", "rate", "exc", "match"),
    [
        (torch.tensor([3, 1, 2, 2, 2, 2]), float("nan"), ValueError, "rate must be a finite"),
        (torch.tensor([3, 1, 2, 2, 2, 2]), float("inf"), ValueError, "rate must be a finite"),
        (torch.tensor([3, 1, 2, 2, 2, 2]), -1e-3, ValueError, r"finite number >= 0, got -0\.001"),
        (torch.tensor([3, 1, 2, 2, 2, 2]), "1e-3", TypeError, "rate must be a real number"),
        (torch.tensor([3, 1, 2, 2, 2, 2]), True, TypeError, "got bool"),
        (torch.tensor([3, 1, 2, 2, 2, 2]), torch.tensor(1e-3), TypeError, "got Tensor"),
        (torch.tensor([3, 1, 2, 2, 2, 2]), 1e308, ValueError, r"rate=1e\+308 is past the largest"),
        (torch.tensor([3, 1, 2, 2, 2, 2]), 2**200, ValueError, "is past the largest"),
        (torch.tensor([3.0, float("nan"), 2, 2, 2, 2]), 1e-3, ValueError, r"\[1\] = nan"),
        (torch.tensor([3.0, 1, 2, float("-inf"), 2, 2]), 1e-3, ValueError, r"\[3\] = -inf"),
        (torch.tensor([3, 1, -2, 2, 2, 2]), 1e-3, ValueError, r"\[2\] = -2: expected finite"),
        (torch.tensor([3.0, 1, 2, 2, -0.5, 2]), 1e-3, ValueError, r"\[4\] = -0.5: expected"),
        (torch.ones(E, dtype=torch.bool), 1e-3, TypeError, "integer or floating dtype"),
        (torch.ones(E, dtype=torch.complex64), 1e-3, TypeError, "integer or floating dtype"),
        (torch.ones(E, 1), 1e-3, ValueError, "tokens_per_expert must have 1 dimensions"),
        (torch.ones(E - 1), 1e-3, ValueError, r"tokens_per_expert must be \[E\] = \[6\]"),
        ([1, 2, 3, 4, 5, 6], 1e-3, TypeError, "tokens_per_expert must be a torch.Tensor"),
    ],
    ids=["nan-rate", "inf-rate", "negative-rate", "str-rate", "bool-rate", "tensor-rate",
         "huge-rate", "huge-int-rate", "nan-count", "inf-count", "negative-int-count",
         "negative-float-count", "bool-counts", "complex-counts", "2d", "short", "list"],
)  # fmt: skip
def test_update_expert_bias_rejects_bad_input(counts, rate, exc, match):
    layer = make_layer(router="sigmoid_grouped")
    before = layer.expert_bias.clone()
    with pytest.raises(exc, match=match):
        layer.update_expert_bias(counts, rate=rate)
    assert torch.equal(layer.expert_bias, before), "a rejected call changed the bias"


@pytest.mark.parametrize(
    "counts",
    [
        torch.tensor([10, 2, 4, 4, 5, 5], dtype=torch.int32),
        torch.tensor([10, 2, 4, 4, 5, 5], dtype=torch.uint8),
        torch.tensor(
            [1.0, 0.25, 0.375, 0.375, 0.5, 0.5], dtype=torch.bfloat16
        ),  # averaged over ranks
        torch.tensor([10, 2, 4, 4, 5, 5], dtype=torch.float64),
    ],
    ids=["int32", "uint8", "bf16", "float64"],
)
@pytest.mark.parametrize("rate", [0.01, np.float32(0.01), 0], ids=["float", "numpy", "zero"])
def test_update_expert_bias_count_dtypes(counts, rate):
    layer = make_layer(router="sigmoid_grouped")
    layer.expert_bias.fill_(0.5)
    layer.update_expert_bias(counts, rate=rate)
    step = torch.tensor([-1.0, 1, 1, 1, 0, 0]) * float(rate)
    assert layer.expert_bias.dtype == torch.float32
    assert torch.equal(layer.expert_bias, 0.5 + step)


def test_update_expert_bias_large_integer_counts_are_exact():
    """float64 arithmetic: counts that float32 cannot tell apart still compare with the mean."""
    layer = make_layer(router="sigmoid_grouped")
    layer.expert_bias.zero_()
    big = 2**25  # float32 rounds 2**25 + 1 to 2**25
    counts = torch.tensor([big + 1, big - 1, big, big, big, big], dtype=torch.int64)
    layer.update_expert_bias(counts, rate=1.0)
    assert layer.expert_bias.tolist() == [-1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


# ----------------------------------------------------------------------------- the example
def _example():
    spec = importlib.util.spec_from_file_location(
        "train_moe_lm", ROOT / "examples" / "train_moe_lm.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "extra",
    [[], ["--router", "sigmoid_grouped", "--capacity-factor", "1.25", "--shared-experts", "1"]],
    ids=["softmax", "deepseek-capacity-shared"],
)
def test_example_trains_and_the_loss_halves(extra, capsys):
    example = _example()
    threads = torch.get_num_threads()
    code = example.main(["--device", "cpu", "--steps", "120", *extra])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "initial loss" in out and "final loss" in out and "120/120" in out
    assert torch.get_num_threads() == threads


def test_router_matmul_falls_back_without_mm_out_dtype(monkeypatch):
    """On a torch whose ``torch.mm`` takes no ``out_dtype`` (setup.cfg allows 2.4), the
    inference router's one-matmul path reports None once and is not tried again."""
    from moe_route import layer_router as layer_module

    calls = []

    def old_mm(a, b, **kw):
        calls.append(kw)
        if kw:
            raise TypeError("mm() got an unexpected keyword argument 'out_dtype'")
        return a @ b

    monkeypatch.setattr(layer_module, "_MM_OUT_DTYPE", True)
    monkeypatch.setattr(torch, "mm", old_mm)
    a, b = torch.randn(3, 4, dtype=torch.float16), torch.randn(4, 5, dtype=torch.float16)
    assert layer_module._mm_float32(a, b) is None
    assert layer_module._mm_float32(a, b) is None
    assert calls == [{"out_dtype": torch.float32}]  # tried once
    assert layer_module._MM_OUT_DTYPE is False


@needs_interpreter
def test_eager_call_memo_serves_no_stale_decision(monkeypatch):
    """An inference layer keeps its decisions per call signature: a repeated call decides
    nothing again and gives the same bits; a call with other weights' strides, another token
    count, a gradient wanted or another finalize request gets its own decisions and the
    right output (the naive loop's, to the float32 tolerance)."""
    layer_mod = importlib.import_module("moe_route.layer_call")
    torch.manual_seed(3)
    layer = moe_route.MoELayer(32, 16, 4, 2, backend="triton").eval()
    plans = []
    real = layer_mod.moe_plan
    monkeypatch.setattr(layer_mod, "moe_plan", lambda *a: plans.append(1) or real(*a))
    x = torch.randn(1, 32)

    def expected(x):
        w, ids = reference.topk_routing_reference(layer.router_logits(x), 2, renormalize=True)
        return reference.moe_forward_reference(x.double(), layer.w1.double(), layer.w2.double(),
                                               w.double(), ids)  # fmt: skip

    with torch.no_grad():
        first, again = layer(x), layer(x)
        assert plans == [1]
        assert torch.equal(first.output, again.output)
        assert torch.equal(first.tokens_per_expert, again.tokens_per_expert)
        assert_matches(first.output, expected(x), 1e-5)
        # the same weights through other strides
        w1 = layer.w1.detach().transpose(1, 2).contiguous().transpose(1, 2)
        layer.w1 = nn.Parameter(w1, requires_grad=False)
        assert_matches(layer(x).output, expected(x), 1e-5)
        assert plans == [1, 1]
        x3 = torch.randn(3, 32)
        assert_matches(layer(x3).output, expected(x3), 1e-5)
        layer.finalize = "standalone"
        layer(x)
        assert len(plans) == 4
    out = layer(x.clone().requires_grad_())
    assert out.output.grad_fn is not None
    assert_matches(out.output.detach(), expected(x), 1e-5)


@needs_interpreter
@pytest.mark.parametrize("name", ["qwen3-no-norm-aux", "deepseek", "qwen2-shared-gate-bias"])
def test_training_step_prepared_route_matches_op_route(monkeypatch, name):
    """An eager training step takes the experts' prepared launch sequences
    (``_LayerCall.sorted_path``: its program run directly) and gives the bits of the op's
    route (the program through the custom op) for
    the output, the aux loss and every gradient, at the first call and at later ones of the
    same signature (a new T of the bucket included)."""
    layer_mod = importlib.import_module("moe_route.layer_call")
    kw = dict(CASES[name], backend="triton")

    def step(layer, x):
        xg = x.clone().requires_grad_(True)
        out = layer(xg)
        loss = (out.output * torch.linspace(-1, 1, out.output.numel()).view_as(out.output)).sum()
        leaves = [xg, *layer.parameters()]
        grads = torch.autograd.grad(loss + out.aux_loss, leaves, allow_unused=True)
        return out.output, out.aux_loss, grads

    taken = []
    real_call = moe_route.experts.MoEProgram.__call__
    monkeypatch.setattr(
        moe_route.experts.MoEProgram,
        "__call__",
        lambda *a, **k: taken.append(k["direct"]) or real_call(*a, **k),
    )
    layer = make_layer(torch.float32, **kw)
    xs = [_x((T, H), torch.float32) for T in (7, 6)]  # the first call; a new T of its bucket
    got = [step(layer, x) for x in xs]
    assert taken == [True] * len(xs), "the layer did not run its program directly"
    real_sorted = layer_mod._LayerCall.sorted_path

    def op_route(self, *args):
        maps, program, _ = real_sorted(self, *args)
        return maps, program, False

    monkeypatch.setattr(layer_mod._LayerCall, "sorted_path", op_route)
    layer._calls.clear()
    taken.clear()
    want = [step(layer, x) for x in xs]
    assert taken == [False] * len(xs)
    for (out, aux, grads), (out_w, aux_w, grads_w) in zip(got, want, strict=True):
        assert torch.equal(out, out_w) and torch.equal(aux, aux_w)
        for a, b in zip(grads, grads_w, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)


# ----------------------------------------------------------------------------- quantised experts
QUANT_FORMATS = ("fp8", "fp8_ue8m0", "fp8_channel", "mxfp4")
#: e4m3 rounds a value by at most half an ulp of its 3 mantissa bits: 2^-4 of itself.
E4M3_REL = 2.0**-4


def _dequantized_params(layer, quantized):
    """The parameters of ``layer`` with ``w1`` / ``w2`` replaced by ``quantized``'s experts
    dequantised (float64)."""
    p = _params(layer)
    for name in ("w1", "w2"):
        codes, scale = getattr(quantized, name), getattr(quantized, f"{name}_scale_inv")
        K = getattr(layer, name).shape[2]
        p[name] = moe_route.dequantize_experts(codes, scale, quantized.quant, K).double()
    return p


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize("name", ["mixtral", "deepseek", "qwen2-shared-gate-bias"])
def test_quantized_layer_matches_its_dequantized_experts(name, fmt):
    """The quantised layer against the oracle on the dequantised experts: the same routing,
    and the output off by the tokens' FP8 rounding only (each GEMM's input moves by at most
    2^-4 of itself; MXFP4 keeps the tokens: float32 rounding). Against the unquantised layer,
    the weights' rounding adds as much again (e2m1's 2^-2 for MXFP4)."""
    layer = make_layer(**CASES[name])
    q = make_layer(**CASES[name]).quantize_experts(fmt)
    assert "w1" not in dict(q.named_parameters()) and q.w1.dtype != layer.w1.dtype
    x = _x((3, 7, H), torch.float32)
    with torch.no_grad():
        out = q(x)
        exact, _, ids = naive_forward(layer, x.double(), _dequantized_params(layer, q))
        full = layer(x).output.double()
    assert torch.equal(out.topk_ids.long(), ids.long().view(out.topk_ids.shape))
    err = (out.output.double() - exact).abs().max().item()
    scale = exact.abs().max().item()
    tokens = 1e-5 if fmt == "mxfp4" else 2 * E4M3_REL
    assert err <= tokens * scale, (err, scale)
    weights = 2.0**-2 if fmt == "mxfp4" else E4M3_REL
    assert (out.output.double() - full).abs().max().item() <= (tokens + 2 * weights) * scale
    assert torch.equal(out.tokens_per_expert, layer(x).tokens_per_expert)


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_quantized_state_dict_round_trips_bit_exact(fmt):
    """codes + *_scale_inv (DeepSeek-V3 / transformers naming) load into a fresh unquantised
    layer (which takes the format from them) or an already quantised one, bit for bit."""
    q = make_layer(**CASES["deepseek"]).quantize_experts(fmt)
    sd = q.state_dict()
    assert {"w1", "w1_scale_inv", "w2", "w2_scale_inv"} <= set(sd)
    # a fresh layer reads the format from the codes and scales (power-of-two fp8_ue8m0 scales
    # read as fp8: quantising the target first keeps its format)
    inferred = "fp8" if fmt == "fp8_ue8m0" else fmt
    fresh = make_layer(seed=5, **CASES["deepseek"])
    prepared = make_layer(seed=5, **CASES["deepseek"]).quantize_experts(fmt)
    for target, want in ((fresh, inferred), (prepared, fmt)):
        target.load_state_dict(sd)
        assert str(target.quant) == want
        for key, value in target.state_dict().items():
            assert value.dtype == sd[key].dtype, key
            assert torch.equal(value.view(torch.uint8), sd[key].view(torch.uint8)), key
    x = _x((5, H), torch.float32)
    assert torch.equal(prepared(x).output, q(x).output)
    if inferred == fmt:
        assert torch.equal(fresh(x).output, q(x).output)


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_quantized_layer_on_the_meta_device(fmt):
    """A layer built on the meta device (torchtitan, FSDP2) quantises to the format's shapes
    and dtypes without reading a value, runs its forward on meta tokens, then, materialised,
    loads a quantised checkpoint: the same bits as the layer that wrote it."""
    src = make_layer(**CASES["deepseek"]).quantize_experts(fmt)
    sd = src.state_dict()
    with torch.device("meta"):
        layer = make_layer(**CASES["deepseek"])
    layer.quantize_experts(fmt)
    for key, value in layer.state_dict().items():
        assert value.is_meta and (value.shape, value.dtype) == (sd[key].shape, sd[key].dtype), key
    out = layer(torch.empty(5, H, device="meta")).output
    assert out.is_meta and out.shape == (5, H)
    layer = layer.to_empty(device="cpu")
    layer.load_state_dict(sd)
    x = _x((5, H), torch.float32)
    assert torch.equal(layer(x).output, src(x).output)


def test_quantized_layer_trains_the_router_not_the_experts():
    layer = make_layer(**CASES["qwen2-shared-gate-bias"]).quantize_experts("fp8")
    codes = {n: b.clone() for n, b in layer.named_buffers()}
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = _x((9, H), torch.float32).requires_grad_()
    out = layer(x)
    (out.output.square().mean() + out.aux_loss).backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    for name in ("gate.weight", "b1", "b2", "shared_w1", "shared_gate.weight"):
        assert dict(layer.named_parameters())[name].grad.abs().sum() > 0, name
    before = layer.gate.weight.detach().clone()
    opt.step()
    assert not torch.equal(layer.gate.weight, before)
    for n, b in layer.named_buffers():
        assert torch.equal(b.view(torch.uint8), codes[n].view(torch.uint8)), n


def test_quantized_layer_to_dtype_keeps_codes_and_scales():
    layer = make_layer(**CASES["mixtral"]).quantize_experts("fp8")
    layer.to(torch.bfloat16)
    assert layer.w1.dtype == torch.float8_e4m3fn and layer.w1_scale_inv.dtype == torch.float32
    out = layer(_x((4, H), torch.bfloat16)).output
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert "quant='fp8'" in repr(layer)


def test_quantize_experts_errors():
    layer = make_layer(**CASES["mixtral"])
    with pytest.raises(ValueError, match="quant='int4'"):
        layer.quantize_experts("int4")
    layer.quantize_experts("fp8")
    with pytest.raises(RuntimeError, match="already quantised"):
        layer.quantize_experts("fp8")
    with pytest.raises(RuntimeError, match="quantised"):
        layer.load_experts_([nn.Linear(1, 1)] * E)
    with pytest.raises(TypeError, match="dtype"):
        layer(_x((4, H), torch.float64))
    with pytest.raises(TypeError, match="float64"):
        make_layer(dtype=torch.float64).quantize_experts("fp8")
    # a 16/32-bit state dict into a quantised layer: said, not cast into codes
    with pytest.raises(RuntimeError, match="quantised"):
        layer.load_state_dict(make_layer(**CASES["mixtral"]).state_dict())
    # codes whose scales fit no format
    sd = make_layer(**CASES["mixtral"]).quantize_experts("fp8").state_dict()
    sd["w1_scale_inv"] = sd["w1_scale_inv"][:, :, :0]
    with pytest.raises(RuntimeError, match="w1_scale_inv"):
        make_layer(**CASES["mixtral"]).load_state_dict(sd)
