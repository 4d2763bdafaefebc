"""What happens when a model asks for a moe_route name: the blocks the request does not reach.

Some MoE blocks build their experts without ``@use_experts_implementation``
(:func:`bypassing_experts`), and experts under a sub-config keep the implementation their own
config names (:func:`_unreached_experts`). transformers offers no hook there, so
:func:`_install_switch_hook` wraps ``PreTrainedModel.post_init`` and
``set_experts_implementation``: a request for a registered name plans the experts modules and
warns once (:class:`MoeRouteNoOpWarning`) about the modules it does not reach.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref

import torch
from torch import nn

from .plan import plan_for

#: Attributes of an experts module that count its experts (for blocks outside the interface).
_COUNT_ATTRS = ("num_experts", "num_local_experts", "num_routed_experts", "total_experts")

# Names registered by register() in this process (the switch hook warns for these only).
_REGISTERED: set[str] = set()
# Experts modules already named in a MoeRouteNoOpWarning (one warning per module).
_WARNED_NO_OPS: weakref.WeakSet = weakref.WeakSet()


class MoeRouteNoOpWarning(UserWarning):
    """moe_route was asked for on a model with MoE blocks that experts_implementation does not
    reach (they build their experts without transformers' experts interface)."""


# --------------------------------------------------------------------------- blocks outside
def bypassing_experts(model: nn.Module) -> dict[str, str]:
    """MoE blocks of ``model`` that ``experts_implementation`` does not reach.

    A module that counts its experts (``num_experts`` / ``num_local_experts`` / ... ``> 0``)
    and either has "expert" in its class name or holds the experts itself (see
    :func:`_holds_experts`: Doge's ``DogeCDMoE``, VitPose's ``VitPoseNaiveMoe``), that is not
    decorated with ``@use_experts_implementation`` and has no decorated experts inside,
    always runs its own forward (DBRX, Llama 4, JetMoE, LongCat-Flash in older transformers,
    Step-3.7, Doge, VitPose, NLLB-MoE, Switch Transformers). A whole model (a
    ``PreTrainedModel``) is never listed, and submodules of a listed module are not listed.

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
