"""The benchmark harness for the scripts in this folder: a re-export of ``moe_route.bench.harness``.

The harness lives in the package so that ``python -m moe_route bench`` works from an install;
the scripts here do ``from harness import Ceilings, time_cuda, make_row, ...`` as before. Run
from a checkout without installing, the repository root is put on ``sys.path``.
"""

import os
import sys

try:
    import moe_route  # noqa: F401
except ImportError:  # a checkout that is not installed: python bench/<script>.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moe_route.bench.harness import (
    BASELINES,
    Ceilings,
    Row,
    Timing,
    add_speedups,
    environment,
    make_row,
    print_table,
    row_from_dict,
    time_auto,
    time_cpu,
    time_cuda,
    write_results,
)

__all__ = [
    "BASELINES",
    "Ceilings",
    "Row",
    "Timing",
    "add_speedups",
    "environment",
    "make_row",
    "print_table",
    "row_from_dict",
    "time_auto",
    "time_cpu",
    "time_cuda",
    "write_results",
]
