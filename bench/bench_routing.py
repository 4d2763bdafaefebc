"""The routing stages (maps, expand, finalize) of the suite, and their tile / block sweeps.

Without ``--sweep`` this is ``python -m moe_route bench --stages routing --name routing``: the
routing maps, expand and finalize kernels at the standard shapes, each next to the PyTorch
code a user would otherwise write (``moe_route/bench/baselines.py``), with every option of the
suite. ``--sweep`` also times the maps kernel per tile size and expand / finalize per block
size (launcher arguments) and writes ``routing_sweep.{json,csv}``.

Usage: ``python bench/bench_routing.py [--quick] [--sweep] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from harness import Ceilings, environment, make_row, print_table, time_cuda, write_results

import moe_route
from moe_route.bench.baselines import argsort_maps, torch_expand, torch_finalize
from moe_route.bench.suite import stage_main
from moe_route.kernels.triton.expand import expand_rows_triton
from moe_route.kernels.triton.finalize import finalize_triton
from moe_route.kernels.triton.routing_maps import routing_maps_triton

# (name, T, K, E) for the maps sweep; (name, T, K, H) for the expand / finalize sweep.
SWEEP_MAPS = [("decode", 64, 8, 256), ("deepseek", 4096, 8, 256), ("deepseek", 32768, 8, 256)]
SWEEP_ROWS = [("mixtral", 4096, 2, 4096), ("deepseek", 4096, 8, 7168)]


def random_ids(T, K, E, device):
    return torch.rand(T, E, device=device).topk(K, dim=1).indices.to(torch.int32)


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
    base = time_cuda(lambda: torch_expand(x, d2s))
    rows.append(make_row("expand", shape, "torch gather", base, ceil, nbytes))
    x_perm = torch.full((N, H), float("nan"), device="cuda", dtype=dtype)
    for bb in block_bytes:
        bh = _block_h(bb, dtype)
        expand_rows_triton(x, s2d, e4s, x_perm, block_h=bh)
        assert torch.equal(x_perm, torch_expand(x, d2s)), shape
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

    base = time_cuda(lambda: torch_finalize(y, w, s2d, bias))
    rows.append(make_row("finalize", shape, "torch gather+sum", base, ceil, nbytes))
    out = torch.full((T, H), float("nan"), device="cuda", dtype=dtype)
    ref = torch_finalize(y, w, s2d, bias).float()
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
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--sweep", action="store_true", help="also sweep tile / block sizes")
    pre.add_argument("--out")
    args, rest = pre.parse_known_args(argv)
    if args.out:
        rest += ["--out", args.out]
    rc = stage_main(["routing"], "routing", rest, doc=__doc__)
    if not args.sweep or "-h" in rest or "--help" in rest:
        return rc
    if not torch.cuda.is_available():
        print("bench_routing --sweep: no CUDA device here; the sweep needs one")
        return rc
    ceil = Ceilings.measure()
    env = environment(ceil)
    rows = []
    bench_maps(SWEEP_MAPS, ceil, rows, tiles=(256, 512, 1024, 2048, 4096))
    bench_rows(SWEEP_ROWS, ceil, rows, block_bytes=(2048, 4096, 8192, 16384))
    out = args.out or os.path.join(os.environ.get("OUT", "bench/results"))
    write_results(rows, env, out, "routing_sweep")
    print_table(rows, env)
    return rc


if __name__ == "__main__":
    sys.exit(main())
