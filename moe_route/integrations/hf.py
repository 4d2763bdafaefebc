"""Hugging Face transformers (>= 5) integration: moe_route as an *experts implementation*.

transformers 5 runs the expert computation of an MoE layer through
``transformers.integrations.moe.ExpertsInterface``: an experts class decorated with
``@use_experts_implementation`` calls ``fn(experts_module, hidden_states, top_k_index,
top_k_weights)`` for the implementation its config names (``"eager"``, ``"grouped_mm"``, ...).
:func:`register` adds ``"moe_route"`` to that table::

    import moe_route.integrations.hf as moe_hf

    moe_hf.register()
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

The activation comes from the module's ``act_fn``: SiLU gives ``swiglu`` when gated and ``silu``
otherwise, exact (erf) GELU ``geglu`` / ``gelu``, and, ungated only, ReLU ``relu`` and the linear
activation ``identity``. ``is_concatenated=False`` is honoured as interleaved gate/up rows (as
transformers' ``sonicmoe`` does), even though transformers' default ``_apply_gate`` always
splits in halves. Slots that transformers' expert parallelism sends elsewhere (ids ``>= E``,
weight zero) become dropped slots (``-1``).

Not supported, and what happens then: an experts class that overrides ``_apply_gate`` (gpt-oss,
DeepSeek-V4, GLM-5 clamp their SwiGLU; moe_route's kernels have no clamp), any other activation
(tanh-approximated GELU, ReLU², ...), a gated ReLU / identity, ``has_post_expert_norm=True``
(the norm sits between GEMM2 and the weighted sum that fused_moe fuses), weights of another dtype
than float32 / float16 / bfloat16 or of two dtypes. Such a module *falls back*: a
:class:`MoeRouteFallbackWarning` names the class and the reason (once per distinct message, by
Python's default warning filter), and transformers' ``"grouped_mm"`` implementation runs it. A
warning rather than an error, so that one unsupported MoE block (say, in a vision tower) does not
stop a model whose other layers run on moe_route; ``register(fallback="error")`` raises
``NotImplementedError`` instead, and :func:`describe` lists, before running anything, which
modules of a model run where.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from ..grouped_gemm import GEMM_DTYPES
from ..moe import fused_moe

#: The name under which :func:`register` installs moe_route by default.
NAME = "moe_route"

FALLBACKS = ("grouped_mm", "batched_mm", "eager", "error")

#: ``fused_moe`` keyword arguments that :func:`register` passes through.
FUSED_MOE_OPTIONS = ("backend", "finalize", "deterministic", "gather", "allow_tf32")


class MoeRouteFallbackWarning(UserWarning):
    """An experts module that moe_route cannot run exactly ran on another implementation."""


class Unsupported(Exception):
    """Raised by :func:`plan_for` with the reason a module cannot run on moe_route."""


@dataclass(frozen=True)
class ExpertsPlan:
    """How one experts module maps onto :func:`moe_route.fused_moe` (static, no tensors)."""

    #: ``fused_moe`` activation: ``swiglu``/``geglu`` (gated) or ``silu``/``gelu``/``relu``/
    #: ``identity``.
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


# --------------------------------------------------------------------------- layout mapping
def _plain_activation(act_fn: object) -> str | None:
    """fused_moe's name for an element-wise activation module/function, or None."""
    from transformers import activations as hf_act

    if isinstance(act_fn, (nn.SiLU, hf_act.SiLUActivation)) or act_fn is torch.nn.functional.silu:
        return "silu"
    if isinstance(act_fn, nn.GELU):
        return "gelu" if act_fn.approximate == "none" else None
    if isinstance(act_fn, hf_act.GELUActivation):
        # Both variants are the exact erf GELU (nn.functional.gelu or the python formula).
        return "gelu"
    if act_fn is torch.nn.functional.gelu:
        return "gelu"
    if isinstance(act_fn, nn.ReLU) or act_fn is torch.nn.functional.relu:
        return "relu"
    if isinstance(act_fn, (nn.Identity, hf_act.LinearActivation)):
        return "identity"
    return None


def _describe_act(act_fn: object) -> str:
    return type(act_fn).__name__ if isinstance(act_fn, nn.Module) else repr(act_fn)


def plan_for(module: nn.Module) -> ExpertsPlan:
    """Map an experts module's flags and ``act_fn`` onto ``fused_moe``, or raise
    :class:`Unsupported` with the reason.
    """
    from transformers.integrations.moe import _default_apply_gate

    cls = type(module).__name__
    if not hasattr(module, "has_gate"):
        raise Unsupported(f"{cls} is not decorated with @use_experts_implementation")
    if getattr(module, "has_post_expert_norm", False):
        raise Unsupported(
            "has_post_expert_norm=True: the norm sits between GEMM2 and the weighted sum, "
            "which fused_moe fuses"
        )
    plain = _plain_activation(getattr(module, "act_fn", None))
    if module.has_gate:
        if getattr(type(module), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
            raise Unsupported(
                f"{cls} overrides _apply_gate (e.g. a clamped SwiGLU); moe_route's fused "
                "activations are plain swiglu / geglu"
            )
        gated = {"silu": "swiglu", "gelu": "geglu"}.get(plain)
        if gated is None:
            raise Unsupported(
                f"gated act_fn {_describe_act(getattr(module, 'act_fn', None))} has no fused "
                "moe_route activation (SiLU -> swiglu and exact GELU -> geglu do)"
            )
        activation, w1_name = gated, "gate_up_proj"
    else:
        if plain is None:
            raise Unsupported(
                f"act_fn {_describe_act(getattr(module, 'act_fn', None))} has no moe_route "
                "activation (silu, exact gelu, relu, identity do)"
            )
        activation, w1_name = plain, "up_proj"
    return ExpertsPlan(
        activation=activation,
        gate_up_layout="concat" if getattr(module, "is_concatenated", True) else "interleaved",
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
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return ALL_EXPERTS_FUNCTIONS[fallback](module, hidden_states, top_k_index, top_k_weights)


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
        w1, w2, b1, b2 = _operands(module, plan)
    except Unsupported as exc:
        return _fallback_forward(
            module, hidden_states, top_k_index, top_k_weights, fallback, str(exc)
        )
    E = w1.shape[0]
    ids = top_k_index
    if getattr(module, "_is_expert_parallel", False):
        ids = torch.where(ids >= E, -1, ids)  # another rank's slot: dropped here
    out = fused_moe(
        hidden_states.to(w1.dtype),  # autocast may hand float32 activations to bf16 experts
        w1,
        w2,
        top_k_weights,
        ids,
        activation=plan.activation,
        gate_up_layout=plan.gate_up_layout,
        b1=b1,
        b2=b2,
        **fused_moe_options,
    )
    return out.to(hidden_states.dtype)


def register(name: str = NAME, *, fallback: str = "grouped_mm", **fused_moe_options) -> str:
    """Install moe_route in transformers' ``ExpertsInterface`` under ``name``.

    Afterwards ``from_pretrained(..., experts_implementation=name)``,
    ``from_config(config, experts_implementation=name)`` and
    ``model.set_experts_implementation(name)`` run the experts on moe_route. Calling it again
    replaces the earlier registration (e.g. with other options).

    Args:
        name: the implementation's name (default ``"moe_route"``).
        fallback: for modules moe_route cannot run: ``"grouped_mm"`` (default), ``"batched_mm"``
            or ``"eager"`` after a :class:`MoeRouteFallbackWarning`; ``"error"`` raises
            ``NotImplementedError``.
        **fused_moe_options: fixed keyword arguments of :func:`moe_route.fused_moe`: ``backend``
            (``"auto"``: Triton on CUDA, the reference on CPU), ``finalize``,
            ``deterministic``, ``gather``, ``allow_tf32``.

    Returns:
        ``name``.
    """
    from transformers.integrations.moe import ExpertsInterface

    if fallback not in FALLBACKS:
        raise ValueError(f"fallback={fallback!r}: expected one of {FALLBACKS}")
    unknown = set(fused_moe_options) - set(FUSED_MOE_OPTIONS)
    if unknown:
        raise TypeError(
            f"register() got fused_moe options {sorted(unknown)}; expected some of "
            f"{FUSED_MOE_OPTIONS}"
        )
    fn = functools.partial(moe_route_experts_forward, fallback=fallback, **fused_moe_options)
    functools.update_wrapper(fn, moe_route_experts_forward)
    ExpertsInterface.register(name, fn)
    return name


def describe(model: nn.Module) -> dict[str, str]:
    """For every experts module of ``model``: how moe_route would run it, or why it cannot.

    Returns:
        ``{module name: "moe_route: swiglu concat" | "fallback: <reason>"}``.
    """
    report = {}
    for module_name, module in model.named_modules():
        if not (hasattr(module, "has_gate") and hasattr(module, "down_proj")):
            continue
        try:
            plan = plan_for(module)
            _operands(module, plan)
            report[module_name] = str(plan)
        except Unsupported as exc:
            report[module_name] = f"fallback: {exc}"
    return report
