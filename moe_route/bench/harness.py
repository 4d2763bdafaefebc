"""Shared benchmark harness: ceilings measured in the same run, roofline rows, their results.

Every benchmark measures the device-to-device copy bandwidth and the dense matmul rate first
(:class:`Ceilings`), then times each implementation with :func:`time_cuda` (or
:func:`time_auto`, which sizes the run to a time budget) and reports it as a fraction of its
roofline floor ``max(bytes / copy_bw, flops / mm_rate)`` and as a speed-up over the PyTorch
baselines timed in the same process.

Results are :class:`Row` records written by :func:`write_results` as JSON (``environment``,
``rows`` and any extra top-level keys) and CSV (one line per row, with the environment and the
speed-ups as columns). ``bench/harness.py`` re-exports this module for the stage scripts.

The timing functions live in :mod:`.timing` and are re-exported here, so that one import
serves a stage script.
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import platform
from dataclasses import asdict, dataclass, field

import torch

from .timing import (
    MAX_INNER,
    MAX_OUTER,
    MIN_OUTER,
    Timing,
    capture_graph,
    time_auto,
    time_cpu,
    time_cuda,
    time_eager,
    time_host,
    time_interleaved,
    time_once,
)

__all__ = [
    "BASELINES",
    "ENV_COLUMNS",
    "MAX_INNER",
    "MAX_OUTER",
    "MIN_OUTER",
    "Ceilings",
    "Row",
    "Timing",
    "add_speedups",
    "capture_graph",
    "environment",
    "make_row",
    "measure_fp8_mm",
    "print_table",
    "row_from_dict",
    "speedup_keys",
    "time_auto",
    "time_cpu",
    "time_cuda",
    "time_eager",
    "time_host",
    "time_interleaved",
    "time_once",
    "write_results",
]

# Implementations a user would otherwise write, and the key of the speed-up over each
# (``extra["x_<key>"] = baseline median / this median``).
BASELINES = {
    "torch argsort": "argsort",
    "torch gather": "torch",
    "torch gather+sum": "torch",
    "grouped_mm": "grouped_mm",
    "loop": "loop",
}
ENV_COLUMNS = ("gpu", "capability", "torch", "triton", "moe_route", "timestamp")


@dataclass
class Ceilings:
    copy_bytes_per_s: float  # bytes read + written per second by a large device-to-device copy
    mm_flops_per_s: float  # dense matmul rate on random data (bf16 on CUDA, float32 on CPU)
    # Dense FP8 matmul rate (``torch._scaled_mm``, e4m3, bf16 out; 0: not measured) and how
    # it was scaled: measured only for the stages that use it (``fp8=True``).
    fp8_mm_flops_per_s: float = 0.0
    fp8_mm: str = ""

    @classmethod
    def measure(cls, device: torch.device | str | None = None, *, fp8: bool = False) -> Ceilings:
        device = torch.device(device or "cuda")
        if device.type != "cuda":
            ceilings = cls._measure_cpu()
        else:
            n = 1 << 28  # 512 MiB of bf16 per buffer, far past L2
            src = torch.randn(n, device=device, dtype=torch.bfloat16)
            dst = torch.empty_like(src)
            t_copy = time_cuda(lambda: dst.copy_(src), use_graph=False).median_s
            src = dst = None  # free 1 GiB before the matmul
            m = 8192
            a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
            b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
            t_mm = time_cuda(lambda: a @ b, use_graph=False).median_s
            a = b = None
            ceilings = cls(copy_bytes_per_s=2 * n * 2 / t_copy, mm_flops_per_s=2 * m**3 / t_mm)
        if fp8:
            ceilings.fp8_mm_flops_per_s, ceilings.fp8_mm = measure_fp8_mm(device)
        return ceilings

    @classmethod
    def _measure_cpu(cls) -> Ceilings:
        n = 1 << 23  # 32 MiB of float32: past most L2 caches, quick to copy
        src = torch.randn(n)
        dst = torch.empty_like(src)
        t_copy = time_cpu(lambda: dst.copy_(src), inner=2, outer=7).median_s
        m = 512
        a, b = torch.randn(m, m), torch.randn(m, m)
        t_mm = time_cpu(lambda: a @ b, inner=2, outer=7).median_s
        return cls(copy_bytes_per_s=2 * n * 4 / t_copy, mm_flops_per_s=2 * m**3 / t_mm)

    def mm_rate(self, fp8: bool = False) -> float:
        """The dense matmul rate of FP8 products where asked and measured, else bf16's."""
        if fp8 and self.fp8_mm_flops_per_s > 0:
            return self.fp8_mm_flops_per_s
        return self.mm_flops_per_s

    def floor_s(self, bytes_moved: float, flops: float = 0.0) -> float:
        return max(bytes_moved / self.copy_bytes_per_s, flops / self.mm_flops_per_s)


def measure_fp8_mm(device: torch.device | str) -> tuple[float, str]:
    """``(FLOP/s, how)`` of a dense FP8 matmul: ``torch._scaled_mm`` of two e4m3 matrices
    (8192³ on CUDA, 512³ on the CPU) with bf16 output, tensorwise scales (rowwise where this
    torch / device refuses those); ``(0.0, "not measured: <why>")`` where neither runs."""
    device = torch.device(device)
    m = 8192 if device.type == "cuda" else 512
    why = "torch._scaled_mm is missing"
    if not hasattr(torch, "_scaled_mm"):
        return 0.0, f"not measured: {why}"
    a = torch.randn(m, m, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(m, m, device=device).to(torch.float8_e4m3fn).t()  # column-major
    one = torch.ones((), device=device)
    scalings = {
        "tensorwise": (one, one),
        "rowwise": (torch.ones(m, 1, device=device), torch.ones(1, m, device=device)),
    }
    for name, (sa, sb) in scalings.items():

        def fn(sa=sa, sb=sb):
            return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

        try:
            fn()
            if device.type == "cuda":
                t = time_cuda(fn, use_graph=False).median_s
            else:
                t = time_cpu(fn, inner=1, outer=5).median_s
        except Exception as exc:  # this scaling is not supported here: try the next
            why = f"{type(exc).__name__}: {exc}"[:200]
            continue
        return 2 * m**3 / t, f"torch._scaled_mm e4m3 {m}^3, {name} scales, bf16 out"
    return 0.0, f"not measured: {why}"


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
    if getattr(timing, "note", ""):
        extra.setdefault("timing", timing.note)
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


def row_from_dict(d: dict) -> Row:
    """A :class:`Row` from its JSON form (unknown keys are kept in ``extra``)."""
    names = {f for f in Row.__dataclass_fields__ if f != "extra"}
    extra = dict(d.get("extra") or {})
    extra.update({k: v for k, v in d.items() if k not in names and k != "extra"})
    return Row(**{k: d[k] for k in names}, extra=extra)


def add_speedups(rows: list[Row]) -> list[Row]:
    """Set ``extra["x_<baseline>"]`` on every non-baseline row from the baselines of its group.

    A group is one (stage, shape). Speed-ups a stage computed itself are kept.
    """
    groups: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.stage, r.shape), []).append(r)
    for group in groups.values():
        bases = [r for r in group if r.impl in BASELINES]
        for r in group:
            if r.impl in BASELINES:
                continue
            for b in bases:
                if r.median_us > 0:
                    r.extra.setdefault(f"x_{BASELINES[b.impl]}", b.median_us / r.median_us)
    return rows


def environment(ceilings: Ceilings, device: torch.device | str | None = None) -> dict:
    import moe_route

    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # pragma: no cover - depends on the install
        triton_version = "unavailable"
    device = torch.device(device or "cuda")
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        capability = "SM{}{}".format(*torch.cuda.get_device_capability(device))
        mm_dtype = "bfloat16"
    else:
        gpu = f"none (CPU: {platform.processor() or platform.machine()})"
        capability = "cpu"
        mm_dtype = "float32"
    return {
        "gpu": gpu,
        "capability": capability,
        "device": device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "moe_route": moe_route.__version__,
        "python": platform.python_version(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "copy_TB_s": ceilings.copy_bytes_per_s / 1e12,
        "bf16_mm_TFLOP_s": ceilings.mm_flops_per_s / 1e12,  # float32 on CPU, see mm_dtype
        "mm_dtype": mm_dtype,
        **(
            {"fp8_mm_TFLOP_s": ceilings.fp8_mm_flops_per_s / 1e12, "fp8_mm": ceilings.fp8_mm}
            if ceilings.fp8_mm
            else {}
        ),
    }


def speedup_keys(rows: list[Row]) -> list[str]:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r.extra if k.startswith("x_") and k not in keys]
    return keys


def write_results(rows: list[Row], env: dict, out_dir: str, name: str, **meta) -> list[str]:
    """Write ``<name>.json`` and ``<name>.csv`` under ``out_dir``; returns their paths.

    JSON: ``{"environment": env, **meta, "rows": [Row as dict, ...]}``. CSV: the environment
    columns of :data:`ENV_COLUMNS`, the :class:`Row` fields, one column per speed-up
    (``x_<baseline>``) and the rest of ``extra`` as a JSON string.
    """
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, f"{name}.json")
    csv_path = os.path.join(out_dir, f"{name}.csv")
    with open(json_path, "w") as f:
        json.dump({"environment": env, **meta, "rows": [asdict(r) for r in rows]}, f, indent=1)
    row_fields = [k for k in Row.__dataclass_fields__ if k != "extra"]
    xs = speedup_keys(rows)
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*ENV_COLUMNS, *row_fields, *xs, "extra"])
        writer.writeheader()
        for r in rows:
            d = asdict(r)
            extra = d.pop("extra")
            d.update({k: env.get(k, "") for k in ENV_COLUMNS})
            d.update({k: extra.pop(k, "") for k in xs})
            d["extra"] = json.dumps(extra)
            writer.writerow(d)
    return [json_path, csv_path]


def _notes(r: Row) -> str:
    """The console's last column: speed-ups and the measurements some stages add."""
    e = r.extra
    notes = [f"{k}={v:.2f}x" for k, v in e.items() if k.startswith("x_")]
    if "tflops" in e and "of_dense" not in e:
        notes.append(f"{e['tflops']:.0f} TFLOP/s")
    if "of_dense" in e:
        notes.append(f"{100 * e['of_dense']:.0f}% of dense mm")
    if "over_floor" in e:
        notes.append(f"{e['over_floor']:.2f}x the weight-read floor")
    if "rel_err" in e and "quant" in e:
        notes.append(f"err {e['rel_err']:.3g}")
    if "peak_mib" in e:
        notes.append(f"peak {e['peak_mib']:.0f} MiB")
    if "activation_MiB" in e:
        notes.append(f"activations {e['activation_MiB']:.1f} MiB")
    if "per_index_select" in e:
        notes.append(f"= {e['per_index_select']:.1f} index_select")
    if "eager_us" in e:
        graph = f", graph {e['graph_us']:.1f} us" if "graph_us" in e else ""
        notes.append(f"eager {e['eager_us']:.1f} us{graph}")
    if e.get("device_bound"):
        notes.append("device-bound")
    if "first_over_repeat" in e:
        notes.append(f"T={e['new_T']}: first/repeated {e['first_over_repeat']:.2f}x")
    return " ".join(notes)


def print_table(rows: list[Row], env: dict, file=None) -> None:
    mm = "bf16" if env.get("mm_dtype", "bfloat16") == "bfloat16" else env["mm_dtype"]
    copy, rate = env["copy_TB_s"], env["bf16_mm_TFLOP_s"]
    fp8 = f", FP8 mm {env['fp8_mm_TFLOP_s']:.3g} TFLOP/s" if env.get("fp8_mm_TFLOP_s") else ""
    print(
        f"\n{env['gpu']} ({env['capability']}), torch {env['torch']}, triton {env['triton']}: "
        f"copy {copy:.3g} TB/s, {mm} mm {rate:.3g} TFLOP/s{fp8}",
        file=file,
    )
    wi = max([16, *(len(r.impl) + 2 for r in rows)])
    ws = max([10, *(len(r.stage) + 1 for r in rows)])
    head = (
        f"{'stage':<{ws}}{'shape':<30}{'impl':<{wi}}{'median us':>11}{'p20-p80':>22}"
        f"{'GB/s':>8}{'roof':>7}  notes"
    )
    print(head, file=file)
    print("-" * (len(head) + 20), file=file)
    for r in rows:
        print(
            f"{r.stage:<{ws}}{r.shape:<30}{r.impl:<{wi}}{r.median_us:>11.1f}"
            f"{f'{r.p20_us:.1f}-{r.p80_us:.1f}':>22}{r.achieved_gb_s:>8.0f}"
            f"{100 * r.roofline_fraction:>6.0f}%  {_notes(r)}",
            file=file,
        )
