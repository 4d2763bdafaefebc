"""Host µs per call of the pieces of an eager ``MoELayer`` forward at decode size (H100 host),
next to ``index_select``: which torch ops the router costs, and how many kernels one layer call
launches (``torch.profiler``); the layer with the router in two steps instead of the fused
launch, and both routers' device time. Run on a GPU: ``python scripts/layer_host.py``."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

import moe_route
import moe_route.layer
import moe_route.routing
from moe_route.bench.harness import time_cuda, time_host
from moe_route.kernels.triton.router import gate_softmax_topk_triton

T, H, INTER, E, K = 1, 2048, 768, 128, 8


def host_us(fn) -> float:
    return time_host(fn, "cuda", calls=300, warmup=20).median_s * 1e6


layer = moe_route.MoELayer(H, INTER, E, K, device="cuda", dtype=torch.bfloat16)
layer.requires_grad_(False)
x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
xf = x.float()
wf = layer.gate.weight.float()
logits = torch.nn.functional.linear(xf, wf)
probs = logits.softmax(-1)
idx = torch.arange(T, device="cuda")
tw, ids = moe_route.softmax_topk(logits, K)
w1, w2 = layer.w1, layer.w2
rows = {
    "index_select": lambda: x.index_select(0, idx),
    "x.float()": lambda: x.float(),
    "gate.weight.float()": lambda: layer.gate.weight.float(),
    "linear fp32": lambda: torch.nn.functional.linear(xf, wf),
    "softmax": lambda: logits.softmax(-1),
    "sort stable": lambda: torch.sort(probs, dim=-1, descending=True, stable=True),
    "topk": lambda: torch.topk(probs, K, dim=-1),
    "softmax_topk": lambda: moe_route.softmax_topk(logits, K),
    "zeros(())": lambda: torch.zeros((), device="cuda"),
    "mm bf16 out fp32": lambda: torch.mm(x, layer.gate.weight.t(), out_dtype=torch.float32),
    "linear bf16": lambda: torch.nn.functional.linear(x, layer.gate.weight),
    "build_routing_maps": lambda: moe_route.build_routing_maps(ids, E),
    "fused_moe": lambda: moe_route.fused_moe(x, w1, w2, tw, ids),
    "MoELayer": lambda: layer(x),
    "route_softmax_fused": lambda: moe_route.routing.route_softmax_fused(
        x, layer.gate.weight, K, True, torch.float32, 0, "auto"
    ),
}
for name, fn in rows.items():
    try:
        print(f"{name:22} {host_us(fn):8.1f} us")
    except Exception as exc:  # e.g. an op this torch lacks
        print(f"{name:22} failed: {type(exc).__name__}: {str(exc)[:80]}")
# The same layer with the router in two steps (matmul, then softmax_topk), in this process.
real_fused = moe_route.layer.fused_router
moe_route.layer.fused_router = lambda *a: None
layer._calls.clear()  # (the layer keeps its decisions per call signature)
print(f"{'MoELayer, 2-step router':22} {host_us(rows['MoELayer']):8.1f} us")
moe_route.layer.fused_router = real_fused
layer._calls.clear()
for name in ("fused_moe", "MoELayer"):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        rows[name]()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    print(f"{name}: {len(kernels)} kernels: {', '.join(k[:40] for k in kernels)}")
# Device time of the router both ways (a CUDA graph of 10 calls, per call: no host time), at
# T = 1, 16, 64.
for t in (1, 16, 64):
    xt = torch.randn(t, H, device="cuda", dtype=torch.bfloat16)
    lg = torch.empty(t, E, device="cuda")
    wt, it = torch.empty(t, K, device="cuda"), torch.empty(t, K, device="cuda", dtype=torch.int32)

    def fused(xt=xt, lg=lg, wt=wt, it=it):
        gate_softmax_topk_triton(xt, layer.gate.weight, K, True, lg, wt, it)

    def two_step(xt=xt):
        moe_route.softmax_topk(torch.mm(xt, layer.gate.weight.t(), out_dtype=torch.float32), K)

    fused_us = time_cuda(fused, use_graph=True).median_s * 1e6
    two_us = time_cuda(two_step, use_graph=True).median_s * 1e6
    print(f"router device T={t}: fused {fused_us:.1f} us, matmul + softmax_topk {two_us:.1f} us")
