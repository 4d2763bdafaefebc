"""The activation between GEMM1 and GEMM2: which function, gated or not, and its parameters.

Every function that takes ``activation=`` accepts a name (``"swiglu"``), the same name with
parameters (``"swiglu(alpha=1.702, limit=7.0, up_offset=1.0)"``) or an :class:`Activation`;
:func:`activation` builds one from keyword arguments::

    moe_route.activation("swiglu", alpha=1.702, limit=7.0, up_offset=1.0)  # gpt-oss
    moe_route.activation("swiglu", limit=10.0)  # DeepSeek-V4-style clamp, alpha 1, offset 0
    moe_route.activation("swiglu", gate_softcap=4.0, up_softcap=25.0)  # Inkling2

Element-wise functions ``f`` (the *kind*):

==============  ===========================================  ===================
kind            ``f(x)``                                      gated name
==============  ===========================================  ===================
``silu``        ``x · sigmoid(alpha · x)`` (``alpha = 1``)    ``swiglu``
``gelu``        ``x · Φ(x)`` (exact, erf)                     ``geglu``
``gelu_tanh``   ``0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))`` ``geglu_tanh``
``relu``        ``max(x, 0)``                                 —
``relu2``       ``max(x, 0)²`` (squared ReLU, NemotronH)      —
``identity``    ``x``                                         —
==============  ===========================================  ===================

A gated activation splits GEMM1's ``[M, 2I]`` output into ``gate`` and ``up`` (in the
``gate_up_layout``) and computes::

    gate = min(gate, limit)             # only with a limit
    up   = clamp(up, -limit, limit)     # only with a limit
    out  = f(gate) · (up + up_offset)

which covers plain SwiGLU / GeGLU and the clamped SwiGLU family (gpt-oss: ``alpha=1.702,
limit=7.0, up_offset=1.0``; DeepSeek-V4 / GLM-5-style experts: a ``limit`` only). Gradients
follow ``torch.clamp``'s convention: they pass where ``gate <= limit`` and ``-limit <= up <=
limit`` (bounds included) and are zero outside. ``alpha``, ``limit`` and ``up_offset`` are for
gated activations (``alpha`` for ``swiglu`` only).

The soft-capped SwiGLU (Inkling2's experts, transformers' ``Inkling2SoftcappedSwiGLU``) bounds
the linear factor of the gate and the up value smoothly, each by its own cap, with
``softcap(x, c) = c · tanh(x / c)``; the sigmoid sees the gate itself::

    up   = softcap(up, up_softcap)                          # only with up_softcap
    out  = softcap(gate, gate_softcap) · sigmoid(alpha · gate) · (up + up_offset)

(``gate_softcap`` replaces silu's linear factor ``gate``; after the clamp when there is a
``limit``). ``gate_softcap`` and ``up_softcap`` are for ``swiglu`` only; each may be given
alone.

Custom ops carry the activation as its canonical string (``str(spec)``), so it crosses
``torch.library`` and ``torch.compile`` as a constant.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

#: Element-wise functions, by the code the Triton kernels switch on
#: (``moe_route/kernels/triton/activation.py``).
KIND_CODES = {"silu": 1, "gelu": 2, "gelu_tanh": 4, "relu": 3, "relu2": 5, "identity": 0}
#: Gated activations by name -> their element-wise kind.
GATED_KINDS = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_tanh"}
#: Every accepted activation name (gated first).
NAMES = (*GATED_KINDS, *KIND_CODES)
_PARAMS = ("alpha", "limit", "up_offset", "gate_softcap", "up_softcap")
#: The parameters for which ``None`` (or ``inf``) means "none" and a number must be > 0.
_BOUNDS = ("limit", "gate_softcap", "up_softcap")


@dataclass(frozen=True)
class Activation:
    """One activation: element-wise ``kind``, ``gated`` or not, and the gated parameters.

    Build it with :func:`activation` (by name) or directly; it validates itself. A ``limit``,
    ``gate_softcap`` or ``up_softcap`` of ``None`` (or ``inf``) means none.
    """

    #: element-wise function: ``silu``, ``gelu``, ``gelu_tanh``, ``relu``, ``relu2``,
    #: ``identity``.
    kind: str
    #: ``f(gate) · (up + up_offset)`` over a ``[M, 2I]`` input, instead of ``f(x)``.
    gated: bool = False
    #: ``silu``'s slope: ``x · sigmoid(alpha · x)`` (gated ``swiglu`` only).
    alpha: float = 1.0
    #: ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)`` (gated only); > 0.
    limit: float | None = None
    #: added to ``up`` after the clamp (gated only).
    up_offset: float = 0.0
    #: ``swiglu``'s linear factor soft-capped: ``c·tanh(gate/c) · sigmoid(alpha·gate)``; > 0.
    gate_softcap: float | None = None
    #: ``up`` soft-capped, ``c·tanh(up/c)``, before ``up_offset`` (``swiglu`` only); > 0.
    up_softcap: float | None = None
    # Derived once in __post_init__ (the public functions turn a spec into its string on every
    # call): plain attributes, which torch.compile traces (a functools.cached_property it
    # cannot: its lock).
    _canonical: str = field(init=False, repr=False, compare=False)
    _constexprs: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.kind not in KIND_CODES:
            raise ValueError(f"activation kind={self.kind!r}: expected one of {tuple(KIND_CODES)}")
        gated_name = next((n for n, k in GATED_KINDS.items() if k == self.kind), None)
        if self.gated and gated_name is None:
            raise ValueError(
                f"activation kind={self.kind!r} has no gated form; gated activations are "
                f"{tuple(GATED_KINDS)}"
            )
        for p in _PARAMS:
            v = getattr(self, p)
            if v is None and p in _BOUNDS:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
                raise ValueError(f"activation {p}={v!r}: expected a number")
            object.__setattr__(self, p, float(v))
        for p in _BOUNDS:
            v = getattr(self, p)
            if v is not None:
                if v <= 0:
                    raise ValueError(f"activation {p}={v!r}: expected a number > 0")
                if math.isinf(v):
                    object.__setattr__(self, p, None)
        if not math.isfinite(self.alpha) or not math.isfinite(self.up_offset):
            raise ValueError(
                f"activation alpha={self.alpha!r}, up_offset={self.up_offset!r}: expected "
                "finite numbers"
            )
        if not self.gated and (self.limit is not None or self.up_offset != 0.0):
            raise ValueError(
                f"activation {self.name!r}: limit and up_offset apply to gated activations "
                f"({tuple(GATED_KINDS)}) only"
            )
        swiglu = self.gated and self.kind == "silu"
        if self.alpha != 1.0 and not swiglu:
            raise ValueError(
                f"activation {self.name!r}: alpha applies to 'swiglu' only, got "
                f"alpha={self.alpha!r}"
            )
        if not swiglu and (self.gate_softcap is not None or self.up_softcap is not None):
            raise ValueError(
                f"activation {self.name!r}: gate_softcap and up_softcap apply to 'swiglu' only, "
                f"got gate_softcap={self.gate_softcap!r}, up_softcap={self.up_softcap!r}"
            )
        params = []
        if self.alpha != 1.0:
            params.append(f"alpha={self.alpha!r}")
        if self.limit is not None:
            params.append(f"limit={self.limit!r}")
        if self.up_offset != 0.0:
            params.append(f"up_offset={self.up_offset!r}")
        if self.gate_softcap is not None:
            params.append(f"gate_softcap={self.gate_softcap!r}")
        if self.up_softcap is not None:
            params.append(f"up_softcap={self.up_softcap!r}")
        canonical = f"{self.name}({', '.join(params)})" if params else self.name
        limit, gate_cap, up_cap = (
            0.0 if getattr(self, p) is None else getattr(self, p) for p in _BOUNDS
        )
        object.__setattr__(self, "_canonical", canonical)
        object.__setattr__(
            self,
            "_constexprs",
            (KIND_CODES[self.kind], self.alpha, limit, self.up_offset, gate_cap, up_cap),
        )

    @property
    def name(self) -> str:
        """``swiglu`` / ``geglu`` / ``geglu_tanh`` when gated, else the kind."""
        if not self.gated:
            return self.kind
        return next(n for n, k in GATED_KINDS.items() if k == self.kind)

    def __str__(self) -> str:
        """Canonical form: the name, then the parameters that differ from their defaults
        (``repr`` of each float, so :func:`as_activation` reads back the same spec)."""
        return self._canonical

    def triton_constexprs(self) -> tuple[int, float, float, float, float, float]:
        """``(ACT, ALPHA, LIMIT, UP_OFFSET, GATE_SOFTCAP, UP_SOFTCAP)`` for the kernels of
        ``moe_route/kernels/triton/activation.py``; ``0.0`` for ``LIMIT`` or a cap means none
        (a real one is > 0)."""
        return self._constexprs


def activation(
    name: str | Activation = "swiglu",
    *,
    alpha: float | None = None,
    limit: float | None = None,
    up_offset: float | None = None,
    gate_softcap: float | None = None,
    up_softcap: float | None = None,
) -> Activation:
    """An :class:`Activation` by name, with parameters (``None`` keeps the name's own).

    Args:
        name: one of ``swiglu``, ``geglu``, ``geglu_tanh`` (gated), ``silu``, ``gelu``,
            ``gelu_tanh``, ``relu``, ``relu2``, ``identity``; or a string with parameters, or
            an :class:`Activation` (then the keyword arguments override its parameters).
        alpha: ``swiglu``'s ``x · sigmoid(alpha · x)`` (1 by default).
        limit: clamp ``gate`` from above and ``up`` to ``[-limit, limit]`` (gated only).
        up_offset: add to ``up`` after the clamp (gated only).
        gate_softcap: soft-cap ``swiglu``'s linear gate factor, ``c·tanh(gate/c)``.
        up_softcap: soft-cap ``up`` (``swiglu`` only), ``c·tanh(up/c)``.

    Examples: gpt-oss's experts are ``activation("swiglu", alpha=1.702, limit=7.0,
    up_offset=1.0)``, Inkling2's ``activation("swiglu", gate_softcap=4.0, up_softcap=25.0)``.
    """
    spec = as_activation(name, arg="name")
    given = {
        "alpha": alpha,
        "limit": limit,
        "up_offset": up_offset,
        "gate_softcap": gate_softcap,
        "up_softcap": up_softcap,
    }
    fields = {p: getattr(spec, p) for p in _PARAMS}
    fields.update({p: v for p, v in given.items() if v is not None})
    return Activation(spec.kind, spec.gated, **fields)


def as_activation(value: object, *, arg: str = "activation") -> Activation:
    """Normalise what a user passes as ``activation`` (name, name with parameters, spec).

    Raises ``ValueError`` (``TypeError`` for another type) naming ``arg``, the value and the
    accepted names.
    """
    if isinstance(value, Activation):
        return value
    if not isinstance(value, str):
        raise TypeError(
            f"{arg} must be an activation name or a moe_route.Activation, got "
            f"{type(value).__name__}"
        )
    return _parse(value, arg)


# The ops carry the activation as its string, and the torch backend's and the reference's
# functions read it back on every call: parse each distinct string once.
@functools.lru_cache(maxsize=256)
def _parse(value: str, arg: str) -> Activation:
    name, paren, rest = value.partition("(")
    name = name.strip()
    if name in GATED_KINDS:
        kind, gated = GATED_KINDS[name], True
    elif name in KIND_CODES:
        kind, gated = name, False
    else:
        raise ValueError(f"{arg}={value!r}: expected one of {NAMES}, optionally with parameters")
    params = {}
    if paren:
        body = rest.strip()
        if not body.endswith(")"):
            raise ValueError(f"{arg}={value!r}: expected 'name(key=value, ...)'")
        for item in body[:-1].split(","):
            if not item.strip():
                continue
            key, eq, val = item.partition("=")
            key = key.strip()
            if not eq or key not in _PARAMS or key in params:
                raise ValueError(
                    f"{arg}={value!r}: parameter {item.strip()!r} is not one of {_PARAMS} "
                    "given once as key=value"
                )
            try:
                params[key] = None if val.strip() == "None" else float(val)
            except ValueError:
                raise ValueError(
                    f"{arg}={value!r}: {key}={val.strip()!r} is not a number"
                ) from None
    try:
        return Activation(kind, gated, **params)
    except ValueError as exc:
        raise ValueError(f"{arg}={value!r}: {exc}") from None
