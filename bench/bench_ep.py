"""Benchmark expert parallelism: ``MoELayer(ep_group=...)`` across the GPUs of one node.

Run with torchrun, one process per GPU::

    torchrun --nproc-per-node 4 bench/bench_ep.py [--quick] [--shapes qwen3,deepseek]
        [--tokens 4096] [--chunks 2] [--comm-sms 0,16] [--iters 20] [--out DIR]

Without CUDA it runs on the CPU over gloo (a smoke run: ``--smoke`` picks a tiny shape).

Per shape and implementation, every rank times (median of ``--iters`` after warm-up, with a
barrier before each sample) its forward (``torch.no_grad``) and forward + backward
(``out.backward(dout)``) on its own ``--tokens`` tokens; the table shows the slowest rank
(the step waits for it), tokens/s per rank and the host time of the call (until it returns,
before the device finishes). Implementations:

* ``moe_route`` — the layer's default exchange (blocks of ``T`` tokens, no host sync);
* ``moe_route-exact`` — ``ep_capacity="exact"`` (the routed tokens, one host sync);
* ``moe_route-chunksN`` — ``ep_chunks=N``: the all-to-alls of one chunk overlap the experts
  of another; ``-smsS`` with ``MOE_ROUTE_COMM_SMS=S`` (the persistent GEMMs leave ``S`` SMs
  to the communication kernels);
* ``grouped_mm`` — torchtitan-style expert parallelism: every slot's row travels (sorted by
  expert, split sizes read on the host), the received rows sorted by local expert, two
  ``torch._grouped_mm`` with SwiGLU, unsorted, sent back and reduced with the router weights;
  the same router and parameters; its output is checked against ``moe_route``'s first;
* ``single`` — the plain layer (all ``E`` experts, no exchange) on the rank's tokens: the
  weak-scaling reference (tokens/s per rank of the others against it).

Columns besides the times: the bytes each rank sends per forward (rows and metadata; the
backward sends as many), the all-to-all ceiling (``all_to_all_single`` of the same bytes
alone, timed in the same run) and, from a profiler trace of one step per rank (CUDA only),
the time the communication kernels run without a compute kernel beside them ("exchange
visible", as a share of the step) and the time no kernel runs at all ("idle"), the mean over
ranks.

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
import tempfile
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
    p.add_argument(
        "--comm-sms", default="0",
        help="comma list of MOE_ROUTE_COMM_SMS values for the chunked variants",
    )  # fmt: skip
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--mem-fraction", type=float, default=0.5)
    p.add_argument("--no-baseline", action="store_true", help="skip grouped_mm and single")
    p.add_argument("--backend", default="auto", help="MoELayer's backend (auto: Triton on CUDA)")
    p.add_argument("--quick", action="store_true", help="fewer iterations")
    p.add_argument("--smoke", action="store_true", help="tiny shape, 2 iterations (CPU test)")
    p.add_argument(
        "--collectives", action="store_true",
        help="only compare the two autograd all-to-alls of torch.distributed",
    )  # fmt: skip
    p.add_argument(
        "--host-profile", action="store_true",
        help="print rank 0's host time of each step of the moe_route forwards",
    )  # fmt: skip
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = p.parse_args(argv)
    if args.quick:
        args.iters, args.warmup = 8, 2
    if args.smoke:
        args.shapes, args.tokens, args.iters, args.warmup, args.chunks = "tiny", 32, 2, 1, "2"
    args.shapes = [s for s in args.shapes.split(",") if s]
    for s in args.shapes:
        if s not in SHAPES:
            p.error(f"--shapes: unknown shape {s!r}; expected some of {list(SHAPES)}")
    args.chunks = [int(c) for c in args.chunks.split(",") if c and int(c) > 1]
    args.comm_sms = [int(c) for c in args.comm_sms.split(",") if c]
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


def time_steps(fn, clock: Clock, iters: int, warmup: int, host: list | None = None) -> list[float]:
    """Seconds of ``fn()``, ``iters`` samples, each after a barrier; with ``host``, the host
    time of each call (until it returns, before waiting for the device) appended to it."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        dist.barrier()
        start = clock.mark()
        t0 = time.perf_counter()
        fn()
        if host is not None:
            host.append(time.perf_counter() - t0)
        samples.append(clock.seconds(start, clock.mark()))
    return samples


@contextlib.contextmanager
def counting_bytes(sent: list[int]):
    """The bytes every all-to-all of the layer (and of the baseline) sends, appended to
    ``sent`` while inside."""
    saved = expert_parallel._exchange

    def exchange(rows, out_splits, in_splits, group):
        sent.append(rows.numel() * rows.element_size())
        return saved(rows, out_splits, in_splits, group)

    expert_parallel._exchange = exchange
    try:
        yield sent
    finally:
        expert_parallel._exchange = saved


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(x, y) -> float:
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(hi - lo, 0.0)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def profile_step(fn) -> dict[str, float]:
    """One ``fn()`` under the profiler (CUDA): the span from the first kernel to the last, the
    time communication kernels (``nccl``) run with no other kernel beside them, and the time
    no kernel runs; microseconds."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as g:
            events = json.load(g)["traceEvents"]
    comm, compute = [], []
    for e in events:
        if e.get("cat") != "kernel" or "dur" not in e:
            continue
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        (comm if "nccl" in e["name"].lower() else compute).append(span)
    if not comm and not compute:
        return {"span_us": math.nan, "visible_us": math.nan, "idle_us": math.nan}
    comm, compute = _union(comm), _union(compute)
    both = _union(comm + compute)
    span = both[-1][1] - both[0][0]
    return {
        "span_us": span,
        "comm_us": _length(comm),
        "visible_us": _length(comm) - _intersection(comm, compute),
        "idle_us": span - _length(both),
    }


def host_profile(fn, name: str, rank: int, calls: int = 5) -> None:
    """Rank 0 prints the host time of each step of the expert-parallel forward (inclusive,
    mean over ``calls`` calls of ``fn``; nothing waits for the device in between)."""
    import moe_route.layer as layer_module

    targets = [
        (expert_parallel._Chunk, "__init__"), (expert_parallel._Chunk, "send"),
        (expert_parallel._Chunk, "compute"), (expert_parallel._Chunk, "combine"),
        (expert_parallel, "_rank_maps"), (expert_parallel, "_run_experts"),
        (expert_parallel, "_exchange"), (expert_parallel, "all_gather"),
        (expert_parallel, "expand_rows"), (expert_parallel, "finalize_moe_routing"),
        (expert_parallel, "tokens_per_expert"), (expert_parallel, "forward"),
        (layer_module.MoELayer, "router_logits"), (layer_module.MoELayer, "route"),
    ]  # fmt: skip
    spent: dict[str, list[float]] = {}
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr in targets]

    def timed(label, f):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                spent.setdefault(label, []).append(time.perf_counter() - t0)

        return wrapper

    for owner, attr, f in saved:
        setattr(owner, attr, timed(f"{getattr(owner, '__name__', '')}.{attr}", f))
    try:
        for _ in range(calls):
            fn()
    finally:
        for owner, attr, f in saved:
            setattr(owner, attr, f)
    if rank == 0:
        print(f"== host time per call (ms, inclusive): {name}")
        for label, ts in sorted(spent.items(), key=lambda kv: -sum(kv[1])):
            print(f"{sum(ts) / calls * 1e3:8.3f}  {len(ts) // calls:3d}x  {label}")


def a2a_ceiling(nbytes: int, group, device, clock: Clock, iters: int) -> float:
    """Seconds of one ``all_to_all_single`` of ``nbytes`` (bf16, equal splits) alone."""
    W = group.size()
    n = max(nbytes // 2 // W * W, W)
    x = torch.randn(n, device=device).to(torch.bfloat16 if device.type == "cuda" else torch.float32)

    def once():
        fc.wait_tensor(fc.all_to_all_single(x, None, None, group)).sum()

    return statistics.median(time_steps(once, clock, iters, 2))


# ----------------------------------------------------------------------------- baseline
def grouped_mm_forward(layer, x: torch.Tensor, group) -> torch.Tensor:
    """torchtitan-style expert parallelism on ``layer``'s router and experts (SwiGLU, concat
    layout, no biases): every slot's row to its expert's rank, split sizes read on the host,
    ``torch._grouped_mm`` over the received rows sorted by local expert, back, reduced."""
    W, El = group.size(), layer.w1.shape[0]
    E = W * El
    weights, ids = layer.route(layer.router_logits(x))
    T, K = ids.shape
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # slots by expert
    counts = torch.bincount(flat, minlength=E)
    recv_counts = fc.wait_tensor(fc.all_to_all_single(counts, None, None, group))
    in_splits = counts.view(W, El).sum(1).tolist()  # the host sync
    out_splits = recv_counts.view(W, El).sum(1).tolist()
    rows = x.index_select(0, order // K)
    recv = expert_parallel._exchange(rows, out_splits, in_splits, group)
    local = torch.arange(El, device=x.device).repeat(W)
    expert = torch.repeat_interleave(local, recv_counts.view(-1), output_size=sum(out_splits))
    perm = torch.argsort(expert, stable=True)
    offs = torch.cumsum(torch.bincount(expert, minlength=El), 0).to(torch.int32)
    gate, up = torch._grouped_mm(recv[perm], layer.w1.transpose(1, 2), offs=offs).chunk(2, -1)
    y = torch._grouped_mm(F.silu(gate) * up, layer.w2.transpose(1, 2), offs=offs)
    y = y.index_select(0, torch.argsort(perm))
    back = expert_parallel._exchange(y, in_splits, out_splits, group)
    slots = back.index_select(0, torch.argsort(order)).view(T, K, -1)
    out = (slots.float() * weights.unsqueeze(-1).float()).sum(1).to(x.dtype)
    shared = layer.shared_expert(x)
    return out if shared is None else out + shared


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


@contextlib.contextmanager
def env(name: str, value: str | None):
    saved = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def implementations(args) -> list[tuple[str, dict, str | None]]:
    """``(name, layer kwargs, MOE_ROUTE_COMM_SMS)``."""
    impls = [("moe_route", {}, None), ("moe_route-exact", {"ep_capacity": "exact"}, None)]
    for n in args.chunks:
        for sms in args.comm_sms:
            suffix = f"-sms{sms}" if sms else ""
            impls.append(
                (f"moe_route-chunks{n}{suffix}", {"ep_chunks": n}, str(sms) if sms else None)
            )
    if not args.no_baseline:
        impls += [("grouped_mm", {}, None), ("single", {}, None)]
    return impls


def run_case(shape, args, device, group, clock) -> list[dict]:
    H, inter, E_full, K = SHAPES[shape]
    W, rank = group.size(), group.rank()
    E = fit_experts(H, inter, E_full, K, W, device, args.mem_fraction)
    T = args.tokens
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(1234 + rank)
    x = torch.randn(T, H, generator=g, device=device, dtype=dtype)
    dout = torch.randn(T, H, generator=g, device=device, dtype=dtype)
    rows, reference, ceiling = [], None, {}
    for impl, kw, comm_sms in implementations(args):
        torch.manual_seed(0)  # the same replicated router on every rank
        E_impl = (
            E if impl != "single" else fit_experts(H, inter, E, K, 1, device, args.mem_fraction)
        )
        ep = {} if impl == "single" else {"ep_group": group}
        layer = moe_route.MoELayer(
            H, inter, E_impl, K, **ep, device=device, dtype=dtype, backend=args.backend, **kw
        )
        baseline = impl == "grouped_mm"
        # CPU: torch._grouped_mm has no usable backward there; the baseline runs forward only
        train = device.type == "cuda" or not baseline

        def call(layer=layer, baseline=baseline):
            if baseline:
                return grouped_mm_forward(layer, x, group)
            return layer(x).output

        def forward(call=call):
            with torch.no_grad():
                return call()

        def train_step(call=call, layer=layer):
            call().backward(dout)
            layer.zero_grad(set_to_none=True)

        with env("MOE_ROUTE_COMM_SMS", comm_sms):
            with counting_bytes([]) as sent:
                out = forward()
            if impl == "moe_route":
                reference = out.float()
            elif baseline:
                err = (out.float() - reference).norm() / reference.norm().clamp(min=1e-30)
                tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
                if err > tol:
                    raise AssertionError(f"{shape}: grouped_mm differs from moe_route by {err:.3g}")
            host_f, host_s = [], [math.nan]
            fwd = statistics.median(time_steps(forward, clock, args.iters, args.warmup, host_f))
            step = math.nan
            if train:
                host_s = []
                step = statistics.median(
                    time_steps(train_step, clock, args.iters, args.warmup, host_s)
                )
            if args.host_profile and impl.startswith("moe_route"):
                host_profile(forward, impl + " forward", rank)
            prof_f = prof_s = {"span_us": math.nan, "visible_us": math.nan, "idle_us": math.nan}
            if device.type == "cuda":
                dist.barrier()
                prof_f = profile_step(forward)
                dist.barrier()
                prof_s = profile_step(train_step)
        nbytes = sum(sent)
        rows_bytes = sent[0] if sent else 0
        if rows_bytes and rows_bytes not in ceiling:
            ceiling[rows_bytes] = a2a_ceiling(rows_bytes, group, device, clock, args.iters)
        stats = torch.tensor(
            [fwd, step, nbytes, ceiling.get(rows_bytes, math.nan),
             prof_f["visible_us"] / prof_f["span_us"], prof_s["visible_us"] / prof_s["span_us"],
             prof_f["idle_us"] / prof_f["span_us"], prof_s["idle_us"] / prof_s["span_us"],
             statistics.median(host_f), statistics.median(host_s)],
            dtype=torch.float64, device=device,
        )  # fmt: skip
        every = fc.wait_tensor(expert_parallel.all_gather(stats, 0, group)).view(W, -1)
        slowest = every.max(0).values.tolist()
        mean = every.mean(0).tolist()
        rows.append({
            "shape": shape, "W": W, "H": H, "I": inter, "E": E_impl, "K": K, "tokens_per_rank": T,
            "impl": impl, "fwd_ms": slowest[0] * 1e3, "fwd_bwd_ms": slowest[1] * 1e3,
            "tokens_per_s_rank": T / slowest[1],
            "mb_sent_fwd": slowest[2] / 1e6,
            "rows_a2a_alone_ms": slowest[3] * 1e3,
            "visible_fwd": mean[4], "visible_fwd_bwd": mean[5],
            "idle_fwd": mean[6], "idle_fwd_bwd": mean[7],
            "host_fwd_ms": slowest[8] * 1e3, "host_fwd_bwd_ms": slowest[9] * 1e3,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        })  # fmt: skip
        del layer, out, forward, train_step, call
        if device.type == "cuda":
            torch.cuda.empty_cache()
    single = next((r for r in rows if r["impl"] == "single"), None)
    for r in rows:
        r["vs_single"] = single["fwd_bwd_ms"] / r["fwd_bwd_ms"] if single else math.nan
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
    head = f"{'shape':9} {'W':>2} {'E':>4} {'impl':22} {'fwd ms':>8} {'f+b ms':>8} "
    head += f"{'tok/s/rank':>11} {'vs single':>9} {'MB/fwd':>7} {'a2a ms':>7} {'vis fwd':>7} "
    print(head + f"{'vis f+b':>7} {'idle f+b':>8} {'host fwd':>8} {'host f+b':>8}")
    for r in rows:
        print(
            f"{r['shape']:9} {r['W']:>2} {r['E']:>4} {r['impl']:22} {r['fwd_ms']:8.3f} "
            f"{r['fwd_bwd_ms']:8.3f} {r['tokens_per_s_rank']:11.0f} {r['vs_single']:9.2f} "
            f"{r['mb_sent_fwd']:7.1f} {r['rows_a2a_alone_ms']:7.3f} {r['visible_fwd']:7.1%} "
            f"{r['visible_fwd_bwd']:7.1%} {r['idle_fwd_bwd']:8.1%} {r['host_fwd_ms']:8.3f} "
            f"{r['host_fwd_bwd_ms']:8.3f}"
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
