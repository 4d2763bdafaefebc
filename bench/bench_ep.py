"""Benchmark expert parallelism: ``MoELayer(ep_group=...)`` across the GPUs of one node.

Run with torchrun, one process per GPU::

    torchrun --nproc-per-node 4 bench/bench_ep.py [--quick] [--shapes qwen3,deepseek]
        [--tokens 4096] [--chunks 1,2] [--iters 20] [--out DIR]

Without CUDA it runs on the CPU over gloo (a smoke run: ``--smoke`` picks a tiny shape).

Per shape and implementation, every rank times (median of ``--iters`` after warm-up, with a
barrier before each sample) its forward (``torch.no_grad``) and forward + backward
(``out.backward(dout)``) on its own ``--tokens`` tokens; the table shows the slowest rank
(the step waits for it), tokens/s per rank and for the group, and the share of the time spent
in the exchanges. Implementations:

* ``moe_route`` — the layer, exact split sizes (one host sync per forward);
* ``moe_route-fixed`` — ``ep_capacity = ceil(1.25·T·K/W)`` rows per pair of ranks (no host
  sync; the slots dropped beyond the capacity are counted in the ``dropped`` column);
* ``moe_route-chunksN`` — ``ep_chunks=N``: the all-to-alls of one chunk overlap the experts
  of another;
* ``grouped_mm`` — the same layer and exchange, the experts by ``torch._grouped_mm`` on the
  received rows (argsort by local expert, two grouped GEMMs, SwiGLU, unsort), as torchtitan's
  expert parallelism does; its output is checked against ``moe_route``'s first.

The communication share comes from a second, instrumented pass: CUDA events around each
exchange (the row all-to-alls, forward and backward, and the count / statistics all-gathers of
the forward), each waited for at once, so that pass serialises what ``ep_chunks`` overlaps;
the share is its exchange time over its own total.

Shapes (``--shapes``): qwen3 (H=2048, I=768, E=128, K=8) and deepseek (H=7168, I=2048,
E=256, K=8), softmax router, SwiGLU, bf16. When ``E/W`` experts (weights and gradients) would
take more than ``--mem-fraction`` of the GPU, ``E`` is scaled down to ``W`` times what fits
(a multiple of 8 per rank); the table shows the ``E`` used.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.nn.functional as F

import moe_route
from moe_route.parallel import expert_parallel

SHAPES = {  # name: (H, I, E, K)
    "qwen3": (2048, 768, 128, 8),
    "deepseek": (7168, 2048, 256, 8),
    "tiny": (64, 32, 8, 2),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3,deepseek", help="comma list of " + str(list(SHAPES)))
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--chunks", default="2", help="comma list of ep_chunks > 1 to time")
    p.add_argument("--capacity-factor", type=float, default=1.25, help="of moe_route-fixed")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--mem-fraction", type=float, default=0.5)
    p.add_argument("--no-baseline", action="store_true", help="skip grouped_mm")
    p.add_argument("--backend", default="auto", help="MoELayer's backend (auto: Triton on CUDA)")
    p.add_argument("--quick", action="store_true", help="fewer tokens and iterations")
    p.add_argument("--smoke", action="store_true", help="tiny shape, 2 iterations (CPU test)")
    p.add_argument(
        "--collectives", action="store_true",
        help="only compare the two autograd all-to-alls of torch.distributed",
    )  # fmt: skip
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.iters, args.warmup = min(args.tokens, 2048), 5, 2
    if args.smoke:
        args.shapes, args.tokens, args.iters, args.warmup, args.chunks = "tiny", 32, 2, 1, "2"
    args.shapes = [s for s in args.shapes.split(",") if s]
    for s in args.shapes:
        if s not in SHAPES:
            p.error(f"--shapes: unknown shape {s!r}; expected some of {list(SHAPES)}")
    args.chunks = [int(c) for c in args.chunks.split(",") if c and int(c) > 1]
    return args


# ----------------------------------------------------------------------------- timing
class Clock:
    """CUDA events on the current stream, or the host clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) * 1e-3
        return end - start


class CommTimer:
    """Context: the layer's exchanges and all-gathers timed (each waited for at once)."""

    def __init__(self, clock: Clock):
        self.clock, self.pairs = clock, []
        self.saved = (expert_parallel._exchange, expert_parallel.all_gather)

    def timed(self, issue):
        start = self.clock.mark()
        out = fc.wait_tensor(issue())
        self.pairs.append((start, self.clock.mark()))
        return out

    def __enter__(self):
        timed, gather = self.timed, self.saved[1]

        class Exchange(torch.autograd.Function):
            @staticmethod
            def forward(ctx, rows, out_splits, in_splits, group):
                ctx.splits, ctx.group = (out_splits, in_splits), group
                return timed(lambda: fc.all_to_all_single(rows, out_splits, in_splits, group))

            @staticmethod
            def backward(ctx, grad):
                out_splits, in_splits = ctx.splits
                g = grad.contiguous()
                back = timed(lambda: fc.all_to_all_single(g, in_splits, out_splits, ctx.group))
                return back, None, None, None

        def exchange(rows, out_splits, in_splits, group):
            return Exchange.apply(rows.contiguous(), out_splits, in_splits, group)

        def all_gather(t, dim, group):
            return timed(lambda: gather(t, dim, group))

        expert_parallel._exchange, expert_parallel.all_gather = exchange, all_gather
        return self

    def __exit__(self, *exc):
        expert_parallel._exchange, expert_parallel.all_gather = self.saved

    def share(self, samples: list[float]) -> float:
        """Exchange time of the steps timed since the last call, over their total time."""
        comm = sum(self.clock.seconds(a, b) for a, b in self.pairs)
        self.pairs = []
        return comm / max(sum(samples), 1e-30)


def time_steps(fn, clock: Clock, iters: int, warmup: int) -> list[float]:
    """Seconds of ``fn()``, ``iters`` samples, each after a barrier."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        dist.barrier()
        start = clock.mark()
        fn()
        samples.append(clock.seconds(start, clock.mark()))
    return samples


# ----------------------------------------------------------------------------- baseline
def grouped_mm_experts(layer, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
    """The received rows through their local experts with ``torch._grouped_mm`` (SwiGLU,
    concat layout, no biases): sort by local expert, two grouped GEMMs, unsort."""
    El = layer.w1.shape[0]
    ids = local_ids.view(-1).long()
    key = torch.where(ids < 0, El - 1, ids)  # padding rows ride with the last expert, masked
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(El, dtype=torch.int64, device=rows.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    gate, up = torch._grouped_mm(rows[order], layer.w1.transpose(1, 2), offs=offs).chunk(2, -1)
    y = torch._grouped_mm(F.silu(gate) * up, layer.w2.transpose(1, 2), offs=offs)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return torch.where((ids >= 0).unsqueeze(1), y[inverse], torch.zeros((), dtype=y.dtype))


@contextlib.contextmanager
def grouped_mm_baseline():
    """The layer's experts run by :func:`grouped_mm_experts` inside the context."""
    saved = expert_parallel._run_experts
    expert_parallel._run_experts = grouped_mm_experts
    try:
        yield
    finally:
        expert_parallel._run_experts = saved


# ----------------------------------------------------------------------------- cases
def fit_experts(H, inter, E, K, W, device, mem_fraction) -> int:
    """Experts to use: ``E``, or ``W`` times the experts per rank whose bf16 weights and
    gradients fit in ``mem_fraction`` of the GPU (a multiple of 8), and at least ``K``."""
    local = E // W
    if device.type == "cuda":
        per_expert = 3 * H * inter * 2 * 2  # w1 [2I, H] + w2 [H, I], bf16, weights + grads
        total = torch.cuda.get_device_properties(device).total_memory
        fits = int(mem_fraction * total) // per_expert
        if fits < local:
            local = max(8 * (fits // 8), 1)
    return W * max(local, math.ceil(K / W))


def run_case(shape, args, device, group, clock) -> list[dict]:
    H, inter, E_full, K = SHAPES[shape]
    W, rank = group.size(), group.rank()
    E = fit_experts(H, inter, E_full, K, W, device, args.mem_fraction)
    T = args.tokens
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    C = math.ceil(args.capacity_factor * T * K / W)
    impls = [("moe_route", {}), ("moe_route-fixed", {"ep_capacity": C})]
    impls += [(f"moe_route-chunks{n}", {"ep_chunks": n}) for n in args.chunks]
    if not args.no_baseline:
        impls.append(("grouped_mm", {}))
    g = torch.Generator(device=device).manual_seed(1234 + rank)
    x = torch.randn(T, H, generator=g, device=device, dtype=dtype)
    dout = torch.randn(T, H, generator=g, device=device, dtype=dtype)
    rows, reference = [], None
    for impl, kw in impls:
        torch.manual_seed(0)  # the same replicated router on every rank
        layer = moe_route.MoELayer(
            H, inter, E, K, ep_group=group, device=device, dtype=dtype, backend=args.backend, **kw
        )
        baseline = impl == "grouped_mm"
        # CPU: torch._grouped_mm has no usable backward there; the baseline runs forward only
        train = device.type == "cuda" or not baseline

        def forward(layer=layer):
            with torch.no_grad():
                return layer(x)

        def train_step(layer=layer):
            layer(x).output.backward(dout)
            layer.zero_grad(set_to_none=True)

        with grouped_mm_baseline() if baseline else contextlib.nullcontext():
            out = forward()
            if impl == "moe_route":
                reference = out.output.float()
            elif baseline:
                err = (out.output.float() - reference).norm() / reference.norm().clamp(min=1e-30)
                tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
                if err > tol:
                    raise AssertionError(f"{shape}: grouped_mm differs from moe_route by {err:.3g}")
            dropped = int((out.topk_ids < 0).sum())
            fwd = statistics.median(time_steps(forward, clock, args.iters, args.warmup))
            step = math.nan
            if train:
                step = statistics.median(time_steps(train_step, clock, args.iters, args.warmup))
            with CommTimer(clock) as timer:
                comm_fwd = timer.share(time_steps(forward, clock, args.iters, 0))
                comm_step = math.nan
                if train:
                    comm_step = timer.share(time_steps(train_step, clock, args.iters, 0))
        stats = torch.tensor([fwd, step, comm_fwd, comm_step, dropped], device=device)
        every = fc.wait_tensor(expert_parallel.all_gather(stats.double(), 0, group)).view(W, 5)
        slowest = every.max(0).values.tolist()
        rows.append({
            "shape": shape, "W": W, "H": H, "I": inter, "E": E, "K": K, "tokens_per_rank": T,
            "impl": impl, "fwd_ms": slowest[0] * 1e3, "fwd_bwd_ms": slowest[1] * 1e3,
            "tokens_per_s_rank": T / slowest[1], "tokens_per_s_group": W * T / slowest[1],
            "comm_share_fwd": every[:, 2].mean().item(),
            "comm_share_fwd_bwd": every[:, 3].mean().item(),
            "dropped_slots": int(every[:, 4].sum().item()),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        })  # fmt: skip
        del layer, out, forward, train_step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def compare_collectives(args, device, group, clock) -> None:
    """Forward + backward of an autograd all-to-all: the functional collective the layer uses
    against ``torch.distributed.nn.functional.all_to_all_single``, alternated, median ms."""
    import warnings

    import torch.distributed.nn.functional as nnf

    W = group.size()
    rows, H = (4096, 256) if device.type == "cpu" else (65536, 4096)
    dtype = torch.float64 if device.type == "cpu" else torch.bfloat16
    x = torch.randn(rows, H, device=device, dtype=dtype, requires_grad=True)
    dout = torch.randn(rows, H, device=device, dtype=dtype)
    splits = [rows // W] * W

    # (y * dout).sum(): an op on y, which waits for a functional collective's result
    def functional():
        y = fc.all_to_all_single_autograd(x, splits, splits, group)
        (y * dout).sum().backward()

    def nn_functional():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecated in torch >= 2.10
            y = nnf.all_to_all_single(torch.empty_like(x), x, splits, splits, group=group)
        (y * dout).sum().backward()

    samples = {"functional": [], "nn.functional": []}
    for _ in range(max(args.iters // 5, 1)):
        for name, fn in (("functional", functional), ("nn.functional", nn_functional)):
            samples[name] += time_steps(fn, clock, 5, 1)
    if group.rank() == 0:
        for name, t in samples.items():
            print(f"{name:14} W={W} {rows}x{H} {dtype}: {statistics.median(t) * 1e3:.2f} ms "
                  "(forward + backward)")  # fmt: skip


def print_rows(rows: list[dict]) -> None:
    head = f"{'shape':9} {'W':>2} {'E':>4} {'impl':18} {'fwd ms':>8} {'f+b ms':>8} "
    print(head + f"{'tok/s/rank':>11} {'comm fwd':>8} {'comm f+b':>8} {'dropped':>7}")
    for r in rows:
        print(
            f"{r['shape']:9} {r['W']:>2} {r['E']:>4} {r['impl']:18} {r['fwd_ms']:8.3f} "
            f"{r['fwd_bwd_ms']:8.3f} {r['tokens_per_s_rank']:11.0f} {r['comm_share_fwd']:8.1%} "
            f"{r['comm_share_fwd_bwd']:8.1%} {r['dropped_slots']:7d}"
        )


def write(rows: list[dict], out: str) -> list[str]:
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"ep_w{rows[0]['W']}")
    with open(stem + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    with open(stem + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return [stem + ".json", stem + ".csv"]


def main(argv=None) -> None:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    group = dist.group.WORLD
    clock = Clock(device)
    rows = []
    try:
        if args.collectives:
            compare_collectives(args, device, group, clock)
            return
        for shape in args.shapes:
            new = run_case(shape, args, device, group, clock)
            rows += new
            if group.rank() == 0:
                print_rows(new)
        if group.rank() == 0 and rows:
            print("wrote", *write(rows, args.out))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
