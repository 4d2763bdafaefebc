"""Where an eager decode call's host time goes (GPU): an inference ``MoELayer`` and
``fused_moe`` at qwen3-30b-a3b's (or olmoe-1b-7b's) MoE sizes, ``T=1``, with inclusive timers
around the pieces of their path (each wrapper adds ~0.3 µs), next to the host cost of the
torch primitives the path is made of (allocation, views, stride reads, mode queries, a thin
launch). Host µs per call in bursts of 8 unsynchronised calls, synchronised between bursts
(the launch queue never fills, so device time does not leak into the figure).

    PYTHONPATH=.:scripts python scripts/decode_host_split.py [--calls 2000] [--model olmoe]
"""

import argparse

import torch
from backward_host import Timers, burst  # scripts/, the running script's folder

import moe_route
import moe_route.layer as layer_mod
import moe_route.moe as moe_mod
from moe_route import reference as R
from moe_route.kernels.triton import ThinKernel
from moe_route.kernels.triton import decode as decode_mod
from moe_route.kernels.triton import router as router_mod

#: (H, I, E, K)
MODELS = {"qwen3": (2048, 768, 128, 8), "olmoe": (2048, 1024, 64, 8)}


def primitives(calls, H=2048):
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    buf = torch.empty(1 << 16, device="cuda", dtype=torch.uint8)
    idx = torch.arange(8, device="cuda") % 1
    rows = {
        "index_select (8 rows)": lambda: torch.index_select(x, 0, idx),
        "torch.empty((8, 768), device=cuda)": lambda: torch.empty((8, 768), device="cuda"),
        "x.new_empty(8, 768)": lambda: x.new_empty(8, 768),
        "x.new_empty((8, 768), dtype=int32)": lambda: x.new_empty((8, 768), dtype=torch.int32),
        "buf[a:b]": lambda: buf[256:1024],
        "buf[a:b].view(bf16).view(1, 2048)": lambda: buf[0:4096].view(torch.bfloat16).view(1, H),
        "buf.as_strided": lambda: buf.as_strided((8, 64), (64, 1), 128),
        "x.view(1, 2048)": lambda: x.view(1, H),
        "x.reshape(-1, 2048)": lambda: x.reshape(-1, H),
        "x.stride()": lambda: x.stride(),
        "x.data_ptr()": lambda: x.data_ptr(),
        "torch.is_grad_enabled()": torch.is_grad_enabled,
        "torch.compiler.is_compiling()": torch.compiler.is_compiling,
        "_cuda_isCurrentStreamCapturing": torch._C._cuda_isCurrentStreamCapturing,
        "torch.cuda.current_device()": torch.cuda.current_device,
        "_cuda_getCurrentRawStream(0)": lambda: torch._C._cuda_getCurrentRawStream(0),
    }
    print("primitives, host us per call:")
    for name, fn in rows.items():
        print(f"  {burst(fn, loops=calls // 8):7.2f}  {name}")


def launch_pieces(calls, w1, w2, tw, ids, x):
    """The decode up kernel's thin launch in pieces: the whole launch as the launcher calls it,
    the key's lookup, the argument packing, and the C launcher with packed arguments."""
    real = ThinKernel.launch
    seen = {}

    def capture(self, key, grid, args, constexprs):
        if self is decode_mod._UP:
            seen.update(key=key, grid=grid, args=args, cx=constexprs)
        return real(self, key, grid, args, constexprs)

    ThinKernel.launch = capture
    moe_route.fused_moe(x, w1, w2, tw, ids)
    ThinKernel.launch = real
    up, key, grid, args, cx = decode_mod._UP, seen["key"], seen["grid"], seen["args"], seen["cx"]
    pack, variants = up._entries[key]
    packed, align = pack(args)
    run = variants[(torch.cuda.current_device(), align)]
    g = (*grid, 1, 1)
    stream = torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())
    rows = {
        f"ThinKernel.launch (up kernel, {len(args)} args)": lambda: up.launch(key, grid, args, cx),
        "key lookup (hash of the key)": lambda: up._entries.get(key),
        "pack (data_ptr of each tensor)": lambda: pack(args),
        "C launcher, packed args": lambda: run(g[0], g[1], g[2], stream, packed),
    }
    print("thin launch pieces, host us per call:")
    for name, fn in rows.items():
        print(f"  {burst(fn, loops=calls // 8):7.2f}  {name}")


def split(title, fn, wraps, calls):
    total = burst(fn, loops=calls // 8)
    timers = Timers()
    for owner, name, label in wraps:
        timers.wrap(owner, name, label)
    try:
        for i in range(calls):
            fn()
            if i % 8 == 7:
                torch.cuda.synchronize()
    finally:
        timers.undo()
    print(f"{title}: {total:.1f} us host per call unwrapped")
    timers.report(calls, title)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3")
    args = ap.parse_args()
    calls = args.calls
    H, INTER, E, K = MODELS[args.model]
    primitives(calls)
    torch.set_grad_enabled(False)
    layer = moe_route.MoELayer(H, INTER, E, K, device="cuda", dtype=torch.bfloat16)
    layer.requires_grad_(False)
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    w1, w2 = layer.w1.detach(), layer.w2.detach()
    tw, ids = R.topk_routing_reference(torch.randn(1, E, device="cuda"), K, renormalize=True)
    common = [
        (ThinKernel, "launch", "ThinKernel.launch (all)"),
        (torch.Tensor, "new_empty", "Tensor.new_empty (all)"),
        (decode_mod.DecodeLaunch, "__call__", "DecodeLaunch (allocations, launches)"),
    ]
    layer_wraps = [
        *common,
        (layer_mod.MoELayer, "forward", "MoELayer.forward"),
        (layer_mod.MoELayer, "_eager_call", "MoELayer._eager_call (memo key, lookup)"),
        (router_mod.GateLaunch, "__call__", "GateLaunch (allocations, launch)"),
        (layer_mod._LayerCall, "decode_launch", "_LayerCall.decode_launch"),
        (layer_mod.MoELayer, "shared_expert", "shared_expert"),
        (layer_mod.MoELayer, "_zero_loss", "_zero_loss"),
        (layer_mod._checks, "check_tensor", "check_tensor"),
    ]
    launch_pieces(calls, w1, w2, tw, ids, x)
    split(f"MoELayer T=1 ({args.model})", lambda: layer(x), layer_wraps, calls)
    fused_wraps = [
        *common,
        (moe_route, "fused_moe", "fused_moe"),
        (moe_mod, "_call_key", "_call_key (memo key)"),
        (moe_mod.FusedCall, "__call__", "FusedCall"),
    ]
    split(f"fused_moe T=1 ({args.model})", lambda: moe_route.fused_moe(x, w1, w2, tw, ids),
          fused_wraps, calls)  # fmt: skip


if __name__ == "__main__":
    main()
