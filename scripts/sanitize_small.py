"""Small fused_moe forward + backward (bf16, dropped slots, odd sizes) for compute-sanitizer."""

import torch

import moe_route
from moe_route import reference as R

torch.manual_seed(0)
for T, H, inter, E, K in ((37, 200, 136, 8, 2), (5, 72, 40, 4, 4)):
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w1 = (torch.randn(E, 2 * inter, H, device="cuda") * 0.05).bfloat16()
    w2 = (torch.randn(E, H, inter, device="cuda") * 0.05).bfloat16()
    tw, ids = R.topk_routing_reference(torch.randn(T, E, device="cuda"), K, renormalize=True)
    ids[1, 0] = -1
    for fin, det in (("standalone", True), ("fused", True), ("fused", False)):
        for _ in range(2):  # the second launch goes through the direct (thin) path
            leaves = [t.detach().requires_grad_() for t in (x, w1, w2, tw)]
            out = moe_route.fused_moe(*leaves, ids, finalize=fin, deterministic=det)
            torch.autograd.grad(out.float().sum(), leaves)
torch.cuda.synchronize()
print("sanitize_small done")
