"""Plots and markdown tables from saved benchmark results (the suite's JSON, or older files).

Everything here reads JSON written by :func:`moe_route.bench.harness.write_results`, so plots
and the README table can be made on any machine from a GPU run's files:
``python -m moe_route bench --render results.json --readme bench/README.md``.

Plots (matplotlib, ``pip install 'moe_route[bench]'``):

* ``roofline`` — per stage, each implementation's fraction of its roofline floor per shape;
* ``speedup`` — per stage, moe_route's speed-up over each baseline per shape (log scale);
* ``decode`` — forward latency against T at decode sizes (T <= 128), per model, with the
  p20–p80 band and the roofline floor (reading the touched experts' weights);
* ``quant`` — the ``quant`` stage: each quantised forward's speed-up over the bf16 one per
  prefill shape, and each format's decode latency over its weight-read floor.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from .backward import BACKWARD_STEPS, MOE_ROUTE_GEMMS, TOTAL
from .harness import BASELINES, Row, add_speedups, row_from_dict
from .profiling import OTHER
from .quant import DECODE as QUANT_DECODE
from .quant import HOST as QUANT_HOST
from .quant import STAGE as QUANT

BEGIN = "<!-- bench-results:begin -->"
END = "<!-- bench-results:end -->"
STAGE_ORDER = (
    "maps", "expand", "finalize", "gemm1", "gemm2+fin", "forward", "train", "backward", "host",
    QUANT, QUANT_DECODE, QUANT_HOST,
)  # fmt: skip
# Tuning sweeps (tile / block / GEMM config) are not part of the tables or plots.
_SWEEP_IMPL = re.compile(r"^(tile=|block=|\d+/\d+/)")
# bench_moe.py before the suite labelled two shapes "decode T=64": its last one had the
# deepseek-v3 dimensions (H=7168, I=2048, E=256, K=8), so its second occurrence is renamed.
_LEGACY_RELABEL = {"decode T=64": "deepseek-v3 T=64"}


@dataclass
class Source:
    path: str
    env: dict
    rows: list[Row]
    shapes: dict = field(default_factory=dict)  # label -> {model, T, H, I, E, K}
    failures: list = field(default_factory=list)
    skipped: list = field(default_factory=list)  # optional baselines not offered there


def parse_label(label: str) -> tuple[str, dict]:
    """``"qwen3-30b-a3b T=8192"`` -> ``("qwen3-30b-a3b", {"T": 8192})``."""
    name, params = [], {}
    for tok in label.split():
        k, sep, v = tok.partition("=")
        if sep and v.lstrip("-").isdigit():
            params[k] = int(v)
        else:
            name.append(tok)
    return " ".join(name), params


def load(paths) -> list[Source]:
    """Read result files; rows of tuning sweeps and repeated (stage, shape, impl) are dropped."""
    sources = []
    for path in [paths] if isinstance(paths, str) else paths:
        with open(path) as f:
            data = json.load(f)
        legacy = "schema" not in data
        seen: set[tuple[str, str, str]] = set()
        relabelled: set[tuple[str, str, str]] = set()
        rows = []
        for d in data.get("rows", []):
            r = row_from_dict(d)
            if _SWEEP_IMPL.match(r.impl):
                continue
            key = (r.stage, r.shape, r.impl)
            if key in seen:
                if not (legacy and r.shape in _LEGACY_RELABEL) or key in relabelled:
                    continue
                relabelled.add(key)
                r.shape = _LEGACY_RELABEL[r.shape]
            seen.add(key)
            rows.append(r)
        sources.append(
            Source(path, data.get("environment", {}), add_speedups(rows),
                   data.get("shapes", {}), data.get("failures", []), data.get("skipped", []))
        )  # fmt: skip
    return sources


def all_rows(sources: list[Source]) -> list[Row]:
    return [r for s in sources for r in s.rows]


def _stages(rows: list[Row]) -> list[str]:
    present = list(dict.fromkeys(r.stage for r in rows))
    return [s for s in STAGE_ORDER if s in present] + [s for s in present if s not in STAGE_ORDER]


def _shapes(rows: list[Row]) -> list[str]:
    return list(dict.fromkeys(r.shape for r in rows))


def _impls(rows: list[Row]) -> list[str]:
    """Implementations in a stable order: moe_route ones first, then the baselines."""
    impls = list(dict.fromkeys(r.impl for r in rows))
    ours = [i for i in impls if i not in BASELINES]
    ours.sort(key=lambda i: (not i.startswith("moe_route"), i != "moe_route"))
    return ours + [i for i in impls if i in BASELINES]


def fmt_time(us: float) -> str:
    if us >= 1e4:
        return f"{us / 1e3:.1f} ms"
    if us >= 1e3:
        return f"{us / 1e3:.2f} ms"
    if us >= 100:
        return f"{us:.0f} µs"
    return f"{us:.1f} µs"


def fmt_rate(x: float, unit: str) -> str:
    """``4.2e12, "B/s"`` -> ``"4.20 TB/s"``; three significant digits, SI prefix."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1, "")):
        if x >= scale:
            v = x / scale
            return f"{v:.3g} {prefix}{unit}" if v < 100 else f"{v:.0f} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _fmt_ratio(x: float) -> str:
    return f"{x:.0f}×" if x >= 100 else f"{x:.1f}×" if x >= 10 else f"{x:.2f}×"


def _fmt_mem(mib: float) -> str:
    if mib >= 1024:
        return f"{mib / 1024:.1f} GiB"
    return f"{mib:.0f} MiB" if mib >= 10 else f"{mib:.2g} MiB"


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


def stage_table(rows: list[Row], stage: str) -> str:
    """One markdown table: a line per shape, a column per implementation.

    The first column is the primary implementation (``moe_route``); every other cell gives its
    time and, in brackets, how many times faster the primary one is.
    """
    rows = [r for r in rows if r.stage == stage]
    impls = _impls(rows)
    primary = impls[0]
    by = {(r.shape, r.impl): r for r in rows}
    show_mem = any("peak_mib" in r.extra for r in rows)
    head = ["shape", *impls, f"{primary} roofline"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for shape in _shapes(rows):
        p = by.get((shape, primary))
        cells = [shape]
        for impl in impls:
            r = by.get((shape, impl))
            if r is None:
                cells.append("—")
                continue
            cell = fmt_time(r.median_us)
            if show_mem and r.extra.get("peak_mib", float("nan")) == r.extra.get("peak_mib"):
                cell += f", {_fmt_mem(r.extra['peak_mib'])}"
            if "activation_MiB" in r.extra:
                cell += f", act. {_fmt_mem(r.extra['activation_MiB'])}"
            if impl != primary and p is not None:
                cell += f" ({_fmt_ratio(r.median_us / p.median_us)})"
            if r.extra.get("mismatch"):
                cell += " ⚠ mismatch"
            cells.append(cell)
        if p is None:
            cells.append("—")
        else:
            roof = f"{100 * p.roofline_fraction:.0f} %"
            if p.roofline_fraction < 0.01:
                roof = f"{100 * p.roofline_fraction:.2g} % (launch-bound)"
            cells.append(roof)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def host_table(rows: list[Row], stage: str = "host") -> str:
    """The host stage: a line per (shape, op) with its host time per call, that over one
    ``index_select``'s, eager and CUDA-graph latency; then the first calls at new token counts."""
    rows = [r for r in rows if r.stage == stage]
    lines = [
        "| shape | op | host time / call | ÷ index_select | eager | CUDA graph | eager ÷ graph |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        e = r.extra
        if "new_T" in e:
            continue
        host = fmt_time(r.median_us) + (" (device-bound)" if e.get("device_bound") else "")
        graph = fmt_time(e["graph_us"]) if "graph_us" in e else "—"
        if "graph" in e:
            graph = "capture failed"
        cells = [
            r.shape,
            r.impl,
            host,
            _fmt_ratio(e["per_index_select"]) if "per_index_select" in e else "—",
            fmt_time(e["eager_us"]) if "eager_us" in e else "—",
            graph,
            _fmt_ratio(e["eager_over_graph"]) if "eager_over_graph" in e else "—",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    first = [r for r in rows if "new_T" in r.extra]
    if first:
        lines += [
            "",
            "`fused_moe`, first call at a token count not used before in the process (the "
            "shape's power-of-two bucket), against the same calls repeated:",
            "",
            "| shape | new T | first calls | repeated call | worst first ÷ repeated | "
            "host time: worst first ÷ repeated |",
            "|---|---|---|---|---|---|",
        ]
        for r in first:
            e = r.extra
            firsts = ", ".join(fmt_time(us) for us in e.get("first_us", []))
            host = e.get("host_first_over_repeat")
            cells = [r.shape, ", ".join(str(t) for t in e["new_T"]), firsts,
                     fmt_time(e["repeat_us"]), _fmt_ratio(e["first_over_repeat"]),
                     _fmt_ratio(host) if host is not None else "—"]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def backward_table(rows: list[Row], stage: str = "backward") -> str:
    """The backward stage: a line per (shape, step), a column per implementation with the
    step's device time and roofline fraction, and how many times faster the first one is; then,
    for moe_route's GEMM steps, its GEMM kernels alone (:func:`_gemm_kernels_cell`)."""
    rows = [r for r in rows if r.stage == stage]
    of = list(dict.fromkeys(r.extra.get("of", r.impl) for r in rows))
    of.sort(key=lambda i: i != "moe_route")
    steps = list(dict.fromkeys(r.extra.get("step", r.impl) for r in rows))
    order = [*BACKWARD_STEPS, OTHER, TOTAL]
    steps.sort(key=lambda s: order.index(s) if s in order else len(order))
    by = {(r.shape, r.extra.get("of", r.impl), r.extra.get("step", r.impl)): r for r in rows}
    head = ["shape", "step", *of]
    if len(of) > 1:
        head.append(f"{of[1]} ÷ {of[0]}")
    gemms = "moe_route" in of
    if gemms:
        head.append("moe_route GEMM kernels")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for shape in _shapes(rows):
        for step in steps:
            found = [by.get((shape, impl, step)) for impl in of]
            if not any(found):
                continue
            cells = [shape, step]
            for r in found:
                if r is None:
                    cells.append("—")
                elif r.floor_us > 0:
                    cells.append(f"{fmt_time(r.median_us)} ({100 * r.roofline_fraction:.0f} %)")
                else:
                    cells.append(fmt_time(r.median_us))
            if len(of) > 1:
                a, b = found[0], found[1]
                cells.append(_fmt_ratio(b.median_us / a.median_us) if a and b else "—")
            if gemms:
                cells.append(_gemm_kernels_cell(by.get((shape, "moe_route", step))))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _gemm_kernels_cell(r: Row | None) -> str:
    """A GEMM step's GEMM kernels (``MOE_ROUTE_GEMMS``) alone: their device time, the step's
    FLOPs over it as a fraction of the dense matmul rate, and the step's roofline time over it
    (the step's time also holds its memory passes, e.g. the expand that feeds ``dW2``, or the
    split activation backward's pass over the rows; where the weights dominate the bytes, as
    at deepseek-v3's 128 rows per expert, the roofline is the bound, not the dense rate);
    ``—`` for the other steps."""
    if r is None or not r.extra.get("of_dense") or not r.extra.get("kernels"):
        return "—"
    us = sum(t for name, t in r.extra["kernels"].items() if re.search(MOE_ROUTE_GEMMS, name))
    if not us:
        return "—"
    dense = r.extra["of_dense"] * r.median_us / us
    roof = r.roofline_fraction * r.median_us / us
    return f"{fmt_time(us)} ({100 * dense:.0f} % of dense, {100 * roof:.0f} % roofline)"


def _ref_key(rows: list[Row]) -> tuple[str, str]:
    """``(name, key)`` of the quant stage's reference (``bf16``, ``x_bf16``): the unquantised
    row's format."""
    from .quant import FORMATS_ALL

    names = [r.extra.get("quant") for r in rows if r.extra.get("quant") not in FORMATS_ALL]
    name = next((n for n in names if n), "bf16")
    return name, f"x_{name}"


def _cell(e: dict, key: str, fmt) -> str:
    return fmt(e[key]) if key in e else "—"


def quant_table(rows: list[Row], stage: str = QUANT) -> str:
    """The quant stage at prefill sizes: a line per (shape, implementation) with its time,
    TFLOP/s and share of the dense rate of its products, its speed-up over the bf16 forward
    and over the baseline of its format, its error against the bf16 output, its peak memory."""
    rows = [r for r in rows if r.stage == stage]
    ref, key = _ref_key(rows)
    lines = [
        f"| shape | implementation | time | FLOP/s (of the dense rate) | × {ref} | × baseline "
        f"| error vs {ref} | peak memory | roofline |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        e = r.extra
        tf = "—"
        if "tflops" in e:
            tf = fmt_rate(e["tflops"] * 1e12, "FLOP/s")
            if "of_dense" in e:
                rate = "FP8 dense" if e.get("rate") == "fp8" else "dense"
                tf += f" ({100 * e['of_dense']:.0f} % of {rate})"
        base = [f"{_fmt_ratio(e[k])} {k[2:]}" for k in ("x_scaled_grouped_mm", "x_transformers")
                if k in e]  # fmt: skip
        err = _cell(e, "rel_err", lambda v: f"{v:.3g}")
        if e.get("mismatch"):
            err += " ⚠ mismatch"
        mem = e.get("peak_mib", float("nan"))
        cells = [r.shape, r.impl, fmt_time(r.median_us), tf, _cell(e, key, _fmt_ratio),
                 ", ".join(base) or "—", err, _fmt_mem(mem) if mem == mem else "—",
                 f"{100 * r.roofline_fraction:.0f} %"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def quant_decode_table(rows: list[Row], stage: str = QUANT_DECODE) -> str:
    """The quant stage at decode sizes: each format's latency against its weight-read floor."""
    rows = [r for r in rows if r.stage == stage]
    ref, key = _ref_key(rows)
    lines = [
        f"| shape | implementation | latency | experts touched | weights read | floor "
        f"| latency ÷ floor | × {ref} | error vs {ref} |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        e = r.extra
        wb = e.get("weight_bytes")
        cells = [r.shape, r.impl, fmt_time(r.median_us), str(e.get("touched", "—")),
                 _fmt_mem(wb / 2**20) if wb else "—", fmt_time(r.floor_us),
                 _cell(e, "over_floor", _fmt_ratio), _cell(e, key, _fmt_ratio),
                 _cell(e, "rel_err", lambda v: f"{v:.3g}")]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def quant_host_table(rows: list[Row], stage: str = QUANT_HOST) -> str:
    """The quant stage's host times: quantised ``fused_moe`` calls against the bf16 call."""
    rows = [r for r in rows if r.stage == stage]
    ref, _ = _ref_key(rows)
    lines = [
        f"| shape | call | host time / call | ÷ {ref} call | eager | CUDA graph |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        e = r.extra
        host = fmt_time(r.median_us) + (" (device-bound)" if e.get("device_bound") else "")
        graph = "capture failed" if "graph" in e else _cell(e, "graph_us", fmt_time)
        cells = [r.shape, r.impl, host, _cell(e, "over_ref", _fmt_ratio),
                 _cell(e, "eager_us", fmt_time), graph]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# Stages with a table of their own (and no place in the roofline / speed-up plots).
OWN_TABLES = {
    "host": host_table,
    "backward": backward_table,
    QUANT: quant_table,
    QUANT_DECODE: quant_decode_table,
    QUANT_HOST: quant_host_table,
}
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
    "calls in turns; device-bound: the CUDA-graph latency is at least 80 % of it).",
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


# --------------------------------------------------------------------------- plots


def _figure(n: int, ncols: int = 2, height: float = 3.4):
    from matplotlib.figure import Figure

    ncols = min(ncols, n)
    nrows = -(-n // ncols)
    fig = Figure(figsize=(6.5 * ncols, height * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes


def _title(sources: list[Source]) -> str:
    gpus = sorted({str(s.env.get("gpu", "?")) for s in sources})
    dates = sorted({str(s.env.get("timestamp", "?"))[:10] for s in sources})
    return f"moe_route on {', '.join(gpus)} ({', '.join(dates)})"


def _plain_log_ticks(ax) -> None:
    """Log-scale y ticks as plain numbers (``2``, ``0.5``), not powers of ten."""
    from matplotlib.ticker import FuncFormatter

    fmt = FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(fmt)
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def _bars(ax, shapes, series: dict[str, list[float]]) -> None:
    n = max(len(series), 1)
    width = 0.8 / n
    for i, (name, values) in enumerate(series.items()):
        xs = [j + (i - (n - 1) / 2) * width for j in range(len(shapes))]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels(shapes, rotation=30, ha="right", fontsize=7)
    ax.legend(fontsize=7)


def plot_roofline(sources: list[Source], path: str) -> str | None:
    rows = all_rows(sources)
    stages = [s for s in _stages(rows) if s not in OWN_TABLES]
    if not stages:
        return None
    fig, axes = _figure(len(stages))
    for ax, stage in zip(axes, stages, strict=False):
        srows = [r for r in rows if r.stage == stage]
        shapes, impls = _shapes(srows), _impls(srows)
        by = {(r.shape, r.impl): r for r in srows}
        series = {
            impl: [100 * by[(s, impl)].roofline_fraction if (s, impl) in by else 0 for s in shapes]
            for impl in impls
        }
        _bars(ax, shapes, series)
        if min((v for vs in series.values() for v in vs if v > 0), default=1) < 1:
            ax.set_yscale("log")
            _plain_log_ticks(ax)
        ax.axhline(100, color="k", lw=0.6, ls="--")
        ax.set_title(f"{stage}: fraction of roofline", fontsize=9)
        ax.set_ylabel("% of roofline floor")
    fig.suptitle(_title(sources), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return path


def plot_speedup(sources: list[Source], path: str) -> str | None:
    rows = all_rows(sources)
    stages = [
        s
        for s in _stages(rows)
        if s not in OWN_TABLES and any(r.impl in BASELINES for r in rows if r.stage == s)
    ]
    if not stages:
        return None
    fig, axes = _figure(len(stages))
    for ax, stage in zip(axes, stages, strict=False):
        srows = [r for r in rows if r.stage == stage]
        shapes = _shapes(srows)
        by = {(r.shape, r.impl): r for r in srows}
        ours = [i for i in _impls(srows) if i not in BASELINES and i.startswith("moe_route")]
        ours = ours or [i for i in _impls(srows) if i not in BASELINES][:1]
        bases = [i for i in _impls(srows) if i in BASELINES]
        series = {}
        for o in ours:
            for b in bases:
                series[f"{o} vs {b}"] = [
                    by[(s, b)].median_us / by[(s, o)].median_us
                    if (s, o) in by and (s, b) in by
                    else 0
                    for s in shapes
                ]
        _bars(ax, shapes, series)
        ax.set_yscale("log")
        _plain_log_ticks(ax)
        ax.axhline(1, color="k", lw=0.6)
        ax.set_title(f"{stage}: speed-up over each baseline", fontsize=9)
        ax.set_ylabel("× faster")
    fig.suptitle(_title(sources), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return path


def _dims(sources: list[Source], label: str) -> tuple[str, int | None]:
    for s in sources:
        if label in s.shapes:
            return s.shapes[label]["model"], s.shapes[label]["T"]
    name, params = parse_label(label)
    return name, params.get("T")


def plot_decode(sources: list[Source], path: str, max_tokens: int = 128) -> str | None:
    """Forward latency against T at decode sizes, one panel per model."""
    rows = [r for r in all_rows(sources) if r.stage == "forward"]
    per_model: dict[str, list[tuple[int, Row]]] = {}
    for r in rows:
        model, T = _dims(sources, r.shape)
        if T is not None and max_tokens >= T:
            per_model.setdefault(model, []).append((T, r))
    if not per_model:
        return None
    fig, axes = _figure(len(per_model), ncols=min(3, len(per_model)), height=3.6)
    for ax, (model, pts) in zip(axes, per_model.items(), strict=False):
        impls = _impls([r for _, r in pts])
        for impl in impls:
            xs = sorted((T, r) for T, r in pts if r.impl == impl)
            if not xs:
                continue
            Ts = [T for T, _ in xs]
            ax.plot(Ts, [r.median_us for _, r in xs], marker="o", label=impl)
            ax.fill_between(Ts, [r.p20_us for _, r in xs], [r.p80_us for _, r in xs], alpha=0.25)
        floor = sorted({(T, r.floor_us) for T, r in pts})
        if floor:
            ax.plot([T for T, _ in floor], [f for _, f in floor], "k--", lw=0.8, label="roofline")
        ax.set_xscale("log", base=2)
        ticks = sorted({T for T, _ in pts})
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(T) for T in ticks])
        ax.set_yscale("log")
        ax.set_xlabel("tokens T")
        ax.set_ylabel("forward latency (µs)")
        ax.set_title(f"{model}: decode latency", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(_title(sources), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return path


def plot_quant(sources: list[Source], path: str) -> str | None:
    """The quant stage: speed-up of each implementation over the bf16 forward per prefill
    shape, and each format's decode latency over its weight-read floor."""
    rows = all_rows(sources)
    panels = []
    prefill = [r for r in rows if r.stage == QUANT]
    if prefill:
        ref, key = _ref_key(prefill)
        panels.append((prefill, key, f"{QUANT}: speed-up over moe_route {ref}", "× faster", 1))
    decode = [r for r in rows if r.stage == QUANT_DECODE]
    if decode:
        panels.append((decode, "over_floor", f"{QUANT_DECODE}: latency ÷ weight-read floor",
                       "× the floor", 1))  # fmt: skip
    if not panels:
        return None
    fig, axes = _figure(len(panels))
    for ax, (prows, key, title, ylabel, line) in zip(axes, panels, strict=False):
        shapes = _shapes(prows)
        impls = [i for i in dict.fromkeys(r.impl for r in prows)
                 if any(key in r.extra for r in prows if r.impl == i)]  # fmt: skip
        by = {(r.shape, r.impl): r for r in prows}
        series = {i: [by[(s, i)].extra.get(key, 0) if (s, i) in by else 0 for s in shapes]
                  for i in impls}  # fmt: skip
        _bars(ax, shapes, series)
        values = [v for vs in series.values() for v in vs if v > 0]
        if values and max(values) > 20 * min(values):  # else a linear axis reads better
            ax.set_yscale("log")
            _plain_log_ticks(ax)
        ax.axhline(line, color="k", lw=0.6)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(ylabel)
    fig.suptitle(_title(sources), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return path


def plot_all(sources: list[Source], out_dir: str, prefix: str = "") -> dict[str, str]:
    """Write the plots that have data; returns ``{name: path}``."""
    import matplotlib  # noqa: F401 - ImportError here means: no plots

    os.makedirs(out_dir, exist_ok=True)
    done = {}
    for name, fn in (
        ("roofline", plot_roofline),
        ("speedup", plot_speedup),
        ("decode", plot_decode),
        ("quant", plot_quant),
    ):
        path = fn(sources, os.path.join(out_dir, f"{prefix}{name}.png"))
        if path:
            done[name] = path
    return done
