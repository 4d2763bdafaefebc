"""Pure-PyTorch reference for every stage of the MoE token path.

This package *defines* the semantics of ``DESIGN.md``; every backend is tested against it, the
benchmarks use it as their oracle, and it is the CPU fallback. It favours clarity over speed:
loops over experts are fine here, kernels elsewhere must not have them.

Arithmetic is float32, or float64 when the inputs are float64 (for ``gradcheck``); results are
returned in the dtype of the activations, rounded once.

Index conventions (the data contract):

* ``T`` tokens, ``K`` slots per token, ``E`` experts; expanded source row ``s = k*T + t``.
* Permuted (dest) order: experts ascending, then token ascending, then slot ``k`` ascending;
  dropped slots (``topk_ids == -1``) after every routed row, in source-row order.

One module per stage family, their functions re-exported here (``moe_route.reference.<name>``):

* :mod:`.router` — the routers: softmax top-``K`` in torch ops, loop oracles of
  :mod:`moe_route.routing`, the routing losses, the expert capacity;
* :mod:`.maps` — the routing maps, expand and finalize (rows between token and expert order);
* :mod:`.experts` — the activations and the grouped GEMM, forward and backward;
* :mod:`.chain` — the whole forward of DESIGN.md and its explicit gradients.
"""

from __future__ import annotations

from .chain import moe_backward_reference, moe_forward_reference
from .experts import (
    GATE_UP_LAYOUTS,
    activation_backward_reference,
    activation_grad_reference,
    activation_reference,
    grouped_gemm_backward_reference,
    grouped_gemm_reference,
    split_gate_up,
)
from .maps import (
    expand_rows_reference,
    finalize_moe_routing_backward_reference,
    finalize_moe_routing_reference,
    routing_maps_reference,
)
from .router import (
    apply_capacity_reference,
    load_balancing_loss_reference,
    router_z_loss_reference,
    sigmoid_grouped_topk_reference,
    softmax_topk_reference,
    topk_routing_reference,
)

__all__ = [
    "GATE_UP_LAYOUTS",
    "activation_backward_reference",
    "activation_grad_reference",
    "activation_reference",
    "apply_capacity_reference",
    "expand_rows_reference",
    "finalize_moe_routing_backward_reference",
    "finalize_moe_routing_reference",
    "grouped_gemm_backward_reference",
    "grouped_gemm_reference",
    "load_balancing_loss_reference",
    "moe_backward_reference",
    "moe_forward_reference",
    "router_z_loss_reference",
    "routing_maps_reference",
    "sigmoid_grouped_topk_reference",
    "softmax_topk_reference",
    "split_gate_up",
    "topk_routing_reference",
]
