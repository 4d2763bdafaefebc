"""What an eager :class:`moe_route.MoELayer` forward decided per call signature
(:class:`_LayerCall`), and how the layer keeps it (:class:`LayerCallMemo`, a base of
:class:`moe_route.MoELayer`; the forward lives in :mod:`moe_route.layer`)."""

from __future__ import annotations

import math

import torch

from ._checks import check_interpreter_dtype
from ._dispatch import MAX_CALLS, memo_env, needs_dispatcher, tensor_key, wants_grad
from .decode import decode_planned
from .experts import program_for, runs_direct
from .kernels.triton.decode import DecodeLaunch
from .maps import MapsCall
from .plan import moe_plan
from .routing import fused_router


class _LayerCall:
    """What an eager :meth:`MoELayer.forward` decided for one call signature (the layer keeps
    it, :meth:`MoELayer._eager_call`): the plan, the router's prepared launch where the one
    launch serves, and the decode path's, prepared at the first call that takes it (from the
    router's outputs, whose layout the signature fixes; checked on each use). Keeps no tensor.

    Those decisions and launch keys were ~40 % of an inference layer call's host time
    (docs/decisions.md, "Call memos").
    """

    __slots__ = ("_decode", "_decode_meta", "_sorted", "_sorted_meta", "ask_capture",
                 "decode_by_op", "eager", "plan", "router")  # fmt: skip

    def __init__(self, plan, router, ask_capture: bool, eager: bool):
        self.plan, self.router, self.ask_capture, self.eager = plan, router, ask_capture, eager
        self._decode = self._decode_meta = self._sorted = self._sorted_meta = None
        #: the decode path, through its custom op (tensors needing the dispatcher)
        self.decode_by_op = False

    def sorted_path(self, x, w1, w2, weights, ids, b1, b2, shared, activation: str,
                    layout: str):  # fmt: skip
        """The sorted path's ``(maps, program, direct)`` for this call: the maps' prepared
        launch (:class:`~moe_route.maps.MapsCall`), the experts'
        :class:`~moe_route.experts.MoEProgram` and whether it runs its launches directly
        (eager, plain tensors). Decided at the first call from the router's outputs and the
        shared expert's, whose layouts the signature fixes (checked on each use)."""
        meta = (weights.dtype, weights.stride(), ids.dtype, ids.stride(),
                None if shared is None else (shared.dtype, shared.stride()))  # fmt: skip
        if meta != self._sorted_meta:
            plan, E = self.plan, w1.shape[0]
            program = program_for(x, w1, w2, weights, b1, b2, shared, activation, layout,
                                  plan.path, plan.gather, False, plan.backend)  # fmt: skip
            direct = runs_direct(self.eager, (x, w1, w2, weights, ids, b1, b2, shared))
            maps = MapsCall(ids, E, plan.maps_backend, False, self.eager)
            self._sorted = (maps, program, direct)
            self._sorted_meta = meta
        return self._sorted

    def decode_launch(self, x, w1, w2, weights, ids, b1, b2, shared):
        """The decode path's :class:`DecodeLaunch` (with counts) for this call, or None where
        the call takes another path: the sorted path (gradients, compile, no decode plan), or
        the decode op (:attr:`decode_by_op`, set here). CUDA-graph capture aside (the caller
        asks it per call)."""
        meta = (weights.dtype, weights.stride(), weights.requires_grad, ids.dtype, ids.stride(),
                None if shared is None else (shared.stride(), shared.requires_grad))  # fmt: skip
        if meta != self._decode_meta:
            self._decode, self._decode_meta, self.decode_by_op = None, meta, False
            args = (x, w1, w2, weights, ids, b1, b2, shared)
            if decode_planned(self.plan, wants_grad(x, w1, w2, weights, b1, b2, shared)):
                if needs_dispatcher(args):
                    self.decode_by_op = True
                else:
                    self._decode = DecodeLaunch(*args, self.plan.configs.epilogue,
                                                self.plan.decode, True)  # fmt: skip
        return self._decode


class LayerCallMemo:
    """The call memo of a :class:`moe_route.MoELayer` (its ``_calls`` dict, keyed per call
    signature)."""

    def _eager_call(self, x2, w1, w2, b1, b2, gate_w) -> _LayerCall:
        """The decisions of a forward on ``x2`` (:class:`_LayerCall`): kept per call signature
        in eager mode, made afresh under torch.compile and a torch dispatch mode."""
        key = None
        compiling = torch.compiler.is_compiling()
        if not compiling and not torch._C._len_torch_dispatch_stack():
            key = (tensor_key(x2), tensor_key(w1), tensor_key(w2), tensor_key(b1),
                   tensor_key(b2), tensor_key(gate_w), self.shared_w1 is None, self.router,
                   self.top_k, self.renormalize, self.router_dtype, self.activation,
                   self.gate_up_layout, self.finalize, self.deterministic, self.backend,
                   torch.is_grad_enabled(), memo_env())  # fmt: skip
            call = self._calls.get(key)
            if call is not None:
                return call
        plan = moe_plan(x2, w1, w2, self.top_k, self.activation, self.gate_up_layout,
                        self.finalize, self.deterministic, None, False, self.backend)  # fmt: skip
        check_interpreter_dtype("x", x2, plan.backend)
        router = None
        if self.router == "softmax":  # eager inference at small T: one launch for the router
            rdt = self.logits_dtype(x2.dtype)
            expert = (math.prod(w1.shape[1:]) + math.prod(w2.shape[1:])) * x2.element_size()
            router = fused_router(x2, gate_w, self.top_k, self.renormalize, rdt, expert,
                                  self.backend)  # fmt: skip
        # (under torch.compile nothing is prepared, and no capture query is traced)
        call = _LayerCall(plan, router, x2.is_cuda and not compiling, key is not None)
        if key is not None and not needs_dispatcher((x2, w1, w2, b1, b2, gate_w)):
            if len(self._calls) >= MAX_CALLS:
                self._calls.clear()
            self._calls[key] = call
        return call
