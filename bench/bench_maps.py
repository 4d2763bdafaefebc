"""Routing maps (``build_routing_maps``) against an ``argsort`` pipeline.

The ``maps`` stage of ``python -m moe_route bench`` (``moe_route/bench/routing.py``) on its own,
with the suite's harness and options (``--quick``, ``--shapes``, ``--tokens``, ``--out``, ...).
Exact same tables; routing maps are launch-bound at decode sizes (CUDA-graph timing).

Usage: ``python bench/bench_maps.py [--quick] [--out DIR]``;
writes ``maps.json``, ``maps.csv``, ``maps.md`` and the plots.
"""

import sys

import harness  # noqa: F401 - puts the checkout on sys.path when moe_route is not installed

from moe_route.bench.suite import stage_main

if __name__ == "__main__":
    sys.exit(stage_main(["maps"], "maps", doc=__doc__))
