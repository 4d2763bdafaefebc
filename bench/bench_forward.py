"""The whole MoE forward (``fused_moe``) against the ``_grouped_mm`` pipeline and the loop.

The ``forward`` stage of ``python -m moe_route bench`` (``moe_route/bench/forward.py``) on its own,
with the suite's harness and options (``--quick``, ``--shapes``, ``--tokens``, ``--out``, ...).
Peak memory per implementation; the per-expert loop only up to ``--loop-max-tokens``.

Usage: ``python bench/bench_forward.py [--quick] [--out DIR]``;
writes ``forward.json``, ``forward.csv``, ``forward.md`` and the plots.
"""

import sys

import harness  # noqa: F401 - puts the checkout on sys.path when moe_route is not installed

from moe_route.bench.suite import stage_main

if __name__ == "__main__":
    sys.exit(stage_main(["forward"], "forward", doc=__doc__))
