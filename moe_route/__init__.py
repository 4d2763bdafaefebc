"""moe_route: GPU kernels for mixture-of-experts layers.

The token path: router top-k → :func:`build_routing_maps` → :func:`expand_rows` →
:func:`grouped_gemm` (GEMM1 + activation, GEMM2) → :func:`finalize_moe_routing`;
:func:`fused_moe` runs all of it in one call. Every op has a pure-PyTorch oracle in
:mod:`moe_route.reference`; :mod:`moe_route.arch` says which implementation runs where.
"""

__version__ = "0.1.0"

from . import arch, reference
from .finalize import finalize_moe_routing
from .grouped_gemm import grouped_gemm
from .maps import RoutingMaps, build_routing_maps
from .moe import fused_moe
from .permute import expand_rows

__all__ = [
    "RoutingMaps",
    "__version__",
    "arch",
    "build_routing_maps",
    "expand_rows",
    "finalize_moe_routing",
    "fused_moe",
    "grouped_gemm",
    "reference",
]
