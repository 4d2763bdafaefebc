"""One launch of GEMM2's activation-backward kernel at a training shape (permuted dout, the
plan's tiles; mixtral T=4096 unless ``--shape qwen3`` / ``deepseek``), for ``ncu``:

    ncu --kernel-name regex:_gemm_act_bwd --launch-count 1 --section SpeedOfLight \
        --section LaunchStats --section Occupancy python scripts/act_bwd_ncu.py [--shape S]
"""

import argparse

import torch

from moe_route import build_routing_maps
from moe_route.kernels.triton.grouped_gemm import grouped_gemm_act_backward_triton
from moe_route.moe import _plan_for
from moe_route.reference import topk_routing_reference

SHAPES = {  # T, H, I, E, K
    "mixtral": (4096, 4096, 14336, 8, 2),
    "qwen3": (8192, 2048, 768, 128, 8),
    "deepseek": (4096, 7168, 2048, 256, 8),
}
ap = argparse.ArgumentParser()
ap.add_argument("--shape", choices=list(SHAPES), default="mixtral")
T, H, inter, E, K = SHAPES[ap.parse_args().shape]
dev, dt = "cuda", torch.bfloat16
M = T * K
tw, ids = topk_routing_reference(torch.randn(T, E, device=dev), K)
_, d2s, _, off = build_routing_maps(ids, E).tensors()
x = torch.randn(T, H, device=dev, dtype=dt)
w2 = torch.randn(E, H, inter, device=dev, dtype=dt) * H**-0.5
plan = _plan_for(x, torch.empty(E, 2 * inter, H, device=dev, dtype=dt), w2, K, "swiglu", "concat",
                 "standalone", True, False, "auto").configs  # fmt: skip
dout_perm = torch.randn(M, H, device=dev, dtype=dt)
z = torch.randn(M, 2 * inter, device=dev, dtype=dt)
wh, dz = torch.empty(M, inter, device=dev, dtype=dt), torch.empty_like(z)
for _ in range(2):
    grouped_gemm_act_backward_triton(
        dout_perm, w2.transpose(1, 2), off, d2s, z, tw.to(dt), wh, dz, plan.act_bwd.fused,
        epilogue=plan.epilogue, permuted=True,
    )  # fmt: skip
torch.cuda.synchronize()
print("act_bwd config", plan.act_bwd.fused)
