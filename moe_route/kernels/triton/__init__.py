"""Triton kernels and their launchers, one file per stage, and the thin launch they share.

A launcher computes the grid and the constexpr flags and launches; it trusts its inputs (the
public functions in :mod:`moe_route` validate them, once per call). A kernel only computes.

:class:`ThinKernel` is how every launcher launches. Triton's ``kernel[grid](...)`` binds and
specialises every argument on every call (33 µs of host time for an 18-argument kernel on an
H100 host, ``scripts/host_probe.py``), where calling the compiled kernel directly costs 11 µs.
A launcher knows which of its arguments can change the compiled variant (dtypes, strides,
alignment, constexprs — the *launch key*), so after the first launch with a key it calls the
compiled kernel straight away. Arguments that vary with the token count are marked
``do_not_specialize`` in the kernels, so a new ``T`` never compiles a new variant.
"""

from __future__ import annotations

import os

import torch
import triton


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


#: Triton decides at decoration (import) time whether a ``@triton.jit`` function is
#: interpreted, so the answer of the launch path is fixed at import too.
INTERPRETING = interpreting()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)``; plain Python (``triton.cdiv`` costs 2 µs of host time per call)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``); plain Python, like :func:`cdiv`."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


#: every :class:`ThinKernel` made (for :func:`launch_keys`)
KERNELS: list[ThinKernel] = []


class ThinKernel:
    """A ``@triton.jit`` function launched through a cache of its compiled variants.

    ``launch(key, grid, args, constexprs)``: ``args`` is the tuple of the kernel's runtime
    arguments in order; ``constexprs`` a callable returning its ``tl.constexpr`` parameters and
    launch options (``num_warps``, ``num_stages``) as a dict, called only when ``key`` is
    launched for the first time (building ~25 keyword arguments on every launch cost more than
    the lookup). ``key`` must determine everything Triton specialises on (argument dtypes,
    16-byte alignment of pointers, integers equal to 1 or divisible by 16 unless marked
    ``do_not_specialize``, the constexprs); ``None`` takes Triton's own path.
    """

    def __init__(self, fn):
        self.fn = fn
        self._compiled: dict = {}
        KERNELS.append(self)
        params = getattr(fn, "params", None)
        if params is None:  # the interpreter wraps the function differently
            params = fn.fn.params if hasattr(fn, "fn") and hasattr(fn.fn, "params") else []
        self._constexpr_names = tuple(p.name for p in params if p.is_constexpr)

    def launch(self, key, grid: tuple, args: tuple, constexprs) -> None:
        if key is None or INTERPRETING:
            self.fn[grid](*args, **constexprs())
            return
        device = torch.cuda.current_device()
        hit = self._compiled.get((device, key))
        if hit is None or _hooks_set():
            cx = constexprs()
            compiled = self.fn[grid](*args, **cx)  # compiles (or finds) and launches
            values = tuple(cx[name] for name in self._constexpr_names)
            self._compiled[(device, key)] = (compiled, values)
            return
        compiled, values = hit
        g = (*grid, 1, 1)
        compiled.run(
            g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(device), compiled.function,
            compiled.packed_metadata, None, None, None, *args, *values,
        )  # fmt: skip


def launch_keys() -> int:
    """How many (device, launch key) variants all thin kernels have launched: a new one means a
    compile or, at best, Triton's own cache lookup (the tests count them across token counts)."""
    return sum(len(k._compiled) for k in KERNELS)


def _hooks_set() -> bool:
    """A profiler (e.g. proton) hooks launches: take Triton's path, which calls the hooks."""
    runtime = triton.knobs.runtime
    return any(
        getattr(h, "calls", h) for h in (runtime.launch_enter_hook, runtime.launch_exit_hook)
    )


def aligned(*tensors: torch.Tensor | None) -> tuple[bool, ...]:
    """16-byte alignment of each tensor's data pointer (what Triton specialises pointers on)."""
    return tuple(t is not None and t.data_ptr() % 16 == 0 for t in tensors)


def int_key(*values: int) -> tuple[tuple[bool, bool], ...]:
    """What Triton specialises a (specialisable) integer argument on: ``== 1``, ``% 16 == 0``."""
    return tuple((v == 1, v % 16 == 0) for v in values)
