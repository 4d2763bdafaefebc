"""Small fused_moe forward + backward (bf16, dropped slots, odd sizes, plain and clamped
SwiGLU), the softmax top-k router forward + backward and an MoELayer step, for
compute-sanitizer. The shapes reach both weight-gradient kernels: the pointer kernel at decode
sizes, the TMA kernel (bounded-row descriptors) at 128 and 1024 rows per expert, where the
persistent GEMM2 and dX also store through TMA and GEMM1 storing z runs 4 stages; and the
decode path (two tokens, no gradient, k- and n-contiguous weights; one token through an
inference MoELayer; 64 slots through one with 128 small experts); then the public ops one
by one, each call signature twice (the call memos' prepared launches).
``MOE_ROUTE_PERSISTENT=1`` runs the GEMMs on the persistent kernel;
``--tiny``: the smallest shape only (racecheck is slow); ``--rows``: the second shape only (75
rows per expert: the split activation backward's row pass on Hopper); ``--store``: the third
only (1024 rows per expert in its bucket: the TMA stores and 4-stage GEMM1 on Hopper);
``--quant``: only the quantised experts (every format, odd sizes with partial scale blocks and
TMA-fed sizes, a dropped slot, an expert without rows; inference twice, also through the
decode path, then a backward; the activation quantiser alone; the FP8 decode path at 32
slots); ``--ep``: only expert
parallelism's rank maps, with which every other run ends."""

import sys

import torch

import moe_route


def rank_maps_sweep():
    """Expert parallelism's rank maps (exact and block layouts, a capacity below T, padding
    tokens beyond the ids, no tokens), the exact ones read back by the finalize over them."""
    from moe_route.kernels.triton.rank_maps import rank_maps_triton

    cases = ((37, 37, 3, 3, 5, 0), (37, 37, 3, 3, 5, 17), (29, 40, 8, 1, 8, 40), (0, 0, 2, 1, 2, 0))
    for T_ids, T, K, El, W, C in cases:
        ids = torch.randint(-1, El * W, (T_ids, K), device="cuda", dtype=torch.int32)
        s2d, d2s, efs = (torch.empty(T * W, device="cuda", dtype=torch.int32) for _ in range(3))
        off = torch.empty(W + 1, device="cuda", dtype=torch.int64)
        ids_out = torch.empty_like(ids)
        rank_maps_triton(ids, El, W, C, T, s2d, d2s, efs, off, ids_out)
        if C == 0:
            maps = moe_route.RoutingMaps(s2d, d2s, efs, off, T, W, W)
            y = torch.randn(T * W, 64, device="cuda", dtype=torch.bfloat16)
            moe_route.finalize_moe_routing(y, torch.ones(T, W, device="cuda"), maps)


torch.manual_seed(0)
if "--ep" in sys.argv:
    rank_maps_sweep()
    torch.cuda.synchronize()
    sys.exit(0)
if "--quant" in sys.argv:
    # odd sizes (partial scale blocks, pointer-fed; about 11 rows per expert: the 16-row
    # tiles); TMA-fed sizes at 128 rows per expert (on SM90 the warp-specialised kernel: an
    # odd block count; per channel also a partial column tile, where 128-row blocks take the
    # Triton kernel); the decode path (3 tokens; FP8 quantising in its main loops)
    for T, H, inter, E, K in ((37, 200, 136, 8, 2), (300, 384, 256, 8, 2), (300, 384, 320, 8, 2)):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        w1 = torch.randn(E, 2 * inter, H, device="cuda") * 0.05
        w2 = torch.randn(E, H, inter, device="cuda") * 0.05
        logits = torch.randn(T, E, device="cuda")
        logits[:, -1] = -1e9
        tw, ids = logits.softmax(-1).topk(K, dim=-1)
        ids[1, 0] = -1
        for fmt in ("fp8", "fp8_ue8m0", "fp8_channel", "mxfp4"):
            (w1q, s1), (w2q, s2) = (moe_route.quantize_experts(w, fmt) for w in (w1, w2))
            kw = dict(quant=fmt, w1_scale=s1, w2_scale=s2)
            with torch.no_grad():
                for _ in range(2):
                    moe_route.fused_moe(x, w1q, w2q, tw, ids, **kw)
                    moe_route.fused_moe(x[:3], w1q, w2q, tw[:3], ids[:3], **kw)
            xx = x.detach().requires_grad_()
            out = moe_route.fused_moe(xx, w1q, w2q, tw, ids, **kw)
            torch.autograd.grad(out.float().sum(), xx)
            if fmt != "mxfp4":
                moe_route.quantize_activations(x[:, :131], fmt)
    # the FP8 decode path at its most slots on small experts: 32 (min(32, E / 2))
    T, H, inter, E, K = 4, 200, 136, 64, 8
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    (w1q, s1), (w2q, s2) = (moe_route.quantize_experts(torch.randn(E, n, k, device="cuda") * 0.05,
                                                       "fp8")
                            for n, k in ((2 * inter, H), (H, inter)))  # fmt: skip
    tw, ids = torch.randn(T, E, device="cuda").softmax(-1).topk(K, dim=-1)
    ids[1, 3] = -1
    with torch.no_grad():
        moe_route.fused_moe(x, w1q, w2q, tw, ids, quant="fp8", w1_scale=s1, w2_scale=s2)
    torch.cuda.synchronize()
    print("sanitize_small done")
    sys.exit(0)
shapes = ((37, 200, 136, 8, 2), (300, 200, 136, 8, 2), (1100, 72, 40, 2, 1), (5, 72, 40, 4, 4))
if "--tiny" in sys.argv:
    shapes = shapes[-1:]
if "--rows" in sys.argv:
    shapes = shapes[1:2]
if "--store" in sys.argv:
    shapes = shapes[2:3]
clamped = moe_route.activation("swiglu", alpha=1.702, limit=0.75, up_offset=1.0)
for T, H, inter, E, K in shapes:
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w1 = (torch.randn(E, 2 * inter, H, device="cuda") * 0.05).bfloat16()
    w2 = (torch.randn(E, H, inter, device="cuda") * 0.05).bfloat16()
    logits = torch.randn(T, E, device="cuda", requires_grad=True)
    tw, ids = moe_route.softmax_topk(logits, K)
    torch.autograd.grad(tw.sum(), logits)
    tw, ids = tw.detach(), ids.clone()
    ids[1, 0] = -1
    for act in ("swiglu", clamped):
        for fin, det in (("standalone", True), ("fused", True), ("fused", False)):
            for _ in range(2):  # the second launch goes through the direct (thin) path
                leaves = [t.detach().requires_grad_() for t in (x, w1, w2, tw)]
                out = moe_route.fused_moe(*leaves, ids, activation=act, finalize=fin,
                                          deterministic=det)  # fmt: skip
                torch.autograd.grad(out.float().sum(), leaves)
        with torch.no_grad():  # inference: the decode path (T*K <= min(16, E) here)
            moe_route.fused_moe(x[:2], w1, w2, tw[:2], ids[:2], activation=act)
            # n-contiguous weights (transposed views): the masked weight rows past H and I
            w1t, w2t = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in (w1, w2))
            moe_route.fused_moe(x[:2], w1t, w2t, tw[:2], ids[:2], activation=act)
    layer = moe_route.MoELayer(H, inter, E, K, device="cuda", dtype=torch.bfloat16)
    out = layer(x)
    (out.output.float().sum() + out.aux_loss).backward()
    with torch.no_grad():  # an inference layer call: the decode path with its counts
        layer.eval()(x[:1])
# the decode path at its most slots (64: small experts, E >= 128), the layer's counts with them
layer = moe_route.MoELayer(72, 40, 128, 8, device="cuda", dtype=torch.bfloat16).eval()
with torch.no_grad():
    layer(torch.randn(8, 72, device="cuda", dtype=torch.bfloat16))
# the public ops one by one, each signature twice (the second call runs its memo's prepared
# launch), odd sizes, a dropped slot, a shared bias, gathering and plain GEMMs, no tokens
H, inter, E, K = 200, 136, 8, 2
w1 = (torch.randn(E, 2 * inter, H, device="cuda") * 0.05).bfloat16()
w2 = (torch.randn(E, H, inter, device="cuda") * 0.05).bfloat16()
bias = torch.randn(H, device="cuda", dtype=torch.bfloat16)
for T in (1, 5, 37, 0):
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    tw, ids = torch.randn(T, E, device="cuda").softmax(-1).topk(K, dim=-1)
    if T:
        ids[0, 1] = -1
    for _ in range(2):
        maps = moe_route.build_routing_maps(ids, E)
        xp = moe_route.expand_rows(x, maps)
        h = moe_route.grouped_gemm(x, w1, maps, activation="swiglu", gather=True)
        h = moe_route.grouped_gemm(xp, w1, maps, activation="swiglu")
        y = moe_route.grouped_gemm(h, w2, maps)
        moe_route.finalize_moe_routing(y, tw, maps, bias)
rank_maps_sweep()
torch.cuda.synchronize()
print("sanitize_small done")
