"""The pure-PyTorch backend (``backend="torch"``, the CPU default): one function per stage.

Same semantics and data contract as the oracles of :mod:`moe_route.reference` (float32
accumulation, float64 for float64 inputs, one rounding, dropped rows zero, finalize in
ascending ``k``). It may read ``expert_first_token_offset`` on the host (free on the CPU; on a
GPU it synchronises, so it is no path for CUDA-graph capture).
"""

from __future__ import annotations

import torch

from .. import reference as R


def routing_maps_torch(topk_ids: torch.Tensor, num_experts: int):
    return R.routing_maps_reference(topk_ids, num_experts)


def expand_rows_torch(x, dest_to_src, offsets):
    return R.expand_rows_reference(x, dest_to_src, offsets)


def finalize_torch(y_perm, topk_weights, src_to_dest, expert_for_src, bias):
    return R.finalize_moe_routing_reference(y_perm, topk_weights, src_to_dest, expert_for_src, bias)


def finalize_backward_torch(dout, y_perm, topk_weights, src_to_dest, expert_for_src):
    return R.finalize_moe_routing_backward_reference(
        dout, y_perm, topk_weights, src_to_dest, expert_for_src
    )


def grouped_gemm_torch(a, w, offsets, bias, activation, gate_up_layout, dest_to_src=None):
    rows = R.expand_rows_reference(a, dest_to_src, offsets) if dest_to_src is not None else a
    return R.grouped_gemm_reference(
        rows, w, offsets, bias, activation=activation, gate_up_layout=gate_up_layout
    )


def grouped_gemm_backward_torch(
    dout, a, w, offsets, bias, activation, gate_up_layout, src_to_dest, dest_to_src,
    expert_for_src, gather,
):  # fmt: skip
    """``(da, dw, db)``; with ``gather`` the ``K`` copies of each token summed in ``k`` order."""
    rows = R.expand_rows_reference(a, dest_to_src, offsets) if gather else a
    da, dw, db = R.grouped_gemm_backward_reference(
        dout, rows, w, offsets, bias, activation=activation, gate_up_layout=gate_up_layout
    )
    if gather:
        T = a.shape[0]
        unit = torch.ones(T, src_to_dest.numel() // max(T, 1), dtype=da.dtype, device=a.device)
        da = R.finalize_moe_routing_reference(da, unit, src_to_dest, expert_for_src)
    return da, dw, db


def moe_forward_torch(
    x, w1, w2, topk_weights, b1, b2, bias, src_to_dest, dest_to_src, expert_for_src, offsets,
    activation, gate_up_layout,
):  # fmt: skip
    """``(out [T, H], z [T*K, N1])``: the whole expert computation and GEMM1's pre-activation."""
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    x_perm = R.expand_rows_reference(x.to(cdt), dest_to_src, offsets)
    z = R.grouped_gemm_reference(x_perm, w1, offsets, b1).to(x.dtype)
    h = R.activation_reference(z.to(cdt), activation, gate_up_layout)
    y = R.grouped_gemm_reference(h, w2, offsets, b2)
    out = R.finalize_moe_routing_reference(y, topk_weights, src_to_dest, expert_for_src, bias)
    return out.to(x.dtype), z


def moe_backward_torch(
    dout, x, w1, w2, topk_weights, b2, z, src_to_dest, dest_to_src, expert_for_src, offsets,
    activation, gate_up_layout,
):  # fmt: skip
    """``(dx, dw1, dw2, d_topk_weights, db1, db2)`` of :func:`moe_forward_torch`."""
    maps = (src_to_dest, dest_to_src, expert_for_src, offsets)
    return R.moe_backward_reference(
        dout, x, w1, w2, topk_weights, z, maps, activation=activation,
        gate_up_layout=gate_up_layout, b2=b2,
    )  # fmt: skip
