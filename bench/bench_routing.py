"""Benchmark the memory-bound routing stages: routing maps, expand rows, standalone finalize.

Each is timed next to the PyTorch baseline a user would otherwise write, in the same process,
after measuring the copy bandwidth and the bf16 matmul rate (see ``harness.py``):

* maps: an ``argsort`` pipeline that builds the same tables;
* expand: ``x.index_select(0, dest_to_src % T)``;
* finalize: gather ``y_perm`` through the map, multiply by the weights, sum over ``k``.

Usage: ``python bench/bench_routing.py [--quick] [--sweep] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Ceilings, environment, make_row, print_table, time_cuda, write_results

import moe_route
from moe_route.kernels.triton.expand import expand_rows_triton
from moe_route.kernels.triton.finalize import finalize_triton
from moe_route.kernels.triton.routing_maps import routing_maps_triton

# (name, T, K, E) for maps; (name, T, K, H) for expand/finalize; from DESIGN.md's standard shapes.
MAPS_SHAPES = [
    ("decode", 1, 8, 64),
    ("decode", 8, 8, 128),
    ("decode", 64, 8, 64),
    ("decode", 64, 8, 256),
    ("mixtral", 4096, 2, 8),
    ("mixtral", 32768, 2, 8),
    ("qwen3", 8192, 8, 128),
    ("qwen3", 32768, 8, 128),
    ("deepseek", 4096, 8, 256),
    ("deepseek", 16384, 8, 256),
    ("deepseek", 32768, 8, 256),
]
ROW_SHAPES = [
    ("decode", 64, 8, 2048),
    ("mixtral", 4096, 2, 4096),
    ("mixtral", 32768, 2, 4096),
    ("qwen3", 8192, 8, 2048),
    ("qwen3", 32768, 8, 2048),
    ("deepseek", 4096, 8, 7168),
    ("deepseek", 16384, 8, 7168),
]
QUICK = {"maps": [0, 3, 10], "rows": [0, 1, 5]}


def random_ids(T, K, E, device):
    return torch.rand(T, E, device=device).topk(K, dim=1).indices.to(torch.int32)


def argsort_maps(ids: torch.Tensor, E: int):
    """What model code writes without a routing kernel: sort unique keys, scatter the inverse."""
    T, K = ids.shape
    N = T * K
    i = torch.arange(N, device=ids.device)
    t, k = i // K, i % K
    s = k * T + t
    flat = ids.reshape(-1).long()
    key = torch.where(flat < 0, E * N + s, flat * N + i)
    dest_to_src = s[torch.argsort(key)]
    src_to_dest = torch.empty_like(dest_to_src).scatter_(0, dest_to_src, i)
    expert_for_src = torch.empty_like(flat).scatter_(0, s, flat)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, torch.where(flat < 0, E, flat), torch.ones_like(flat))
    offsets = torch.cumsum(counts, 0) - counts
    return src_to_dest.int(), dest_to_src.int(), expert_for_src.int(), offsets


def bench_maps(shapes, ceil, rows, tiles=(None,)):
    for name, T, K, E in shapes:
        _bench_maps_shape(f"{name} T={T} K={K} E={E}", T, K, E, ceil, rows, tiles)


def _bench_maps_shape(shape, T, K, E, ceil, rows, tiles):
    ids = random_ids(T, K, E, "cuda")
    N = T * K
    nbytes = N * 4 + 3 * N * 4 + (E + 1) * 8
    base = time_cuda(lambda: argsort_maps(ids, E))
    rows.append(make_row("maps", shape, "torch argsort", base, ceil, nbytes))
    outs = [torch.empty(N, dtype=torch.int32, device="cuda") for _ in range(3)]
    outs.append(torch.empty(E + 1, dtype=torch.int64, device="cuda"))
    ref = argsort_maps(ids, E)
    for tile in tiles:
        routing_maps_triton(ids, E, *outs, tile=tile)
        assert all(torch.equal(a, b) for a, b in zip(outs, ref, strict=True)), (shape, tile)
        ours = time_cuda(lambda t=tile: routing_maps_triton(ids, E, *outs, tile=t))
        impl = "moe_route" if tile is None else f"tile={tile}"
        speedup = base.median_s / ours.median_s
        rows.append(make_row("maps", shape, impl, ours, ceil, nbytes, x_argsort=speedup))


def bench_rows(shapes, ceil, rows, dtype=torch.bfloat16, block_bytes=(None,)):
    for name, T, K, H in shapes:
        E = {"decode": 64, "mixtral": 8, "qwen3": 128, "deepseek": 256}[name]
        maps = moe_route.build_routing_maps(random_ids(T, K, E, "cuda"), E)
        shape = f"{name} T={T} K={K} H={H}"
        _bench_expand_shape(shape, maps, H, dtype, ceil, rows, block_bytes)
        _bench_finalize_shape(shape, maps, H, dtype, ceil, rows, block_bytes)


def _block_h(block_bytes, dtype):
    return None if block_bytes is None else block_bytes // dtype.itemsize


def _bench_expand_shape(shape, maps, H, dtype, ceil, rows, block_bytes):
    T, N, es = maps.num_tokens, maps.num_expanded_rows, dtype.itemsize
    x = torch.randn(T, H, device="cuda", dtype=dtype)
    d2s = maps.expanded_dest_row_to_expanded_source_row
    s2d = maps.expanded_source_row_to_expanded_dest_row
    e4s = maps.expert_for_source_row
    nbytes = T * H * es + N * H * es + N * 4  # read x once, write N rows, read the map
    base = time_cuda(lambda: x.index_select(0, d2s % T))
    rows.append(make_row("expand", shape, "torch gather", base, ceil, nbytes))
    x_perm = torch.full((N, H), float("nan"), device="cuda", dtype=dtype)
    for bb in block_bytes:
        bh = _block_h(bb, dtype)
        expand_rows_triton(x, s2d, e4s, x_perm, block_h=bh)
        assert torch.equal(x_perm, x.index_select(0, d2s % T)), shape
        ours = time_cuda(lambda bh=bh: expand_rows_triton(x, s2d, e4s, x_perm, block_h=bh))
        impl = "moe_route" if bb is None else f"block={bb}B"
        speedup = base.median_s / ours.median_s
        rows.append(make_row("expand", shape, impl, ours, ceil, nbytes, x_torch=speedup))


def _bench_finalize_shape(shape, maps, H, dtype, ceil, rows, block_bytes):
    T, K, N, es = maps.num_tokens, maps.top_k, maps.num_expanded_rows, dtype.itemsize
    s2d = maps.expanded_source_row_to_expanded_dest_row
    e4s = maps.expert_for_source_row
    y = torch.randn(N, H, device="cuda", dtype=dtype)
    w = torch.rand(T, K, device="cuda", dtype=torch.float32)
    bias = torch.randn(H, device="cuda", dtype=dtype)
    # Read N permuted rows, the weights and two maps, write T rows; the [H] bias is noise.
    nbytes = N * H * es + T * H * es + N * 12 + H * es

    def torch_finalize():
        rows_k = y[s2d.view(K, T).long()].float()  # [K, T, H]
        return ((rows_k * w.t().unsqueeze(-1)).sum(0) + bias.float()).to(dtype)

    base = time_cuda(torch_finalize)
    rows.append(make_row("finalize", shape, "torch gather+sum", base, ceil, nbytes))
    out = torch.full((T, H), float("nan"), device="cuda", dtype=dtype)
    ref = torch_finalize().float()
    for bb in block_bytes:
        bh = _block_h(bb, dtype)
        finalize_triton(y, w, s2d, e4s, bias, out, block_h=bh)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (shape, err)
        ours = time_cuda(lambda bh=bh: finalize_triton(y, w, s2d, e4s, bias, out, block_h=bh))
        impl = "moe_route" if bb is None else f"block={bb}B"
        speedup = base.median_s / ours.median_s
        rows.append(
            make_row("finalize", shape, impl, ours, ceil, nbytes, x_torch=speedup, rel_err=err)
        )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="three shapes per stage")
    p.add_argument("--sweep", action="store_true", help="also sweep tile / block sizes")
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_routing: no CUDA device here; it needs one (see scripts/gpu_check.sh)")
        return 0
    maps_shapes = [MAPS_SHAPES[i] for i in QUICK["maps"]] if args.quick else MAPS_SHAPES
    row_shapes = [ROW_SHAPES[i] for i in QUICK["rows"]] if args.quick else ROW_SHAPES
    ceil = Ceilings.measure()
    env = environment(ceil)
    rows = []
    bench_maps(maps_shapes, ceil, rows)
    bench_rows(row_shapes, ceil, rows)
    if args.sweep:
        bench_maps(
            [MAPS_SHAPES[3], MAPS_SHAPES[8], MAPS_SHAPES[10]],
            ceil,
            rows,
            tiles=(256, 512, 1024, 2048, 4096),
        )
        bench_rows(
            [ROW_SHAPES[1], ROW_SHAPES[5]], ceil, rows, block_bytes=(2048, 4096, 8192, 16384)
        )
    write_results(rows, env, args.out, "routing")
    print_table(rows, env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
