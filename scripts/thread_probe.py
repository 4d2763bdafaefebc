"""Host cost of the eager path's pieces on the main thread against another Python thread (GPU).

Autograd runs a backward on its own device thread, where ``moe_backward_triton`` measured
1.5-2x its main-thread host time (``scripts/backward_host.py``, H100 hosts, 2026-11-24; on
2026-11-27 two hosts read 1.1-1.2x: 191 against 206 us, 172 against 210 us at qwen3 T=1), and a
plain ``threading.Thread`` showed the same. This times each piece the launch sequence is made of, on
the main thread and on a worker thread in alternating rounds, to find the one that pays:
pure Python, tensor allocation, ``data_ptr``, the stream lookup, a torch kernel launch, a thin
launch of a Triton kernel; on the main thread, a ``threading.Thread`` (with and without
``torch.cuda.set_device`` first) and inside a Function's backward (autograd's thread).

    PYTHONPATH=. python scripts/thread_probe.py [--rounds 6] [--calls 2000]
"""

import argparse
import statistics
import threading
import time

import torch
import triton
import triton.language as tl
from backward_host import in_backward_step  # scripts/, the running script's folder

from moe_route.kernels.triton import ThinKernel


@triton.jit
def _touch_kernel(x_ptr, n):
    i = tl.arange(0, 16)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)


_TOUCH = ThinKernel(_touch_kernel)


def pieces():
    x = torch.zeros(16, device="cuda")
    stream = torch._C._cuda_getCurrentRawStream
    acc = [0]

    def python():
        acc[0] = sum(range(40))

    def thin():
        _TOUCH.launch(("touch",), (1,), (x, 16), lambda: {"num_warps": 1})

    dev = torch.device("cuda", 0)

    def in_device_ctx():
        with torch.cuda.device(0):
            return torch.empty(1024, device=dev)

    return {
        "pure Python (sum of 40)": python,
        "torch.empty 4 KiB cpu": lambda: torch.empty(1024),
        "torch.empty 4 KiB cuda": lambda: torch.empty(1024, device="cuda"),
        "torch.empty 4 KiB cuda:0": lambda: torch.empty(1024, device=dev),
        "torch.empty in device(0) ctx": in_device_ctx,
        "x.new_empty": lambda: x.new_empty(1024),
        "torch.zeros 4 KiB cuda:0": lambda: torch.zeros(1024, device=dev),
        "x.view(4, 4)": lambda: x.view(4, 4),
        "torch.empty_like": lambda: torch.empty_like(x),
        "tensor.data_ptr()": x.data_ptr,
        "current raw stream": lambda: stream(0),
        "torch kernel (x.add_(1))": lambda: x.add_(1),
        "thin Triton launch": thin,
    }


def per_call(fn, calls):
    for _ in range(50):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    return dt * 1e6


def on_thread(fn, calls, set_device=False):
    out = {}

    def work():
        if set_device:
            torch.cuda.set_device(0)
        out["us"] = per_call(fn, calls)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    return out["us"]


def in_backward(fn, calls):
    """``per_call`` run inside a Function's backward, on autograd's device thread."""
    out = {}
    in_backward_step(lambda: out.setdefault("us", per_call(fn, calls)))()
    return out["us"]


WHERE = {
    "main": per_call,
    "thread": on_thread,
    "thread+set_device": lambda fn, calls: on_thread(fn, calls, set_device=True),
    "autograd": in_backward,
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    items = pieces()
    samples = {(name, where): [] for name in items for where in WHERE}
    for r in range(args.rounds):
        for name, fn in items.items():
            order = list(WHERE) if r % 2 == 0 else list(WHERE)[::-1]
            for where in order:
                samples[(name, where)].append(WHERE[where](fn, args.calls))
    print(f"{'piece':<30}" + "".join(f"{w:>19}" for w in WHERE) + "   (host us per call)")
    for name in items:
        med = [statistics.median(samples[(name, w)]) for w in WHERE]
        print(f"{name:<30}" + "".join(f"{m:>19.2f}" for m in med))


if __name__ == "__main__":
    main()
