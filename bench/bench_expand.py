"""Expand rows (``expand_rows``: tokens into expert order) against ``index_select``.

The ``expand`` stage of ``python -m moe_route bench`` (``moe_route/bench/routing.py``) on its own,
with the suite's harness and options (``--quick``, ``--shapes``, ``--tokens``, ``--out``, ...).
Memory-bound: roofline = reading x once and writing T*K rows at the copy bandwidth.

Usage: ``python bench/bench_expand.py [--quick] [--out DIR]``;
writes ``expand.json``, ``expand.csv``, ``expand.md`` and the plots.
"""

import sys

import harness  # noqa: F401 - puts the checkout on sys.path when moe_route is not installed

from moe_route.bench.suite import stage_main

if __name__ == "__main__":
    sys.exit(stage_main(["expand"], "expand", doc=__doc__))
