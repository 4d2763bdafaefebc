"""Shared benchmark harness: ceilings measured in the same run, robust timing, roofline rows.

Every stage script measures the device-to-device copy bandwidth and the dense bf16 matmul rate
first (``Ceilings``), then times each implementation with :func:`time_cuda` and reports it as a
fraction of its roofline floor ``max(bytes / copy_bw, flops / mm_rate)`` and as a speed-up over
the PyTorch baselines timed in the same process.
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import statistics
from dataclasses import asdict, dataclass, field

import torch


@dataclass
class Ceilings:
    copy_bytes_per_s: float  # bytes read + written per second by a large device-to-device copy
    mm_flops_per_s: float  # dense bf16 matmul rate on random data

    @classmethod
    def measure(cls, device: torch.device | None = None) -> Ceilings:
        device = device or torch.device("cuda")
        n = 1 << 28  # 512 MiB of bf16 per buffer, far past L2
        src = torch.randn(n, device=device, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        t_copy = time_cuda(lambda: dst.copy_(src), use_graph=False).median_s
        m = 8192
        a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
        b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
        t_mm = time_cuda(lambda: a @ b, use_graph=False).median_s
        return cls(copy_bytes_per_s=2 * n * 2 / t_copy, mm_flops_per_s=2 * m**3 / t_mm)

    def floor_s(self, bytes_moved: float, flops: float = 0.0) -> float:
        return max(bytes_moved / self.copy_bytes_per_s, flops / self.mm_flops_per_s)


@dataclass
class Timing:
    median_s: float
    p20_s: float
    p80_s: float
    samples: int


def time_cuda(
    fn, *, use_graph: bool = True, inner: int = 10, outer: int = 30, warmup: int = 3
) -> Timing:
    """Median and 20/80 percentiles of one call of ``fn``, timed with CUDA events.

    With ``use_graph`` the ``inner`` calls are captured in a CUDA graph and each sample is one
    replay divided by ``inner``: launch gaps vanish, which is what a CUDA-graph-captured model
    sees (small routing kernels are launch-bound). Without it, calls are launched eagerly.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if use_graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()

        def run():
            graph.replay()
    else:

        def run():
            for _ in range(inner):
                fn()

    run()
    torch.cuda.synchronize()
    samples = []
    for _ in range(outer):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e-3 / inner)
    q = statistics.quantiles(samples, n=10)
    return Timing(statistics.median(samples), q[1], q[7], len(samples))


@dataclass
class Row:
    stage: str
    shape: str
    impl: str
    median_us: float
    p20_us: float
    p80_us: float
    bytes: float
    flops: float
    floor_us: float
    roofline_fraction: float
    achieved_gb_s: float
    extra: dict = field(default_factory=dict)


def make_row(
    stage, shape, impl, timing: Timing, ceilings: Ceilings, bytes_moved, flops=0.0, **extra
):
    floor = ceilings.floor_s(bytes_moved, flops)
    return Row(
        stage=stage,
        shape=shape,
        impl=impl,
        median_us=timing.median_s * 1e6,
        p20_us=timing.p20_s * 1e6,
        p80_us=timing.p80_s * 1e6,
        bytes=bytes_moved,
        flops=flops,
        floor_us=floor * 1e6,
        roofline_fraction=floor / timing.median_s,
        achieved_gb_s=bytes_moved / timing.median_s / 1e9,
        extra=extra,
    )


def environment(ceilings: Ceilings) -> dict:
    import triton

    import moe_route

    return {
        "gpu": torch.cuda.get_device_name(),
        "capability": "SM{}{}".format(*torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "moe_route": moe_route.__version__,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "copy_TB_s": ceilings.copy_bytes_per_s / 1e12,
        "bf16_mm_TFLOP_s": ceilings.mm_flops_per_s / 1e12,
    }


def write_results(rows: list[Row], env: dict, out_dir: str, name: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump({"environment": env, "rows": [asdict(r) for r in rows]}, f, indent=1)
    with open(os.path.join(out_dir, f"{name}.csv"), "w", newline="") as f:
        fields = [k for k in asdict(rows[0]) if k != "extra"] + ["extra"]
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            d = asdict(r)
            d["extra"] = json.dumps(d["extra"])
            writer.writerow(d)


def print_table(rows: list[Row], env: dict) -> None:
    print(
        f"\n{env['gpu']} ({env['capability']}), torch {env['torch']}, triton {env['triton']}: "
        f"copy {env['copy_TB_s']:.2f} TB/s, bf16 mm {env['bf16_mm_TFLOP_s']:.0f} TFLOP/s"
    )
    head = (
        f"{'stage':<9}{'shape':<30}{'impl':<16}{'median us':>11}{'p20-p80':>16}"
        f"{'GB/s':>8}{'roof':>7}{'vs':>22}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        vs = " ".join(f"{k}={v:.2f}x" for k, v in r.extra.items() if k.startswith("x_"))
        if "of_dense" in r.extra:
            vs += f" {100 * r.extra['of_dense']:.0f}% of dense mm"
        print(
            f"{r.stage:<9}{r.shape:<30}{r.impl:<16}{r.median_us:>11.1f}"
            f"{f'{r.p20_us:.1f}-{r.p80_us:.1f}':>16}{r.achieved_gb_s:>8.0f}"
            f"{100 * r.roofline_fraction:>6.0f}%{vs:>22}"
        )
