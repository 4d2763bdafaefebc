"""Grouped GEMM1 (+SwiGLU) and GEMM2 + finalize against ``torch._grouped_mm``.

The ``gemm`` stage of ``python -m moe_route bench`` (``moe_route/bench/gemm.py``) on its own,
with the suite's harness and options (``--quick``, ``--shapes``, ``--tokens``, ``--out``, ...).
GEMM1 gathers its rows through the maps; rows ``gemm1`` and ``gemm2+fin`` (standalone and
epilogue-fused finalize).

Usage: ``python bench/bench_gemm.py [--quick] [--out DIR]``;
writes ``gemm.json``, ``gemm.csv``, ``gemm.md`` and the plots.
"""

import sys

import harness  # noqa: F401 - puts the checkout on sys.path when moe_route is not installed

from moe_route.bench.suite import stage_main

if __name__ == "__main__":
    sys.exit(stage_main(["gemm"], "gemm", doc=__doc__))
