"""``python -m moe_route bench --sweep NAME``: the tuning sweeps behind the tile tables.

Each sweep times one family of kernels over tile configurations at the standard shapes, checks
every variant's result against the configuration the tables choose today (or the sorted path),
prints a table per shape and writes every row to ``<NAME>_sweep.csv`` under ``--out``
(rewritten after every shape, so an interrupted run keeps what it measured):

* ``gemm`` — GEMM1 (gathered and on permuted rows) and GEMM2: the tables' config against the
  persistent kernel over a grid of tiles; the best config per shape and a suggested tail of
  ``tuning.gemm_config``'s table (``--training``: also GEMM1 storing ``z`` and the backward's
  dX GEMM; ``--store``: instead of the grid, the tables' tiles with TMA stores);
* ``wgrad`` — the weight gradients ``dW1 = dz^T x_perm`` and ``dW2 = dout_perm^T (w h)``: the
  pointer kernel gathering through the maps, the TMA kernel on permuted rows over a few tiles,
  ``torch._grouped_mm``; % of a dense ``mm`` and of the roofline (``--extra``, ``--candidates``,
  ``--pointer`` add tiles);
* ``act`` — GEMM2's backward with the activation's backward, tiles on gathered and permuted
  ``dout``, then the same GEMM with a plain store and the epilogue's bytes at the copy rate;
* ``decode`` — the decode path's two kernels per tile configuration against ``fused_moe``
  in a CUDA graph (the sorted path), 16 routings per graph (``--near``: the tiles near the
  best; ``--layouts``: k- and n-contiguous weights; ``--slots``: more slots than the path takes);
* ``bwd_decode`` — the backward's dX and activation-backward GEMMs at decode sizes, weights
  read transposed, against a k-contiguous copy; GB/s of the touched experts' weights;
* ``quant`` — the 16-row tiles of the GEMMs on FP8 (128-block) and MXFP4 experts at decode
  sizes, the experts step in a CUDA graph of 16 routings, against the tables' tiles and the
  touched weights' read time at the copy rate; on FP8 also the tokens quantised by a launch
  of their own rather than in the GEMMs' main loops (``--quick``: a small grid;
  ``--prefill``: the MXFP4 tiles of prefill sizes against the dense bf16 rate).

On a GPU the kernels run in bf16, each variant timed by ``triton.testing.do_bench`` (median,
L2 flushed). Without one (or with ``--device cpu``), under ``TRITON_INTERPRET=1``, each sweep
runs its tiny float16 case (the interpreter's bf16 ``tl.dot`` is wrong), one call per variant:
a check that the sweep and its kernels run and agree, not a timing.

One module per sweep (:mod:`.gemm`, :mod:`.wgrad`, :mod:`.act`, :mod:`.decode`,
:mod:`.bwd_decode`, :mod:`.quant`), each a subclass of :class:`.common.Sweep`; this one holds
their registry, the options and :func:`run`, which ``python -m moe_route bench`` calls for
``--sweep``.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time

import torch

from moe_route import arch

from .act import ActSweep
from .bwd_decode import BwdDecodeSweep
from .common import Sweep
from .decode import DecodeSweep
from .gemm import GemmSweep
from .quant import QuantSweep
from .wgrad import WgradSweep

SWEEPS: dict[str, type[Sweep]] = {
    cls.name: cls
    for cls in (GemmSweep, WgradSweep, ActSweep, DecodeSweep, BwdDecodeSweep, QuantSweep)
}

#: The options only sweeps read: (flags, argparse keywords).
OPTIONS = (
    (("--training",), {"action": "store_true",
                       "help": "gemm: also GEMM1 storing z (the training forward) and the "
                               "backward's dX GEMM"}),
    (("--store",), {"action": "store_true",
                    "help": "gemm: instead of the grid, the tables' config with TMA stores "
                            "(3 stages) and pointer stores (4 stages)"}),
    (("--rounds",), {"type": int, "default": 1, "metavar": "N",
                     "help": "gemm: time the configs in turns over N rounds (median; default 1)"}),
    (("--time-limit",), {"type": float, "default": 280.0, "metavar": "S",
                         "help": "gemm: stop adding configs after S seconds (default 280)"}),
    (("--rep-ms",), {"type": int, "metavar": "MS",
                     "help": "gemm, wgrad, act, bwd_decode: do_bench's time per variant "
                             "(default gemm 40, bwd_decode 60, else 100)"}),
    (("--extra",), {"action": "store_true",
                    "help": "wgrad: also more programs per SM and shorter row steps"}),
    (("--candidates",), {"action": "store_true",
                         "help": "wgrad: only the candidate TMA tiles, in both tile orders"}),
    (("--pointer",), {"action": "store_true",
                      "help": "wgrad: also the pointer kernel at the TMA kernel's tile sizes, "
                              "permuted and gathering"}),
    (("--near",), {"action": "store_true", "help": "decode: the tiles near the best of a sweep"}),
    (("--layouts",), {"action": "store_true",
                      "help": "decode: the tables' tiles on k- and n-contiguous weights"}),
    (("--slots",), {"action": "store_true",
                    "help": "decode: the tables' tiles at up to 256 slots (T*K)"}),
    (("--prefill",), {"action": "store_true",
                      "help": "quant: the MXFP4 tiles of prefill sizes (mixtral-8x7b and "
                              "qwen3-30b-a3b at T=4096) against the dense bf16 rate"}),
)  # fmt: skip

#: The suite's options a sweep reads whatever its name (the others: its ``takes``).
ALWAYS = ("sweep", "device", "out", "name", "seed", "list")

GROUP_HELP = """\
--sweep NAME runs one tuning sweep instead of the suite (NAME: {names}); '--sweep NAME
--list' shows what it would run. --shapes keeps the shapes whose 'model T=...' contains a
word, --tokens sets their T; --quick: gemm two shapes, wgrad the plan's tiles only, decode and
quant a small grid. Without a GPU (or with --device cpu) a tiny float16 case runs through the Triton
interpreter (TRITON_INTERPRET=1 in the environment). The options below belong to the sweeps
they name."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    names = ", ".join(SWEEPS)
    p.add_argument("--sweep", choices=list(SWEEPS), metavar="NAME",
                   help=f"run a tuning sweep instead of the suite: {names}")  # fmt: skip
    group = p.add_argument_group("tuning sweeps", GROUP_HELP.format(names=", ".join(SWEEPS)))
    for flags, kwargs in OPTIONS:
        group.add_argument(*flags, **kwargs)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_options(args, defaults: dict) -> None:
    """``ValueError`` for an option given that this sweep does not read."""
    cls = SWEEPS[args.sweep]
    foreign = [d for d, v in defaults.items() if d not in ALWAYS and d not in cls.takes
               and getattr(args, d, v) != v]  # fmt: skip
    if foreign:
        takes = ", ".join(_flag(d) for d in cls.takes)
        raise ValueError(f"--sweep {cls.name} does not take {', '.join(map(_flag, foreign))} "
                         f"(it takes {takes})")  # fmt: skip


def write_csv(rows: list[dict], path: str) -> None:
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(rows)


def run(args, defaults: dict, out_dir) -> int:
    """``bench --sweep NAME``: ``defaults`` are the parser's (an option that differs from its
    default was given), ``out_dir()`` the output folder."""
    prog = f"bench --sweep {args.sweep}"
    interpreted = arch.triton_interpreter_enabled()
    want_cuda = args.device == "cuda" or (
        args.device == "auto" and torch.cuda.is_available() and not interpreted
    )
    try:
        check_options(args, defaults)
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda but no CUDA device is visible")
        if not want_cuda and not args.list and not interpreted:
            raise ValueError(
                "needs a CUDA device (none is visible, or --device cpu); the tiny CPU case runs "
                "its kernels through the Triton interpreter: set TRITON_INTERPRET=1 in the "
                "environment before Python starts"
            )
        sweep = SWEEPS[args.sweep](args, torch.device("cuda" if want_cuda else "cpu"))
        shapes = sweep.shapes()
    except ValueError as exc:
        print(f"{prog}: {exc}")
        return 2
    if args.list:
        print(f"sweep {sweep.name}: {sweep.help}")
        print(f"on {'CUDA, bf16' if want_cuda else 'the CPU (interpreter), float16'}:")
        for line in sweep.describe():
            print(f"  {line}")
        print("shapes:")
        for s in shapes:
            print(f"  {s.label:<28} H={s.H} I={s.I} E={s.E} K={s.K}")
        return 0
    if sweep.cpu:
        print(f"{prog}: no GPU; the tiny float16 case through the Triton interpreter, one call "
              "per variant (a check that it runs, not a timing)")  # fmt: skip
    folder = out_dir()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{args.name if args.name != 'suite' else sweep.name + '_sweep'}"
                                ".csv")  # fmt: skip
    started = time.perf_counter()
    sweep.start()
    interrupted = False
    try:
        for shape in shapes:
            sweep.run_shape(shape)
            sweep.release()
            sys.stdout.flush()
            if sweep.rows:
                write_csv(sweep.rows, path)
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted")
    sweep.release()
    if not sweep.rows:
        print(f"{prog}: nothing measured")
        return 130 if interrupted else 1
    sweep.finish()
    write_csv(sweep.rows, path)
    print(f"\nwrote {path} ({time.perf_counter() - started:.0f} s)")
    return 130 if interrupted else sweep.status()
