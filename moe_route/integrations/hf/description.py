"""``describe(model)``: which experts modules of a model run where, and why, before running any.

Each experts module gets its plan (or the reason it falls back), the quantised path it takes,
and whether the request reaches it; the MoE blocks outside the experts interface are listed as
no-ops.
"""

from __future__ import annotations

from torch import nn

from .forward import _resolve
from .plan import Unsupported, plan_for
from .quantized import _quant_summary
from .registration import NAME, is_registered
from .switch import _module_implementation, _unreached_experts, bypassing_experts


def _bypass_reason(cls: str) -> str:
    return (
        f"no-op: {cls} builds its experts without transformers' experts interface "
        "(@use_experts_implementation), so experts_implementation never reaches it; it runs "
        "its own forward whatever is asked for"
    )


def _unreached_reason(module: nn.Module) -> str:
    return (
        f"its config ({type(module.config).__name__}) asks for "
        f"{_module_implementation(module)!r}: transformers does not pass experts_implementation "
        "to this sub-config (set it there too to run it on moe_route)"
    )


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
