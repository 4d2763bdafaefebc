"""fused_moe(): the whole MoE token path in one call."""

from __future__ import annotations

import torch

from . import _checks
from .arch import backend_for, finalize_path_for
from .finalize import finalize_moe_routing
from .grouped_gemm import GEMM_DTYPES, check_gemm_args, grouped_gemm
from .maps import build_routing_maps
from .reference import finalize_moe_routing_reference, grouped_gemm_reference


@torch.library.custom_op("moe_route::gemm2_fused_finalize", mutates_args=())
def _gemm2_fused_finalize_op(
    h: torch.Tensor,
    w2: torch.Tensor,
    offsets: torch.Tensor,
    src_to_dest: torch.Tensor,
    dest_to_src: torch.Tensor,
    expert_for_src: torch.Tensor,
    topk_weights: torch.Tensor,
    b2: torch.Tensor | None,
    bias: torch.Tensor | None,
    allow_tf32: bool,
    backend: str,
) -> torch.Tensor:
    T, H = topk_weights.shape[0], w2.shape[1]
    if backend_for(h.device, backend).value == "reference":
        y = grouped_gemm_reference(h, w2, offsets, b2)
        return finalize_moe_routing_reference(y, topk_weights, src_to_dest, expert_for_src, bias)
    from .kernels.triton.grouped_gemm import grouped_gemm_triton

    acc = torch.zeros(T, H, dtype=torch.float32, device=h.device)
    if bias is not None:
        acc += bias.float()
    grouped_gemm_triton(
        h, w2, offsets, acc, bias=b2, dest_to_src=dest_to_src, finalize_weights=topk_weights,
        allow_tf32=allow_tf32,
    )  # fmt: skip
    return acc.to(h.dtype)


@_gemm2_fused_finalize_op.register_fake
def _(h, w2, offsets, src_to_dest, dest_to_src, expert_for_src, topk_weights, b2, bias, *_):
    return h.new_empty(topk_weights.shape[0], w2.shape[1])


def fused_moe(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "swiglu",
    gate_up_layout: str = "concat",
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    finalize: str = "auto",
    deterministic: bool = True,
    gather: bool | None = None,
    allow_tf32: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """The MoE layer's expert computation: maps → GEMM1 + activation → GEMM2 → finalize.

    Args:
        x: ``[T, H]`` bf16 / fp16 / fp32 tokens.
        w1: ``[E, 2I, H]`` (gated) or ``[E, I, H]``, any strided view; w2: ``[E, H, I]``.
        topk_weights: ``[T, K]`` router weights; topk_ids: ``[T, K]`` expert ids (``-1``
            drops a slot).
        activation, gate_up_layout: as :func:`moe_route.grouped_gemm`.
        b1: ``[E, 2I or I]``; b2: ``[E, H]`` (scaled by the router weight, as part of the expert).
        bias: ``[H]`` or ``[T, H]`` added once per token (e.g. the residual).
        finalize: ``"auto"``, ``"fused"`` (GEMM2's epilogue reduces into the output) or
            ``"standalone"``; see :func:`moe_route.arch.finalize_path_for`.
        deterministic: same bits on every run (the default). ``False`` allows the fused
            finalize's float atomics.
        gather: read GEMM1's rows straight from ``x`` through the maps (no ``x_perm``), or
            expand first so that GEMM1 loads its rows with TMA. ``None`` picks by shape: a
            separate expand pays off only when each row carries much work (large ``I``).

    Returns:
        ``[T, H]`` in ``x.dtype``.
    """
    E, n_inter = check_gemm_args("x", x, "w1", w1, "b1", b1, activation, gate_up_layout)
    T, H = x.shape
    _checks.check_tensor("w2", w2, ndim=3, dtypes=(x.dtype,))
    if tuple(w2.shape) != (E, H, n_inter):
        raise ValueError(
            f"w2 must be [E, H, I] = [{E}, {H}, {n_inter}] to follow w1 {list(w1.shape)} with "
            f"activation {activation!r}, got {_checks.describe(w2)}"
        )
    if b2 is not None:
        _checks.check_tensor("b2", b2, ndim=2, dtypes=GEMM_DTYPES)
        if tuple(b2.shape) != (E, H):
            raise ValueError(f"b2 must be [E, H] = [{E}, {H}], got {_checks.describe(b2)}")
    if bias is not None:
        _checks.check_tensor("bias", bias, dtypes=_checks.FLOAT_DTYPES)
        if tuple(bias.shape) not in ((H,), (T, H)):
            raise ValueError(
                f"bias must be [H] = [{H}] or [T, H] = [{T}, {H}], got {_checks.describe(bias)}"
            )
    _checks.check_tensor("topk_weights", topk_weights, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    _checks.check_tensor("topk_ids", topk_ids, ndim=2)
    if topk_weights.shape[0] != T or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"topk_weights {_checks.describe(topk_weights)} must match topk_ids "
            f"{_checks.describe(topk_ids)} and have T = {T} rows like x"
        )
    _checks.check_same_device(
        x=x, w1=w1, w2=w2, b2=b2, bias=bias, topk_weights=topk_weights, topk_ids=topk_ids
    )
    path = finalize_path_for(x.device, finalize, deterministic).value

    maps = build_routing_maps(topk_ids, E, backend=backend)
    if gather is None:
        # NOTE: H200, bf16: the TMA-fed GEMM1 over x_perm beat the gathering GEMM1 by 6% at
        # mixtral (I=14336), more than the expand costs; at qwen3 (I=768) and deepseek-v3
        # (I=2048) the expand cost more than it saved (bench/bench_moe.py --sweep).
        gather = n_inter < 4096
    if gather:
        h = grouped_gemm(
            x, w1, maps, bias=b1, activation=activation, gate_up_layout=gate_up_layout,
            gather=True, allow_tf32=allow_tf32, backend=backend,
        )  # fmt: skip
    else:
        from .permute import expand_rows

        h = grouped_gemm(
            expand_rows(x, maps, backend=backend), w1, maps, bias=b1, activation=activation,
            gate_up_layout=gate_up_layout, allow_tf32=allow_tf32, backend=backend,
        )  # fmt: skip
    if bias is not None and tuple(bias.shape) not in ((H,), (T, H)):
        raise ValueError(
            f"bias must be [H] = [{H}] or [T, H] = [{T}, {H}], got {_checks.describe(bias)}"
        )
    if path == "fused":
        return _gemm2_fused_finalize_op(
            h, w2, maps.expert_first_token_offset,
            maps.expanded_source_row_to_expanded_dest_row,
            maps.expanded_dest_row_to_expanded_source_row, maps.expert_for_source_row,
            topk_weights, b2, bias, allow_tf32, backend,
        )  # fmt: skip
    y = grouped_gemm(h, w2, maps, bias=b2, allow_tf32=allow_tf32, backend=backend)
    return finalize_moe_routing(y, topk_weights, maps, bias, backend=backend)
