"""cProfile of eager fused_moe calls at a decode size (where the host time goes)."""

import cProfile
import pstats

import torch
import triton

import moe_route
from moe_route import reference as R

T, H, inter, E, K = 1, 2048, 1024, 64, 8
x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
w1 = torch.randn(E, 2 * inter, H, device="cuda", dtype=torch.bfloat16) * 0.02
w2 = torch.randn(E, H, inter, device="cuda", dtype=torch.bfloat16) * 0.02
tw, ids = R.topk_routing_reference(torch.randn(T, E, device="cuda"), K, renormalize=True)
for _ in range(20):
    moe_route.fused_moe(x, w1, w2, tw, ids)
torch.cuda.synchronize()
rt = triton.knobs.runtime
print("hooks:", rt.launch_enter_hook, getattr(rt.launch_enter_hook, "calls", None))
prof = cProfile.Profile()
prof.enable()
for _ in range(200):
    moe_route.fused_moe(x, w1, w2, tw, ids)
prof.disable()
torch.cuda.synchronize()
pstats.Stats(prof).sort_stats("tottime").print_stats(25)
