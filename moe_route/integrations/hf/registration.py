"""Registration: moe_route installed in transformers' experts interfaces under a name.

:func:`register` checks the name and the ``fused_moe`` options, installs
:func:`~.forward.moe_route_experts_forward` in ``ExpertsInterface`` and the FP8 table, and
installs the switch hook (:mod:`.switch`); :func:`is_registered` asks transformers.
"""

from __future__ import annotations

import functools

from .forward import moe_route_experts_forward
from .quantized import _register_quantized
from .switch import _REGISTERED, _install_switch_hook

#: The name under which :func:`register` installs moe_route by default.
NAME = "moe_route"

FALLBACKS = ("grouped_mm", "batched_mm", "eager", "error")

#: ``fused_moe`` keyword arguments that :func:`register` passes through.
FUSED_MOE_OPTIONS = ("backend", "finalize", "deterministic", "gather", "allow_tf32")


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
    from ... import _checks
    from ...arch import check_backend_name
    from ...layer import FINALIZE_CHOICES

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
