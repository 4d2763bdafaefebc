"""The spawned side of the expert-parallelism tests (tests/test_ep.py): scenarios and a worker.

Spawning a gloo group costs seconds (each process imports torch and moe_route), so one job
per world size runs every scenario: each rank builds the single-process layer of a scenario
from its seed, loads its full state dict into the expert-parallel layer (the checkpoint path
under test), runs forward + backward twice on its own tokens and saves what it saw. The test
process then compares with the single-process layer on the rank-major concatenation of the
ranks' tokens. Scenario inputs are functions of (scenario, rank, world size) only, so both
sides rebuild them alike.
"""

from __future__ import annotations

import copy
import datetime
import os
import socket

import interpreter_patch
import torch
import torch.distributed as dist

import moe_route

H, INTER, E, K = 16, 8, 8, 3

# name -> (layer kwargs, tokens per rank for W=2, for W=4). The default exchange (blocks of T
# rows, no host sync) needs the same T on every rank; uneven counts take ep_capacity="exact"
# or an int bound.
SCENARIOS = {
    "softmax": (
        dict(aux_loss_coef=0.1, z_loss_coef=0.01), (7, 7), (7, 7, 7, 7)),
    "softmax-exact": (
        dict(ep_capacity="exact", aux_loss_coef=0.1, z_loss_coef=0.01), (5, 9), (5, 9, 2, 7)),
    # a bound above every rank's T: padding tokens
    "softmax-capacity": (
        dict(ep_capacity=9, capacity_factor=0.7, renormalize=False, bias=True,
             gate_up_layout="interleaved", aux_loss_coef=0.1), (9, 6), (4, 8, 6, 5)),
    # the last rank's experts lose every choice (expert bias): it receives no rows at all
    "deepseek": (
        dict(router="sigmoid_grouped", n_group=4, topk_group=2, routed_scaling_factor=2.5,
             num_shared_experts=2, shared_intermediate_size=4, capacity_factor=1.0,
             aux_loss_coef=0.05, z_loss_coef=0.01), (9, 9), (7, 7, 7, 7)),
    "zero-tokens": (
        dict(ep_capacity="exact", num_shared_experts=1, shared_expert_gate=True,
             activation="geglu", bias=True, z_loss_coef=0.1), (0, 8), (6, 0, 3, 0)),
    "all-zero-tokens": (dict(num_shared_experts=1, aux_loss_coef=0.1), (0, 0), (0, 0, 0, 0)),
    "fixed": (
        dict(ep_capacity=30, aux_loss_coef=0.1, capacity_factor=1.3), (6, 9), (6, 9, 1, 5)),
    # chunks of the local batch, some empty (T=2 in 3 chunks)
    "chunked": (
        dict(ep_chunks=3, aux_loss_coef=0.1, capacity_factor=0.9, num_shared_experts=1),
        (5, 5), (2, 2, 2, 2)),
    "exact-chunked": (
        dict(ep_capacity="exact", ep_chunks=3, aux_loss_coef=0.1, capacity_factor=0.9,
             num_shared_experts=1), (5, 9), (5, 9, 2, 0)),
    "fixed-chunked": (
        dict(ep_capacity=12, ep_chunks=2, z_loss_coef=0.1, bias=True), (6, 9), (6, 9, 1, 5)),
    # the Triton kernels (interpreted on the CPU: seconds, so W=2 only), float32, the default
    # exchange's padding rows
    "triton": (
        dict(ep_chunks=2, z_loss_coef=0.1, aux_loss_coef=0.1, bias=True), (6, 6), None),
    # capacity too small: tokens beyond 2 per pair of ranks are dropped
    "fixed-truncated": (
        dict(ep_capacity=2, num_shared_experts=1, activation="gelu", bias=True), (6, 9),
        (6, 9, 1, 5)),
}  # fmt: skip
EP_ONLY = ("ep_capacity", "ep_chunks")
# Scenarios whose expert-parallel layer runs the Triton kernels in float32 (routing in float64,
# on parameters and tokens that float32 holds exactly, so that it routes as the float64 oracle).
TRITON = ("triton",)


def tokens(name: str, world: int) -> tuple[int, ...] | None:
    """Tokens per rank, or None where the scenario does not run at this world size."""
    return SCENARIOS[name][1] if world == 2 else SCENARIOS[name][2]


def ep_layer(name: str, group) -> moe_route.MoELayer:
    if name in TRITON:
        kw = dict(backend="triton", router_dtype=torch.float64, dtype=torch.float32)
    else:
        kw = dict(backend="reference", router_dtype=None, dtype=torch.float64)
    return moe_route.MoELayer(
        H, INTER, E, K, **layer_kwargs(name), **ep_kwargs(name), **kw, ep_group=group
    )


def layer_kwargs(name: str) -> dict:
    return {k: v for k, v in SCENARIOS[name][0].items() if k not in EP_ONLY}


def ep_kwargs(name: str) -> dict:
    return {k: v for k, v in SCENARIOS[name][0].items() if k in EP_ONLY}


def full_layer(name: str, world: int, **extra) -> moe_route.MoELayer:
    """The single-process float64 layer of a scenario (same values on every rank)."""
    torch.manual_seed(sum(map(ord, name)))
    kw = dict(layer_kwargs(name), backend="reference", router_dtype=None, dtype=torch.float64)
    layer = moe_route.MoELayer(H, INTER, E, K, **kw, **extra)
    with torch.no_grad():
        for b in (layer.b1, layer.b2):
            if b is not None:
                b.normal_(0, 0.3)
        layer.gate.weight.mul_(3)  # a peaked router: the choice matters
        if layer.expert_bias is not None:
            layer.expert_bias.copy_(torch.linspace(-0.2, 0.3, E))
            layer.expert_bias[E - E // world :] = -1e3  # the last rank's experts: no tokens
        if name in TRITON:
            for p in layer.parameters():
                p.copy_(p.float())
    return layer


def inputs(name: str, world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every rank's tokens ``x [T_r, H]`` and output gradient ``dout [T_r, H]``."""
    xs, douts = [], []
    for r, T in enumerate(tokens(name, world)):
        g = torch.Generator().manual_seed(1000 * world + 10 * r + sum(map(ord, name)))
        xs.append(torch.randn(T, H, generator=g, dtype=torch.float64))
        douts.append(torch.randn(T, H, generator=g, dtype=torch.float64))
    if name in TRITON:
        xs, douts = [x.float().double() for x in xs], [d.float().double() for d in douts]
    return xs, douts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _step(layer, x, dout):
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = layer(x)
    ((out.output * dout).sum() + out.aux_loss).backward()
    rec = {f: getattr(out, f).detach().clone() for f in out._fields}
    rec["x.grad"] = x.grad
    rec.update({f"{n}.grad": p.grad for n, p in layer.named_parameters()})
    return rec


def run_scenario(name: str, group, world: int, rank: int) -> dict:
    full = full_layer(name, world)
    ep = ep_layer(name, group)
    ep.load_state_dict(full.state_dict())
    xs, douts = inputs(name, world)
    dtype = ep.w1.dtype
    runs = [_step(ep, xs[rank].to(dtype), douts[rank].to(dtype)) for _ in range(2)]
    # checkpoints: the gathered full state dict, and the per-rank one into a fresh layer
    torch.manual_seed(12345 + rank)
    fresh = ep_layer(name, group)
    fresh.load_state_dict(ep.state_dict())
    return {
        "runs": runs,
        "full_state": ep.full_state_dict(),
        "rank_state": ep.state_dict(),
        "reloaded_state": fresh.state_dict(),
    }


def run_errors(group, world: int, rank: int) -> dict:
    """The messages of the collective errors (each rank's own)."""
    msgs = {}
    try:  # rank 1 builds a different layer: every rank must refuse
        inter = INTER + (rank == 1)
        moe_route.MoELayer(H, inter, E, K, dtype=torch.float64, ep_group=group)
    except ValueError as err:
        msgs["mismatch"] = str(err)
    try:
        moe_route.MoELayer(H, INTER, E, K, dtype=torch.float64, ep_group=group, ep_capacity=2,
                           capacity_factor=1.0 + (rank == 0))  # fmt: skip
    except ValueError as err:
        msgs["mismatch-float"] = str(err)
    try:
        moe_route.MoELayer(H, INTER, 2 * world - 1, K, ep_group=group)
    except ValueError as err:
        msgs["divide"] = str(err)
    for arg, key in (("ep_capacity", "capacity"), ("ep_chunks", "chunks")):
        try:
            moe_route.MoELayer(H, INTER, E, K, ep_group=group, **{arg: 0})
        except ValueError as err:
            msgs[key] = str(err)
    return msgs


def run_compiled(group) -> dict:
    """The fixed-capacity layer under ``torch.compile(fullgraph=True)`` (aot_eager: Dynamo's
    capture and AOT autograd, without code generation) next to eager: outputs and grads."""
    name = "fixed-chunked"
    full = full_layer(name, group.size())
    ep = ep_layer(name, group)
    ep.load_state_dict(full.state_dict())
    x = inputs(name, group.size())[0][group.rank()].requires_grad_(True)
    leaves = [x, *ep.parameters()]

    def step(x):
        out = ep(x)
        return out.output.square().sum() + out.aux_loss

    torch._dynamo.reset()
    loss = torch.compile(step, fullgraph=True, backend="aot_eager")(x)
    compiled = [loss, *torch.autograd.grad(loss, leaves)]
    loss = step(x)
    return {"compiled": compiled, "eager": [loss, *torch.autograd.grad(loss, leaves)]}


def run_from_experts(group) -> tuple[torch.Tensor, ...]:
    """``from_experts`` with all E modules: the full layer's w1, w2 and the rank's."""
    torch.manual_seed(7)
    experts = []
    for _ in range(E):
        m = torch.nn.Module()
        m.gate_proj, m.up_proj = (torch.nn.Linear(H, INTER, bias=False) for _ in range(2))
        m.down_proj = torch.nn.Linear(INTER, H, bias=False)
        experts.append(m.double())
    full = moe_route.MoELayer.from_experts(experts, K)
    mine = copy.deepcopy(moe_route.MoELayer.from_experts(experts, K, ep_group=group))
    assert mine.ep_group is group  # a deep copy shares the process group
    return full.w1.detach(), full.w2.detach(), mine.w1.detach(), mine.w2.detach()


def worker(rank: int, world: int, port: int, outdir: str, names: list[str]) -> None:
    # A spawned rank runs no conftest: the "triton" scenario's interpreter gets the same
    # once-per-module patching as the test process (its kernels run the same either way).
    interpreter_patch.apply_if_interpreting()
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=120),  # a rank that fails does not hang the rest
    )  # fmt: skip
    try:
        results = {
            name: run_scenario(name, dist.group.WORLD, world, rank)
            for name in names
            if tokens(name, world) is not None
        }
        results["errors"] = run_errors(dist.group.WORLD, world, rank)
        results["from_experts"] = run_from_experts(dist.group.WORLD)
        if world == 2:  # compiling costs seconds per rank: one world size is enough
            results["compiled"] = run_compiled(dist.group.WORLD)
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
