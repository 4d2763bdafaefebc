"""Hugging Face transformers (>= 5) integration: moe_route as an *experts implementation*.

transformers 5 runs the expert computation of an MoE layer through
``transformers.integrations.moe.ExpertsInterface``: an experts class decorated with
``@use_experts_implementation`` calls ``fn(experts_module, hidden_states, top_k_index,
top_k_weights)`` for the implementation its config names (``"eager"``, ``"grouped_mm"``, ...).
:func:`register` adds ``"moe_route"`` to that table::

    import moe_route.integrations.hf as moe_hf

    moe_hf.register()  # first: transformers rejects an unknown name
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="moe_route")
    model.set_experts_implementation("moe_route")  # or switch a model already loaded

and the experts then run as one :func:`moe_route.fused_moe` call per layer, forward and backward.

Layouts. The decorator's flags describe how the module stores its weights; each maps onto
``fused_moe``'s arguments as a view, never a copy:

* ``has_gate=True``: ``gate_up_proj [E, 2I, H]`` is ``w1``, ``down_proj [E, H, I]`` is ``w2``;
  ``has_gate=False``: ``up_proj [E, I, H]`` is ``w1`` and the activation is a plain one.
* ``is_transposed=True``: the module holds ``[E, H, 2I]`` (or ``[E, H, I]``) and ``[E, I, H]``;
  ``w1``/``w2`` are their ``.transpose(1, 2)`` views (fused_moe reads strides).
* ``is_concatenated``: gate rows then up rows (``gate_up_layout="concat"``); ``False``:
  alternating gate/up rows (``"interleaved"``).
* ``has_bias=True``: ``gate_up_proj_bias`` (or ``up_proj_bias``) ``[E, N]`` is ``b1``,
  ``down_proj_bias [E, H]`` is ``b2`` (scaled by the router weight, as in transformers).

The activation is recognised from what the module computes, not from its class name:

* the module's ``act_fn`` is evaluated on a probe vector and compared with moe_route's
  element-wise functions (SiLU, exact GELU, tanh-approximated GELU, ReLU, squared ReLU, the
  identity); gated with transformers' default ``_apply_gate`` that gives ``swiglu`` /
  ``geglu`` / ``geglu_tanh``, with the gate/up layout of ``is_concatenated`` (honoured as
  interleaved rows, as transformers' ``sonicmoe`` does, although the default ``_apply_gate``
  splits in halves);
* a class that overrides ``_apply_gate`` (gpt-oss, DeepSeek-V4, GLM-5, MiniMax-M3, ...) has its
  ``_apply_gate`` evaluated on a probe ``[gate | up]`` tensor and compared with the clamped
  SwiGLU family and the plain gated activations, in both gate/up layouts, with the parameters
  the module holds (``alpha`` / ``swiglu_alpha``, ``limit`` / ``swiglu_limit``) and an
  ``up_offset`` of 0 or 1. The one that agrees (to float32 rounding) is what runs; its layout
  is the one ``_apply_gate`` reads (gpt-oss: interleaved). gpt-oss's experts, for instance,
  run as ``swiglu(alpha=1.702, limit=7.0, up_offset=1.0)``, interleaved, transposed weights,
  biases.

The probes run once per module (CPU, float64, a few hundred values) and the plan is kept on
the module until its ``act_fn``, parameters or flags change. Slots that transformers' expert
parallelism sends elsewhere (ids ``>= E``, weight zero) become dropped slots (``-1``).

Quantised experts. transformers loads FineGrainedFP8 checkpoints (DeepSeek-V3, Qwen3-MoE FP8,
...) into ``FP8Experts``, whose implementations come from a second table,
``transformers.integrations.finegrained_fp8.FP8ExpertsInterface`` (``"batched_mm"``,
``"grouped_mm"``, ``"deepgemm"``); :func:`register` installs ``name`` there too, and such a
module runs as ``fused_moe(..., quant=..., w1_scale=..., w2_scale=...)`` on its own tensors
(detached views, no copy: the quantised weights are frozen, gradients reach the tokens and the
router weights):

* FP8: ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` ``float8_e4m3fn`` are ``w1`` /
  ``w2`` as stored (``[out, in]``, no transpose), ``gate_up_proj_scale_inv [E, ceil(2I/bn),
  ceil(H/bk)]`` / ``down_proj_scale_inv`` their float32 block scales (the multipliers, DeepSeek's
  "scale_inv"), ``quant="fp8[bn x bk]"`` from the module's ``block_size`` (``"fp8"`` at 128x128;
  ``bk`` must be 128, ``bn`` a multiple or divisor of 128). ``scale_fmt="ue8m0"`` scales
  (``float8_e8m0fnu``) run as ``"fp8_ue8m0"`` from a float32 copy of the scales made once per
  module (1/16384 of the weights' bytes). moe_route quantises the tokens per token and 128
  columns at each call, as transformers' ``activation_scheme="dynamic"`` does.
* FP4 (``expert_dtype="fp4"``, DeepSeek-V4): ``int8 [E, N, K/2]`` e2m1 pairs (low nibble first)
  with e8m0 scales ``[E, N, K/32]`` are ``quant="mxfp4"`` through ``.view(torch.uint8)``
  (float32 power-of-two scales: converted once); the tokens stay 16-bit (DeepGEMM quantises
  them to FP8 there).
* Falls back (see below; to transformers' FP8 table): ``activation_scheme="static"``,
  ``block_size=None`` (one scale per matrix), other block widths, scales of another shape
  (e.g. the two-row gate/up scale transformers allocates when ``2I < bn``).

gpt-oss's MXFP4 experts (``transformers.integrations.mxfp4.Mxfp4GptOssExperts``) have no such
table: they are not decorated with ``@use_experts_implementation``, ``Mxfp4GptOssMLP`` calls the
hub's Triton ``matmul_ogs`` directly, and the loaded weights are swizzled into that kernel's
tensor objects. :func:`describe` lists them as blocks outside the interface. To run gpt-oss on
moe_route, load it dequantised (``Mxfp4Config(dequantize=True)``: bf16 experts, moe_route's
16-bit path), or quantise a layer's experts with ``moe_route.quantize_experts(w, "mxfp4")`` (the
same e2m1 + ue8m0-per-32 format, unswizzled) and call ``fused_moe(..., quant="mxfp4")``.

Not supported, and what happens then: an ``act_fn`` or ``_apply_gate`` that matches none of
the above (e.g. Step-3.7's clamp after the activation, a soft-capped SwiGLU, a gated ReLU),
``has_post_expert_norm=True`` (the norm sits between GEMM2 and the weighted sum that fused_moe
fuses), weights of another dtype than float32 / float16 / bfloat16 or of two dtypes. Such a
module *falls back*: a :class:`MoeRouteFallbackWarning` names the class and the reason (once per
distinct message, by Python's default warning filter), and transformers' ``"grouped_mm"``
implementation runs it. A warning rather than an error, so that one unsupported MoE block (say,
in a vision tower) does not stop a model whose other layers run on moe_route;
``register(fallback="error")`` raises ``NotImplementedError`` instead.

Blocks that ``experts_implementation`` never reaches: some families (DBRX, Llama 4, JetMoE,
LongCat-Flash, Step-3.7, Doge, VitPose, ...) build their experts without
``@use_experts_implementation``, so whatever the implementation asked for, they run their own
forward. Asking for a moe_route name on a model that has such blocks
(``from_pretrained``/``from_config(..., experts_implementation=...)`` or
``set_experts_implementation``) emits one :class:`MoeRouteNoOpWarning` naming them. transformers
offers no hook there, so :func:`register` wraps ``PreTrainedModel.post_init`` and
``PreTrainedModel.set_experts_implementation`` (once; they call the originals unchanged) to see
the request.

:func:`describe` lists, before running anything, which modules of a model run where and why, the
blocks that bypass the interface included, and says when moe_route is not registered yet.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from ..activations import GATED_KINDS, KIND_CODES, Activation
from ..grouped_gemm import GEMM_DTYPES
from ..moe import fused_moe

#: The name under which :func:`register` installs moe_route by default.
NAME = "moe_route"

FALLBACKS = ("grouped_mm", "batched_mm", "eager", "error")

#: ``fused_moe`` keyword arguments that :func:`register` passes through.
FUSED_MOE_OPTIONS = ("backend", "finalize", "deterministic", "gather", "allow_tf32")

#: Module attributes read as the gated activation's parameters, by parameter.
PARAMETER_ATTRS = {"alpha": ("alpha", "swiglu_alpha"), "limit": ("limit", "swiglu_limit")}

#: Attributes of an experts module that count its experts (for blocks outside the interface).
_COUNT_ATTRS = ("num_experts", "num_local_experts", "num_routed_experts", "total_experts")

# Names registered by register() in this process (the switch hook warns for these only).
_REGISTERED: set[str] = set()
# Experts modules already named in a MoeRouteNoOpWarning (one warning per module).
_WARNED_NO_OPS: weakref.WeakSet = weakref.WeakSet()


class MoeRouteFallbackWarning(UserWarning):
    """An experts module that moe_route cannot run exactly ran on another implementation."""


class MoeRouteNoOpWarning(UserWarning):
    """moe_route was asked for on a model with MoE blocks that experts_implementation does not
    reach (they build their experts without transformers' experts interface)."""


class Unsupported(Exception):
    """Raised by :func:`plan_for` with the reason a module cannot run on moe_route."""


@dataclass(frozen=True)
class ExpertsPlan:
    """How one experts module maps onto :func:`moe_route.fused_moe` (static, no tensors)."""

    #: ``fused_moe`` activation, canonical string (``str`` of a :class:`moe_route.Activation`):
    #: ``swiglu``, ``swiglu(alpha=1.702, limit=7.0, up_offset=1.0)``, ``relu2``, ...
    activation: str
    #: ``"concat"`` (gate rows, then up rows) or ``"interleaved"``; ignored when ungated.
    gate_up_layout: str
    #: Weights stored ``[E, in, out]`` (read through ``.transpose(1, 2)`` views).
    transposed: bool
    #: ``gate_up_proj`` (gated) or ``up_proj``.
    w1_name: str
    #: Per-expert biases present.
    has_bias: bool

    def __str__(self) -> str:
        layout = f" {self.gate_up_layout}" if self.w1_name == "gate_up_proj" else ""
        return (
            f"moe_route: {self.activation}{layout}"
            f"{', transposed weights' if self.transposed else ''}"
            f"{', biases' if self.has_bias else ''}"
        )


# --------------------------------------------------------------------------- recognition
def _probe_points(limit: float | None) -> torch.Tensor:
    """float64 points on both sides of ``±limit`` (when given) and through ``[-4, 4]``, where
    exact and tanh GELU differ by up to 5e-4 and SiLU's slope matters."""
    span = 1.5 * max(4.0, limit or 0.0)
    pts = torch.linspace(-span, span, 97, dtype=torch.float64)
    return torch.cat([pts, torch.linspace(-4.0, 4.0, 31, dtype=torch.float64)])


def _agrees(got: object, want: torch.Tensor) -> bool:
    """Equal to float32 rounding (an implementation may compute in float32)."""
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
        return False
    got = got.detach().to("cpu", torch.float64)
    return bool(((got - want).abs() <= 1e-5 * (1.0 + want.abs())).all())


@torch.compiler.disable
def _recognise_act_fn(act_fn: object) -> str | None:
    """The element-wise kind (a key of ``KIND_CODES``) that ``act_fn`` computes, or None."""
    if act_fn is None or not callable(act_fn):
        return None
    x = _probe_points(None)
    try:
        with torch.no_grad():
            got = act_fn(x.clone())
    except Exception:  # e.g. an activation with parameters on another device
        return None
    from ..reference import activation_reference

    for kind in KIND_CODES:
        if _agrees(got, activation_reference(x, Activation(kind))):
            return kind
    return None


def _attr_number(module: nn.Module, names: tuple[str, ...]) -> float | None:
    for name in names:
        v = getattr(module, name, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return float(v)
    return None


@torch.compiler.disable
def _recognise_apply_gate(module: nn.Module) -> tuple[Activation, str] | None:
    """``(spec, gate_up_layout)`` that the module's own ``_apply_gate`` computes, or None.

    Candidates: every gated kind (an ``_apply_gate`` need not use ``act_fn``), the module's
    ``alpha`` (and 1), its ``limit`` (and none), an ``up_offset`` of 0 or 1, both layouts.
    """
    from ..reference import activation_reference

    alpha = _attr_number(module, PARAMETER_ATTRS["alpha"])
    limit = _attr_number(module, PARAMETER_ATTRS["limit"])
    limit = limit if limit is not None and limit > 0 else None
    pts = _probe_points(limit)
    n = pts.numel()
    # Two rows: gate and up take every pairing of small, large and clamped values.
    gate = torch.stack([pts, pts.flip(0)])
    up = torch.stack([pts.roll(n // 3), pts.roll(2 * n // 3).flip(0)])
    concat = torch.cat([gate, up], dim=-1)
    interleaved = torch.stack([gate, up], dim=-1).reshape(2, 2 * n)
    got = {}
    for layout, probe in (("concat", concat), ("interleaved", interleaved)):
        try:
            with torch.no_grad():
                got[layout] = module._apply_gate(probe.clone())
        except Exception:
            got[layout] = None
    found = set()
    for k in GATED_KINDS.values():
        for a in {alpha or 1.0, 1.0} if k == "silu" else {1.0}:
            for lim in {limit, None}:
                for off in (0.0, 1.0):
                    spec = Activation(k, gated=True, alpha=a, limit=lim, up_offset=off)
                    for layout, probe in (("concat", concat), ("interleaved", interleaved)):
                        want = activation_reference(probe, spec, layout)
                        if _agrees(got[layout], want):
                            found.add((spec, layout))
    return found.pop() if len(found) == 1 else None


def _describe_act(act_fn: object) -> str:
    return type(act_fn).__name__ if isinstance(act_fn, nn.Module) else repr(act_fn)


def _plan_key(module: nn.Module) -> tuple:
    """What the plan depends on; cheap enough to compare on every forward."""
    attrs = tuple(
        v if v is None or isinstance(v, (bool, int, float)) else id(v)  # never a tensor's ==
        for v in (getattr(module, a, None) for names in PARAMETER_ATTRS.values() for a in names)
    )
    flags = tuple(
        getattr(module, f, None)
        for f in ("has_gate", "has_bias", "is_transposed", "is_concatenated",
                  "has_post_expert_norm")
    )  # fmt: skip
    return (id(getattr(module, "act_fn", None)), getattr(type(module), "_apply_gate", None),
            *flags, *attrs)  # fmt: skip


def plan_for(module: nn.Module) -> ExpertsPlan:
    """Map an experts module's flags and computation onto ``fused_moe``, or raise
    :class:`Unsupported` with the reason. The result is kept on the module (see
    :func:`_plan_key`), so the probes run once.
    """
    if not hasattr(module, "has_gate"):
        raise Unsupported(
            f"{type(module).__name__} is not decorated with @use_experts_implementation"
        )
    key = _plan_key(module)
    cached = module.__dict__.get("_moe_route_plan")
    if cached is None or cached[0] != key:
        try:
            cached = (key, _make_plan(module))
        except Unsupported as exc:
            cached = (key, str(exc))
        module.__dict__["_moe_route_plan"] = cached
    if isinstance(cached[1], str):
        raise Unsupported(cached[1])
    return cached[1]


def _make_plan(module: nn.Module) -> ExpertsPlan:
    from transformers.integrations.moe import _default_apply_gate

    cls = type(module).__name__
    if getattr(module, "has_post_expert_norm", False):
        raise Unsupported(
            "has_post_expert_norm=True: the norm sits between GEMM2 and the weighted sum, "
            "which fused_moe fuses"
        )
    act_fn = getattr(module, "act_fn", None)
    kind = _recognise_act_fn(act_fn)
    layout = "concat" if getattr(module, "is_concatenated", True) else "interleaved"
    if not module.has_gate:
        if kind is None:
            raise Unsupported(
                f"act_fn {_describe_act(act_fn)} computes none of moe_route's activations "
                f"({', '.join(KIND_CODES)})"
            )
        spec, w1_name = Activation(kind), "up_proj"
    elif getattr(type(module), "_apply_gate", _default_apply_gate) is _default_apply_gate:
        if kind is None or kind not in GATED_KINDS.values():
            raise Unsupported(
                f"gated act_fn {_describe_act(act_fn)} has no fused moe_route activation "
                "(SiLU -> swiglu, exact GELU -> geglu and tanh GELU -> geglu_tanh do)"
            )
        spec, w1_name = Activation(kind, gated=True), "gate_up_proj"
    else:
        found = _recognise_apply_gate(module)
        if found is None:
            raise Unsupported(
                f"{cls}._apply_gate computes none of moe_route's gated activations (swiglu, "
                "geglu, geglu_tanh, with the module's alpha / limit and an up_offset of 0 or 1, "
                "in either gate/up layout)"
            )
        (spec, layout), w1_name = found, "gate_up_proj"
    return ExpertsPlan(
        activation=str(spec),
        gate_up_layout=layout,
        transposed=bool(module.is_transposed),
        w1_name=w1_name,
        has_bias=bool(module.has_bias),
    )


def _operands(module: nn.Module, plan: ExpertsPlan):
    """``(w1 [E, N1, H], w2 [E, H, I], b1, b2)`` as views of the module's parameters."""
    w1 = getattr(module, plan.w1_name)
    w2 = module.down_proj
    if plan.transposed:
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
    b1 = getattr(module, f"{plan.w1_name}_bias") if plan.has_bias else None
    b2 = module.down_proj_bias if plan.has_bias else None
    if w1.dtype not in GEMM_DTYPES or w2.dtype != w1.dtype:
        raise Unsupported(
            f"weights {plan.w1_name} {w1.dtype} / down_proj {w2.dtype}: moe_route needs one "
            "dtype among float32, float16, bfloat16"
        )
    # Per-expert biases in another dtype than the weights are rare; match them (tiny tensors).
    b1 = b1.to(w1.dtype) if b1 is not None else None
    b2 = b2.to(w1.dtype) if b2 is not None else None
    return w1, w2, b1, b2


# --------------------------------------------------------------------------- quantised experts
# transformers' FP8Experts (FineGrainedFP8Config: DeepSeek-V3, Qwen3-MoE FP8, ...) holds
#   gate_up_proj [E, 2I, H] float8_e4m3fn + gate_up_proj_scale_inv [E, ceil(2I/bn), ceil(H/bk)]
#   down_proj    [E, H, I]  float8_e4m3fn + down_proj_scale_inv    [E, ceil(H/bn), ceil(I/bk)]
# (block_size = (bn, bk); scales float32, or float8_e8m0fnu for scale_fmt="ue8m0"), which is
# fused_moe's quant="fp8" layout as it stands: w1 = gate_up_proj, w2 = down_proj, the scales
# are the multipliers (w ~= q * scale, DeepSeek's "scale_inv"). expert_dtype="fp4" (DeepSeek-V4)
# holds int8 [E, N, K/2] e2m1 pairs (low nibble first) and [E, N, K/32] e8m0 scales: moe_route's
# "mxfp4" layout, read through .view(torch.uint8).
_E8M0 = getattr(torch, "float8_e8m0fnu", None)


def is_quantized_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds quantised expert weights with their ``*_scale_inv`` scales
    (transformers' ``FP8Experts``, FP8 or FP4)."""
    return hasattr(module, "down_proj_scale_inv")


def _converted_scales(module: nn.Module, scales: tuple[torch.Tensor, ...], convert):
    """``convert(scale)`` of each scale, made once and kept on the module until a scale tensor
    changes (its storage or version)."""
    key = tuple((s.data_ptr(), s._version, s.device, tuple(s.shape)) for s in scales)
    cached = module.__dict__.get("_moe_route_scales")
    if cached is None or cached[0] != key:
        with torch.no_grad():
            cached = (key, tuple(convert(s.detach()) for s in scales))
        module.__dict__["_moe_route_scales"] = cached
    return cached[1]


def _float_scales(module: nn.Module, *scales: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """float32 copies of e8m0 scales (1/16384 of the FP8 weights' bytes at 128x128 blocks),
    kept on the module (:func:`_converted_scales`)."""
    return _converted_scales(module, scales, torch.Tensor.float)


def _exponent_scales(module: nn.Module, *scales: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """MXFP4 scales as ``uint8`` ue8m0 exponents: a view of e8m0 or uint8 scales; float32
    powers of two converted once (kept like :func:`_float_scales`); others are unsupported."""
    if all(s.dtype == torch.uint8 or (_E8M0 is not None and s.dtype == _E8M0) for s in scales):
        return tuple(s.detach().view(torch.uint8) for s in scales)
    if any(s.dtype != torch.float32 for s in scales):
        raise Unsupported(f"FP4 weight scales {[s.dtype for s in scales]}: expected e8m0, uint8 "
                          "or float32 powers of two")  # fmt: skip
    return _converted_scales(module, scales, _ue8m0_exponents)


def _ue8m0_exponents(s: torch.Tensor) -> torch.Tensor:
    mant, exp = torch.frexp(s)
    if not bool(((mant == 0.5) & (exp >= -126) & (exp <= 128)).all()):
        raise Unsupported("FP4 weight scales are not all powers of two (MXFP4 takes "
                          "ue8m0 exponents)")  # fmt: skip
    return (exp - 1 + 127).to(torch.uint8)


def _quant_operands(module: nn.Module, plan: ExpertsPlan):
    """``(w1, w2, b1, b2, {quant, w1_scale, w2_scale})`` of a quantised experts module: views
    of its own tensors (detached: quantised weights are frozen), or :class:`Unsupported`."""
    from ..quant import QuantSpec, check_weight

    scheme = getattr(module, "activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise Unsupported(
            f"activation_scheme={scheme!r}: moe_route quantises the activations per token and "
            "128 columns at each call ('dynamic'), not with the checkpoint's static scales"
        )
    if plan.transposed:
        raise Unsupported("is_transposed=True on quantised weights (the scale blocks follow the "
                          "stored [E, out, in] orientation)")  # fmt: skip
    w1, s1 = getattr(module, plan.w1_name), getattr(module, f"{plan.w1_name}_scale_inv")
    w2, s2 = module.down_proj, module.down_proj_scale_inv
    E, n1 = w1.shape[0], w1.shape[1]
    gated = plan.w1_name == "gate_up_proj"
    if w1.dtype == torch.float8_e4m3fn and w2.dtype == w1.dtype:
        block = getattr(module, "block_size", None)
        if block is None:
            raise Unsupported(
                "block_size=None (one scale per expert matrix): moe_route's FP8 experts take "
                "block scales (fp8[ROWSxCOLS], 128 columns)"
            )
        block = tuple(int(b) for b in block)
        if len(block) != 2 or block[1] != 128 or not (block[0] % 128 == 0 or 128 % block[0] == 0):
            raise Unsupported(f"block_size={list(block)}: moe_route's FP8 GEMMs take 128 columns "
                              "per scale and a multiple or divisor of 128 rows")  # fmt: skip
        ue8m0 = _E8M0 is not None and s1.dtype == _E8M0
        if ue8m0 or s2.dtype != torch.float32:
            s1, s2 = _float_scales(module, s1, s2)
        spec = QuantSpec("fp8_block", block, ue8m0)
        H = w1.shape[2]
    elif w1.dtype in (torch.int8, torch.uint8) and w2.dtype == w1.dtype:
        spec = QuantSpec("mxfp4")
        w1, w2 = w1.view(torch.uint8), w2.view(torch.uint8)
        s1, s2 = _exponent_scales(module, s1, s2)
        H = 2 * w1.shape[2]
    else:
        raise Unsupported(
            f"quantised weights {plan.w1_name} {w1.dtype} / down_proj {w2.dtype}: moe_route takes "
            "float8_e4m3fn (block scales) or int8 / uint8 packed e2m1 (FP4) weights"
        )
    w1, w2, s1, s2 = (t.detach() for t in (w1, w2, s1, s2))
    try:
        check_weight(plan.w1_name, w1, f"{plan.w1_name}_scale_inv", s1, spec, (E, n1, H))
        check_weight("down_proj", w2, "down_proj_scale_inv", s2, spec,
                     (E, H, n1 // 2 if gated else n1))  # fmt: skip
    except (TypeError, ValueError) as exc:
        raise Unsupported(str(exc)) from None
    b1 = getattr(module, f"{plan.w1_name}_bias", None) if plan.has_bias else None
    b2 = getattr(module, "down_proj_bias", None) if plan.has_bias else None
    return w1, w2, b1, b2, {"quant": spec, "w1_scale": s1, "w2_scale": s2}


def _resolve(module: nn.Module, plan: ExpertsPlan):
    """``(w1, w2, b1, b2, quant kwargs)`` of any experts module (empty kwargs: 16/32-bit)."""
    if is_quantized_experts(module):
        return _quant_operands(module, plan)
    return (*_operands(module, plan), {})


def _quant_summary(quant: dict) -> str:
    """How ``describe`` names a quantised path."""
    spec = quant.get("quant")
    if spec is None:
        return ""
    if spec.format == "mxfp4":
        return f", FP4 weights as quant={str(spec)!r} (e2m1 + ue8m0 per 32; 16-bit activations)"
    rows, cols = spec.block
    return (f", FP8 weights as quant={str(spec)!r} ({rows}x{cols} blocks; activations e4m3 per "
            f"token per {cols} columns)")  # fmt: skip


def _activation_dtype(hidden_states: torch.Tensor, w1: torch.Tensor, quant: dict) -> torch.dtype:
    """The dtype the experts take their tokens in: the weights' (16/32-bit experts; autocast may
    hand float32 activations to bf16 experts), the tokens' own for FP8 (bf16 / fp16 / fp32),
    bf16 for MXFP4 tokens of another dtype on CUDA (its GEMMs take 16-bit tokens)."""
    spec = quant.get("quant")
    if spec is None:
        return w1.dtype
    dt = hidden_states.dtype
    if dt in (torch.bfloat16, torch.float16):
        return dt
    if dt == torch.float32 and (spec.fp8 or not hidden_states.is_cuda):
        return dt
    return torch.bfloat16


def _fallback_table(module: nn.Module):
    """transformers' experts functions for ``module``'s kind (FP8 modules have their own)."""
    if is_quantized_experts(module):
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS

        return ALL_FP8_EXPERTS_FUNCTIONS
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return ALL_EXPERTS_FUNCTIONS


def _register_quantized(name: str, fn) -> None:
    """Install ``fn`` in transformers' FP8 experts interface too (``FP8Experts`` looks its
    implementation up there, and rejects a name it does not hold)."""
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:  # a transformers without FineGrainedFP8
        return
    FP8ExpertsInterface.register(name, fn)


# --------------------------------------------------------------------------- the forward
def _fallback_forward(module, hidden_states, top_k_index, top_k_weights, fallback, reason):
    cls = type(module).__name__
    if fallback == "error":
        raise NotImplementedError(f"moe_route cannot run {cls}: {reason}")
    warnings.warn(
        f"moe_route cannot run {cls} ({reason}); running transformers' {fallback!r} experts "
        "implementation for it instead (moe_route.integrations.hf.register(fallback='error') "
        "raises here)",
        MoeRouteFallbackWarning,
        stacklevel=3,
    )
    if fallback == "eager":
        # use_experts_implementation wraps the class's own forward with functools.wraps.
        eager = type(module).forward.__wrapped__
        return eager(module, hidden_states, top_k_index, top_k_weights)
    table = _fallback_table(module)
    return table[fallback](module, hidden_states, top_k_index, top_k_weights)


def moe_route_experts_forward(
    module: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    fallback: str = "grouped_mm",
    **fused_moe_options,
) -> torch.Tensor:
    """The experts forward that :func:`register` installs (see the module docstring).

    Args:
        module: an experts module of transformers (``@use_experts_implementation``).
        hidden_states: ``[T, H]`` tokens.
        top_k_index: ``[T, K]`` expert ids (ids ``>= E`` are slots of other EP ranks).
        top_k_weights: ``[T, K]`` router weights.
        fallback: what runs a module moe_route cannot: ``"grouped_mm"``, ``"batched_mm"``,
            ``"eager"`` (after a :class:`MoeRouteFallbackWarning`), or ``"error"``.
        **fused_moe_options: passed to :func:`moe_route.fused_moe` (``backend``, ...).

    Returns:
        ``[T, H]`` in ``hidden_states.dtype``.
    """
    try:
        plan = plan_for(module)
        w1, w2, b1, b2, quant = _resolve(module, plan)
    except Unsupported as exc:
        return _fallback_forward(
            module, hidden_states, top_k_index, top_k_weights, fallback, str(exc)
        )
    E = w1.shape[0]
    ids = top_k_index
    if getattr(module, "_is_expert_parallel", False):
        ids = torch.where(ids >= E, -1, ids)  # another rank's slot: dropped here
    out = fused_moe(
        hidden_states.to(_activation_dtype(hidden_states, w1, quant)),
        w1,
        w2,
        top_k_weights,
        ids,
        activation=plan.activation,
        gate_up_layout=plan.gate_up_layout,
        b1=b1,
        b2=b2,
        **quant,
        **fused_moe_options,
    )
    return out.to(hidden_states.dtype)


def register(name: str = NAME, *, fallback: str = "grouped_mm", **fused_moe_options) -> str:
    """Install moe_route in transformers' ``ExpertsInterface`` under ``name``.

    Afterwards ``from_pretrained(..., experts_implementation=name)``,
    ``from_config(config, experts_implementation=name)`` and
    ``model.set_experts_implementation(name)`` run the experts on moe_route (before it,
    transformers rejects the name as not a valid experts implementation). Calling it again
    replaces the earlier registration (e.g. with other options).

    It also wraps ``PreTrainedModel.post_init`` and ``set_experts_implementation`` (once) so
    that asking for ``name`` on a model with MoE blocks outside the experts interface warns
    (:class:`MoeRouteNoOpWarning`): those blocks would silently keep their own forward.

    Args:
        name: the implementation's name (default ``"moe_route"``): a non-empty ``str`` that
            names none of transformers' own implementations (``"eager"``, ``"grouped_mm"``,
            ``"batched_mm"``, ...; registering over one would make it run moe_route), nor one
            that another library registered; a name this function registered before is
            replaced.
        fallback: for modules moe_route cannot run: ``"grouped_mm"`` (default), ``"batched_mm"``
            or ``"eager"`` after a :class:`MoeRouteFallbackWarning`; ``"error"`` raises
            ``NotImplementedError``.
        **fused_moe_options: fixed keyword arguments of :func:`moe_route.fused_moe`: ``backend``
            (``"auto"``: Triton on CUDA, the reference on CPU), ``finalize``,
            ``deterministic``, ``gather``, ``allow_tf32``; checked here, as ``fused_moe``
            checks them, so that a bad value fails at registration, not at the first forward.

    Returns:
        ``name``.
    """
    from transformers.integrations.moe import ExpertsInterface

    _check_name(name)
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback={fallback!r}: expected one of {FALLBACKS}")
    unknown = set(fused_moe_options) - set(FUSED_MOE_OPTIONS)
    if unknown:
        raise TypeError(
            f"register() got fused_moe options {sorted(unknown)}; expected some of "
            f"{FUSED_MOE_OPTIONS}"
        )
    _check_fused_moe_options(fused_moe_options)
    fn = functools.partial(moe_route_experts_forward, fallback=fallback, **fused_moe_options)
    functools.update_wrapper(fn, moe_route_experts_forward)
    ExpertsInterface.register(name, fn)
    _register_quantized(name, fn)
    _REGISTERED.add(name)
    _install_switch_hook()
    return name


def _taken_names() -> set[str]:
    """Experts implementations that :func:`register` must not replace: transformers' own
    (``"eager"`` is not in its tables but is its name for the modules' own forward) and any
    another library installed, in the plain and the FP8 tables."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    names = {"eager", *ALL_EXPERTS_FUNCTIONS.keys()}
    try:
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
    except ImportError:  # a transformers without FineGrainedFP8
        pass
    else:
        names.update(ALL_FP8_EXPERTS_FUNCTIONS.keys())
    return names - _REGISTERED


def _check_name(name: object) -> None:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__} {name!r}")
    if not name or name != name.strip():
        raise ValueError(f"name={name!r}: expected a non-empty name without surrounding spaces")
    taken = _taken_names()
    if name in taken:
        raise ValueError(
            f"name={name!r} already names an experts implementation that moe_route did not "
            f"register (transformers' own or another library's: {sorted(taken)}); registering "
            "over it would make every model that asks for it run moe_route: pick another name "
            f"(the default is {NAME!r})"
        )


def _check_fused_moe_options(options: dict) -> None:
    """The values of ``register``'s ``fused_moe`` options, as ``fused_moe`` checks them."""
    from .. import _checks
    from ..arch import check_backend_name
    from ..layer import FINALIZE_CHOICES

    if "backend" in options:
        check_backend_name(options["backend"])
    if "finalize" in options and options["finalize"] not in FINALIZE_CHOICES:
        raise ValueError(f"finalize={options['finalize']!r}: expected one of {FINALIZE_CHOICES}")
    for flag in ("deterministic", "allow_tf32"):
        if flag in options:
            _checks.check_bool(flag, options[flag])
    if "gather" in options:
        _checks.check_bool("gather", options["gather"], optional=True)


def is_registered(name: str = NAME) -> bool:
    """Whether transformers knows ``name`` as an experts implementation."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return name in ALL_EXPERTS_FUNCTIONS


# --------------------------------------------------------------------------- blocks outside
def bypassing_experts(model: nn.Module) -> dict[str, str]:
    """MoE blocks of ``model`` that ``experts_implementation`` does not reach.

    A module that counts its experts (``num_experts`` / ``num_local_experts`` / ... ``> 0``)
    and either has "expert" in its class name or holds the experts itself (see
    :func:`_holds_experts`: Doge's ``DogeCDMoE``, VitPose's ``VitPoseNaiveMoe``), that is not
    decorated with ``@use_experts_implementation`` and has no decorated experts inside,
    always runs its own forward (DBRX, Llama 4, JetMoE, LongCat-Flash, Step-3.7, Doge,
    VitPose, NLLB-MoE, Switch Transformers). A whole model (a ``PreTrainedModel``) is never
    listed, and submodules of a listed module are not listed.

    Returns:
        ``{module name: class name}``.
    """
    from transformers import PreTrainedModel

    modules = list(model.named_modules())
    decorated = [n for n, m in modules if hasattr(m, "has_gate")]
    found: dict[str, str] = {}
    for module_name, module in modules:
        if any(module_name.startswith(f"{p}.") for p in found):
            continue
        if hasattr(module, "has_gate") or isinstance(module, PreTrainedModel):
            continue
        count = next((getattr(module, a) for a in _COUNT_ATTRS if hasattr(module, a)), None)
        if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
            continue
        named = "expert" in type(module).__name__.lower()
        if not (named or _holds_experts(module, count)):
            continue
        inside = f"{module_name}." if module_name else ""
        if any(n.startswith(inside) for n in decorated):
            continue  # a block around experts that the interface reaches
        found[module_name] = type(module).__name__
    return found


def _holds_experts(module: nn.Module, count: int) -> bool:
    """Whether ``module`` itself holds ``count`` experts, whatever its class is called: a
    list or dict of ``count`` modules, weights of its own stacked ``[count, ...]`` (three or
    more dimensions: a router's ``[count, H]`` is two), or an embedding of ``count`` rows (a
    vector per expert, as Doge's)."""
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return len(module) == count
    for p in module.parameters(recurse=False):
        if p.dim() >= 3 and p.shape[0] == count:
            return True
    return any(
        isinstance(child, nn.Embedding) and child.num_embeddings == count
        for child in module.children()
    )


def _bypass_reason(cls: str) -> str:
    return (
        f"no-op: {cls} builds its experts without transformers' experts interface "
        "(@use_experts_implementation), so experts_implementation never reaches it; it runs "
        "its own forward whatever is asked for"
    )


def _module_implementation(module: nn.Module) -> object:
    """The experts implementation a decorated experts module will run: its own config's."""
    return getattr(getattr(module, "config", None), "_experts_implementation", None)


def _unreached_experts(model: nn.Module) -> dict[str, str]:
    """``{name: implementation}`` of the experts modules that will not run moe_route although
    ``model`` asks for it: their config is a sub-config (a vision tower's, say) that the switch
    does not update, so each keeps the implementation its own config names."""
    asked = _module_implementation(model)
    if not (isinstance(asked, str) and asked in _REGISTERED):
        return {}
    out = {}
    for module_name, module in model.named_modules():
        if hasattr(module, "has_gate") and hasattr(module, "down_proj"):
            own = _module_implementation(module)
            if isinstance(own, str) and own != asked and own not in _REGISTERED:
                out[module_name] = own
    return out


def _unreached_reason(module: nn.Module) -> str:
    return (
        f"its config ({type(module.config).__name__}) asks for "
        f"{_module_implementation(module)!r}: transformers does not pass experts_implementation "
        "to this sub-config (set it there too to run it on moe_route)"
    )


def _on_request(model: nn.Module, name: str) -> None:
    """A moe_route name was asked for on ``model``: plan its experts modules now (the probes
    then never run inside a forward) and warn about the blocks the request does not reach.

    Never fails the model's construction or switch: ``from_pretrained`` builds the model under
    ``torch.device("meta")``, so the probes run under an explicit CPU device, and an error
    other than :class:`Unsupported` is left to the forward, which plans again and raises it
    there (only :class:`Unsupported` is cached)."""
    with torch.device("cpu"):
        for module in model.modules():
            if hasattr(module, "has_gate") and hasattr(module, "down_proj"):
                with contextlib.suppress(Exception):  # Unsupported: said by the fallback
                    plan_for(module)
    modules = dict(model.named_modules())
    blocks = {n: f"{n or '<model>'} ({c})" for n, c in bypassing_experts(model).items()}
    _warn_once(modules, blocks, lambda k, listed: (
        f"experts_implementation={name!r} does not reach {k} MoE block(s) of "
        f"{type(model).__name__}: {listed}. They build their experts without transformers' "
        "experts interface (@use_experts_implementation) and keep running their own forward; "
        "moe_route.integrations.hf.describe(model) lists every experts module"
    ))  # fmt: skip
    unreached = {n: f"{n} ({impl!r})" for n, impl in _unreached_experts(model).items()}
    _warn_once(modules, unreached, lambda k, listed: (
        f"experts_implementation={name!r} does not reach {k} experts module(s) of "
        f"{type(model).__name__} whose config is a sub-config: {listed} keep the "
        "implementation their own config names; moe_route.integrations.hf.describe(model) "
        "says which"
    ))  # fmt: skip


def _warn_once(modules: dict, found: dict[str, str], message) -> None:
    """One :class:`MoeRouteNoOpWarning` naming the modules of ``found`` (``{name: label}``)
    not warned about before (``message(count, listed)``)."""
    new = {n: label for n, label in found.items() if modules[n] not in _WARNED_NO_OPS}
    if not new:
        return
    for n in new:
        _WARNED_NO_OPS.add(modules[n])
    listed = ", ".join(list(new.values())[:4])
    listed += f" and {len(new) - 4} more" if len(new) > 4 else ""
    warnings.warn(message(len(new), listed), MoeRouteNoOpWarning, stacklevel=4)


def _install_switch_hook() -> None:
    """Wrap ``PreTrainedModel.post_init`` (the end of every model's ``__init__``, so of
    ``from_pretrained`` / ``from_config(..., experts_implementation=...)``: the modules exist and
    the config holds the request) and ``PreTrainedModel.set_experts_implementation`` (which
    leaves the config alone on a model without decorated experts, so the request is read from
    its argument).

    transformers offers no callback for either: it checks the name in
    ``PreTrainedModel.__init__``, before the model's submodules exist, and a forward hook would
    never fire on the blocks that matter here (they never call an experts implementation)."""
    from transformers import PreTrainedModel

    # Each wrapper is installed once (a later functools.wraps around it keeps the mark), calls
    # the original first and unchanged, and does nothing more unless a registered moe_route
    # name was asked for: models that never ask pay one attribute read per post_init.
    post_init = PreTrainedModel.post_init
    if not getattr(post_init, "_moe_route_hook", False):

        @functools.wraps(post_init)
        def hooked_post_init(self, *args, **kwargs):
            out = post_init(self, *args, **kwargs)
            requested = getattr(getattr(self, "config", None), "_experts_implementation", None)
            if isinstance(requested, str) and requested in _REGISTERED:
                _on_request(self, requested)
            return out

        hooked_post_init._moe_route_hook = True
        PreTrainedModel.post_init = hooked_post_init

    set_impl = PreTrainedModel.set_experts_implementation
    if not getattr(set_impl, "_moe_route_hook", False):

        @functools.wraps(set_impl)
        def hooked_set_experts_implementation(self, experts_implementation, *args, **kwargs):
            out = set_impl(self, experts_implementation, *args, **kwargs)
            asked = experts_implementation
            names = asked.values() if isinstance(asked, dict) else [asked]
            ours = [n for n in names if isinstance(n, str) and n in _REGISTERED]
            if ours:
                _on_request(self, ours[0])
            return out

        hooked_set_experts_implementation._moe_route_hook = True
        PreTrainedModel.set_experts_implementation = hooked_set_experts_implementation


# --------------------------------------------------------------------------- describe
class Description(dict):
    """``{module name: how it runs}`` with ``notes`` (e.g. how to register); ``str()`` is a
    printable report."""

    def __init__(self, entries: dict[str, str], notes: list[str]):
        super().__init__(entries)
        self.notes = notes

    def __str__(self) -> str:
        lines = [f"{name or '<module>'}: {how}" for name, how in self.items()]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def describe(model: nn.Module, name: str = NAME) -> Description:
    """For every experts module of ``model``: how moe_route would run it, or why it cannot.

    Args:
        model: a transformers model (or any module holding experts modules).
        name: the implementation name the notes refer to.

    Returns:
        ``{module name: "moe_route: swiglu concat" | "fallback: <reason>" | "no-op: <reason>"}``
        (a :class:`Description`): ``fallback`` modules run on transformers' ``grouped_mm``
        (see :func:`register`), ``no-op`` ones are MoE blocks outside the experts interface,
        which keep their own forward. ``.notes`` says when ``name`` is not registered yet and
        how to register it.
    """
    report = {}
    unreached = _unreached_experts(model)
    for module_name, module in model.named_modules():
        if not (hasattr(module, "has_gate") and hasattr(module, "down_proj")):
            continue
        try:
            plan = plan_for(module)
            how = str(plan) + _quant_summary(_resolve(module, plan)[4])
        except Unsupported as exc:
            how = f"fallback: {exc}"
        if module_name in unreached:
            how = f"{unreached[module_name]}: {_unreached_reason(module)} (on moe_route: {how})"
        report[module_name] = how
    for module_name, cls in bypassing_experts(model).items():
        report[module_name] = _bypass_reason(cls)
    notes = []
    if not is_registered(name):
        notes.append(
            f"{name!r} is not registered in transformers yet: call "
            "moe_route.integrations.hf.register() before from_pretrained(..., "
            f"experts_implementation={name!r}) or model.set_experts_implementation({name!r}) "
            "(transformers rejects an unknown name)"
        )
    return Description(report, notes)
