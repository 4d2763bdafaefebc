"""Host time of each small public op at T=64 (qwen3 sizes) and a cProfile of where it goes."""

import cProfile
import io
import pstats

import torch

import moe_route
from moe_route import reference as R
from moe_route.bench.harness import time_host

T, H, E, K = 64, 2048, 128, 8
x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
tw, ids = R.topk_routing_reference(torch.randn(T, E, device="cuda"), K, renormalize=True)
maps = moe_route.build_routing_maps(ids, E)
y = torch.randn(T * K, H, device="cuda", dtype=torch.bfloat16)
idx = torch.arange(T, device="cuda")
calls = {
    "index_select": lambda: x.index_select(0, idx),
    "build_routing_maps": lambda: moe_route.build_routing_maps(ids, E),
    "expand_rows": lambda: moe_route.expand_rows(x, maps),
    "finalize_moe_routing": lambda: moe_route.finalize_moe_routing(y, tw, maps),
    "torch.empty": lambda: torch.empty(T, H, device="cuda", dtype=torch.bfloat16),
}


def per_call(fn, n=300):
    """Host µs per call (the bench suite's host loop: median of 3 loops of ``n`` calls)."""
    return time_host(fn, "cuda", calls=n, warmup=30).median_s * 1e6


for name, fn in calls.items():
    print(f"{name:24} {per_call(fn):7.1f} us/call")
for name in ("build_routing_maps", "expand_rows", "finalize_moe_routing"):
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        calls[name]()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
    print(f"===== {name}\n" + "\n".join(s.getvalue().splitlines()[6:]))
