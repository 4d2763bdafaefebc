"""Whether a matmul's zero rows cost less energy (H100 at its power limit): sustained bf16
``torch.mm`` with A random against A with a fraction of its rows zero, each for ~2 s back to
back, with the board power and SM clock sampled by nvidia-smi (medians), in alternating rounds.

    python scripts/zero_rows_power.py [--fractions 0 0.125 0.5] [--rounds 2]
"""

import argparse
import statistics
import subprocess

import torch


def sustained(fn, seconds=2.0):
    """(µs per call, W, MHz) of ``fn`` repeated back to back for about ``seconds``."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    end.synchronize()
    n = max(10, int(seconds * 1e3 / (start.elapsed_time(end) / 5)))
    smi = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=power.draw,clocks.sm", "--format=csv,noheader,nounits",
         "-lms", "50"], stdout=subprocess.PIPE, text=True)  # fmt: skip
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    smi.terminate()
    rows = [line.split(",") for line in smi.communicate()[0].splitlines() if "," in line]
    rows = rows[len(rows) // 4 :]  # past the ramp
    watts = statistics.median(float(a) for a, _ in rows)
    mhz = statistics.median(float(b) for _, b in rows)
    return start.elapsed_time(end) * 1e3 / n, watts, mhz


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.125, 0.5])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--size", type=int, default=8192)
    args = ap.parse_args()
    n = args.size
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    mats = {}
    for f in args.fractions:
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        rows = int(n * f)
        # zero rows spread over the matrix (every 128-row tile gets its share, as padding would)
        if rows:
            step = n // rows
            a[::step][:rows] = 0
        mats[f] = a
    results = {f: [] for f in args.fractions}
    for _ in range(args.rounds):
        for f in args.fractions:
            results[f].append(sustained(lambda a=mats[f]: torch.mm(a, b, out=out)))
    base = statistics.median(r[0] for r in results[args.fractions[0]])
    for f in args.fractions:
        us = statistics.median(r[0] for r in results[f])
        w = statistics.median(r[1] for r in results[f])
        mhz = statistics.median(r[2] for r in results[f])
        tf = 2 * n**3 / us / 1e6
        print(f"zero rows {f:5.3f}: {us:8.1f} us ({base / us:.3f}x), {tf:5.0f} TFLOP/s, "
              f"{w:4.0f} W, {mhz:5.0f} MHz")  # fmt: skip


if __name__ == "__main__":
    main()
