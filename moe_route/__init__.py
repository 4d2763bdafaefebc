"""moe_route: GPU kernels for mixture-of-experts layers.

The token path: router top-k → :func:`build_routing_maps` → :func:`expand_rows` →
:func:`grouped_gemm` (GEMM1 + activation, GEMM2) → :func:`finalize_moe_routing`;
:func:`fused_moe` runs all of it in one call, and :class:`MoELayer` wraps the routers,
auxiliary losses and capacity of :mod:`moe_route.routing` around it as a trainable module.
:func:`activation` builds the activation between the GEMMs (:mod:`moe_route.activations`).
Every op has a pure-PyTorch oracle in :mod:`moe_route.reference`; :mod:`moe_route.arch`
says which implementation runs where.
"""

__version__ = "0.1.0"

from . import arch, reference
from .activations import Activation, activation
from .finalize import finalize_moe_routing
from .grouped_gemm import grouped_gemm
from .layer import MoELayer, MoEOutput
from .maps import RoutingMaps, build_routing_maps
from .moe import fused_moe, warmup
from .permute import expand_rows
from .quant import QuantSpec, dequantize_experts, quantize_activations, quantize_experts
from .routing import (
    apply_capacity,
    expert_capacity,
    load_balancing_loss,
    router_z_loss,
    sigmoid_grouped_topk,
    softmax_topk,
    tokens_per_expert,
)

__all__ = [
    "Activation",
    "MoELayer",
    "MoEOutput",
    "QuantSpec",
    "RoutingMaps",
    "__version__",
    "activation",
    "apply_capacity",
    "arch",
    "build_routing_maps",
    "dequantize_experts",
    "expand_rows",
    "expert_capacity",
    "finalize_moe_routing",
    "fused_moe",
    "grouped_gemm",
    "load_balancing_loss",
    "quantize_activations",
    "quantize_experts",
    "reference",
    "router_z_loss",
    "sigmoid_grouped_topk",
    "softmax_topk",
    "tokens_per_expert",
    "warmup",
]
