"""Why the first fused_moe call at a token count not seen before (same bucket, nothing to
compile) costs more than a repeated one: times, cudaMalloc counts, and a cProfile of a first
call against a repeated call. qwen3-30b-a3b sizes; ``--tokens 8`` takes the decode path.

    python scripts/new_t_probe.py [--tokens 64]
"""

import argparse
import cProfile
import io
import pstats
import time

import torch

import moe_route
from moe_route import reference as R

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, default=64)
T0 = ap.parse_args().tokens
H, inter, E, K = 2048, 768, 128, 8
NEW = [t for t in (T0 - 1, T0 - 1 - max(T0 // 8, 1)) if t > T0 // 2 + 2]
x = torch.randn(T0, H, device="cuda", dtype=torch.bfloat16)
w1 = torch.randn(E, 2 * inter, H, device="cuda", dtype=torch.bfloat16) * 0.02
w2 = torch.randn(E, H, inter, device="cuda", dtype=torch.bfloat16) * 0.02
tw, ids = R.topk_routing_reference(torch.randn(T0, E, device="cuda"), K, renormalize=True)


def call(t):
    return moe_route.fused_moe(x[:t], w1, w2, tw[:t], ids[:t])


def once(t):
    torch.cuda.synchronize()
    n0 = torch.cuda.memory_stats().get("num_device_alloc", -1)
    s = time.perf_counter()
    call(t)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - s) * 1e6
    n1 = torch.cuda.memory_stats().get("num_device_alloc", -1)
    return dt, n1 - n0


for _ in range(10):
    call(T0)
once(T0)
for t in [*NEW, *NEW, T0, NEW[0], T0]:  # new T, the same again, seen T between
    dt, mallocs = once(t)
    print(f"T={t}: {dt:8.1f} us, cudaMalloc calls {mallocs}")


def profiled(t):
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    call(t)
    torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
    return s.getvalue()


def loop(t, n=300):
    for _ in range(n):
        call(t)


loop(T0)
us, mallocs = once(T0)
print(f"after a 300-call loop: seen T={T0} {us:.1f} us ({mallocs} mallocs)")
t_new = T0 // 2 + 1
loop(T0)
us, mallocs = once(t_new)
print(f"after a 300-call loop: new T={t_new} {us:.1f} us ({mallocs} mallocs)")
print(f"then seen T={T0} {once(T0)[0]:.1f} us, T={t_new} {once(t_new)[0]:.1f} us")

t_prof = T0 // 2 + 2 if T0 > 4 else T0
print(f"===== first call at T={t_prof}\n", profiled(t_prof))
print(f"===== repeated call at T={t_prof}\n", profiled(t_prof))
