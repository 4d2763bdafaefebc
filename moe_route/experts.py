"""The experts step of the MoE token path: GEMM1 + activation → GEMM2 → finalize on built
routing maps, as custom ops (schema, fake, autograd; what ``torch.compile`` and
``torch.ops.moe_route`` see) and, for eager calls of a known signature, as prepared launch
sequences (:class:`PreparedExperts`, :class:`PreparedQuantExperts`) with their autograd.

The forward returns GEMM1's pre-activation ``z`` when a gradient is wanted, and the backward
needs only ``x``, ``z``, the weights and the routing (:mod:`moe_route.kernels.triton.moe`).
Quantised experts are frozen: their backward runs the 16-bit backward on the weights
dequantised for it. The decode path (no maps, two launches) is the ``moe_decode`` op.
"""

from __future__ import annotations

import torch

from . import tuning
from ._dispatch import Op, needs_dispatcher
from .activations import as_activation
from .grouped_gemm import epilogue_for
from .kernels import torch_impl
from .kernels.triton.decode import MAX_SLOTS, moe_decode_triton
from .kernels.triton.moe import (
    MoEConfigs,
    moe_backward_triton,
    moe_forward_quant_triton,
    moe_forward_triton,
)
from .plan import MoEPlan, plan_for, quant_plan_for
from .quant import as_quant, dequantize_experts


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
    plan = plan_for(x, w1, w2, topk_weights.shape[1], activation, gate_up_layout, path, gather,
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
        plan = plan_for(x, w1, w2, topk_weights.shape[1], activation, gate_up_layout,
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
    dbias = _bias_grad(ctx, dout) if need[6] else None
    grads = (dx, dw1, dw2, dtopk, db1, db2)
    return (
        tuple(g if n else None for g, n in zip(grads, need[:6], strict=True))
        + (dbias,)
        + (None,) * 11
    )


def _bias_grad(ctx, dout: torch.Tensor) -> torch.Tensor:
    """The gradient of the per-token ``bias`` (``[H]`` or ``[T, H]``, added once per token):
    ``dout`` itself, or its sum over the tokens, in the bias's dtype."""
    ndim, dtype = ctx.bias_meta
    acc = torch.float64 if dout.dtype == torch.float64 else torch.float32
    return (dout if ndim == 2 else dout.sum(0, dtype=acc)).to(dtype)


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
    plan = quant_plan_for(x, w1, w2, topk_weights.shape[1], activation, gate_up_layout, spec,
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
    w1d = dequantize_experts(w1, w1s, spec, x.shape[1], dtype=x.dtype)
    n_inter = n1 // 2 if as_activation(act).gated else n1
    w2d = dequantize_experts(w2, w2s, spec, n_inter, dtype=x.dtype)
    maps = (s2d, d2s, efs, offsets)
    _, z = MOE(x, w1d, w2d, tw, b1, b2, None, *maps, act, layout, "standalone", True, False, be,
               True)  # fmt: skip
    dx, _, _, dtw, db1, db2 = _MOE_BACKWARD(
        dout, x, w1d, w2d, tw, b1, b2, z, *maps, act, layout, need[0], need[6], need[7],
        need[5], False, False, be,
    )  # fmt: skip
    dbias = _bias_grad(ctx, dout) if need[8] else None
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
        self.plan, self.activation, self.layout = plan, activation, gate_up_layout
        self.quant = quant
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


def takes_prepared_route(plan: MoEPlan, eager: bool, args) -> bool:
    """Whether a call of this plan runs the experts' prepared launch sequences
    (:class:`PreparedExperts`, :class:`PreparedQuantExperts`): eager, the Triton backend and
    tensors the kernels take as they are; else the experts' custom ops."""
    return eager and plan.backend == "triton" and not needs_dispatcher(args)


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
