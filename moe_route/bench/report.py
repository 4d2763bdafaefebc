"""The markdown results section from saved benchmark results (the suite's JSON, or older
files), and the README block it replaces.

Everything here reads JSON written by :func:`moe_route.bench.harness.write_results`, so plots
and the README table can be made on any machine from a GPU run's files:
``python -m moe_route bench --render results.json --readme bench/README.md``. The files are read
by :mod:`moe_route.bench.results`, the tables made by :mod:`moe_route.bench.tables`, the plots
by :mod:`moe_route.bench.plots`; their entry points are importable from here too.
"""

from __future__ import annotations

import os

from .plots import plot_all, plot_decode, plot_quant, plot_roofline, plot_speedup
from .quant import DECODE as QUANT_DECODE
from .quant import HOST as QUANT_HOST
from .quant import STAGE as QUANT
from .results import Source, _stages, all_rows, load, parse_label
from .tables import OWN_TABLES, fmt_rate, stage_table

__all__ = [
    "BEGIN", "END", "STAGE_NOTES", "Source", "describe_env", "load", "markdown", "parse_label",
    "plot_all", "plot_decode", "plot_quant", "plot_roofline", "plot_speedup", "stage_table",
    "update_readme",
]  # fmt: skip

BEGIN = "<!-- bench-results:begin -->"
END = "<!-- bench-results:end -->"


def describe_env(env: dict) -> str:
    mm = "bf16" if env.get("mm_dtype", "bfloat16") == "bfloat16" else env.get("mm_dtype")
    when = str(env.get("timestamp", "?")).replace("T", " ")[:16]
    parts = [
        f"**{env.get('gpu', '?')}** ({env.get('capability', '?')})",
        f"torch {env.get('torch', '?')}",
        f"Triton {env.get('triton', '?')}",
        f"moe_route {env.get('moe_route', '?')}",
        f"{when} UTC",
    ]
    ceil = ""
    if "copy_TB_s" in env:
        ceil = (
            f"; measured ceilings: copy {fmt_rate(env['copy_TB_s'] * 1e12, 'B/s')}, {mm} matmul "
            f"{fmt_rate(env['bf16_mm_TFLOP_s'] * 1e12, 'FLOP/s')}"
        )
        if env.get("fp8_mm_TFLOP_s"):
            ceil += f", FP8 matmul {fmt_rate(env['fp8_mm_TFLOP_s'] * 1e12, 'FLOP/s')}"
    return ", ".join(parts) + ceil


STAGE_NOTES = {
    "train": "Memory: peak allocated during forward + backward beyond what was allocated "
    "before; act. = the same without the gradients the step returns (each from the moment it "
    "is allocated): what the forward saves, its output, the temporaries of both passes.",
    "host": "Host time per call: `time.perf_counter()` around many calls with no "
    "synchronisation inside the loop, after warm-up (device-bound: the CUDA-graph latency is "
    "at least 80 % of it, so the loop may have waited for the device). ÷ index_select: over one "
    "`torch.index_select` of the expand's size timed the same way. Eager: `do_bench` median of "
    "one call; CUDA graph: one call of a replayed graph of 10.",
    QUANT: "Forward only. `fused_moe` on the bf16 weights and on the same weights quantised "
    "(`quantize_experts`: fp8 = 128x128 blocks, fp8_channel = per output channel, mxfp4 = e2m1 "
    "with a power-of-two scale per 32 values), the moe_route rows timed in turns; then "
    "`torch._scaled_grouped_mm` (tokens quantised rowwise, fp8_channel weights) and "
    "transformers' FP8 `grouped_mm` experts function (fp8 weights), each on its own. FLOP/s: "
    "6·T·K·H·I FLOPs over the time, and its share of the dense rate of the row's products: FP8 "
    "dense = `torch._scaled_mm` 8192³, dense = the bf16 matmul, both measured in the same run "
    "(the roofline takes the same rate). × baseline: the baseline of the "
    "same format over this row. Error: relative Frobenius norm against the bf16 output.",
    QUANT_DECODE: "Decode latency of `fused_moe` per weight format against its weight-read "
    "floor: the bytes of the experts the routing touches (distinct ids among the T·K slots) "
    "in that format, scales included, over the measured copy bandwidth.",
    QUANT_HOST: "Host time per eager call of `fused_moe` on quantised experts against the bf16 "
    "call (`time.perf_counter()` around calls with no synchronisation, as the host stage, the "
    "calls in turns; device-bound: the CUDA-graph latency is at least 80 % of it). Eager path: "
    "`decode` (two launches, no routing maps) or `sorted` (the maps, then the grouped GEMMs "
    "and the finalize; on FP8 a quantiser launch too).",
    "backward": "Device time per backward call of each step, from `torch.profiler` (kernels "
    "grouped by name, moe_route/bench/backward.py), and in brackets its roofline fraction "
    "(the step's own bytes and FLOPs); `other` are kernels no pattern matched, `total` all. "
    "moe_route GEMM kernels: the GEMM steps' GEMM kernels alone (without the step's memory "
    "passes: the expands that feed dW1 and dW2, the split activation backward's pass over the "
    "rows): their time, the step's FLOPs over it against the dense matmul rate, and the step's "
    "roofline time over it.",
}


def markdown(sources: list[Source], plots: dict | None = None, relative_to: str = ".") -> str:
    """The results section: where it was measured, a table per stage, the plots, failures."""
    out = [
        "<!-- Generated by `python -m moe_route bench` (moe_route/bench/report.py) from the JSON "
        "files named below; do not edit by hand. -->",
        "",
    ]
    for s in sources:
        out.append(f"- `{_display_path(s.path)}`: {describe_env(s.env)}.")
    out += [
        "",
        "Median of the timed runs (CUDA-graph replays where the code allows it; the per-expert "
        "loop and training run eagerly). In brackets: how many times faster the first column "
        "is than that one. Roofline = the time of `max(bytes / copy bandwidth, FLOPs / matmul "
        "rate)` over the measured time, from the ceilings measured in the same run; memory = "
        "peak allocated beyond the inputs.",
    ]
    rows = all_rows(sources)  # one table per stage, whichever files its rows come from
    for stage in _stages(rows):
        title = f"### {stage}"
        if len(sources) > 1:
            names = [
                os.path.basename(s.path) for s in sources if any(r.stage == stage for r in s.rows)
            ]
            title += " (" + ", ".join(f"`{n}`" for n in names) + ")"
        out += ["", title, ""]
        if stage in STAGE_NOTES:
            out += [STAGE_NOTES[stage], ""]
        out.append(OWN_TABLES.get(stage, stage_table)(rows, stage))
    if plots:
        out += ["", "### plots", ""]
        for name, path in plots.items():
            rel = os.path.relpath(path, relative_to).replace(os.sep, "/")
            out.append(f"![{name}]({rel})")
    failures = [f for s in sources for f in s.failures]
    if failures:
        out += ["", "### not measured", ""]
        for f in failures:
            out.append(f"- {f['stage']} / {f['shape']} / {f['impl']}: {f['error'][:200]}")
    skipped = [f for s in sources for f in s.skipped]
    if skipped:
        out += ["", "### skipped (optional baselines not offered there)", ""]
        for f in skipped:
            out.append(f"- {f['stage']} / {f['shape']} / {f['impl']}: {f['reason'][:200]}")
    return "\n".join(out) + "\n"


def _display_path(path: str) -> str:
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else path


def update_readme(path: str, sources: list[Source], plots: dict | None = None) -> None:
    """Replace the text between the markers of ``path`` (append markers if it has none)."""
    section = markdown(sources, plots, relative_to=os.path.dirname(os.path.abspath(path)))
    block = f"{BEGIN}\n{section}{END}\n"
    text = ""
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1].lstrip("\n")
        text = head + block + tail
    else:
        text = (text.rstrip("\n") + "\n\n## Results\n\n" if text else "# Results\n\n") + block
    with open(path, "w") as f:
        f.write(text)
