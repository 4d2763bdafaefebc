"""``warmup(model, max_tokens)``: compile, before the first request, every kernel that the
experts of a transformers model will launch on moe_route.

A fresh process compiles ``fused_moe``'s kernels at the first call of each token bucket (``T``
rounded up to a power of two). :func:`warmup` makes those calls up front, once per distinct
*configuration* (the weights' shapes, strides, dtypes and alignment, the activation, layout,
quantisation, options, and what the model hands its experts: the tokens' dtype, the router's
``top_k``, ids and weights dtypes), so that the 48 identical layers of a model warm once.

Each call goes through the forward's own code (:func:`~.forward._resolve` and
:func:`~.forward._run`), on random tokens and routing of the dtypes the model's forward gives
its experts. Those dtypes are the router's and differ by family (Qwen3-MoE hands bf16 router
weights to bf16 experts, Mixtral and DeepSeek-V3 float32 ones), so they are *probed*: a
forward of the model on two tokens with every experts module replaced by one that records its
arguments and returns zeros, and, for the modules that forward does not reach, a call of the
module's parent block (the MoE block) on two random tokens, stopped at the experts.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from ... import _checks
from ..._dispatch import tensor_key
from ...tuning import token_buckets, warmup_buckets
from .forward import _fallback_table, _resolve, _run, moe_route_experts_forward
from .plan import Unsupported, plan_for
from .quantized import _quant_summary
from .switch import _REGISTERED, _module_implementation


@dataclass(frozen=True)
class WarmedExperts:
    """One configuration :func:`warmup` warmed: the experts modules that share its compiled
    kernels, what it is, and the token buckets it ran."""

    #: names of the experts modules (``model.named_modules()``) of this configuration
    modules: tuple[str, ...]
    #: the plan, weights and call signature, e.g. ``"swiglu concat; w1 [128, 1536, 2048]
    #: bfloat16; top_k 8, tokens bfloat16, ids int64, router weights bfloat16"``
    description: str
    #: the token buckets warmed: ``1, 2, 4, ..., >= max_tokens``
    buckets: tuple[int, ...]

    def __str__(self) -> str:
        return f"{len(self.modules)} module(s), {self.description}: buckets {list(self.buckets)}"


@dataclass(frozen=True)
class _Call:
    """What the model's forward hands an experts module (probed): dtypes, ``top_k``, and which
    of the tokens and router weights require grad."""

    hidden_dtype: torch.dtype
    ids_dtype: torch.dtype
    weights_dtype: torch.dtype
    top_k: int
    hidden_grad: bool
    weights_grad: bool


def warmup(model: nn.Module, max_tokens: int, *, backward: bool = False) -> list[WarmedExperts]:
    """Compile every kernel that ``model``'s experts will launch on moe_route for calls of up to
    ``max_tokens`` tokens (per experts call: batch x sequence for a prefill).

    For each distinct configuration among the experts modules that run on moe_route (their
    config's experts implementation is a name :func:`~.registration.register` installed, and
    they do not fall back), one ``fused_moe`` call per token bucket ``1, 2, 4, ..., >=
    max_tokens``, built by the forward's own code with the options of that registration,
    as :func:`moe_route.warmup` does for one set of weights; with ``backward``, the calls run
    with gradients and their backward (none accumulated into ``.grad``), as a training step
    does, instead of the inference calls (``torch.no_grad``, as ``generate`` runs).
    Afterwards such calls with ``T <= max_tokens`` compile nothing. Synchronises each device
    once, at the end. Leaves the global random state as it was.

    Under tensor or expert parallelism, call it on every rank: the probe (a two-token forward
    of the model, see the module docstring) runs the model's collectives.

    Returns:
        one :class:`WarmedExperts` per configuration warmed.

    Raises:
        ValueError: no experts module of ``model`` runs on moe_route (none registered or asked
            for, or all fall back; the message says which), or ``max_tokens`` is out of range
            (:func:`moe_route.tuning.warmup_buckets`), before any warm-up call.
        RuntimeError: no experts module's call could be probed.
    """
    _checks.check_bool("backward", backward)
    token_buckets(max_tokens)  # its type and sign, before the probe
    found, skipped = {}, {}
    with torch.set_grad_enabled(backward):  # the operands' views, as the forward makes them
        for name, module in model.named_modules():
            if not (hasattr(module, "has_gate") and hasattr(module, "down_proj")):
                continue
            options, why = _moe_route_options(module)
            if options is not None:
                try:
                    plan = plan_for(module)
                    found[name] = (module, plan, _resolve(module, plan), options)
                    continue
                except Unsupported as exc:
                    why = f"falls back: {exc}"
            skipped[name] = why
    if not found:
        raise ValueError(_nothing_to_warm(model, skipped))
    devices = sorted({ops[0].device for _, _, ops, _ in found.values()}, key=str)
    cuda = [d.index if d.index is not None else torch.cuda.current_device()
            for d in devices if d.type == "cuda"]  # fmt: skip
    with torch.random.fork_rng(devices=cuda):
        with warnings.catch_warnings():  # what the probe's own forward warns is no news
            warnings.simplefilter("ignore")
            calls, errors = _probe(model, found, backward)
        missing = [n for n in found if n not in calls]
        if len(missing) == len(found):
            raise RuntimeError(_unprobed(missing, errors, "none of them can be warmed"))
        if missing:
            warnings.warn(_unprobed(missing, errors, "not warmed"), UserWarning, stacklevel=2)
        groups: dict[tuple, list[str]] = {}
        for name in (n for n in found if n in calls):  # in the model's order
            _, plan, operands, options = found[name]
            groups.setdefault(_config_key(plan, operands, options, calls[name]), []).append(name)
        work = []
        for names in groups.values():  # every bound checked before anything runs
            _, _, (w1, w2, *_), _ = found[names[0]]
            buckets = warmup_buckets(max_tokens, calls[names[0]].top_k, w1, w2, backward)
            work.append((names, buckets))
        warmed = []
        for names, buckets in work:
            module, plan, operands, options = found[names[0]]
            call = calls[names[0]]
            for T in buckets:
                _warm_call(module, plan, operands, options, call, T, backward)
            warmed.append(WarmedExperts(tuple(names), _describe(plan, operands, call),
                                        tuple(buckets)))  # fmt: skip
    for index in cuda:
        torch.cuda.synchronize(index)
    return warmed


# --------------------------------------------------------------------------- which modules
def _moe_route_options(module: nn.Module) -> tuple[dict | None, str]:
    """``(fused_moe options, "")`` of the registration ``module`` runs (its config names a
    registered moe_route implementation), or ``(None, why not)``."""
    impl = _module_implementation(module)
    fn = None
    if isinstance(impl, str) and impl in _REGISTERED:
        with contextlib.suppress(KeyError):
            fn = _fallback_table(module)[impl]
    if getattr(fn, "func", None) is not moe_route_experts_forward:
        return None, f"its experts implementation is {impl!r}, not a registered moe_route name"
    return {k: v for k, v in fn.keywords.items() if k != "fallback"}, ""


def _nothing_to_warm(model: nn.Module, skipped: dict[str, str]) -> str:
    cls = type(model).__name__
    if not skipped:
        return (f"{cls} has no experts module of transformers' experts interface "
                "(@use_experts_implementation): nothing runs on moe_route, nothing to warm "
                "(moe_route.integrations.hf.describe(model) lists its MoE blocks)")  # fmt: skip
    listed = "; ".join(f"{n}: {why}" for n, why in list(skipped.items())[:3])
    more = f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
    return (f"no experts module of {cls} runs on moe_route, nothing to warm ({listed}{more}); "
            "call moe_route.integrations.hf.register() and load the model with "
            "experts_implementation='moe_route' (or model.set_experts_implementation("
            "'moe_route')) first")  # fmt: skip


def _unprobed(names: list[str], errors: dict[str, str], what: str) -> str:
    listed = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    why = "; ".join(sorted(set(errors.values())))[:400]
    return (f"moe_route.integrations.hf.warmup: the experts calls of {listed} could not be "
            f"probed (neither a two-token forward of the model nor a call of their MoE block "
            f"reached them{': ' + why if why else ''}); {what}")  # fmt: skip


# --------------------------------------------------------------------------- the probe
class _Probed(Exception):
    """Raised by a recording experts forward to stop its parent block's probe."""


_ARG_NAMES = ("hidden_states", "top_k_index", "top_k_weights")


def _record(name: str, seen: dict, stop: bool, *args, **kwargs):
    """An experts module's forward while probing: keep what it is handed in ``seen[name]``,
    then stop (``stop``) or return zeros."""
    given = dict(zip(_ARG_NAMES, args, strict=False))
    given |= {k: v for k, v in kwargs.items() if k in _ARG_NAMES}
    x, ids, w = (given.get(n) for n in _ARG_NAMES)
    if all(isinstance(t, torch.Tensor) for t in (x, ids, w)) and ids.dim() == 2:
        seen.setdefault(name, _Call(x.dtype, ids.dtype, w.dtype, ids.shape[1],
                                    x.requires_grad, w.requires_grad))  # fmt: skip
    if stop or not isinstance(x, torch.Tensor):
        raise _Probed
    return torch.zeros_like(x)


@contextlib.contextmanager
def _recording(modules: dict[str, nn.Module], seen: dict, stop: bool):
    """Each module's forward replaced by :func:`_record` (an instance attribute, put back after;
    one already there, e.g. accelerate's hook, is restored)."""
    saved = {name: m.__dict__.get("forward") for name, m in modules.items()}
    for name, m in modules.items():
        m.__dict__["forward"] = functools.partial(_record, name, seen, stop)
    try:
        yield
    finally:
        for name, m in modules.items():
            m.__dict__.pop("forward", None)
            if saved[name] is not None:
                m.__dict__["forward"] = saved[name]


def _probe(model: nn.Module, found: dict, backward: bool) -> tuple[dict, dict]:
    """``({name: _Call}, {name: why the probe failed})`` for the modules of ``found``."""
    seen: dict[str, _Call] = {}
    errors: dict[str, str] = {}
    modules = {name: entry[0] for name, entry in found.items()}
    embeddings = _input_embeddings(model)
    if embeddings is not None:  # the whole model on two tokens, experts returning zeros
        ids = torch.zeros(1, 2, dtype=torch.long, device=embeddings.weight.device)
        with _recording(modules, seen, False), torch.set_grad_enabled(backward):
            try:
                model(input_ids=ids, use_cache=False)
            except Exception as exc:  # the parent blocks are probed instead
                errors["<model>"] = f"{type(model).__name__}: {type(exc).__name__}: {exc}"
    dtype = embeddings.weight.dtype if embeddings is not None else None
    for name, (module, _, (w1, w2, *_), _) in found.items():
        if name in seen or not name:
            continue
        parent = model.get_submodule(name.rpartition(".")[0])
        H, hidden = w2.shape[1], dtype or (w1.dtype if w1.is_floating_point() else None)
        if hidden is None or not hidden.is_floating_point:
            hidden = torch.get_default_dtype()
        for shape in ((1, 2, H), (2, H)):  # [batch, seq, H] blocks, then [tokens, H] ones
            x = torch.randn(shape, dtype=hidden, device=w1.device).requires_grad_(backward)
            with _recording({name: module}, seen, True), torch.set_grad_enabled(backward):
                try:
                    parent(x)
                except _Probed:
                    break
                except Exception as exc:  # this module is left unprobed
                    errors.setdefault(name, f"{type(parent).__name__}: {type(exc).__name__}: "
                                            f"{exc}")  # fmt: skip
    return seen, errors


def _input_embeddings(model: nn.Module):
    """The token embeddings of a transformers model (a forward takes ``input_ids``), or None."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return None
    try:
        emb = model.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        return None
    weight = getattr(emb, "weight", None)
    return emb if isinstance(weight, torch.Tensor) and weight.is_floating_point() else None


# --------------------------------------------------------------------------- the warm calls
def _aligned_key(t: torch.Tensor | None):
    """:func:`moe_route._dispatch.tensor_key` and the 16-byte alignment the kernels specialise
    on (:class:`moe_route.kernels.triton.ThinKernel`)."""
    return None if t is None else (*tensor_key(t), t.data_ptr() % 16)


def _config_key(plan, operands, options: dict, call: _Call) -> tuple:
    """What ``fused_moe``'s compiled variants of one module's calls depend on (all but ``T``):
    modules with equal keys share them."""
    w1, w2, b1, b2, quant = operands
    tensors = (w1, w2, b1, b2, quant.get("w1_scale"), quant.get("w2_scale"))
    return (plan.activation, plan.gate_up_layout, str(quant.get("quant")),
            tuple(_aligned_key(t) for t in tensors), tuple(sorted(options.items())),
            call)  # fmt: skip


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _describe(plan, operands, call: _Call) -> str:
    w1 = operands[0]
    return (f"{str(plan).removeprefix('moe_route: ')}{_quant_summary(operands[4])}; w1 "
            f"{list(w1.shape)} {_name(w1.dtype)}; top_k {call.top_k}, tokens "
            f"{_name(call.hidden_dtype)}, ids {_name(call.ids_dtype)}, router weights "
            f"{_name(call.weights_dtype)}")  # fmt: skip


def _warm_call(module, plan, operands, options, call: _Call, T: int, backward: bool) -> None:
    """One call of the module's forward (:func:`~.forward._run`) on ``T`` random tokens and a
    random routing of the probed dtypes; with ``backward``, its backward too."""
    w1, w2, b1, b2, _ = operands
    E, H, device = w1.shape[0], w2.shape[1], w1.device
    gen = torch.Generator(device=device).manual_seed(T)
    x = torch.randn(T, H, device=device, generator=gen).to(call.hidden_dtype)
    logits = torch.randn(T, E, device=device, generator=gen)
    weights, ids = torch.softmax(logits, dim=-1).topk(call.top_k, dim=-1)
    weights, ids = weights.to(call.weights_dtype), ids.to(call.ids_dtype)
    if not backward:
        with torch.no_grad():
            _run(module, plan, operands, x, ids, weights, options)
        return
    with torch.enable_grad():
        x.requires_grad_(call.hidden_grad)
        weights.requires_grad_(call.weights_grad)
        out = _run(module, plan, operands, x, ids, weights, options)
        inputs = [t for t in (x, weights, w1, w2, b1, b2) if t is not None and t.requires_grad]
        if out.requires_grad:  # autograd.grad, not backward(): nothing lands in .grad
            dout = torch.randn(out.shape, device=device, generator=gen).to(out.dtype)
            torch.autograd.grad(out, inputs, dout, allow_unused=True)
