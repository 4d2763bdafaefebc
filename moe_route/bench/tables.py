"""The markdown tables of saved benchmark results: one per stage (:func:`stage_table`), and
the stages with a table of their own (:data:`OWN_TABLES`: host, backward, quant)."""

from __future__ import annotations

import re

from .backward import BACKWARD_STEPS, MOE_ROUTE_GEMMS, TOTAL
from .harness import Row
from .profiling import OTHER
from .quant import DECODE as QUANT_DECODE
from .quant import HOST as QUANT_HOST
from .quant import STAGE as QUANT
from .results import _impls, _shapes


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
    # the eager path's column where the rows record it (data from before it was recorded: none)
    paths = any("path" in r.extra for r in rows)
    head = ["shape", "call", *(["eager path"] if paths else []), "host time / call",
            f"÷ {ref} call", "eager", "CUDA graph"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        e = r.extra
        graph = "capture failed" if "graph" in e else _cell(e, "graph_us", fmt_time)
        cells = [r.shape, r.impl, *([e.get("path", "—")] if paths else []),
                 fmt_time(r.median_us), _cell(e, "over_ref", _fmt_ratio),
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
