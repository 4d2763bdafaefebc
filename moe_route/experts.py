"""The experts step of the MoE token path: GEMM1 + activation → GEMM2 → finalize on built
routing maps, as one prepared program per call signature (:class:`MoEProgram`) that every
route runs.

A program holds the call's plan and the launch sequences' prepared launches (the forward's
per ``store_z``, the backward's per layout of ``dout``). ``fused_moe``, :class:`moe_route.MoELayer`
and expert parallelism keep the program of their signature and call it; the program chooses
the route, here and nowhere else:

- eager, on tensors the kernels take as they are: its launch sequences directly, under
  autograd through :class:`_ExpertsFunction` (the one ``autograd.Function`` of the experts);
- under ``torch.compile`` or a torch dispatch mode, or given tensor subclasses: the custom ops
  (``torch.ops.moe_route.moe_experts``, ``moe_experts_backward``, ``moe_experts_quant``:
  schema, fake, the autograd the op registers), whose implementations find the same program
  by :func:`program_for` and run its launches, so compiled code gets the prepared launches too.

The forward keeps GEMM1's pre-activation ``z`` when a gradient is wanted, and the backward
needs only ``x``, ``z``, the weights and the maps (:mod:`moe_route.kernels.triton.moe`).
Quantised experts are frozen: their backward runs the 16-bit program on the weights
dequantised for it. The decode path (no maps, two launches) is the ``moe_decode`` op.
"""

from __future__ import annotations

import torch

from . import arch
from ._dispatch import CallMemo, Op, needs_dispatcher, wants_grad
from .activations import as_activation
from .kernels import torch_impl
from .kernels.triton import INTERPRETING, compiling_ahead
from .kernels.triton.moe import moe_backward_triton, moe_forward_quant_triton, moe_forward_triton
from .plan import MoEPlan, plan_for, quant_plan_for
from .quant import as_quant, dequantize_experts
from .tuning import token_bucket


# --------------------------------------------------------------------------- the program
class MoEProgram:
    """The experts step for one call signature: the plan and the forward and backward launch
    sequences' prepared launches (:func:`moe_route.kernels.triton.moe.prepared`), kept so that
    a later call launches without working out strides, keys and constexprs again
    (docs/decisions.md, "Prepared launch sequences"). Keeps no tensor. ``quant``: the
    :class:`~moe_route.quant.QuantSpec`'s name for quantised experts, else None.

    Made by :func:`program_for` / :func:`quant_program_for` (one per signature, shared by
    every route). Call it (:meth:`__call__`) on checked inputs and built maps.
    """

    __slots__ = ("activation", "allow_tf32", "backward_launches", "forward_launches", "layout",
                 "plan", "quant")  # fmt: skip

    #: the most layouts of ``dout`` whose backward launches are kept (then it starts over)
    MAX_LAYOUTS = 8

    def __init__(self, plan: MoEPlan, activation: str, gate_up_layout: str, allow_tf32: bool,
                 quant: str | None = None):  # fmt: skip
        self.plan, self.activation, self.layout = plan, activation, gate_up_layout
        self.allow_tf32, self.quant = allow_tf32, quant
        self.forward_launches: tuple[dict, dict] = ({}, {})  # by store_z
        self.backward_launches: dict = {}  # by dout's layout

    def __call__(self, x, w1, w2, topk_weights, tables, b1=None, b2=None, bias=None,
                 w1_scale=None, w2_scale=None, *, direct: bool | None = None):  # fmt: skip
        """``out [T, H]``: the experts on checked inputs and built maps (``tables``:
        :meth:`moe_route.RoutingMaps.tensors`). ``direct``: whether the call may run the launch
        sequences itself (:func:`runs_direct`), when the caller's memo decided it already."""
        if direct is None:
            tensors = (x, w1, w2, topk_weights, b1, b2, bias, w1_scale, w2_scale)
            direct = runs_direct(not torch.compiler.is_compiling(), tensors)
        if not direct:
            return self._through_op(x, w1, w2, topk_weights, tables, b1, b2, bias, w1_scale,
                                    w2_scale)  # fmt: skip
        if wants_grad(x, w1, w2, topk_weights, b1, b2, bias):
            return _ExpertsFunction.apply(self, tables, x, w1, w2, topk_weights, b1, b2, bias,
                                          w1_scale, w2_scale)  # fmt: skip
        return self.forward(x, w1, w2, topk_weights, b1, b2, bias, tables, False,
                            w1_scale, w2_scale)[0]  # fmt: skip

    def _through_op(self, x, w1, w2, topk_weights, tables, b1, b2, bias, w1_scale, w2_scale):
        plan = self.plan
        if self.quant is not None:
            return QMOE(x, w1, w1_scale, w2, w2_scale, topk_weights, b1, b2, bias, *tables,
                        self.activation, self.layout, self.quant, plan.backend)  # fmt: skip
        store_z = wants_grad(x, w1, w2, topk_weights, b1, b2, bias)
        return MOE(x, w1, w2, topk_weights, b1, b2, bias, *tables, self.activation, self.layout,
                   plan.path, plan.gather, self.allow_tf32, plan.backend, store_z)[0]  # fmt: skip

    def forward(self, x, w1, w2, topk_weights, b1, b2, bias, tables, store_z: bool,
                w1_scale=None, w2_scale=None) -> tuple:  # fmt: skip
        """``(out, z)``: ``z`` is GEMM1's pre-activation when ``store_z`` (16-bit experts), else
        None or empty."""
        plan, act, layout = self.plan, self.activation, self.layout
        if self.quant is not None:
            if plan.backend == "torch":
                out = torch_impl.moe_forward_quant_torch(
                    x, w1, w1_scale, w2, w2_scale, topk_weights, b1, b2, bias, *tables, act,
                    layout, as_quant(self.quant),
                )  # fmt: skip
            else:
                args = (x, w1, w1_scale, w2, w2_scale, topk_weights, b1, b2, bias, tables,
                        plan.configs, self.forward_launches[False])  # fmt: skip
                if not args[-1]:  # the sequence's first run
                    _compiled_ahead(moe_forward_quant_triton, args)
                out = moe_forward_quant_triton(*args)
            return out, None
        if plan.backend == "torch":
            return torch_impl.moe_forward_torch(x, w1, w2, topk_weights, b1, b2, bias, *tables,
                                                act, layout, keep_z=store_z)  # fmt: skip
        args = (x, w1, w2, topk_weights, b1, b2, bias, tables, plan.configs, store_z,
                self.forward_launches[store_z])  # fmt: skip
        if not args[-1]:  # the sequence's first run
            _compiled_ahead(moe_forward_triton, args)
        return moe_forward_triton(*args)

    def backward(self, dout, x, w1, w2, topk_weights, b1, b2, z, tables, need: tuple,
                 consume_z: bool = False, w1_scale=None, w2_scale=None) -> tuple:  # fmt: skip
        """``(dx, dw1, dw2, d_topk_weights, db1, db2)``, None for those not asked for
        (``need``: dx, dw1 (and db1), dw2 (and db2), d_topk_weights); the bias gradients in
        the biases' dtypes. ``consume_z``: GEMM1's pre-activation gradient is written over
        ``z`` (the backward's largest buffer) and ``z``'s version bumped, so that a later use
        of the saved ``z`` raises (Triton). Quantised experts: the 16-bit program's backward
        on the weights dequantised for it, GEMM1's pre-activation recomputed first."""
        if self.quant is not None:
            return self._quant_backward(dout, x, w1, w1_scale, w2, w2_scale, topk_weights, b1, b2,
                                        tables, need)  # fmt: skip
        need_dx, need_dw1, need_dw2, need_dtopk = need
        if self.plan.backend == "torch":
            grads = list(torch_impl.moe_backward_torch(
                dout, x, w1, w2, topk_weights, b2, z, *tables, self.activation, self.layout,
                need_dx=need_dx, need_dw1=need_dw1, need_dw2=need_dw2, need_dtopk=need_dtopk,
            ))  # fmt: skip
        else:
            launches = self._backward_for(dout)
            args = (dout, x, w1, w2, topk_weights, b1, b2, z, tables, self.plan.configs, *need)
            if not launches:  # the sequence's first run
                _compiled_ahead(moe_backward_triton, args, launches=launches)
            grads = list(moe_backward_triton(*args, dz_out=z if consume_z else None,
                                             launches=launches))  # fmt: skip
            if consume_z:
                torch.autograd.graph.increment_version(z)
        for i, bias_in in ((4, b1), (5, b2)):
            if bias_in is not None and grads[i] is not None:
                grads[i] = grads[i].to(bias_in.dtype)
        return tuple(grads)

    def _backward_for(self, dout: torch.Tensor) -> dict:
        """The backward's prepared launches for ``dout``'s layout."""
        key = (dout.stride(), dout.dtype)
        launches = self.backward_launches.get(key)
        if launches is None:
            if len(self.backward_launches) >= self.MAX_LAYOUTS:
                self.backward_launches.clear()
            launches = self.backward_launches[key] = {}
        return launches

    def _quant_backward(self, dout, x, w1, w1_scale, w2, w2_scale, topk_weights, b1, b2, tables,
                        need) -> tuple:  # fmt: skip
        """Gradients of ``x``, the router weights and the biases on frozen quantised experts:
        16-bit products (the activations' dtype) on the weights dequantised for this
        backward, at the unquantised ``x`` (the quantisers pass gradients straight through).
        FP8 products would need ``dout`` quantised too: that is FP8 training, not adapters
        on an FP8 base."""
        w1d, w2d = _dequantized(x, w1, w1_scale, w2, w2_scale, self.activation, self.quant)
        dense = program_for(x, w1d, w2d, topk_weights, b1, b2, None, self.activation,
                            self.layout, "standalone", True, False, self.plan.backend)  # fmt: skip
        _, z = dense.forward(x, w1d, w2d, topk_weights, b1, b2, None, tables, True)
        dx, _, _, dtw, db1, db2 = dense.backward(dout, x, w1d, w2d, topk_weights, b1, b2, z,
                                                 tables, need, consume_z=True)  # fmt: skip
        return dx, None, None, dtw, db1, db2

    def backward_by_op(self, dout, x, w1, w2, topk_weights, b1, b2, z, tables, need,
                       w1_scale=None, w2_scale=None) -> tuple:  # fmt: skip
        """:meth:`backward` through the custom ops, for a ``dout`` the kernels cannot take as
        it is (a subclass) or a backward being compiled."""
        if self.quant is not None:
            config = (self.activation, self.layout, self.quant, self.plan.backend)
            return _quant_backward_by_op(dout, x, w1, w1_scale, w2, w2_scale, topk_weights, b1,
                                         b2, tables, config, need)  # fmt: skip
        config = (self.activation, self.layout, self.plan.path, self.plan.gather,
                  self.allow_tf32, self.plan.backend)  # fmt: skip
        return _backward_by_op(dout, x, w1, w2, topk_weights, b1, b2, z, tables, config, need)


def _compiled_ahead(sequence, args: tuple, **kwargs) -> None:
    """Before a launch sequence's first run with its prepared launches (still empty), on a
    GPU: the same sequence once in a compile-ahead pass, so that the variants it needs
    compile side by side (:func:`compile_ahead`)."""
    if args[1].is_cuda:
        with torch.no_grad():
            compile_ahead(sequence, *args, **kwargs)


def compile_ahead(call, *args, **kwargs) -> None:
    """``call(*args, **kwargs)`` once in a compile-ahead pass
    (:func:`moe_route.kernels.triton.compiling_ahead`: its launches compile their variants in
    child processes and run nothing; its result is garbage and dropped), where one can run: on
    a GPU, not inside another such pass, not while a CUDA graph is captured (the pass's
    allocations and torch ops would be recorded), not while ``torch.compile`` traces. The pass
    only saves time: whatever goes wrong in it is left to the real call, which compiles what
    is missing at its first launch and raises its own errors."""
    if INTERPRETING or torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return
    ahead = compiling_ahead()
    if ahead is not None:
        try:
            with ahead:
                call(*args, **kwargs)
        except Exception:  # the real call reports it
            pass


def runs_direct(eager: bool, tensors) -> bool:
    """Whether a call runs its program's launch sequences itself: eager, and
    tensors the kernels take as they are (else the custom ops' dispatch must see them). The
    Triton backend and the torch backend alike."""
    return eager and not needs_dispatcher(tensors)


def _dequantized(x, w1, w1_scale, w2, w2_scale, activation: str, quant: str):
    spec = as_quant(quant)
    n1 = w1.shape[1]
    n_inter = n1 // 2 if as_activation(activation).gated else n1
    w1d = dequantize_experts(w1, w1_scale, spec, x.shape[1], dtype=x.dtype)
    w2d = dequantize_experts(w2, w2_scale, spec, n_inter, dtype=x.dtype)
    return w1d, w2d


#: the programs by call signature (:func:`program_for`), emptied by ``plan.clear_plans()``
_PROGRAMS = CallMemo()


def _layout(t: torch.Tensor | None):
    return None if t is None else (t.dtype, t.stride(), t.dim())


def program_for(x, w1, w2, topk_weights, b1, b2, bias, activation: str, gate_up_layout: str,
                path: str, gather: bool, allow_tf32: bool, backend: str) -> MoEProgram:  # fmt: skip
    """The program of a resolved call (``path``, ``gather``, ``backend`` decided;
    ``activation`` canonical): one lookup keyed on what decides its plan and its prepared
    launches (the device, dtypes, the weights' shapes, the options, the environment
    overrides, the token bucket and every operand's layout); made on a miss from
    :func:`moe_route.plan.plan_for`. (While ``torch.compile`` traces, a new one: the
    compiled graph calls the op, whose implementation looks the program up at run time.)"""
    if torch.compiler.is_compiling():
        plan = plan_for(x, w1, w2, topk_weights.shape[1], activation, gate_up_layout, path,
                        gather, allow_tf32, backend)  # fmt: skip
        return MoEProgram(plan, activation, gate_up_layout, allow_tf32)
    key = (x.device, x.dtype, x.stride(), w1.shape, w1.stride(), w2.shape, w2.stride(),
           topk_weights.shape[1], _layout(topk_weights), token_bucket(x.shape[0]), _layout(b1),
           _layout(b2), _layout(bias), activation, gate_up_layout, path, gather, allow_tf32,
           backend, arch.env_key())  # fmt: skip
    program = _PROGRAMS.get(key)
    if program is None:
        plan = plan_for(x, w1, w2, topk_weights.shape[1], activation, gate_up_layout, path,
                        gather, allow_tf32, backend)  # fmt: skip
        program = MoEProgram(plan, activation, gate_up_layout, allow_tf32)
        _PROGRAMS.keep(key, program, ())
    return program


def quant_program_for(x, w1, w1_scale, w2, w2_scale, topk_weights, b1, b2, bias,
                      activation: str, gate_up_layout: str, quant: str,
                      backend: str) -> MoEProgram:  # fmt: skip
    """:func:`program_for` of a call on quantised experts (``quant``: the spec's name)."""
    if torch.compiler.is_compiling():
        plan = quant_plan_for(x, w1, w2, topk_weights.shape[1], activation, gate_up_layout,
                              as_quant(quant), backend)  # fmt: skip
        return MoEProgram(plan, activation, gate_up_layout, False, quant)
    key = (x.device, x.dtype, x.stride(), w1.shape, w1.dtype, w1.stride(), _layout(w1_scale),
           w2.shape, w2.stride(), _layout(w2_scale), topk_weights.shape[1],
           _layout(topk_weights), token_bucket(x.shape[0]), _layout(b1), _layout(b2),
           _layout(bias), activation, gate_up_layout, quant, backend, arch.env_key())  # fmt: skip
    program = _PROGRAMS.get(key)
    if program is None:
        plan = quant_plan_for(x, w1, w2, topk_weights.shape[1], activation, gate_up_layout,
                              as_quant(quant), backend)  # fmt: skip
        program = MoEProgram(plan, activation, gate_up_layout, False, quant)
        _PROGRAMS.keep(key, program, ())
    return program


# --------------------------------------------------------------------------- autograd
class _ExpertsFunction(torch.autograd.Function):
    """The experts under autograd on the direct route: the program's forward keeping ``z``,
    its backward with the prepared launches. Saves ``x``, the weights, the router weights,
    the biases, ``z`` and the maps, nothing else."""

    @staticmethod
    def forward(ctx, program: MoEProgram, tables, x, w1, w2, topk_weights, b1, b2, bias,
                w1_scale, w2_scale):  # fmt: skip
        out, z = program.forward(x, w1, w2, topk_weights, b1, b2, bias, tables, True, w1_scale,
                                 w2_scale)  # fmt: skip
        ctx.save_for_backward(x, w1, w2, topk_weights, b1, b2, z, w1_scale, w2_scale, *tables)
        ctx.program = program
        ctx.bias_meta = None if bias is None else (bias.dim(), bias.dtype)
        # z has no gradient and the maps none either: nothing is materialised for them.
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx, dout):
        if dout is None:  # the output took no part in what is differentiated
            return (None,) * 11
        x, w1, w2, topk_weights, b1, b2, z, w1_scale, w2_scale, *tables = ctx.saved_tensors
        need = ctx.needs_input_grad[2:9]
        wanted = (need[0], need[1] or need[4], need[2] or need[5], need[3])
        program = ctx.program
        if torch.compiler.is_compiling() or needs_dispatcher((dout,)):
            grads = program.backward_by_op(dout, x, w1, w2, topk_weights, b1, b2, z, tables,
                                           wanted, w1_scale, w2_scale)  # fmt: skip
        else:
            consume = z is not None and _last_backward()
            grads = program.backward(dout, x, w1, w2, topk_weights, b1, b2, z, tables, wanted,
                                     consume, w1_scale, w2_scale)  # fmt: skip
        dbias = _bias_grad(ctx.bias_meta, dout) if need[6] else None
        grads = tuple(g if n else None for g, n in zip(grads, need[:6], strict=True))
        return (None, None, *grads, dbias, None, None)


def _last_backward() -> bool:
    """Whether this backward is the last through its graph (``retain_graph`` keeps ``z``),
    so that it may overwrite the saved ``z``, which only the program's own forward holds."""
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return keep_graph is not None and not keep_graph()


def _bias_grad(bias_meta, dout: torch.Tensor) -> torch.Tensor:
    """The gradient of the per-token ``bias`` (``[H]`` or ``[T, H]``, added once per token):
    ``dout`` itself, or its sum over the tokens, in the bias's dtype."""
    ndim, dtype = bias_meta
    acc = torch.float64 if dout.dtype == torch.float64 else torch.float32
    return (dout if ndim == 2 else dout.sum(0, dtype=acc)).to(dtype)


# --------------------------------------------------------------------------- custom ops
def _moe_experts_impl(
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
    program = program_for(x, w1, w2, topk_weights, b1, b2, bias, activation, gate_up_layout,
                          path, gather, allow_tf32, backend)  # fmt: skip
    maps = (src_to_dest, dest_to_src, expert_for_src, offsets)
    out, z = program.forward(x, w1, w2, topk_weights, b1, b2, bias, maps, store_z)
    return out, z if store_z else x.new_empty(0)


def _moe_fake(x, w1, w2, topk_weights, b1, b2, bias, s2d, dest_to_src, *rest):
    store_z = rest[-1]
    z = x.new_empty(dest_to_src.numel(), w1.shape[1]) if store_z else x.new_empty(0)
    return x.new_empty(x.shape), z


def _moe_experts_backward_impl(
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
    path: str,
    gather: bool,
    need_dx: bool,
    need_dw1: bool,
    need_dw2: bool,
    need_dtopk: bool,
    allow_tf32: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dw1, dw2, d_topk_weights, db1, db2)`` of the program the forward ran (the same
    arguments find it); the ones not asked for are empty. ``need_dw1`` / ``need_dw2`` also
    cover ``db1`` / ``db2`` when those biases exist."""
    program = program_for(x, w1, w2, topk_weights, b1, b2, None, activation, gate_up_layout,
                          path, gather, allow_tf32, backend)  # fmt: skip
    maps = (src_to_dest, dest_to_src, expert_for_src, offsets)
    wanted = (need_dx, need_dw1, need_dw2, need_dtopk)
    grads = program.backward(dout, x, w1, w2, topk_weights, b1, b2, z, maps, wanted)
    wanted += (b1 is not None and need_dw1, b2 is not None and need_dw2)
    # Outputs may not alias each other: each gradient not asked for is its own empty tensor.
    return tuple(g if w else x.new_empty(0) for g, w in zip(grads, wanted, strict=True))


def _moe_backward_fake(dout, x, w1, w2, topk_weights, b1, b2, z, s2d, d2s, efs, o, act, lay,
                       path, gather, ndx, nw1, nw2, ntk, *_):  # fmt: skip
    like = (x, w1, w2, topk_weights, b1, b2)
    wanted = (ndx, nw1, nw2, ntk, b1 is not None and nw1, b2 is not None and nw2)
    return tuple(
        torch.empty_like(t) if w else x.new_empty(0) for t, w in zip(like, wanted, strict=True)
    )


_MOE_BACKWARD = Op("moe_experts_backward", _moe_experts_backward_impl, _moe_backward_fake)


def _setup_context(ctx, inputs, output):
    x, w1, w2, topk_weights, b1, b2, bias, s2d, d2s, efs, offsets = inputs[:11]
    act, layout, path, gather, tf32, be = inputs[11:17]
    ctx.save_for_backward(x, w1, w2, topk_weights, b1, b2, output[1], s2d, d2s, efs, offsets)
    ctx.config = (act, layout, path, gather, tf32, be)
    ctx.bias_meta = None if bias is None else (bias.dim(), bias.dtype)
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, _dz=None):
    """The op's registered backward (the compiled route's): the backward op."""
    if dout is None:  # the output took no part in what is differentiated
        return (None,) * 18
    x, w1, w2, topk_weights, b1, b2, z, *tables = ctx.saved_tensors
    need = ctx.needs_input_grad
    wanted = (need[0], need[1] or need[4], need[2] or need[5], need[3])
    grads = _backward_by_op(dout, x, w1, w2, topk_weights, b1, b2, z, tables, ctx.config, wanted)
    dbias = _bias_grad(ctx.bias_meta, dout) if need[6] else None
    grads = tuple(g if n else None for g, n in zip(grads, need[:6], strict=True))
    return (*grads, dbias) + (None,) * 11


def _backward_by_op(dout, x, w1, w2, topk_weights, b1, b2, z, tables, config: tuple,
                    need: tuple) -> tuple:  # fmt: skip
    """:meth:`MoEProgram.backward` through the backward op (``config``: the forward op's
    ``(activation, layout, path, gather, allow_tf32, backend)``); None for what is not
    asked for."""
    act, layout, path, gather, tf32, be = config
    grads = _MOE_BACKWARD(dout, x, w1, w2, topk_weights, b1, b2, z, *tables, act, layout, path,
                          gather, *need, tf32, be)  # fmt: skip
    wanted = (*need, b1 is not None and need[1], b2 is not None and need[2])
    return tuple(g if w else None for g, w in zip(grads, wanted, strict=True))


MOE = Op("moe_experts", _moe_experts_impl, _moe_fake, setup_context=_setup_context,
         backward=_backward, eager_autograd=False)  # fmt: skip


def _moe_experts_quant_impl(
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
    program = quant_program_for(x, w1, w1_scale, w2, w2_scale, topk_weights, b1, b2, bias,
                                activation, gate_up_layout, quant, backend)  # fmt: skip
    maps = (src_to_dest, dest_to_src, expert_for_src, offsets)
    return program.forward(x, w1, w2, topk_weights, b1, b2, bias, maps, False, w1_scale,
                           w2_scale)[0]  # fmt: skip


def _moe_quant_fake(x, *_):
    return x.new_empty(x.shape)


def _quant_setup_context(ctx, inputs, output):
    x, w1, w1s, w2, w2s, tw, b1, b2, bias, s2d, d2s, efs, offsets, act, layout, quant, be = inputs
    ctx.save_for_backward(x, w1, w1s, w2, w2s, tw, b1, b2, s2d, d2s, efs, offsets)
    ctx.config = (act, layout, quant, be)
    ctx.bias_meta = None if bias is None else (bias.dim(), bias.dtype)


def _quant_backward(ctx, dout):
    """The quantised op's registered backward (the compiled route's)."""
    x, w1, w1s, w2, w2s, tw, b1, b2, *tables = ctx.saved_tensors
    need = ctx.needs_input_grad
    wanted = (need[0], need[6], need[7], need[5])
    dx, _, _, dtw, db1, db2 = _quant_backward_by_op(dout, x, w1, w1s, w2, w2s, tw, b1, b2,
                                                    tables, ctx.config, wanted)  # fmt: skip
    dbias = _bias_grad(ctx.bias_meta, dout) if need[8] else None
    grads = (dx, None, None, None, None, dtw, db1, db2)
    return (
        tuple(g if n else None for g, n in zip(grads, need[:8], strict=True))
        + (dbias,)
        + (None,) * 8
    )


def _quant_backward_by_op(dout, x, w1, w1_scale, w2, w2_scale, topk_weights, b1, b2, tables,
                          config: tuple, need: tuple) -> tuple:  # fmt: skip
    """:meth:`MoEProgram._quant_backward` through the ops (``config``: the quantised op's
    ``(activation, layout, quant, backend)``)."""
    act, layout, quant, be = config
    w1d, w2d = _dequantized(x, w1, w1_scale, w2, w2_scale, act, quant)
    _, z = MOE(x, w1d, w2d, topk_weights, b1, b2, None, *tables, act, layout, "standalone", True,
               False, be, True)  # fmt: skip
    dense = (act, layout, "standalone", True, False, be)
    dx, _, _, dtw, db1, db2 = _backward_by_op(dout, x, w1d, w2d, topk_weights, b1, b2, z, tables,
                                              dense, need)  # fmt: skip
    return dx, None, None, dtw, db1, db2


QMOE = Op("moe_experts_quant", _moe_experts_quant_impl, _moe_quant_fake,
          setup_context=_quant_setup_context, backward=_quant_backward,
          eager_autograd=False)  # fmt: skip
