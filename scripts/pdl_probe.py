"""Whether programmatic dependent launch (PDL) shortens a chain of small Triton kernels on this
GPU: a chain of ``--chain`` dependent kernels (each reads the previous one's output), launched
plain and with PDL (``griddepcontrol.wait`` before the first load, the dependents released
at the start), timed as a CUDA graph and eagerly (do_bench), per kernel.

    PYTHONPATH=. python scripts/pdl_probe.py [--chain 8] [--n 65536 1048576]
"""

import argparse

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def step_kernel(x, y, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    v = tl.load(x + offs, mask=offs < n)
    tl.store(y + offs, v * 1.0001 + 1.0, mask=offs < n)


def chain(bufs, n, pdl, length):
    grid = (triton.cdiv(n, 1024),)
    for i in range(length):
        step_kernel[grid](bufs[i % 2], bufs[(i + 1) % 2], n, BLOCK=1024, PDL=pdl, launch_pdl=pdl,
                          num_warps=4)


def graph_us(fn, reps=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    return triton.testing.do_bench(g.replay, warmup=50, rep=300) * 1e3 / reps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--chain", type=int, default=8)
    p.add_argument("--n", type=int, nargs="+", default=[4096, 65536, 1048576])
    a = p.parse_args()
    for n in a.n:
        bufs = [torch.randn(n, device="cuda") for _ in range(2)]
        ref = None
        for pdl in (False, True):
            bufs[0].copy_(torch.arange(n, device="cuda", dtype=torch.float32))
            chain(bufs, n, pdl, a.chain)
            torch.cuda.synchronize()
            out = bufs[a.chain % 2].clone()
            if ref is None:
                ref = out
            ok = torch.equal(ref, out)
            g = graph_us(lambda: chain(bufs, n, pdl, a.chain))
            e = triton.testing.do_bench(lambda: chain(bufs, n, pdl, a.chain), warmup=50, rep=300) * 1e3
            print(f"n={n:>8} pdl={pdl!s:5} graph {g / a.chain:6.2f} us/kernel  eager {e / a.chain:6.2f}"
                  f" us/kernel  same result {ok}")


if __name__ == "__main__":
    main()
