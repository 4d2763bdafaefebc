"""fused_moe(): the whole MoE token path in one call, and its warm-up.

One validation and one plan per call signature: :func:`fused_moe` checks its arguments, takes
the call's :class:`moe_route.plan.MoEPlan`, builds the routing maps and runs the experts step
(:mod:`moe_route.experts`). What it decided is kept per call signature (:class:`FusedCall`), so
a later call of that signature goes straight to the allocations and launches.
"""

from __future__ import annotations

import torch

from . import _checks
from ._checks import bias_dtypes, check_gemm_args, check_interpreter_dtype
from ._dispatch import (
    CallMemo,
    bias_key,
    memo_env,
    memo_wanted,
    needs_dispatcher,
    rows_key,
    tensor_key,
    wants_grad,
)
from .activations import Activation, as_activation
from .decode import DECODE, decode_planned
from .experts import compile_ahead, program_for, quant_program_for, runs_direct
from .kernels.triton.decode import DecodeLaunch
from .kernels.triton.decode_quant import QuantDecodeLaunch
from .kernels.triton.gemm_mainloop import MAX_EXPERTS
from .maps import MapsCall
from .plan import moe_plan, quant_plan_for
from .quant import QuantSpec, as_quant, check_weight
from .reference import GATE_UP_LAYOUTS
from .tuning import token_bucket, warmup_buckets


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
    check_weight("w1", w1, "w1_scale", w1_scale, spec, (E, n1, H), f"K = x.shape[1] = {H}")
    check_weight("w2", w2, "w2_scale", w2_scale, spec, (E, H, n_inter),
                 f"[E, H, I] to follow x {list(x.shape)} and w1 {list(w1.shape)} with "
                 f"activation {str(act)!r}")  # fmt: skip
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
    if isinstance(w1, torch.Tensor) and w1.dtype in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(f"w1 {_checks.describe(w1)} holds quantised codes: pass quant= ('fp8', "
                        "'fp8_channel', 'mxfp4', ...) with w1_scale and w2_scale")  # fmt: skip
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
    ids = _check_routing(x, topk_weights, topk_ids, bias, E)
    _checks.check_same_device(
        x=x, w1=w1, w2=w2, b2=b2, bias=bias, topk_weights=topk_weights, topk_ids=ids
    )
    plan = moe_plan(x, w1, w2, ids.shape[1], activation, gate_up_layout, finalize,
                    deterministic, gather, allow_tf32, backend)  # fmt: skip
    check_interpreter_dtype("x", x, plan.backend)
    program = program_for(x, w1, w2, topk_weights, b1, b2, bias, activation, gate_up_layout,
                          plan.path, plan.gather, allow_tf32, plan.backend)  # fmt: skip
    call = FusedCall(program, x, w1, w2, topk_weights, ids, b1, b2, bias, key is not None)
    if token_bucket(T) * ids.shape[1] < 2**31:  # the whole bucket fits the maps' int32 rows
        _CALLS.keep(key, call, (x, w1, w2, topk_weights, ids, b1, b2, bias))
    if call.cuda and call.direct:  # a new signature: its kernels compile side by side
        compile_ahead(call, x, w1, w2, topk_weights, ids, b1, b2, bias)
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
    T = x.shape[0]
    ids = _check_routing(x, topk_weights, topk_ids, bias, E)
    _checks.check_same_device(x=x, w1=w1, bias=bias, topk_weights=topk_weights, topk_ids=ids)
    plan = quant_plan_for(x, w1, w2, ids.shape[1], activation, gate_up_layout, spec, backend)
    if plan.backend == "triton":
        if x.dtype == torch.float32 and not spec.fp8:
            raise TypeError(f"x is float32: MXFP4 experts take bf16 / fp16 tokens, got "
                            f"{_checks.describe(x)}")  # fmt: skip
        check_interpreter_dtype("x", x, plan.backend)
    program = quant_program_for(x, w1, w1_scale, w2, w2_scale, topk_weights, b1, b2, bias,
                                activation, gate_up_layout, str(spec), plan.backend)  # fmt: skip
    call = FusedCall(program, x, w1, w2, topk_weights, ids, b1, b2, bias, key is not None,
                     w1_scale, w2_scale)  # fmt: skip
    args = (x, w1, w2, topk_weights, ids, b1, b2, bias, w1_scale, w2_scale)
    if token_bucket(T) * ids.shape[1] < 2**31:
        _CALLS.keep(key, call, args)
    if call.cuda and call.direct:  # a new signature: its kernels compile side by side
        compile_ahead(call, *args)
    return call(*args)


def _check_routing(x, topk_weights, topk_ids, bias, E: int) -> torch.Tensor:
    """Check the per-token arguments of a ``fused_moe`` call (``bias``, the router's outputs)
    against ``x [T, H]`` and ``E`` experts; the ids, as checked."""
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
    return ids


# --------------------------------------------------------------------------- call memo
class FusedCall:
    """What :func:`fused_moe` decided for one call signature (:func:`_call_key`): the experts'
    :class:`~moe_route.experts.MoEProgram`, the path (decode or sorted) and route, the
    per-call checks left (the ids' values, where those are checked), the maps' and the decode
    path's prepared launches. Keeps no tensor. A later call with the same signature runs this
    without checking its arguments again: the signature holds all that the checks and
    decisions read.

    The checks and decisions were half of an eager decode call's host time (docs/decisions.md,
    "Call memos").
    """

    __slots__ = ("E", "check_ids", "cuda", "decode", "direct", "graphs", "maps", "program")

    def __init__(self, program, x, w1, w2, topk_weights, ids, b1, b2, bias, eager: bool,
                 w1_scale=None, w2_scale=None):  # fmt: skip
        plan = program.plan
        self.program, self.E = program, w1.shape[0]
        self.check_ids = _checks.ids_value_check_wanted(ids, None)
        self.cuda = x.is_cuda
        # The decode path, where this signature takes it (an inference call: gradients are part
        # of the signature; eager), prepared; CUDA-graph capture is asked per call, unless the
        # path serves capture too (``graphs``: no slower on the device either).
        self.decode, self.graphs = None, False
        args = (x, w1, w2, topk_weights, ids, b1, b2, bias)
        gradient = wants_grad(x, w1, w2, topk_weights, b1, b2, bias)
        if program.quant is None and decode_planned(plan, gradient):
            self.decode = self._through_op
            if not needs_dispatcher(args):
                self.decode = DecodeLaunch(*args, plan.configs.epilogue, plan.decode, False)
        elif decode_planned(plan, gradient) and not needs_dispatcher((*args, w1_scale, w2_scale)):
            cfg = plan.configs  # quantised experts
            self.decode = QuantDecodeLaunch(x, w1, w1_scale, w2, w2_scale, topk_weights, ids, b1,
                                            b2, bias, cfg.epilogue, plan.decode, cfg.x_group,
                                            cfg.w_block_rows, cfg.ue8m0)  # fmt: skip
            self.graphs = plan.decode.graphs
        # The sorted path: the maps' launch prepared, and the route of the experts' program.
        self.maps = MapsCall(ids, self.E, plan.maps_backend, False, eager)
        self.direct = runs_direct(eager, (*args, w1_scale, w2_scale))

    def __call__(self, x, w1, w2, topk_weights, ids, b1, b2, bias, w1_scale=None,
                 w2_scale=None) -> torch.Tensor:  # fmt: skip
        if self.check_ids:
            _checks.check_topk_id_values(ids, self.E)
        decode = self.decode  # (None under torch.compile: nothing below traces a capture query)
        if decode is not None and (
            self.graphs or not (self.cuda and torch._C._cuda_isCurrentStreamCapturing())
        ):
            if w1_scale is None:
                return decode(x, w1, w2, topk_weights, ids, b1, b2, bias)
            return decode(x, w1, w2, topk_weights, ids, b1, b2, bias, w1_scale, w2_scale)
        return self.program(x, w1, w2, topk_weights, self.maps(ids).tensors(), b1, b2, bias,
                            w1_scale, w2_scale, direct=self.direct)  # fmt: skip

    def _through_op(self, x, w1, w2, topk_weights, ids, b1, b2, bias) -> torch.Tensor:
        """The decode path through its custom op: tensors the kernels cannot take as they are
        (fake tensors, subclasses; such a call is not memoised)."""
        program = self.program
        return DECODE(x, w1, w2, topk_weights, ids, b1, b2, bias, program.activation,
                      program.layout, False)[0]  # fmt: skip


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
