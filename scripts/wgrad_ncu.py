"""One launch of a weight-gradient kernel at a training shape (deepseek-v3 T=4096 unless
``--shape``), with the plan's tiles, after a zero fill of the same output (the write-only
yardstick), for ``ncu``:

    ncu --kernel-name regex:"weight_grad|fill" --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis \
        python scripts/wgrad_ncu.py [--shape deepseek] [--which dw1|dw2]

Without ncu it prints the kernel's and the fill's time (CUDA events, median of 5).
"""

import argparse

import torch

from moe_route import build_routing_maps
from moe_route.kernels.triton.weight_grad import expert_weight_grad_triton
from moe_route.moe import _plan_for
from moe_route.reference import topk_routing_reference

SHAPES = {  # T, H, I, E, K
    "mixtral": (4096, 4096, 14336, 8, 2),
    "qwen3": (8192, 2048, 768, 128, 8),
    "deepseek": (4096, 7168, 2048, 256, 8),
}
ap = argparse.ArgumentParser()
ap.add_argument("--shape", choices=list(SHAPES), default="deepseek")
ap.add_argument("--which", choices=["dw1", "dw2"], default="dw1")
args = ap.parse_args()
T, H, inter, E, K = SHAPES[args.shape]
dev, dt = "cuda", torch.bfloat16
M = T * K
tw, ids = topk_routing_reference(torch.randn(T, E, device=dev), K)
_, d2s, _, off = build_routing_maps(ids, E).tensors()
w1 = torch.empty(E, 2 * inter, H, device=dev, dtype=dt)
w2 = torch.empty(E, H, inter, device=dev, dtype=dt)
cfgs = _plan_for(torch.empty(T, H, device=dev, dtype=dt), w1, w2, K, "swiglu", "concat",
                 "standalone", True, False, "auto").configs  # fmt: skip
if args.which == "dw1":  # dW1 = dz^T x_perm
    a, dw, cfg = torch.randn(M, 2 * inter, device=dev, dtype=dt), w1, cfgs.wgrad1
    b = torch.randn(M, H, device=dev, dtype=dt)
else:  # dW2 = dout_perm^T (w h)
    a, dw, cfg = torch.randn(M, H, device=dev, dtype=dt), w2, cfgs.wgrad2
    b = torch.randn(M, inter, device=dev, dtype=dt)
print(args.shape, args.which, cfg, f"{dw.numel() * 2 / 1e9:.2f} GB written")


def run():
    expert_weight_grad_triton(a, b, off, dw, cfg, dest_to_src=d2s, num_rows=M)


def fill():
    dw.fill_(1.0)


times = {}
for fn in (fill, run, fill, run):
    fn()
for name, fn in (("fill", fill), ("kernel", run)):
    ev = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        ev.append((s, e))
    torch.cuda.synchronize()
    times[name] = sorted(s.elapsed_time(e) for s, e in ev)[2]
gb = dw.numel() * 2 / 1e9
for name, ms in times.items():
    print(f"{name:7s} {ms * 1e3:8.0f} us  {gb / ms:.2f} TB/s of dW written")
