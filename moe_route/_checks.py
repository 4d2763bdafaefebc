"""Input validation shared by the public functions.

Every public entry point checks what it can from metadata (dtype, shape, device, sizes) before
anything is launched, and raises ``TypeError`` / ``ValueError`` naming the argument, what it got
and what it expected. Checks that need the *values* of a device tensor (e.g. ids in range) would
synchronise with the host, so they run on CPU tensors always and on GPU tensors only when asked
(``check_ids=True`` or ``MOE_ROUTE_CHECK_IDS=1``). Under ``torch.compile`` the default skips
them too (a data-dependent branch cannot be traced); ``check_ids=True`` still asks for them.
"""

from __future__ import annotations

import math

import torch

from ._env import flag
from .activations import as_activation
from .kernels.triton.gemm_mainloop import MAX_EXPERTS as GEMM_MAX_EXPERTS
from .reference import GATE_UP_LAYOUTS

INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: The most experts the routing maps hold: their expert ids (and ``E`` itself, a kernel
#: argument) are int32, whatever the dtype of ``topk_ids``.
MAX_EXPERTS = 2**31 - 1


def describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_tensor(name: str, t: object, *, ndim: int | None = None, dtypes=None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got {describe(t)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {describe(t)}")
    return t


def check_bool(name: str, value: object, *, optional: bool = False) -> bool | None:
    """``value`` is a real ``bool`` (or ``None`` where ``optional``). Anything else is a
    ``TypeError``: ``"False"`` or ``"no"`` are truthy, so coercing them would invert the
    caller's intent."""
    if isinstance(value, bool) or (optional and value is None):
        return value
    expected = "a bool or None" if optional else "a bool"
    raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    first_name = first = None
    for name, t in tensors.items():
        if t is None:
            continue
        if first is None:
            first_name, first = name, t.device
        elif t.device != first:
            raise ValueError(
                f"{name} is on {t.device} but {first_name} is on {first}: expected one device"
            )
    return first


def check_size(name: str, value: object, minimum: int) -> int:
    """``value`` is a Python int (not a bool) ``>= minimum``; a traced size under
    ``torch.compile`` passes as it is."""
    if isinstance(value, torch.SymInt):
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}={value}: expected an int >= {minimum}")
    return value


def check_num_experts(num_experts: object, name: str = "num_experts") -> int:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int):
        raise TypeError(f"{name} must be an int, got {type(num_experts).__name__}")
    if num_experts < 1:
        raise ValueError(f"{name} must be >= 1, got {num_experts}")
    if num_experts > MAX_EXPERTS:
        raise ValueError(
            f"{name}={num_experts} is more than the int32 expert ids of the routing maps "
            f"(expert_for_source_row) can address: expected {name} <= 2**31 - 1"
        )
    return num_experts


def check_topk_ids(topk_ids: object, num_experts: int) -> torch.Tensor:
    t = check_tensor("topk_ids", topk_ids, ndim=2)
    if t.dtype.is_floating_point or t.dtype not in INDEX_DTYPES:
        raise TypeError(f"topk_ids must be int32 or int64 expert ids, got {describe(t)}")
    T, K = t.shape
    if K < 1:
        raise ValueError(
            f"topk_ids must have at least one slot per token (K >= 1), got {describe(t)}"
        )
    if num_experts < K:
        raise ValueError(
            f"topk_ids has K={K} slots per token but num_experts={num_experts}: expected K <= E"
        )
    if T * K >= 2**31:
        raise ValueError(
            f"topk_ids has T*K={T * K} expanded rows; the int32 routing maps hold < 2**31"
        )
    return t


def ids_value_check_wanted(t: torch.Tensor, check_ids: bool | None) -> bool:
    if check_ids is not None:
        return check_ids
    if torch.compiler.is_compiling():
        return False  # a data-dependent branch cannot be traced; check eagerly instead
    if t.device.type == "cpu":
        return True
    return flag("MOE_ROUTE_CHECK_IDS")


def check_topk_id_values(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Raise if any id is outside ``[-1, num_experts)``. Reads values: syncs on a GPU tensor."""
    if topk_ids.numel() == 0:
        return
    bad = (topk_ids < -1) | (topk_ids >= num_experts)
    if bool(bad.any()):
        where = bad.nonzero()[0].tolist()
        value = int(topk_ids[where[0], where[1]])
        raise ValueError(
            f"topk_ids[{where[0]}, {where[1]}] = {value} is out of range: expected expert ids in "
            f"[0, {num_experts}) or -1 for a dropped slot"
        )


# --------------------------------------------------------------------------- grouped GEMM operands
# float64 runs on the FMA units (small tiles): it is there for gradcheck, not for speed.
GEMM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def bias_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """A per-expert bias has the activations' dtype or float32 (float64 only with float64)."""
    return (dtype,) if dtype in (torch.float32, torch.float64) else (dtype, torch.float32)


def check_gemm_args(a_name, a, w_name, w, bias_name, bias, activation, gate_up_layout, E=None):
    """Validate one grouped GEMM's operands; returns ``(E, N_out)``."""
    check_tensor(a_name, a, ndim=2, dtypes=GEMM_DTYPES)
    check_tensor(w_name, w, ndim=3, dtypes=GEMM_DTYPES)
    spec = as_activation(activation)  # raises, naming the argument
    if gate_up_layout not in GATE_UP_LAYOUTS:
        raise ValueError(f"gate_up_layout={gate_up_layout!r}: expected one of {GATE_UP_LAYOUTS}")
    if w.dtype != a.dtype:
        raise TypeError(
            f"{w_name} has dtype {w.dtype} but {a_name} has {a.dtype}: expected one dtype"
        )
    if E is not None and w.shape[0] != E:
        raise ValueError(f"{w_name} must have E = {E} experts in dim 0, got {describe(w)}")
    if w.shape[0] > GEMM_MAX_EXPERTS:
        raise ValueError(
            f"{w_name} has E = {w.shape[0]} experts; the grouped GEMM takes at most "
            f"{GEMM_MAX_EXPERTS}"
        )
    if w.shape[2] != a.shape[1]:
        raise ValueError(
            f"{w_name} [E, N, K] must have K = {a_name}.shape[1] = {a.shape[1]}, got {describe(w)}"
        )
    if spec.gated and w.shape[1] % 2:
        raise ValueError(
            f"{w_name} for gated activation {str(spec)!r} must have an even N = 2*I (gate and "
            f"up rows), got {describe(w)}"
        )
    if bias is not None:
        check_tensor(bias_name, bias, ndim=2, dtypes=bias_dtypes(a.dtype))
        if tuple(bias.shape) != tuple(w.shape[:2]):
            raise ValueError(
                f"{bias_name} must be [E, N] = {list(w.shape[:2])} (one row per expert, matching "
                f"{w_name}), got {describe(bias)}"
            )
    check_same_device(**{a_name: a, w_name: w, bias_name: bias})
    return w.shape[0], w.shape[1] // 2 if spec.gated else w.shape[1]


def check_interpreter_dtype(name: str, t: torch.Tensor, backend: str) -> None:
    """The Triton interpreter's bf16 ``tl.dot`` is wrong: refuse it rather than return garbage."""
    if backend == "triton" and t.dtype == torch.bfloat16 and t.device.type == "cpu":
        raise TypeError(
            f"{name} is bfloat16 on the CPU with the Triton interpreter (TRITON_INTERPRET=1), "
            "whose bf16 matrix product is wrong: use float16/float32 there, or backend='torch'"
        )


# --------------------------------------------------------------------------- MoELayer
def positive_int(name: str, value: object, minimum: int = 1) -> int:
    """``value``, an int (not a bool) of at least ``minimum``, or a clear error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}={value}: expected >= {minimum}")
    return value


def nonneg_float(name: str, value: object) -> float:
    """``value`` as a float, a finite number (not a bool) >= 0, or a clear error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not 0 <= value < math.inf:
        raise ValueError(f"{name}={value}: expected a finite number >= 0")
    return float(value)


def check_layer_input(x: object, H: int, dtype: torch.dtype) -> None:
    """Raise unless ``x`` is a ``[..., H]`` tensor of the layer's ``dtype``."""
    check_tensor("x", x)
    if x.dim() < 1 or x.shape[-1] != H:
        raise ValueError(f"x must be [..., hidden_size] = [..., {H}], got {describe(x)}")
    if x.dtype != dtype:
        raise TypeError(
            f"x has dtype {x.dtype} but the layer's parameters are {dtype}: convert one of them "
            "(layer.to(dtype) or x.to(dtype))"
        )
