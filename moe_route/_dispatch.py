"""How an op runs: a ``torch.library`` custom op under ``torch.compile``, its implementation
called directly in eager mode.

The custom-op dispatcher costs about 20 µs of host time per call on an H100 host, more than a
Triton launch through :class:`moe_route.kernels.triton.ThinKernel` (docs/decisions.md, "Thin
eager path"). So an :class:`Op`
registers the custom op (schema, fake implementation, autograd: what ``torch.compile``,
``opcheck`` and users of ``torch.ops.moe_route`` see) and, outside compilation, calls the same
implementation itself — through an ``autograd.Function`` built from the same ``setup_context``
and ``backward`` when a gradient is wanted. Both routes run the same code, so they give the
same bits. The experts' ops (``eager_autograd=False``) leave eager autograd to their caller,
:class:`moe_route.experts.MoEProgram`, whose launches their implementations run too.

An op's ``backend`` argument is resolved by :func:`moe_route.arch.resolve_backend` before its
implementation runs, on both routes, so ``"auto"`` and the aliases (``"reference"``) mean
what they mean to the public functions whichever entry point a caller takes.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch

from . import arch
from ._env import reader


class Op:
    """One ``moe_route::<name>`` op; ``op(*args)`` picks the route (see the module docstring)."""

    def __init__(
        self,
        name: str,
        impl: Callable,
        fake: Callable,
        *,
        setup_context: Callable | None = None,
        backward: Callable | None = None,
        eager_autograd: bool = True,
    ):
        impl = _resolving_backend(impl)
        self.impl = impl
        self.op = torch.library.custom_op(f"moe_route::{name}", impl, mutates_args=())
        self.op.register_fake(fake)
        self.differentiable = backward is not None
        self.function = None
        if backward is not None:
            self.op.register_autograd(backward, setup_context=setup_context)
            if eager_autograd:
                self.function = _autograd_function(name, impl, setup_context, backward)

    def __call__(self, *args):
        if torch.compiler.is_compiling() or needs_dispatcher(args):
            return self.op(*args)
        if self.differentiable and torch.is_grad_enabled():
            for a in args:
                if isinstance(a, torch.Tensor) and a.requires_grad:
                    # (an op whose eager autograd is its caller's goes through the dispatcher)
                    fn = self.function
                    return self.op(*args) if fn is None else fn.apply(*args)
        return self.impl(*args)


_PYTHON_KEY = torch._C.DispatchKey.Python


def needs_dispatcher(args) -> bool:
    """Whether the kernels cannot run on ``args`` as they are, so the custom op's dispatch must
    see them first: under a torch dispatch mode (fake tensors, functionalization, make_fx:
    what opcheck and AOTAutograd outside Dynamo trace a backward with), or given a tensor
    subclass that dispatches in Python (e.g. a functional collective's result, waited for
    lazily, which has no storage of its own; a DTensor), or on the meta device (shape
    inference and meta-device initialisation: the fake implementations answer)."""
    if torch._C._len_torch_dispatch_stack():
        return True
    first = next((a for a in args if type(a) in _TENSORS), None)
    if first is not None and first.is_meta:  # one device per call: the first tensor's
        return True
    for a in args:
        # Reading every weight's dispatch keys costs more host time than the decode launches;
        # plain tensors and Parameters never dispatch in Python (docs/decisions.md, "Thin
        # eager path").
        kind = type(a)
        if (
            kind not in _PLAIN
            and isinstance(a, torch.Tensor)
            and torch._C._dispatch_keys(a).has(_PYTHON_KEY)
        ):
            return True
    return False


_PLAIN = (torch.Tensor, torch.nn.Parameter, type(None), bool, int, float, str)
_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _resolving_backend(impl: Callable) -> Callable:
    """``impl`` with its ``backend`` argument (if it has one) passed through
    :func:`moe_route.arch.resolve_backend` on the device of its first tensor argument; the
    same signature, so the custom op infers the same schema."""
    # A resolved name is passed on as it is: the check costs host time on every eager call
    # (docs/decisions.md, "Thin eager path").
    sig = inspect.signature(impl, eval_str=True)
    names = list(sig.parameters)
    if "backend" not in names:
        return impl
    at = names.index("backend")
    resolved = frozenset(arch.BACKENDS)

    def run(*args):  # positional: the schemas have no keyword-only arguments
        if args[at] in resolved:
            return impl(*args)
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        return impl(*args[:at], arch.resolve_backend(device, args[at]), *args[at + 1 :])

    functools.update_wrapper(run, impl)
    run.__signature__ = sig
    return run


def _autograd_function(name, impl, setup_context, backward):
    def forward(ctx, *args):
        out = impl(*args)
        setup_context(ctx, args, out)
        return out

    def backward_(ctx, *grads):
        return backward(ctx, *grads)

    return type(
        f"{name}_function",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward_)},
    )


def wants_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether a call records a graph for autograd: grad mode on and a tensor requiring grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# --------------------------------------------------------------------------- call memos
#: The most call signatures a memo keeps (``fused_moe``'s, each layer's) before starting over.
MAX_CALLS = 256

#: The environment a memoised decision depends on: the plans' overrides and the ids' checks.
memo_env = reader((*arch.ENV_OVERRIDES, "MOE_ROUTE_CHECK_IDS"))


def memo_wanted() -> bool:
    """Whether a public function may look up or keep a call memo: not while ``torch.compile``
    traces it (the plain path is what compiles), nor under a torch dispatch mode (opcheck,
    fake tensors, make_fx: the custom op's dispatch must see the call)."""
    return not (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack())


class CallMemo:
    """One public function's decisions by call signature, each a callable that runs a call
    of that signature without checking or deciding again (``fused_moe``'s
    :class:`moe_route.moe.FusedCall`, the ops' ``*Call`` objects). The signature must hold
    everything the checks and decisions read. Bounded by :data:`MAX_CALLS` (emptied when
    full: a process meets few signatures), emptied by :func:`clear_memos`."""

    __slots__ = ("calls",)

    def __init__(self):
        self.calls: dict = {}
        _MEMOS.append(self)

    def get(self, key):
        """The call kept for ``key``, or None (also for ``key=None``, and for an unhashable
        option in it: the checks then say what is wrong)."""
        if key is None:
            return None
        try:
            return self.calls.get(key)
        except TypeError:
            return None

    def keep(self, key, call, tensors: tuple) -> None:
        """Keep ``call`` for ``key``, unless ``key`` is None or one of ``tensors`` must go
        through the dispatcher (a subclass: such calls are not memoised)."""
        if key is None or needs_dispatcher(tensors):
            return
        try:
            hash(key)
        except TypeError:
            return
        if len(self.calls) >= MAX_CALLS:
            self.calls.clear()
        self.calls[key] = call

    def __len__(self) -> int:
        return len(self.calls)


_MEMOS: list[CallMemo] = []


def clear_memos() -> None:
    """Empty every :class:`CallMemo`."""
    for memo in _MEMOS:
        memo.calls.clear()


def tensor_key(t: torch.Tensor | None):
    """What a call's checks and decisions read of one tensor argument, for a memo's key: its
    type, shape, strides, dtype, device and ``requires_grad`` (None stays None; a non-tensor
    raises ``AttributeError``)."""
    if t is None:
        return None
    return (type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad)


def bias_key(t: torch.Tensor | None):
    """The key of a bias that is ``[H]`` (one row for all tokens: :func:`tensor_key`) or
    ``[T, H]`` (one per token: :func:`rows_key`)."""
    return rows_key(t) if t is not None and t.dim() == 2 else tensor_key(t)


def rows_key(t: torch.Tensor | None):
    """:func:`tensor_key` of a tensor with one row per token, without the row count (the
    caller keys on the token bucket and on the rows agreeing)."""
    if t is None:
        return None
    return (type(t), t.shape[1:], t.dim(), t.stride(), t.dtype, t.device, t.requires_grad)
