"""GPU check of the dispatch layer: correctness of the thin launches, graphs, compile, host time.

``python scripts/gpu_dispatch_check.py``: for a few shapes, ``fused_moe`` forward (and
backward) three times — the first launch compiles through Triton's path, the next ones call the
compiled kernels directly — against the float64 reference and bitwise across runs; CUDA-graph
capture and ``torch.compile(fullgraph=True)`` equal to eager; then the host time per call of
every public op (``time.perf_counter`` over 300 calls, no sync inside) next to one
``torch.index_select``, eager vs CUDA-graph latency of ``fused_moe`` at decode sizes, and the
first call at a new ``T`` of a warmed bucket. One table at the end.
"""

from __future__ import annotations

import time

import torch
import triton

import moe_route
from moe_route import reference as R
from moe_route.bench.harness import capture_graph, time_host

DEV = torch.device("cuda")
N = 300


def host_us(fn, n=N):
    """Host µs per call: the suite's :func:`moe_route.bench.harness.time_host` (median of 3
    loops of ``n`` unsynchronised calls)."""
    return time_host(fn, "cuda", calls=n, warmup=10).median_s * 1e6


def graph_us(fn, reps=10):
    g = capture_graph(fn, reps)
    return triton.testing.do_bench(g.replay, return_mode="median") * 1e3 / reps


def case(T, H, inter, E, K, dtype=torch.bfloat16, seed=0, drop=0.1):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(T, H, device=DEV, dtype=dtype, generator=g)
    w1 = torch.randn(E, 2 * inter, H, device=DEV, dtype=dtype, generator=g) * H**-0.5
    w2 = torch.randn(E, H, inter, device=DEV, dtype=dtype, generator=g) * inter**-0.5
    logits = torch.randn(T, E, device=DEV, generator=g)
    tw, ids = R.topk_routing_reference(logits, K, renormalize=True)
    if drop and T:
        ids = torch.where(torch.rand(T, K, device=DEV, generator=g) < drop, -1, ids)
    return x, w1, w2, tw, ids


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check_correctness(rows):
    shapes = [(1, 256, 128, 8, 2), (37, 200, 136, 8, 2), (300, 512, 384, 64, 8),
              (1000, 1024, 512, 16, 4), (5, 7168, 2048, 32, 8)]  # fmt: skip
    worst = 0.0
    for T, H, inter, E, K in shapes:
        x, w1, w2, tw, ids = case(T, H, inter, E, K)
        ref = R.moe_forward_reference(x.double(), w1.double(), w2.double(), tw.double(), ids)
        for fin in ("standalone", "fused"):
            for gather in (True, False):
                outs = [moe_route.fused_moe(x, w1, w2, tw, ids, finalize=fin, gather=gather)
                        for _ in range(3)]  # fmt: skip
                same = all(torch.equal(outs[0], o) for o in outs)
                e = rel(outs[-1], ref)
                worst = max(worst, e)
                ok = same and e < 1e-2
                rows.append(
                    (f"fwd T={T} H={H} E={E} {fin} gather={gather}", e, "ok" if ok else "FAIL")
                )
        # backward: three runs bitwise, against the float64 reference gradients
        leaves = [t.detach().requires_grad_() for t in (x, w1, w2, tw)]
        grads = []
        for _ in range(3):
            out = moe_route.fused_moe(*leaves, ids)
            grads.append(torch.autograd.grad(out, leaves, torch.ones_like(out)))
        dl = [t.detach().double().requires_grad_() for t in (x, w1, w2, tw)]
        gref = torch.autograd.grad(R.moe_forward_reference(*dl, ids).sum(), dl)
        same = all(all(torch.equal(a, b) for a, b in zip(grads[0], g, strict=False)) for g in grads)
        e = max(rel(a, b) for a, b in zip(grads[-1], gref, strict=False))
        rows.append((f"bwd T={T} H={H} E={E}", e, "ok" if same and e < 2e-2 else "FAIL"))
    # graph capture and compile, forward + backward
    x, w1, w2, tw, ids = case(64, 512, 256, 16, 4)
    eager = moe_route.fused_moe(x, w1, w2, tw, ids)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            moe_route.fused_moe(x, w1, w2, tw, ids)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = moe_route.fused_moe(x, w1, w2, tw, ids)
    g.replay()
    torch.cuda.synchronize()
    rows.append(("cuda graph fwd == eager", 0.0, "ok" if torch.equal(out, eager) else "FAIL"))
    leaves = [t.detach().requires_grad_() for t in (x, w1, w2, tw)]

    def step(*a):
        out = moe_route.fused_moe(*a, ids)
        return (out.float() * out.float()).sum()

    step(*leaves).backward()
    eg = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    torch.compile(step, fullgraph=True)(*leaves).backward()
    same = all(torch.equal(a, t.grad) for a, t in zip(eg, leaves, strict=True))
    rows.append(("compile fullgraph fwd+bwd == eager", 0.0, "ok" if same else "FAIL"))
    return worst


def time_shape(rows, T, H, inter, E, K):
    torch.cuda.empty_cache()
    x, w1, w2, tw, ids = case(T, H, inter, E, K, drop=0.0)
    idx = torch.randint(0, T, (T * K,), device=DEV)
    base = host_us(lambda: torch.index_select(x, 0, idx))
    tag = f"T={T} H={H} I={inter} E={E}"
    rows.append((f"host index_select {tag}", base, "µs"))
    maps = moe_route.build_routing_maps(ids, E)
    h = moe_route.grouped_gemm(x, w1, maps, activation="swiglu", gather=True)
    y = moe_route.grouped_gemm(h, w2, maps)
    ops = {
        "build_routing_maps": lambda: moe_route.build_routing_maps(ids, E),
        "expand_rows": lambda: moe_route.expand_rows(x, maps),
        "finalize_moe_routing": lambda: moe_route.finalize_moe_routing(y, tw, maps),
        "grouped_gemm gemm1": lambda: moe_route.grouped_gemm(
            x, w1, maps, activation="swiglu", gather=True),
        "grouped_gemm gemm2": lambda: moe_route.grouped_gemm(h, w2, maps),
        "fused_moe": lambda: moe_route.fused_moe(x, w1, w2, tw, ids),
    }  # fmt: skip
    for name, fn in ops.items():
        us = host_us(fn)
        rows.append((f"host {name} {tag}", us, f"{us / base:.2f}x index_select"))
    leaves = [t.detach().requires_grad_() for t in (x, w1, w2, tw)]
    dout = torch.randn_like(x)

    def fwd_bwd():
        out = moe_route.fused_moe(*leaves, ids)
        torch.autograd.grad(out, leaves, dout)

    us = host_us(fwd_bwd, 100)
    rows.append((f"host fused_moe fwd+bwd {tag}", us, f"{us / base:.2f}x index_select"))
    layer = moe_route.MoELayer(H, inter, E, K).to(DEV, torch.bfloat16)
    with torch.no_grad():
        us = host_us(lambda: layer(x), 100)
    rows.append((f"host MoELayer fwd {tag}", us, f"{us / base:.2f}x index_select"))
    fn = ops["fused_moe"]
    eager = triton.testing.do_bench(fn, return_mode="median") * 1e3
    graph = graph_us(fn)
    rows.append((f"latency fused_moe eager {tag}", eager, f"{eager / graph:.2f}x graph"))
    rows.append((f"latency fused_moe graph {tag}", graph, "µs"))


def timings(rows):
    for T, H, inter, E, K in ((64, 2048, 1024, 64, 8), (1, 2048, 1024, 64, 8),
                              (1, 7168, 2048, 256, 8), (8, 7168, 2048, 256, 8),
                              (64, 7168, 2048, 256, 8)):  # fmt: skip
        time_shape(rows, T, H, inter, E, K)
        torch.cuda.empty_cache()
    # a new T in a warmed bucket: no compile
    x, w1, w2, tw, ids = case(64, 2048, 1024, 64, 8, drop=0.0)
    moe_route.fused_moe(x, w1, w2, tw, ids)
    torch.cuda.synchronize()
    rep = []
    for _ in range(5):
        t0 = time.perf_counter()
        moe_route.fused_moe(x, w1, w2, tw, ids)
        torch.cuda.synchronize()
        rep.append(time.perf_counter() - t0)
    rep_us = sorted(rep)[2] * 1e6
    worst_new = 0.0
    for T in (33, 40, 51, 63):
        x2, _, _, tw2, ids2 = case(T, 2048, 1024, 64, 8, drop=0.0, seed=T)
        t0 = time.perf_counter()
        moe_route.fused_moe(x2, w1, w2, tw2, ids2)
        torch.cuda.synchronize()
        worst_new = max(worst_new, (time.perf_counter() - t0) * 1e6)
    rows.append(("first call at new T in bucket (worst of 4)", worst_new,
                 f"{worst_new / rep_us:.2f}x repeated ({rep_us:.0f} µs)"))  # fmt: skip


class Rows(list):
    def append(self, row):
        super().append(row)
        name, v, note = row
        print(f"{name:<60} {v:10.3g}  {note}", flush=True)


def main():
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    rows = Rows()
    try:
        check_correctness(rows)
    except Exception as exc:  # keep going to the timings, but say so
        import traceback

        traceback.print_exc()
        rows.append(
            (f"correctness crashed: {type(exc).__name__}: {exc}"[:100], float("nan"), "FAIL")
        )
    torch.cuda.empty_cache()
    timings(rows)
    print(f"{'what':<60} {'value':>10}  note")
    for name, v, note in rows:
        print(f"{name:<60} {v:10.3g}  {note}")


if __name__ == "__main__":
    main()
