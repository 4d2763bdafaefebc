"""fused_moe(): the whole MoE token path in one call, and its autograd wiring.

One validation and one plan per call: :func:`fused_moe` checks its arguments, looks up the
:class:`MoEPlan` cached on everything that decides it (device, dtypes, shapes and strides of
the weights, flags, environment overrides, the token bucket), builds the routing maps and runs
the plan's launch sequence — :mod:`moe_route.kernels.triton.moe` on the Triton backend,
:mod:`moe_route.kernels.torch_impl` on the torch backend. When a gradient is wanted, the same
forward also returns GEMM1's pre-activation ``z``, and the registered backward needs only
``x``, ``z``, the weights and the routing (see :mod:`moe_route.kernels.triton.moe`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from . import _checks, arch, tuning
from ._dispatch import (
    CallMemo,
    Op,
    bias_key,
    clear_memos,
    memo_env,
    memo_wanted,
    needs_dispatcher,
    rows_key,
    tensor_key,
)
from .activations import Activation, as_activation
from .grouped_gemm import (
    bias_dtypes,
    check_gemm_args,
    check_interpreter_dtype,
    epilogue_for,
    gemm_configs,
)
from .kernels import torch_impl
from .kernels.triton.decode import MAX_SLOTS, DecodeConfig, DecodeLaunch, moe_decode_triton
from .kernels.triton.grouped_gemm import MAX_EXPERTS
from .kernels.triton.moe import (
    MoEConfigs,
    QuantConfigs,
    moe_backward_triton,
    moe_forward_quant_triton,
    moe_forward_triton,
)
from .maps import MapsCall, check_kernel_limits, maps_backend
from .quant import QuantSpec, as_quant, check_weight, dequantize_experts
from .reference import GATE_UP_LAYOUTS
from .tuning import token_bucket, warmup_buckets


@dataclass(frozen=True)
class MoEPlan:
    """Everything decided once for a ``fused_moe`` call shape (cached; see the module doc)."""

    #: ``"triton"`` or ``"torch"`` (``"cupy"`` runs the GEMMs on Triton).
    backend: str
    #: who builds the routing maps (``"cupy"`` where those kernels measured faster).
    maps_backend: str
    #: launch configurations (Triton), or None.
    configs: object
    #: the finalize path: ``"standalone"``, ``"fused"`` or ``"fused_atomic"``.
    path: str
    #: GEMM1 reads its rows from ``x`` through the maps (no expand).
    gather: bool
    #: the decode path's tiles where eager calls that want no gradient take it
    #: (:mod:`moe_route.kernels.triton.decode`, :func:`moe_route.tuning.decode_config`), else
    #: None.
    decode: DecodeConfig | None = None


@functools.cache
def _plan(device, dtype, w1_shape, w2_shape, E, K, bucket, activation, layout, path, gather,
          allow_tf32, backend, env):  # fmt: skip
    chosen = arch.backend_for(device, backend).value
    maps_chosen = maps_backend(device, backend, bucket, K, E)
    check_kernel_limits(maps_chosen, E, K, device)
    if chosen == "torch":
        return MoEPlan("torch", maps_chosen, None, path, gather)
    epi = epilogue_for(activation, layout)
    M = bucket * K
    first = gemm_configs(device, dtype, E, M, epi.gated, w2_shape[2], w1_shape[2], env)
    second = gemm_configs(device, dtype, E, M, False, w2_shape[1], w2_shape[2], env)
    cfg = MoEConfigs(
        gemm1=first.forward, gemm1_z=first.forward_z, gemm2=second.forward,
        act_bwd=first.act_backward, dx=first.dx, wgrad2=second.weight_grad,
        wgrad1=first.weight_grad, epilogue=epi, finalize=path, gather=gather,
        allow_tf32=allow_tf32,
    )  # fmt: skip
    expert_bytes = (math.prod(w1_shape[1:]) + math.prod(w2_shape[1:])) * dtype.itemsize
    decode = tuning.decode_config(bucket, K, E, expert_bytes, dtype)
    return MoEPlan("triton", maps_chosen, cfg, path, gather, decode)


def _plan_for(x, w1, w2, K, activation, layout, path, gather, allow_tf32, backend):
    return _plan(
        x.device, x.dtype, tuple(w1.shape), tuple(w2.shape), w1.shape[0], K,
        token_bucket(x.shape[0]), activation, layout, path, gather, allow_tf32, backend,
        arch.env_key(),
    )  # fmt: skip


# --------------------------------------------------------------------------- op
def moe_tables(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    b1: torch.Tensor | None,
    b2: torch.Tensor | None,
    bias: torch.Tensor | None,
    src_to_dest: torch.Tensor,
    dest_to_src: torch.Tensor,
    expert_for_src: torch.Tensor,
    offsets: torch.Tensor,
    activation: str,
    gate_up_layout: str,
    path: str,
    gather: bool,
    allow_tf32: bool,
    backend: str,
    store_z: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H], z)`` on a resolved ``backend``; ``z`` (GEMM1's pre-activation, for the
    backward) is empty unless ``store_z``."""
    maps = (src_to_dest, dest_to_src, expert_for_src, offsets)
    if backend == "torch":
        out, z = torch_impl.moe_forward_torch(
            x, w1, w2, topk_weights, b1, b2, bias, *maps, activation, gate_up_layout,
            keep_z=store_z,
        )  # fmt: skip
        return out, z if store_z else x.new_empty(0)
    plan = _plan_for(x, w1, w2, topk_weights.shape[1], activation, gate_up_layout, path, gather,
                     allow_tf32, backend)  # fmt: skip
    return moe_forward_triton(x, w1, w2, topk_weights, b1, b2, bias, maps, plan.configs, store_z)


def _moe_fake(x, w1, w2, topk_weights, b1, b2, bias, s2d, dest_to_src, *rest):
    store_z = rest[-1]
    z = x.new_empty(dest_to_src.numel(), w1.shape[1]) if store_z else x.new_empty(0)
    return x.new_empty(x.shape), z


def _moe_backward_impl(
    dout: torch.Tensor,
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    b1: torch.Tensor | None,
    b2: torch.Tensor | None,
    z: torch.Tensor,
    src_to_dest: torch.Tensor,
    dest_to_src: torch.Tensor,
    expert_for_src: torch.Tensor,
    offsets: torch.Tensor,
    activation: str,
    gate_up_layout: str,
    need_dx: bool,
    need_dw1: bool,
    need_dw2: bool,
    need_dtopk: bool,
    consume_z: bool,
    allow_tf32: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dw1, dw2, d_topk_weights, db1, db2)``; the ones not asked for are empty.

    ``need_dw1`` / ``need_dw2`` also cover ``db1`` / ``db2`` when those biases exist.
    ``consume_z``: the Triton backend writes GEMM1's pre-activation gradient over ``z``
    instead of into a new ``[T*K, 2I]`` buffer (the backward's largest) and bumps ``z``'s
    version, so that any later use of the saved ``z`` raises. Only the eager autograd route
    passes it, and only when the graph is not kept for another backward (the op's schema
    declares no mutation: traced graphs always pass ``False``).
    """
    maps = (src_to_dest, dest_to_src, expert_for_src, offsets)
    wanted = (need_dx, need_dw1, need_dw2, need_dtopk)
    if backend == "torch":
        grads = torch_impl.moe_backward_torch(
            dout, x, w1, w2, topk_weights, b2, z, *maps, activation, gate_up_layout,
            need_dx=need_dx, need_dw1=need_dw1, need_dw2=need_dw2, need_dtopk=need_dtopk,
        )  # fmt: skip
    else:
        plan = _plan_for(x, w1, w2, topk_weights.shape[1], activation, gate_up_layout,
                         "standalone", True, allow_tf32, backend)  # fmt: skip
        grads = _triton_backward(dout, x, w1, w2, topk_weights, b1, b2, z, maps, plan.configs,
                                 wanted, consume_z, {})  # fmt: skip
    wanted += (b1 is not None and need_dw1, b2 is not None and need_dw2)
    # Outputs may not alias each other: each gradient not asked for is its own empty tensor.
    return tuple(g if w else x.new_empty(0) for g, w in zip(grads, wanted, strict=True))


def _triton_backward(dout, x, w1, w2, topk_weights, b1, b2, z, maps, cfg: MoEConfigs, need,
                     consume_z: bool, launches: dict) -> list:  # fmt: skip
    """The Triton backward of both routes (the op's, :class:`_Experts`'): the launch sequence
    (``launches``: see :func:`moe_route.kernels.triton.moe.prepared`), ``z`` consumed and its
    version bumped where ``consume_z``, the bias gradients in the biases' dtypes."""
    grads = list(moe_backward_triton(dout, x, w1, w2, topk_weights, b1, b2, z, maps, cfg, *need,
                                     dz_out=z if consume_z else None,
                                     launches=launches))  # fmt: skip
    if consume_z:
        torch.autograd.graph.increment_version(z)
    for i, bias_in in ((4, b1), (5, b2)):
        if bias_in is not None and grads[i] is not None:
            grads[i] = grads[i].to(bias_in.dtype)
    return grads


def _moe_backward_fake(dout, x, w1, w2, topk_weights, b1, b2, z, s2d, d2s, efs, o, act, lay,
                       ndx, nw1, nw2, ntk, *_):  # fmt: skip
    like = (x, w1, w2, topk_weights, b1, b2)
    wanted = (ndx, nw1, nw2, ntk, b1 is not None and nw1, b2 is not None and nw2)
    return tuple(
        torch.empty_like(t) if w else x.new_empty(0) for t, w in zip(like, wanted, strict=True)
    )


_MOE_BACKWARD = Op("moe_experts_backward", _moe_backward_impl, _moe_backward_fake)


def _setup_context(ctx, inputs, output):
    (
        x,
        w1,
        w2,
        topk_weights,
        b1,
        b2,
        bias,
        s2d,
        d2s,
        efs,
        offsets,
        act,
        layout,
        _,
        _,
        tf32,
        be,
        _,
    ) = inputs
    _save(ctx, (x, w1, w2, topk_weights, b1, b2, output[1], s2d, d2s, efs, offsets), bias,
          (act, layout, tf32, be))  # fmt: skip
    ctx.mark_non_differentiable(output[1])


def _save(ctx, saved: tuple, bias, config: tuple) -> None:
    """What both routes' backward reads (the op's, :class:`_Experts`'): ``saved`` is
    ``(x, w1, w2, topk_weights, b1, b2, z, *tables)``, ``config`` the op's
    ``(activation, layout, allow_tf32, backend)``."""
    ctx.save_for_backward(*saved)
    ctx.config = config
    ctx.bias_meta = None if bias is None else (bias.dim(), bias.dtype)
    # z has no gradient: without this, autograd would hand the backward a zero-filled
    # [T*K, 2I] tensor for it (448 MiB at Mixtral's T=4096), allocated and written for nothing.
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, _dz=None):
    """The op's backward, and :class:`_Experts`' (whose first seven inputs are the op's)."""
    if dout is None:  # the output took no part in what is differentiated
        return (None,) * 18
    x, w1, w2, topk_weights, b1, b2, z, s2d, d2s, efs, offsets = ctx.saved_tensors
    act, layout, tf32, be = ctx.config
    need = ctx.needs_input_grad
    wanted = (need[0], need[1] or need[4], need[2] or need[5], need[3])
    consume = _may_consume(ctx, z, dout)
    experts = getattr(ctx, "experts", None)
    if experts is not None and not (torch.compiler.is_compiling() or needs_dispatcher((dout,))):
        dx, dw1, dw2, dtopk, db1, db2 = _triton_backward(
            dout, x, w1, w2, topk_weights, b1, b2, z, (s2d, d2s, efs, offsets),
            experts.plan.configs, wanted, consume, experts.backward_launches(dout),
        )  # fmt: skip
    else:
        dx, dw1, dw2, dtopk, db1, db2 = _MOE_BACKWARD(
            dout, x, w1, w2, topk_weights, b1, b2, z, s2d, d2s, efs, offsets, act, layout,
            *wanted, consume, tf32, be,
        )  # fmt: skip
    dbias = None
    if need[6]:
        ndim, dtype = ctx.bias_meta
        acc = torch.float64 if dout.dtype == torch.float64 else torch.float32
        dbias = (dout if ndim == 2 else dout.sum(0, dtype=acc)).to(dtype)
    grads = (dx, dw1, dw2, dtopk, db1, db2)
    return (
        tuple(g if n else None for g, n in zip(grads, need[:6], strict=True))
        + (dbias,)
        + (None,) * 11
    )


def _may_consume(ctx, z: torch.Tensor, dout: torch.Tensor) -> bool:
    """Whether this backward may overwrite the saved ``z`` (see ``consume_z``): a forward
    called by moe_route itself (whose caller dropped ``z``; a user of ``torch.ops`` holds it),
    eager, on real tensors, and the last backward through this graph (``retain_graph`` keeps
    ``z``)."""
    if not getattr(ctx, "internal_call", False):
        return False
    if torch.compiler.is_compiling() or needs_dispatcher((z, dout)):
        return False
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return keep_graph is not None and not keep_graph()


MOE = Op("moe_experts", moe_tables, _moe_fake, setup_context=_setup_context, backward=_backward)


def moe_decode_tables(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    b1: torch.Tensor | None,
    b2: torch.Tensor | None,
    bias: torch.Tensor | None,
    activation: str,
    gate_up_layout: str,
    want_counts: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, counts)`` on the decode path (Triton; no maps, no gradient): ``fused_moe``'s
    output, and with ``want_counts`` the routed slots per expert (``[E] int64``, else empty),
    which :class:`moe_route.MoELayer` returns as ``tokens_per_expert``. The op's
    implementation; eager calls on plain tensors run their prepared
    :class:`~moe_route.kernels.triton.decode.DecodeLaunch` without it."""
    E, K = w1.shape[0], topk_ids.shape[1]
    if want_counts and x.shape[0] * K > MAX_SLOTS:
        raise ValueError(
            f"moe_decode counts at most {MAX_SLOTS} slots per call, got T*K = "
            f"{x.shape[0]}*{K}: take the sorted path (fused_moe) at this size"
        )
    cfg = tuning.decode_tiles(x.dtype)
    counts = topk_ids.new_empty(E if want_counts else 0, dtype=torch.int64)
    out = moe_decode_triton(x, w1, w2, topk_weights, topk_ids, b1, b2, bias,
                            epilogue_for(activation, gate_up_layout), cfg,
                            counts if want_counts else None)  # fmt: skip
    return out, counts


def _decode_fake(x, w1, w2, topk_weights, topk_ids, *rest):
    want_counts = rest[-1]
    return x.new_empty(x.shape), topk_ids.new_empty(w1.shape[0] if want_counts else 0,
                                                    dtype=torch.int64)  # fmt: skip


DECODE = Op("moe_decode", moe_decode_tables, _decode_fake)


# --------------------------------------------------------------------------- quantised experts
@functools.cache
def _quant_plan(device, dtype, w1_shape, w2_shape, E, K, bucket, activation, layout,
                spec: QuantSpec, backend, env):  # fmt: skip
    """The plan of a call on quantised experts: the standalone finalize, GEMM1 gathering."""
    chosen = arch.backend_for(device, backend).value
    maps_chosen = maps_backend(device, backend, bucket, K, E)
    check_kernel_limits(maps_chosen, E, K, device)
    if chosen == "torch":
        return MoEPlan("torch", maps_chosen, None, "standalone", True)
    epi = epilogue_for(activation, layout)
    cc = arch.compute_capability(device)
    rows = bucket * K / E
    mx = spec.format == "mxfp4"
    cfg = QuantConfigs(
        gemm1=tuning.quant_gemm_config(rows, epi.gated, mx, cc),
        gemm2=tuning.quant_gemm_config(rows, False, mx, cc), epilogue=epi, fp8=spec.fp8,
        x_group=max(spec.act_group, 0), ue8m0=spec.ue8m0,
        w_block_rows=spec.block[0] if spec.format == "fp8_block" else 1,
    )  # fmt: skip
    return MoEPlan("triton", maps_chosen, cfg, "standalone", True)


def _quant_plan_for(x, w1, w2, K, activation, layout, spec: QuantSpec, backend) -> MoEPlan:
    return _quant_plan(x.device, x.dtype, tuple(w1.shape), tuple(w2.shape), w1.shape[0], K,
                       token_bucket(x.shape[0]), activation, layout, spec, backend,
                       arch.env_key())  # fmt: skip


def moe_quant_tables(
    x: torch.Tensor,
    w1: torch.Tensor,
    w1_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    b1: torch.Tensor | None,
    b2: torch.Tensor | None,
    bias: torch.Tensor | None,
    src_to_dest: torch.Tensor,
    dest_to_src: torch.Tensor,
    expert_for_src: torch.Tensor,
    offsets: torch.Tensor,
    activation: str,
    gate_up_layout: str,
    quant: str,
    backend: str,
) -> torch.Tensor:
    """``out [T, H]`` of the experts on quantised weights (``quant``: the spec's name) on a
    resolved ``backend``."""
    spec = as_quant(quant)
    maps = (src_to_dest, dest_to_src, expert_for_src, offsets)
    if backend == "torch":
        return torch_impl.moe_forward_quant_torch(
            x, w1, w1_scale, w2, w2_scale, topk_weights, b1, b2, bias, *maps, activation,
            gate_up_layout, spec,
        )  # fmt: skip
    plan = _quant_plan_for(x, w1, w2, topk_weights.shape[1], activation, gate_up_layout, spec,
                           backend)  # fmt: skip
    return moe_forward_quant_triton(x, w1, w1_scale, w2, w2_scale, topk_weights, b1, b2, bias,
                                    maps, plan.configs)  # fmt: skip


def _moe_quant_fake(x, *_):
    return x.new_empty(x.shape)


def _quant_setup_context(ctx, inputs, output):
    x, w1, w1s, w2, w2s, tw, b1, b2, bias, s2d, d2s, efs, offsets, act, layout, quant, be = inputs
    ctx.save_for_backward(x, w1, w1s, w2, w2s, tw, b1, b2, s2d, d2s, efs, offsets)
    ctx.config = (act, layout, quant, be)
    ctx.bias_meta = None if bias is None else (bias.dim(), bias.dtype)


def _quant_backward(ctx, dout):
    """Gradients of ``x``, the router weights and the biases on frozen quantised experts:
    bf16 (the activations' dtype) products on the weights dequantised for this backward, at
    the unquantised ``x`` (the quantisers pass gradients straight through), by the 16-bit
    backward's launch sequence (which recomputes GEMM1's pre-activation first). FP8 products
    would need ``dout`` quantised too: that is FP8 training, not adapters on an FP8 base."""
    x, w1, w1s, w2, w2s, tw, b1, b2, s2d, d2s, efs, offsets = ctx.saved_tensors
    act, layout, quant, be = ctx.config
    need = ctx.needs_input_grad
    spec = as_quant(quant)
    n1 = w1.shape[1]
    w1d = dequantize_experts(w1, w1s, spec, x.shape[1]).to(x.dtype)
    w2d = dequantize_experts(w2, w2s, spec, n1 // 2 if as_activation(act).gated else n1)
    w2d = w2d.to(x.dtype)
    maps = (s2d, d2s, efs, offsets)
    _, z = MOE(x, w1d, w2d, tw, b1, b2, None, *maps, act, layout, "standalone", True, False, be,
               True)  # fmt: skip
    dx, _, _, dtw, db1, db2 = _MOE_BACKWARD(
        dout, x, w1d, w2d, tw, b1, b2, z, *maps, act, layout, need[0], need[6], need[7],
        need[5], False, False, be,
    )  # fmt: skip
    dbias = None
    if need[8]:
        ndim, dtype = ctx.bias_meta
        acc = torch.float64 if dout.dtype == torch.float64 else torch.float32
        dbias = (dout if ndim == 2 else dout.sum(0, dtype=acc)).to(dtype)
    grads = (dx, None, None, None, None, dtw, db1, db2)
    return (
        tuple(
            g if n and g is not None and g.numel() else None
            for g, n in zip(grads, need[:8], strict=True)
        )
        + (dbias,)
        + (None,) * 8
    )


QMOE = Op("moe_experts_quant", moe_quant_tables, _moe_quant_fake,
          setup_context=_quant_setup_context, backward=_quant_backward)  # fmt: skip


def run_quant_experts(plan: MoEPlan, x, w1, w1_scale, w2, w2_scale, topk_weights, maps,
                      activation: str, gate_up_layout: str, quant: str, b1=None, b2=None,
                      bias=None) -> torch.Tensor:  # fmt: skip
    """The experts on quantised weights, on checked inputs and built maps, through the op."""
    return QMOE(x, w1, w1_scale, w2, w2_scale, topk_weights, b1, b2, bias, *maps.tensors(),
                activation, gate_up_layout, quant, plan.backend)  # fmt: skip


class PreparedQuantExperts:
    """:func:`run_quant_experts` for one call signature in eager inference on the Triton
    backend and plain tensors: the launch sequence's prepared launches kept (as
    :class:`PreparedExperts` keeps the 16-bit ones). Calls that want a gradient go through
    the op. Keeps no tensor."""

    __slots__ = ("activation", "forward", "layout", "plan", "quant")

    def __init__(self, plan: MoEPlan, activation: str, gate_up_layout: str, quant: str):
        self.plan, self.activation, self.layout, self.quant = (
            plan,
            activation,
            gate_up_layout,
            quant,
        )
        self.forward: dict = {}

    def __call__(self, x, w1, w1_scale, w2, w2_scale, topk_weights, maps, b1=None, b2=None,
                 bias=None):  # fmt: skip
        if _wants_grad(x, topk_weights, b1, b2, bias):
            return run_quant_experts(self.plan, x, w1, w1_scale, w2, w2_scale, topk_weights,
                                     maps, self.activation, self.layout, self.quant, b1, b2,
                                     bias)  # fmt: skip
        return moe_forward_quant_triton(x, w1, w1_scale, w2, w2_scale, topk_weights, b1, b2,
                                        bias, maps.tensors(), self.plan.configs,
                                        self.forward)  # fmt: skip


def _check_quant_args(x, w1, w1_scale, w2, w2_scale, b1, b2, spec: QuantSpec, activation,
                      gate_up_layout: str) -> tuple[int, int]:  # fmt: skip
    """Validate ``fused_moe``'s experts on quantised weights; ``(E, I)``."""
    _checks.check_tensor("x", x, ndim=2, dtypes=(torch.bfloat16, torch.float16, torch.float32))
    act = as_activation(activation)
    if gate_up_layout not in GATE_UP_LAYOUTS:
        raise ValueError(f"gate_up_layout={gate_up_layout!r}: expected one of {GATE_UP_LAYOUTS}")
    _checks.check_tensor("w1", w1, ndim=3)
    _checks.check_tensor("w2", w2, ndim=3)
    H = x.shape[1]
    E, n1 = w1.shape[0], w1.shape[1]
    if act.gated and n1 % 2:
        raise ValueError(f"w1 for gated activation {str(act)!r} must have an even N = 2*I, got "
                         f"{_checks.describe(w1)}")  # fmt: skip
    n_inter = n1 // 2 if act.gated else n1
    check_weight("w1", w1, "w1_scale", w1_scale, spec, (E, n1, H))
    check_weight("w2", w2, "w2_scale", w2_scale, spec, (E, H, n_inter))
    for name, b, n in (("b1", b1, n1), ("b2", b2, H)):
        if b is not None:
            _checks.check_tensor(name, b, ndim=2, dtypes=(x.dtype, torch.float32))
            if tuple(b.shape) != (E, n):
                raise ValueError(f"{name} must be [E, N] = [{E}, {n}], got {_checks.describe(b)}")
    if E > MAX_EXPERTS:
        raise ValueError(f"w1 has E = {E} experts; the grouped GEMM takes at most {MAX_EXPERTS}")
    _checks.check_same_device(x=x, w1=w1, w1_scale=w1_scale, w2=w2, w2_scale=w2_scale, b1=b1,
                              b2=b2)  # fmt: skip
    return E, n_inter


# --------------------------------------------------------------------------- public API
def fused_moe(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str | Activation = "swiglu",
    gate_up_layout: str = "concat",
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    finalize: str = "auto",
    deterministic: bool = True,
    gather: bool | None = None,
    allow_tf32: bool = False,
    backend: str = "auto",
    quant: str | QuantSpec | None = None,
    w1_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MoE layer's expert computation: maps → GEMM1 + activation → GEMM2 → finalize.

    Args:
        x: ``[T, H]`` bf16 / fp16 / fp32 (/ fp64) tokens.
        w1: ``[E, 2I, H]`` (gated) or ``[E, I, H]``, any strided view; w2: ``[E, H, I]``.
        topk_weights: ``[T, K]`` router weights; topk_ids: ``[T, K]`` expert ids (``-1``
            drops a slot).
        activation, gate_up_layout: as :func:`moe_route.grouped_gemm` (a name, a name with
            parameters, or a :class:`moe_route.Activation`).
        b1: ``[E, 2I or I]``; b2: ``[E, H]`` (scaled by the router weight, as part of the expert).
        bias: ``[H]`` or ``[T, H]`` added once per token (e.g. the residual).
        finalize: ``"auto"``, ``"fused"`` (GEMM2's epilogue reduces into the output, no
            separate finalize launch) or ``"standalone"``; see
            :func:`moe_route.arch.finalize_path_for`.
        deterministic: same bits on every run (the default; both finalize paths honour it).
            ``False`` with ``finalize="fused"`` reduces with float atomics instead (in float32,
            float64 for float64 inputs).
        gather: read GEMM1's rows straight from ``x`` through the maps (no ``x_perm``), or
            expand first so that GEMM1 loads its rows with TMA. ``None`` picks by shape: a
            separate expand pays off only when each row carries much work (large ``I``).
        backend: ``"auto"``, ``"triton"``, ``"cupy"`` (its maps, Triton GEMMs) or ``"torch"``.
        quant: quantised experts (:mod:`moe_route.quant`: ``"fp8"``, ``"fp8_ue8m0"``,
            ``"fp8_channel"``, ``"mxfp4"`` or a :class:`moe_route.QuantSpec`): ``w1`` / ``w2``
            hold the codes and ``w1_scale`` / ``w2_scale`` their scales in that layout
            (:func:`moe_route.quantize_experts` makes both). FP8 quantises the tokens per
            call; the finalize is the standalone one. The weights are frozen: gradients reach
            ``x``, the router weights and the biases (bf16 products on the dequantised
            weights).

    Returns:
        ``[T, H]`` in ``x.dtype``.

    Differentiable in ``x``, ``w1``, ``w2``, ``topk_weights``, ``b1``, ``b2`` and ``bias``
    (float64 included, for ``gradcheck``). With grad enabled and any of them requiring grad, the
    forward saves GEMM1's pre-activation ``[T*K, 2I or I]`` and the routing, nothing else; the
    backward is deterministic and skips the gradients nobody asked for.
    """
    key = None
    if memo_wanted():
        key = _call_key(x, w1, w2, topk_weights, topk_ids, b1, b2, bias, activation,
                        gate_up_layout, finalize, deterministic, gather, allow_tf32,
                        backend, quant, tensor_key(w1_scale), tensor_key(w2_scale))  # fmt: skip
        call = _CALLS.get(key)
        if call is not None:
            return call(x, w1, w2, topk_weights, topk_ids, b1, b2, bias, w1_scale, w2_scale)
    _checks.check_bool("deterministic", deterministic)
    _checks.check_bool("gather", gather, optional=True)
    _checks.check_bool("allow_tf32", allow_tf32)
    if quant is not None or w1_scale is not None or w2_scale is not None:
        return _fused_moe_quant(key, x, w1, w2, topk_weights, topk_ids, activation,
                                gate_up_layout, b1, b2, bias, finalize, backend, quant,
                                w1_scale, w2_scale)  # fmt: skip
    spec = as_activation(activation)
    E, n_inter = check_gemm_args("x", x, "w1", w1, "b1", b1, spec, gate_up_layout)
    # The op and the plan carry the spec as its canonical string: a constant for
    # torch.library / torch.compile, and a key of the plan cache with its parameters.
    activation = str(spec)
    T, H = x.shape
    _checks.check_tensor("w2", w2, ndim=3, dtypes=(x.dtype,))
    if tuple(w2.shape) != (E, H, n_inter):
        raise ValueError(
            f"w2 must be [E, H, I] = [{E}, {H}, {n_inter}] to follow w1 {list(w1.shape)} with "
            f"activation {activation!r}, got {_checks.describe(w2)}"
        )
    if b2 is not None:
        _checks.check_tensor("b2", b2, ndim=2, dtypes=bias_dtypes(x.dtype))
        if tuple(b2.shape) != (E, H):
            raise ValueError(f"b2 must be [E, H] = [{E}, {H}], got {_checks.describe(b2)}")
    if bias is not None:
        _checks.check_tensor("bias", bias, dtypes=_checks.FLOAT_DTYPES)
        if tuple(bias.shape) not in ((H,), (T, H)):
            raise ValueError(
                f"bias must be [H] = [{H}] or [T, H] = [{T}, {H}], got {_checks.describe(bias)}"
            )
    _checks.check_tensor("topk_weights", topk_weights, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    ids = _checks.check_topk_ids(topk_ids, E)
    if topk_weights.shape[0] != T or tuple(topk_weights.shape) != tuple(ids.shape):
        raise ValueError(
            f"topk_weights {_checks.describe(topk_weights)} must match topk_ids "
            f"{_checks.describe(ids)} and have T = {T} rows like x"
        )
    _checks.check_same_device(
        x=x, w1=w1, w2=w2, b2=b2, bias=bias, topk_weights=topk_weights, topk_ids=ids
    )
    plan = moe_plan(x, w1, w2, ids.shape[1], activation, gate_up_layout, finalize,
                    deterministic, gather, allow_tf32, backend)  # fmt: skip
    check_interpreter_dtype("x", x, plan.backend)
    call = FusedCall(plan, x, w1, w2, topk_weights, ids, b1, b2, bias, activation,
                     gate_up_layout, allow_tf32, key is not None)  # fmt: skip
    if token_bucket(T) * ids.shape[1] < 2**31:  # the whole bucket fits the maps' int32 rows
        _CALLS.keep(key, call, (x, w1, w2, topk_weights, ids, b1, b2, bias))
    return call(x, w1, w2, topk_weights, ids, b1, b2, bias)


def _fused_moe_quant(key, x, w1, w2, topk_weights, topk_ids, activation, gate_up_layout, b1, b2,
                     bias, finalize, backend, quant, w1_scale, w2_scale):  # fmt: skip
    """:func:`fused_moe` on quantised experts, first call of its signature: checks, plan."""
    spec = as_quant(quant)
    if spec is None:
        raise ValueError("w1_scale / w2_scale are given without quant=: name the weights' format "
                         "(e.g. quant='fp8')")  # fmt: skip
    if finalize not in ("auto", "standalone"):
        raise ValueError(f"finalize={finalize!r}: quantised experts take the standalone finalize "
                         "('auto' or 'standalone')")  # fmt: skip
    E, _ = _check_quant_args(x, w1, w1_scale, w2, w2_scale, b1, b2, spec, activation,
                             gate_up_layout)  # fmt: skip
    activation = str(as_activation(activation))
    T, H = x.shape
    if bias is not None:
        _checks.check_tensor("bias", bias, dtypes=_checks.FLOAT_DTYPES)
        if tuple(bias.shape) not in ((H,), (T, H)):
            raise ValueError(
                f"bias must be [H] = [{H}] or [T, H] = [{T}, {H}], got {_checks.describe(bias)}"
            )
    _checks.check_tensor("topk_weights", topk_weights, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    ids = _checks.check_topk_ids(topk_ids, E)
    if topk_weights.shape[0] != T or tuple(topk_weights.shape) != tuple(ids.shape):
        raise ValueError(
            f"topk_weights {_checks.describe(topk_weights)} must match topk_ids "
            f"{_checks.describe(ids)} and have T = {T} rows like x"
        )
    _checks.check_same_device(x=x, w1=w1, bias=bias, topk_weights=topk_weights, topk_ids=ids)
    plan = _quant_plan_for(x, w1, w2, ids.shape[1], activation, gate_up_layout, spec, backend)
    if plan.backend == "triton":
        if x.dtype == torch.float32 and not spec.fp8:
            raise TypeError(f"x is float32: MXFP4 experts take bf16 / fp16 tokens, got "
                            f"{_checks.describe(x)}")  # fmt: skip
        check_interpreter_dtype("x", x, plan.backend)
    call = FusedCall(plan, x, w1, w2, topk_weights, ids, b1, b2, bias, activation,
                     gate_up_layout, False, key is not None, str(spec))  # fmt: skip
    if token_bucket(T) * ids.shape[1] < 2**31:
        _CALLS.keep(key, call, (x, w1, w2, topk_weights, ids, b1, b2, bias, w1_scale, w2_scale))
    return call(x, w1, w2, topk_weights, ids, b1, b2, bias, w1_scale, w2_scale)


# --------------------------------------------------------------------------- call memo
class FusedCall:
    """What :func:`fused_moe` decided for one call signature (:func:`_call_key`): the plan, the
    path (decode or sorted), the per-call checks left (the ids' values, where those are
    checked), and the decode path's prepared launches. Keeps no tensor. A later call with the
    same signature runs this without checking its arguments again: the signature holds all
    that the checks and decisions read.

    The checks and decisions were half of an eager decode call's host time (docs/decisions.md,
    "Call memos").
    """

    __slots__ = (
        "E",
        "activation",
        "allow_tf32",
        "check_ids",
        "cuda",
        "decode",
        "experts",
        "layout",
        "maps",
        "plan",
        "quant",
    )  # fmt: skip

    def __init__(self, plan: MoEPlan, x, w1, w2, topk_weights, ids, b1, b2, bias,
                 activation: str, gate_up_layout: str, allow_tf32: bool,
                 eager: bool, quant: str | None = None):  # fmt: skip
        self.plan, self.E, self.quant = plan, w1.shape[0], quant
        self.activation, self.layout, self.allow_tf32 = activation, gate_up_layout, allow_tf32
        self.check_ids = _checks.ids_value_check_wanted(ids, None)
        self.cuda = x.is_cuda
        # The decode path, where this signature takes it (an inference call: gradients are part
        # of the signature; eager), prepared; CUDA-graph capture is asked per call.
        self.decode = None
        args = (x, w1, w2, topk_weights, ids, b1, b2, bias)
        if decode_planned(plan, x, w1, w2, topk_weights, b1, b2, bias):
            self.decode = self._through_op
            if not needs_dispatcher(args):
                self.decode = DecodeLaunch(*args, plan.configs.epilogue, plan.decode, False)
        # The sorted path: the maps' and the experts' launches prepared (eager, Triton, plain
        # tensors), else through the ops.
        self.maps = MapsCall(ids, self.E, plan.maps_backend, False, eager)
        self.experts = None
        if eager and plan.backend == "triton" and not needs_dispatcher(args):
            if quant is None:
                self.experts = PreparedExperts(plan, activation, gate_up_layout, allow_tf32)
            else:
                self.experts = PreparedQuantExperts(plan, activation, gate_up_layout, quant)

    def __call__(self, x, w1, w2, topk_weights, ids, b1, b2, bias, w1_scale=None,
                 w2_scale=None) -> torch.Tensor:  # fmt: skip
        if self.check_ids:
            _checks.check_topk_id_values(ids, self.E)
        decode = self.decode  # (None under torch.compile: nothing below traces a capture query)
        if decode is not None and not (self.cuda and torch._C._cuda_isCurrentStreamCapturing()):
            return decode(x, w1, w2, topk_weights, ids, b1, b2, bias)
        maps = self.maps(ids)
        if self.quant is not None:
            if self.experts is not None:
                return self.experts(x, w1, w1_scale, w2, w2_scale, topk_weights, maps, b1, b2,
                                    bias)  # fmt: skip
            return run_quant_experts(self.plan, x, w1, w1_scale, w2, w2_scale, topk_weights,
                                     maps, self.activation, self.layout, self.quant, b1, b2,
                                     bias)  # fmt: skip
        if self.experts is not None:
            return self.experts(x, w1, w2, topk_weights, maps, b1, b2, bias)
        return run_experts(self.plan, x, w1, w2, topk_weights, maps, self.activation,
                           self.layout, b1, b2, bias, self.allow_tf32)  # fmt: skip

    def _through_op(self, x, w1, w2, topk_weights, ids, b1, b2, bias) -> torch.Tensor:
        """The decode path through its custom op: tensors the kernels cannot take as they are
        (fake tensors, subclasses; such a call is not memoised)."""
        return DECODE(x, w1, w2, topk_weights, ids, b1, b2, bias, self.activation, self.layout,
                      False)[0]  # fmt: skip


#: :func:`fused_moe`'s decisions by call signature
_CALLS = CallMemo()


def _call_key(x, w1, w2, topk_weights, topk_ids, b1, b2, bias, *options) -> tuple | None:
    """The signature of a :func:`fused_moe` call: each tensor's type, shape, strides, dtype,
    device and ``requires_grad``, the other arguments, grad mode and the environment overrides
    (None with arguments that are not tensors; the checks then say what is wrong). The token
    count enters as its bucket and whether every per-token tensor has that many rows, so that
    a new ``T`` in a bucket seen before is not checked again either (a decision never depends
    on more than the bucket; :func:`fused_moe` keeps only signatures whose whole bucket passes
    the checks)."""
    try:
        T = x.shape[0]
        rows = (
            topk_weights.shape[0] == T
            and topk_ids.shape[0] == T
            and (bias is None or bias.dim() == 1 or bias.shape[0] == T)
        )
        key = (token_bucket(T), rows, rows_key(x), tensor_key(w1), tensor_key(w2),
               rows_key(topk_weights), rows_key(topk_ids), tensor_key(b1), tensor_key(b2),
               bias_key(bias), *options, torch.is_grad_enabled(), memo_env())  # fmt: skip
    except (AttributeError, TypeError, IndexError):
        return None
    return key


# --------------------------------------------------------------------------- internal entry
def moe_plan(x, w1, w2, K, activation: str, gate_up_layout: str, finalize: str,
             deterministic: bool, gather: bool | None, allow_tf32: bool,
             backend: str) -> MoEPlan:  # fmt: skip
    """The plan of a call (arguments already checked; ``activation`` canonical): one lookup
    keyed on the call's arguments as they come (the finalize request, ``gather=None``),
    resolved on a miss through :func:`_plan`."""
    key = (x.device, x.dtype, w1.shape, w2.shape, K, token_bucket(x.shape[0]), activation,
           gate_up_layout, finalize, deterministic, gather, allow_tf32, backend,
           arch.env_key())  # fmt: skip
    plan = _CALL_PLANS.get(key)
    if plan is None:
        path = arch.finalize_path_for(x.device, finalize, deterministic).value
        if gather is None:
            # Expand only where I is large enough for the TMA-fed GEMM1 to pay for it
            # (docs/decisions.md, "Gather or expand before GEMM1").
            gather = w2.shape[2] < 4096
        plan = _CALL_PLANS[key] = _plan_for(x, w1, w2, K, activation, gate_up_layout, path,
                                            gather, allow_tf32, backend)  # fmt: skip
    return plan


#: :func:`moe_plan`'s answers by call arguments (bounded by the configurations a process
#: runs: weights' shapes, dtypes, flags, token buckets).
_CALL_PLANS: dict = {}


def clear_plans() -> None:
    """Forget every plan (tests that change what a plan is decided from, e.g. a tuning table)."""
    clear_memos()
    _CALL_PLANS.clear()
    _plan.cache_clear()
    gemm_configs.cache_clear()


def run_experts(plan: MoEPlan, x, w1, w2, topk_weights, maps, activation: str,
                gate_up_layout: str, b1=None, b2=None, bias=None,
                allow_tf32: bool = False) -> torch.Tensor:  # fmt: skip
    """The experts on checked inputs and built maps (``fused_moe`` after its checks, and
    :class:`moe_route.MoELayer`, whose own router made the ids)."""
    store_z = _wants_grad(x, w1, w2, topk_weights, b1, b2, bias)
    out, _ = MOE(
        x, w1, w2, topk_weights, b1, b2, bias, *maps.tensors(), activation, gate_up_layout,
        plan.path, plan.gather, allow_tf32, plan.backend, store_z,
    )  # fmt: skip
    return out


class PreparedExperts:
    """:func:`run_experts` for one call signature in eager mode, on plain tensors and the
    Triton backend, without the custom ops' dispatch: the launch sequences'
    prepared launches (:func:`moe_route.kernels.triton.moe.prepared`) kept per signature —
    the forward's per ``store_z``, the backward's per layout of ``dout`` — and autograd
    through :class:`_Experts`. The same launch sequences as the op's route: the same bits.
    Keeps no tensor.

    Working out strides, keys and constexprs per call was most of the backward sequence's host
    time (docs/decisions.md, "Prepared launch sequences").
    """

    __slots__ = ("activation", "allow_tf32", "backward", "forward", "layout", "plan")

    #: the most layouts of ``dout`` whose backward launches are kept (then it starts over)
    MAX_LAYOUTS = 8

    def __init__(self, plan: MoEPlan, activation: str, gate_up_layout: str, allow_tf32: bool):
        self.plan, self.activation, self.layout = plan, activation, gate_up_layout
        self.allow_tf32 = allow_tf32
        self.forward: tuple[dict, dict] = ({}, {})  # by store_z
        self.backward: dict = {}

    def __call__(self, x, w1, w2, topk_weights, maps, b1=None, b2=None, bias=None):
        if _wants_grad(x, w1, w2, topk_weights, b1, b2, bias):
            return _Experts.apply(x, w1, w2, topk_weights, b1, b2, bias, maps, self)
        out, _ = moe_forward_triton(x, w1, w2, topk_weights, b1, b2, bias, maps.tensors(),
                                    self.plan.configs, False, self.forward[False])  # fmt: skip
        return out

    def backward_launches(self, dout: torch.Tensor) -> dict:
        """The backward's prepared launches for ``dout``'s layout."""
        key = (dout.stride(), dout.dtype)
        launches = self.backward.get(key)
        if launches is None:
            if len(self.backward) >= self.MAX_LAYOUTS:
                self.backward.clear()
            launches = self.backward[key] = {}
        return launches


class _Experts(torch.autograd.Function):
    """The experts under autograd on :class:`PreparedExperts`' route: the forward's prepared
    launches, then what the op's autograd saves (:func:`_save`; ``z`` is an intermediate here,
    not an output) and its backward (:func:`_backward`, with the prepared launches)."""

    @staticmethod
    def forward(ctx, x, w1, w2, topk_weights, b1, b2, bias, maps, experts: PreparedExperts):
        tables = maps.tensors()
        out, z = moe_forward_triton(x, w1, w2, topk_weights, b1, b2, bias, tables,
                                    experts.plan.configs, True, experts.forward[True])  # fmt: skip
        _save(ctx, (x, w1, w2, topk_weights, b1, b2, z, *tables), bias,
              (experts.activation, experts.layout, experts.allow_tf32, "triton"))  # fmt: skip
        ctx.experts = experts
        ctx.internal_call = True  # z is the Function's own: the backward may consume it
        return out

    @staticmethod
    def backward(ctx, dout):
        return _backward(ctx, dout)[:9]


def decode_planned(plan: MoEPlan, x, *params) -> bool:
    """Whether a call takes the decode path, CUDA-graph capture aside (the caller asks that per
    call: :class:`FusedCall`, the layer): a decode plan, eager inference.

    The decode path saves host time but not device time, so CUDA-graph capture and
    torch.compile keep the sorted path (docs/decisions.md, "Decode path threshold").
    """
    return not (plan.decode is None or _wants_grad(x, *params) or torch.compiler.is_compiling())


def _wants_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# --------------------------------------------------------------------------- warm-up
def warmup(
    w1: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    max_tokens: int,
    *,
    backward: bool = False,
    **kwargs,
) -> list[int]:
    """Compile every kernel ``fused_moe`` will launch for up to ``max_tokens`` tokens.

    Kernels are compiled per token *bucket* (``T`` rounded up to a power of two), so this
    runs one call per bucket ``1, 2, 4, ..., >= max_tokens`` on random tokens and routing with
    these weights (and ``kwargs``, as :func:`fused_moe` takes them: ``activation``, ``b1``,
    ``finalize``, ``backend``, ...) and float32 router weights, plus its backward (gradients
    of ``x``, the router weights and every weight that requires grad, none accumulated into
    ``.grad``) when ``backward``. Afterwards no call with these shapes, dtypes and flags
    compiles anything, whatever its ``T <= max_tokens`` (serving without compile pauses).
    Returns the buckets warmed. Synchronises the device (once, at the end). ``max_tokens``
    is bounded by the int32 routing maps (``bucket · top_k < 2**31``) and, on a GPU, by the
    free memory (see :func:`moe_route.tuning.warmup_buckets`): past either, ``ValueError``
    before anything runs.
    """
    E, H = w1.shape[0], w2.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"top_k={top_k!r}: expected an int in [1, num_experts = {E}]")
    _checks.check_bool("backward", backward)
    buckets = warmup_buckets(max_tokens, top_k, w1, w2, backward)
    gen = torch.Generator(device=w1.device).manual_seed(0)
    for T in buckets:
        x = torch.randn(T, H, device=w1.device, dtype=w1.dtype, generator=gen)
        logits = torch.randn(T, E, device=w1.device, generator=gen)
        weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
        ids = ids.to(torch.int32)
        if not backward:
            with torch.no_grad():
                fused_moe(x, w1, w2, weights, ids, **kwargs)
            continue
        with torch.enable_grad():
            inputs = [t.requires_grad_() for t in (x, weights)]
            inputs += [w for w in (w1, w2, kwargs.get("b1"), kwargs.get("b2"))
                       if w is not None and w.requires_grad]  # fmt: skip
            out = fused_moe(x, w1, w2, weights, ids, **kwargs)
            # autograd.grad, not backward(): nothing accumulates into the caller's .grad
            dout = torch.randn(out.shape, device=w1.device, dtype=out.dtype, generator=gen)
            torch.autograd.grad(out, inputs, dout)
    if w1.device.type == "cuda":
        torch.cuda.synchronize(w1.device)
    return buckets
