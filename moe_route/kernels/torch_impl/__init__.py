"""The pure-PyTorch backend: every stage of the MoE token path, vectorised, for the CPU.

This is what runs where no Triton kernel can (the CPU by default; a GPU when asked for). It
keeps the semantics and data contract of :mod:`moe_route.reference`, which stays the oracle it
is tested against: arithmetic in float32 (float64 when an input is float64), results rounded
once to the activations' dtype, rows of dropped slots zero, the finalize sum in ascending ``k``.
Where the reference is written to be read, this is written to be fast at the sizes a CPU runs
(per-call overhead matters as much as arithmetic there):

* the expert GEMMs run over the routed rows only, as one ``torch._grouped_mm`` where torch
  supports it (CPU, float32, 16-byte aligned pitches), else one matmul per expert with rows;
* each GEMM-bearing function reads ``expert_first_token_offset`` to the host once (a memory
  read on the CPU) and every segment bound follows from it; the other stages are a few
  whole-tensor ops;
* float32 operands are used as they are (no copies); 16-bit operands are upcast per touched
  expert, so that GEMM1's activation sees the float32 result (one rounding, as the contract);
* the routing maps of CPU tensors are built in Python lists (a few slots) or NumPy, whose
  calls cost less than torch ops at these sizes; torch ops elsewhere.

On CUDA tensors it runs too (the "runs anywhere" path: torch ops, one matmul per expert). The
routing maps, expand, finalize and its backward read nothing there; the GEMMs and the MoE
forward / backward read the offsets (``_Segments``), which synchronises: this backend is not
capture-safe and must not run under CUDA-graph capture (the ops' fake implementations keep
``torch.compile`` tracing it; the Triton path is the one for graphs).

Activations are the oracles' own (:func:`moe_route.reference.activation_reference` and its
backward), reached through :func:`_activation` only, the one place this backend interprets
``activation`` / ``gate_up_layout``.

The functions take the routing tables as the ops pass them: ``src_to_dest``
(``expanded_source_row_to_expanded_dest_row``), ``dest_to_src``, ``expert_for_src`` and
``offsets`` (``expert_first_token_offset``), see :class:`moe_route.RoutingMaps`.

The package, one module per stage as :mod:`moe_route.kernels.triton`: ``common`` (the dtype
helpers, the expert segments and their GEMMs), ``routing_maps``, ``rank_maps``, ``expand``,
``finalize``, ``grouped_gemm``, ``moe`` (the forward / backward chain and the quantised
experts' forward). The callers read every function through this package.
"""

from .expand import _expand_rows_masked, expand_rows_torch
from .finalize import finalize_backward_torch, finalize_torch
from .grouped_gemm import grouped_gemm_backward_torch, grouped_gemm_torch
from .moe import moe_backward_torch, moe_forward_quant_torch, moe_forward_torch
from .rank_maps import rank_maps_torch
from .routing_maps import (
    _routing_maps_numpy,
    _routing_maps_python,
    _routing_maps_sorted,
    routing_maps_torch,
)

__all__ = [
    "_expand_rows_masked",
    "_routing_maps_numpy",
    "_routing_maps_python",
    "_routing_maps_sorted",
    "expand_rows_torch",
    "finalize_backward_torch",
    "finalize_torch",
    "grouped_gemm_backward_torch",
    "grouped_gemm_torch",
    "moe_backward_torch",
    "moe_forward_quant_torch",
    "moe_forward_torch",
    "rank_maps_torch",
    "routing_maps_torch",
]
