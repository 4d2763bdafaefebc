"""finalizeMoeRouting (``finalize_moe_routing``) against gather + weighted sum.

The ``finalize`` stage of ``python -m moe_route bench`` (``moe_route/bench/routing.py``) on its own,
with the suite's harness and options (``--quick``, ``--shapes``, ``--tokens``, ``--out``, ...).
Memory-bound: reads T*K permuted rows once, writes T rows; float32 accumulation in both.

Usage: ``python bench/bench_finalize.py [--quick] [--out DIR]``;
writes ``finalize.json``, ``finalize.csv``, ``finalize.md`` and the plots.
"""

import sys

import harness  # noqa: F401 - puts the checkout on sys.path when moe_route is not installed

from moe_route.bench.suite import stage_main

if __name__ == "__main__":
    sys.exit(stage_main(["finalize"], "finalize", doc=__doc__))
