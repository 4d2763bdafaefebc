"""Host µs per call of the pieces of an eager ``MoELayer`` forward at decode size (H100 host),
next to ``index_select``: which torch ops the router costs, and how many kernels one layer call
launches (``torch.profiler``). Run on a GPU: ``python scripts/layer_host.py``."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

import moe_route
from moe_route.bench.harness import time_host

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
}
for name, fn in rows.items():
    try:
        print(f"{name:22} {host_us(fn):8.1f} us")
    except Exception as exc:  # e.g. an op this torch lacks
        print(f"{name:22} failed: {type(exc).__name__}: {str(exc)[:80]}")
for name in ("fused_moe", "MoELayer"):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        rows[name]()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    print(f"{name}: {len(kernels)} kernels: {', '.join(k[:40] for k in kernels)}")
