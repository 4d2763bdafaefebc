"""How one experts module of transformers maps onto :func:`moe_route.fused_moe`.

Its flags give the layout (``has_gate``, ``is_transposed``, ``is_concatenated``, ``has_bias``);
its activation is recognised from what the module computes (``act_fn`` on a probe vector, or
its own ``_apply_gate`` on a probe ``[gate | up]`` tensor), not from its class name. The result,
an :class:`ExpertsPlan`, is kept on the module (:func:`plan_for`); :func:`_operands` gives its
16/32-bit weights and biases as views. The package docstring (:mod:`moe_route.integrations.hf`)
says what is recognised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..._checks import GEMM_DTYPES
from ...activations import GATED_KINDS, KIND_CODES, Activation

#: Module attributes read as the gated activation's parameters, by parameter. The soft caps
#: are looked for on the module and on its ``act_fn``, as numbers or as submodules holding a
#: ``softcap`` number (Inkling2: ``act_fn.gate_softcap.softcap``, ``act_fn.up_softcap.softcap``).
PARAMETER_ATTRS = {
    "alpha": ("alpha", "swiglu_alpha"),
    "limit": ("limit", "swiglu_limit"),
    "gate_softcap": ("gate_softcap", "mlp_gate_softcap"),
    "up_softcap": ("up_softcap", "mlp_up_softcap"),
}
#: The parameters read on the module only (``getattr``); the others are :func:`_softcaps`.
_MODULE_PARAMETERS = ("alpha", "limit")


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
def _probe_points(limit: float | None, *caps: float | None) -> torch.Tensor:
    """float64 points on both sides of ``±limit`` (when given) and through ``[-4, 4]``, where
    exact and tanh GELU differ by up to 5e-4 and SiLU's slope matters; out to 1.5 times the
    largest soft cap given, where a cap and no cap differ."""
    span = 1.5 * max(4.0, limit or 0.0, *(c or 0.0 for c in caps))
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
    from ...reference import activation_reference

    for kind in KIND_CODES:
        if _agrees(got, activation_reference(x, Activation(kind))):
            return kind
    return None


def _number(v: object) -> float | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


def _attr_number(module: nn.Module, names: tuple[str, ...]) -> float | None:
    for name in names:
        v = _number(getattr(module, name, None))
        if v is not None:
            return v
    return None


def _softcaps(module: nn.Module) -> tuple[float | None, float | None]:
    """``(gate_softcap, up_softcap)`` the module or its ``act_fn`` holds (> 0), else None.

    Read from the instances' ``__dict__`` and submodules, never by ``getattr`` (a missing
    attribute of an ``nn.Module`` costs microseconds, and :func:`_plan_key` runs per forward):
    a number, or a submodule holding a ``softcap`` number."""
    holders = [module]
    act_fn = module.__dict__.get("_modules", {}).get("act_fn", module.__dict__.get("act_fn"))
    if act_fn is not None:
        holders.append(act_fn)
    found = []
    for param in ("gate_softcap", "up_softcap"):
        cap = None
        for holder in holders:
            attrs = getattr(holder, "__dict__", {})
            for name in PARAMETER_ATTRS[param]:
                v = attrs.get("_modules", {}).get(name, attrs.get(name))
                if isinstance(v, nn.Module):
                    v = v.__dict__.get("softcap")
                v = _number(v)
                if v is not None and v > 0:
                    cap = v
                    break
            if cap is not None:
                break
        found.append(cap)
    return found[0], found[1]


@torch.compiler.disable
def _recognise_apply_gate(module: nn.Module) -> tuple[Activation, str] | None:
    """``(spec, gate_up_layout)`` that the module's own ``_apply_gate`` computes, or None.

    Candidates: every gated kind (an ``_apply_gate`` need not use ``act_fn``), the module's
    ``alpha`` (and 1), its ``limit`` (and none), an ``up_offset`` of 0 or 1, for ``swiglu`` the
    soft caps it holds (and none: :func:`_softcaps`), both layouts.
    """
    from ...reference import activation_reference

    alpha = _attr_number(module, PARAMETER_ATTRS["alpha"])
    limit = _attr_number(module, PARAMETER_ATTRS["limit"])
    limit = limit if limit is not None and limit > 0 else None
    gate_cap, up_cap = _softcaps(module)
    pts = _probe_points(limit, gate_cap, up_cap)
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
    for spec in _candidates(alpha, limit, gate_cap, up_cap):
        for layout, probe in (("concat", concat), ("interleaved", interleaved)):
            want = activation_reference(probe, spec, layout)
            if _agrees(got[layout], want):
                found.add((spec, layout))
    return found.pop() if len(found) == 1 else None


def _candidates(alpha, limit, gate_cap, up_cap):
    """The gated activations :func:`_recognise_apply_gate` compares with (a set: no repeats)."""
    specs = set()
    for k in GATED_KINDS.values():
        swiglu = k == "silu"
        for a in {alpha or 1.0, 1.0} if swiglu else {1.0}:
            for lim in {limit, None}:
                for off in (0.0, 1.0):
                    for gc in {gate_cap, None} if swiglu else {None}:
                        for uc in {up_cap, None} if swiglu else {None}:
                            specs.add(Activation(k, gated=True, alpha=a, limit=lim,
                                                 up_offset=off, gate_softcap=gc,
                                                 up_softcap=uc))  # fmt: skip
    return specs


def _describe_act(act_fn: object) -> str:
    return type(act_fn).__name__ if isinstance(act_fn, nn.Module) else repr(act_fn)


def _plan_key(module: nn.Module) -> tuple:
    """What the plan depends on; cheap enough to compare on every forward."""
    attrs = tuple(
        v if v is None or isinstance(v, (bool, int, float)) else id(v)  # never a tensor's ==
        for v in (getattr(module, a, None) for p in _MODULE_PARAMETERS
                  for a in PARAMETER_ATTRS[p])
    ) + _softcaps(module)  # fmt: skip
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
                "geglu, geglu_tanh, with the module's alpha / limit, an up_offset of 0 or 1 and "
                "swiglu's soft caps, in either gate/up layout)"
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
