"""``python -m moe_route bench``: the standard benchmark suite of DESIGN.md, in one process.

Measures the copy bandwidth and matmul rate first (and the FP8 matmul rate when a selected stage
needs it), then runs every selected stage on every selected shape (a progress bar on stderr),
timing moe_route next to the per-expert PyTorch loop and the ``torch._grouped_mm`` pipeline.
Writes ``<name>.json`` and ``<name>.csv`` (rewritten after every step, so an interrupted run
keeps what it measured), PNG plots and a markdown results table (:mod:`moe_route.bench.report`);
optional baselines this torch / device / install cannot run are listed under ``skipped`` with
the reason. Without a CUDA device it says so and runs a small CPU comparison (the reference path
against the PyTorch baselines at tiny sizes). ``--sweep NAME`` runs one of the tuning sweeps of
:mod:`.sweeps` instead.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time

import torch

from . import report, sweeps
from .context import Context, available_alt_backends
from .harness import Ceilings, add_speedups, environment, print_table, write_results
from .shapes import Shape, select_shapes
from .stages import GROUPS, STAGES, select_stages

SCHEMA = "moe_route.bench/1"
DEFAULT_README = os.path.join("bench", "README.md")


class Progress:
    """A one-line progress bar: redrawn in place on a terminal, a line per step in a log."""

    def __init__(self, total: float, stream=None, width: int = 24):
        self.total, self.done, self.width = max(total, 1e-9), 0.0, width
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.monotonic()
        self.steps = 0

    def _fmt(self, seconds: float) -> str:
        m, s = divmod(int(seconds), 60)
        return f"{m}:{s:02d}"

    def step(self, label: str, weight: float = 1.0) -> None:
        """Announce the step about to run; ``weight`` is its share of the total."""
        elapsed = time.monotonic() - self.start
        frac = min(self.done / self.total, 1.0)
        eta = f" eta {self._fmt(elapsed / frac * (1 - frac))}" if frac > 0.05 else ""
        n = round(frac * self.width)
        line = (
            f"[{'#' * n}{'.' * (self.width - n)}] {100 * frac:3.0f}% "
            f"{self._fmt(elapsed)}{eta}  {label}"
        )
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self.done += weight
        self.steps += 1

    def close(self, label: str = "done") -> None:
        self.done = self.total
        elapsed = self._fmt(time.monotonic() - self.start)
        line = f"[{'#' * self.width}] 100% {elapsed}  {label}"
        self.stream.write(("\r\033[K" + line + "\n") if self.tty else line + "\n")
        self.stream.flush()


def _raise_on_sigterm():
    """Make SIGTERM (``timeout``, a job limit) end the run like Ctrl-C: the table and the plots
    of what was measured are still written. Returns the previous handler (None if not set)."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    try:
        return signal.signal(signal.SIGTERM, handler)
    except (ValueError, OSError):  # not the main thread
        return None


def add_arguments(p: argparse.ArgumentParser) -> None:
    stage_names = ", ".join([*STAGES, *GROUPS])
    p.add_argument("--quick", action="store_true", help="one prefill size per model, short timings")
    p.add_argument("--stages", nargs="+", metavar="STAGE", help=f"stages to run ({stage_names})")
    p.add_argument(
        "--shapes", nargs="+", metavar="WORD",
        help="model names or prefixes (mixtral, qwen3, deepseek), decode, prefill",
    )  # fmt: skip
    p.add_argument(
        "--tokens", nargs="+", type=int, metavar="T", help="T values instead of the standard ones"
    )
    p.add_argument(
        "--skew", type=float, default=0.0, metavar="S",
        help="uneven experts: the router logits get a per-expert offset of standard deviation S "
        "(0.2 spreads deepseek-v3's 128 rows per expert over ~16-400; default 0: uniform)",
    )  # fmt: skip
    p.add_argument(
        "--custom",
        action="append",
        default=[],
        metavar="T,H,I,E,K",
        help="an extra shape (repeatable)",
    )
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="cpu: the small CPU comparison (default without a GPU)")  # fmt: skip
    p.add_argument(
        "--budget",
        type=float,
        help="seconds of timing per implementation (default 1, --quick 0.4, CPU 0.05)",
    )
    p.add_argument("--no-loop", action="store_true", help="skip the per-expert loop baseline")
    p.add_argument(
        "--no-alt-backends", action="store_true",
        help="time only the default backend (not also CuPy for maps / expand / finalize)",
    )  # fmt: skip
    p.add_argument(
        "--loop-max-tokens", type=int, default=8192, help="largest T for the loop baseline"
    )
    p.add_argument(
        "--host-calls", type=int, metavar="N",
        help="calls per host-time loop of the host stage (default 300, CPU 20)",
    )  # fmt: skip
    p.add_argument(
        "--out", help="output folder (default $OUT/bench, else a new temporary folder; printed)"
    )
    p.add_argument("--name", default="suite", help="stem of the JSON/CSV files (default: suite)")
    p.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    p.add_argument(
        "--readme", nargs="?", const=DEFAULT_README, metavar="PATH",
        help=f"also write the results table into PATH (default {DEFAULT_README}), between "
        "its markers",
    )  # fmt: skip
    p.add_argument(
        "--render", nargs="+", metavar="JSON",
        help="measure nothing: make plots and the table from saved results (plots go to --out, "
        "default the first JSON's folder)",
    )  # fmt: skip
    p.add_argument("--list", action="store_true", help="print the stages and shapes and exit")
    p.add_argument("--strict", action="store_true", help="exit 1 if any implementation failed")
    p.add_argument("--seed", type=int, default=0)
    sweeps.add_arguments(p)


def _defaults() -> dict:
    """Every option's default (an option whose value differs was given)."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    return vars(p.parse_args([]))


def _out_dir(args) -> str:
    """``--out``, else ``$OUT/bench``, else a new temporary folder: never the source tree."""
    if args.out:
        return args.out
    if os.environ.get("OUT"):
        return os.path.join(os.environ["OUT"], "bench")
    return tempfile.mkdtemp(prefix="moe_route_bench-")


def _finish_outputs(paths: list[str], out_dir: str, args, stem: str) -> list[str]:
    """Plots, the markdown table, and the README section, from saved JSON files."""
    written = []
    sources = report.load(paths)
    plots = {}
    if not args.no_plots:
        try:
            plots = report.plot_all(sources, out_dir, prefix=f"{stem}_")
            written += list(plots.values())
        except ImportError:
            print("plots: matplotlib is not installed (pip install 'moe_route[bench]'); skipped")
    if not (args.render and args.readme):  # a rendered README needs no copy beside it
        md_path = os.path.join(out_dir, f"{stem}.md")
        with open(md_path, "w") as f:
            f.write(report.markdown(sources, plots=plots, relative_to=out_dir))
        written.append(md_path)
    if args.readme:
        report.update_readme(args.readme, sources, plots=plots)
        written.append(args.readme)
    return written


def run(args) -> int:
    if args.sweep:
        return sweeps.run(args, _defaults(), lambda: _out_dir(args))
    if args.render:
        out_dir = args.out or os.path.dirname(os.path.abspath(args.render[0]))
        os.makedirs(out_dir, exist_ok=True)
        stem = args.name if args.name != "suite" else "results"
        for path in _finish_outputs(args.render, out_dir, args, stem):
            print(f"wrote {path}")
        return 0

    want_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench: --device cuda but no CUDA device is visible")
        return 2
    cpu = not want_cuda
    device = torch.device("cuda" if want_cuda else "cpu")
    try:
        stages = select_stages(args.stages)
        shapes = select_shapes(
            args.shapes, args.tokens, args.custom, args.quick, cpu=cpu, skew=args.skew
        )
    except ValueError as exc:
        print(f"bench: {exc}")
        return 2
    units = [(sh, st) for sh in shapes for st in stages if st.applies(sh)]
    if args.list:
        print("stages:")
        for st in STAGES.values():
            print(f"  {st.name:<10} {st.help}")
        print(f"groups: {', '.join(f'{k}={list(v) or list(STAGES)}' for k, v in GROUPS.items())}")
        print(f"shapes ({'CPU' if cpu else 'CUDA'}{', quick' if args.quick else ''}):")
        for sh in shapes:
            todo = [st.name for st in stages if st.applies(sh)]
            print(f"  {sh.label:<28} H={sh.H} I={sh.I} E={sh.E} K={sh.K}  {' '.join(todo)}")
        return 0
    if cpu:
        print(
            "bench: no CUDA device here; running the small CPU comparison instead: moe_route's "
            "pure-PyTorch reference path against the torch baselines at tiny sizes (float32). "
            "These are CPU timings, not GPU ones."
            if args.device == "auto"
            else "bench: the CPU comparison (--device cpu), float32, tiny sizes."
        )
    if not units:
        print("bench: nothing to run for these --stages / --shapes")
        return 2

    budget = args.budget or (0.05 if cpu else 0.4 if args.quick else 1.0)
    out_dir = _out_dir(args)
    print(
        f"bench: {len(units)} steps ({len(shapes)} shapes, {len(stages)} stages); results go to "
        f"{out_dir}"
    )
    progress = Progress(1 + sum(st.cost for _, st in units))
    fp8 = any(st.fp8_rate for st in stages)
    progress.step("measuring copy bandwidth and matmul rate" + (" (bf16, FP8)" if fp8 else ""))
    ceilings = Ceilings.measure(device, fp8=fp8)
    env = environment(ceilings, device)
    env["backend"] = "reference" if cpu else "auto"
    alt = () if cpu or args.no_alt_backends else available_alt_backends(device)
    env["alt_backends"] = list(alt)
    ctx = Context(
        device=device, ceilings=ceilings, dtype=torch.float32 if cpu else torch.bfloat16,
        budget_s=budget, with_loop=not args.no_loop, loop_max_tokens=args.loop_max_tokens,
        backend="reference" if cpu else "auto", alt_backends=alt, seed=args.seed,
        host_calls=args.host_calls or (20 if cpu else 300),
    )  # fmt: skip
    meta = {
        "schema": SCHEMA,
        "config": {
            "argv": sys.argv[1:],
            "quick": args.quick,
            "stages": [st.name for st in stages],
            "budget_s": budget,
            "device": device.type,
        },
        "shapes": {sh.label: sh.dims() for sh in shapes},
    }

    def save() -> list[str]:
        rows = add_speedups(ctx.rows)
        return write_results(rows, env, out_dir, args.name, **meta, failures=ctx.failures,
                             skipped=ctx.skipped)  # fmt: skip

    interrupted = False
    current: Shape | None = None
    previous = _raise_on_sigterm()
    try:
        for shape, stage in units:
            if current is not None and shape != current:
                ctx.release()
            current = shape
            progress.step(f"{stage.name:<9} {shape.label}", stage.cost)
            try:
                stage.run(shape, ctx)
            except Exception as exc:  # a stage's own setup failed (out of memory, ...)
                ctx.fail(stage.name, shape, "*", exc)
            save()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    ctx.release()
    progress.close("interrupted" if interrupted else "done")
    paths = save()
    print_table(add_speedups(ctx.rows), env)
    if ctx.failures:
        print(f"\n{len(ctx.failures)} failure(s); the other measurements stand:")
        for f in ctx.failures:
            print(f"  {f['stage']:<10} {f['shape']:<28} {f['impl']:<16} {f['error'][:160]}")
    if ctx.skipped:
        print(f"\n{len(ctx.skipped)} optional baseline(s) skipped here:")
        for f in ctx.skipped:
            print(f"  {f['stage']:<10} {f['shape']:<28} {f['impl']:<16} {f['reason'][:160]}")
    paths += _finish_outputs([paths[0]], out_dir, args, args.name)
    print("\nwrote " + "\n      ".join(paths))
    if interrupted:
        return 130
    if not ctx.rows:
        return 1
    return 1 if args.strict and ctx.failures else 0


def stage_main(stages: list[str], name: str, argv=None, doc: str | None = None) -> int:
    """The command line of one stage script (``bench/bench_<stage>.py``): the suite's options,
    with ``--stages`` and ``--name`` defaulting to that stage."""
    p = argparse.ArgumentParser(
        prog=os.path.basename(sys.argv[0]), description=(doc or __doc__).splitlines()[0]
    )
    add_arguments(p)
    p.set_defaults(stages=stages, name=name)
    return run(p.parse_args(argv))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m moe_route bench", description=__doc__.splitlines()[0]
    )
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
