"""Host µs of one small op, layer by layer (H100 host): the public function (its call memo),
its op object, the ``*_tables`` implementation, the Triton launcher, ``ThinKernel.launch``, the
direct launch it ends in and Triton's own ``kernel[grid]``, with ``torch.empty``,
``torch.index_select`` and two ways to allocate the maps' tables beside them; the GEMMs'
public calls. The differences say which layer costs what. qwen3-30b-a3b sizes, T=64 (``--tokens``).

    python scripts/op_layers.py [--tokens T]
"""

import argparse

import torch

import moe_route
from moe_route import arch
from moe_route import reference as R
from moe_route.bench.harness import time_host
from moe_route.finalize import FINALIZE, finalize_tables
from moe_route.kernels import triton as kt
from moe_route.kernels.triton.expand import expand_rows_triton
from moe_route.kernels.triton.finalize import finalize_triton
from moe_route.kernels.triton.routing_maps import routing_maps_triton
from moe_route.maps import maps_op, new_tables, routing_maps_tables
from moe_route.permute import EXPAND, expand_tables

H, inter, E, K = 2048, 768, 128, 8


def us(fn):
    return time_host(fn, "cuda", calls=300, warmup=30).median_s * 1e6


def raw_launches(call):
    """For the last thin launch ``call`` makes: Triton's own ``kernel[grid]``, the thin
    ``ThinKernel.launch`` and the direct launch it ends in (arguments packed once)."""
    seen = []
    orig = kt.ThinKernel.launch

    def spy(self, key, grid, args, constexprs):
        seen.append((self, key, grid, args, constexprs()))
        return orig(self, key, grid, args, constexprs)

    kt.ThinKernel.launch = spy
    try:
        call()
    finally:
        kt.ThinKernel.launch = orig
    self, key, grid, args, cx = seen[-1]
    device = torch.cuda.current_device()
    packed, alignment = self._entries[key][0](args)
    direct = self.variant(key, device, alignment)
    stream = torch._C._cuda_getCurrentRawStream(device)
    g = (*grid, 1, 1)
    return {
        "kernel[grid]": lambda: self.fn[grid](*args, **cx),
        "ThinKernel.launch": lambda: self.launch(key, grid, args, None),
        "direct launch": lambda: direct(g[0], g[1], g[2], stream, packed),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=64)
    T = p.parse_args().tokens
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    tw, ids = R.topk_routing_reference(torch.randn(T, E, device="cuda"), K, renormalize=True)
    maps = moe_route.build_routing_maps(ids, E)
    s2d, d2s, efs, off = maps.tensors()
    y = torch.randn(T * K, H, device="cuda", dtype=torch.bfloat16)
    out_f = torch.empty(T, H, device="cuda", dtype=torch.bfloat16)
    out_e = torch.empty(T * K, H, device="cuda", dtype=torch.bfloat16)
    tables = [torch.empty(T * K, device="cuda", dtype=torch.int32) for _ in range(3)]
    off_out = torch.empty(E + 1, device="cuda", dtype=torch.int64)
    idx = torch.arange(T * K, device="cuda") % T
    be = arch.cached_backend(x.device, "auto")
    w1 = torch.randn(E, 2 * inter, H, device="cuda", dtype=torch.bfloat16) * H**-0.5
    w2 = torch.randn(E, H, inter, device="cuda", dtype=torch.bfloat16) * inter**-0.5
    h = moe_route.grouped_gemm(x, w1, maps, activation="swiglu", gather=True)
    pad = -(-2 * (E + 1) // 4) * 4  # the offsets' int32 words, to a 16-byte multiple

    def one_alloc():
        buf = ids.new_empty(pad + 3 * T * K, dtype=torch.int32)
        parts = buf.split_with_sizes((pad, T * K, T * K, T * K))
        return (*parts[1:], parts[0][: 2 * (E + 1)].view(torch.int64))

    rows = {
        "index_select": lambda: x.index_select(0, idx),
        "torch.empty": lambda: torch.empty(T, H, device="cuda", dtype=torch.bfloat16),
        "new_empty": lambda: x.new_empty(T, H),
        "current_device": torch.cuda.current_device,
        "maps: public": lambda: moe_route.build_routing_maps(ids, E),
        "maps: maps_op": lambda: maps_op(ids, E, be),
        "maps: tables": lambda: routing_maps_tables(ids, E, be),
        "maps: launcher": lambda: routing_maps_triton(ids, E, *tables, off_out),
        "maps: new_tables": lambda: new_tables(ids, E),
        "maps: one alloc, split": one_alloc,
        "gemm1 (gather, swiglu): public": lambda: moe_route.grouped_gemm(
            x, w1, maps, activation="swiglu", gather=True
        ),
        "gemm2: public": lambda: moe_route.grouped_gemm(h, w2, maps),
        "expand: public": lambda: moe_route.expand_rows(x, maps),
        "expand: op": lambda: EXPAND(x, s2d, d2s, efs, off, be),
        "expand: tables": lambda: expand_tables(x, s2d, d2s, efs, off, be),
        "expand: launcher": lambda: expand_rows_triton(x, s2d, efs, out_e),
        "finalize: public": lambda: moe_route.finalize_moe_routing(y, tw, maps),
        "finalize: op": lambda: FINALIZE(y, tw, s2d, efs, None, be),
        "finalize: tables": lambda: finalize_tables(y, tw, s2d, efs, None, be),
        "finalize: launcher": lambda: finalize_triton(y, tw, s2d, efs, None, out_f),
    }
    for name, call in (
        ("maps", rows["maps: launcher"]),
        ("expand", rows["expand: launcher"]),
        ("finalize", rows["finalize: launcher"]),
    ):
        for how, fn in raw_launches(call).items():
            rows[f"{name}: {how}"] = fn
    for fn in rows.values():
        for _ in range(30):
            fn()
    torch.cuda.synchronize()
    base = us(rows["index_select"])
    print(f"{'call':28} {'host us':>8} {'/ index_select':>15}")
    for name, fn in rows.items():
        t = us(fn)
        print(f"{name:28} {t:8.1f} {t / base:15.2f}")


if __name__ == "__main__":
    main()
