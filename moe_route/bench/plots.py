"""PNG plots of saved benchmark results (matplotlib, ``pip install 'moe_route[bench]'``):

* ``roofline`` — per stage, each implementation's fraction of its roofline floor per shape;
* ``speedup`` — per stage, moe_route's speed-up over each baseline per shape (log scale);
* ``decode`` — forward latency against T at decode sizes (T <= 128), per model, with the
  p20–p80 band and the roofline floor (reading the touched experts' weights);
* ``quant`` — the ``quant`` stage: each quantised forward's speed-up over the bf16 one per
  prefill shape, and each format's decode latency over its weight-read floor.
"""

from __future__ import annotations

import os

from .harness import BASELINES, Row
from .quant import DECODE as QUANT_DECODE
from .quant import STAGE as QUANT
from .results import Source, _impls, _shapes, _stages, all_rows, parse_label
from .tables import OWN_TABLES, _ref_key


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
