"""The Triton interpreter's per-call patching of ``triton.language``, done once per module, and
its integer-overflow checks skipped where it would drop their result unread.

Used by ``tests/conftest.py`` (the pytest processes), and by the processes that the tests start
and that run interpreted kernels themselves: ``tests/ep_worker.py``'s gloo ranks and the
notebooks' kernels (``tests/test_notebooks.py``). Imports triton only, never moe_route, so it
may run before or after the kernel modules are decorated (it patches the interpreter's module,
which each launch reads). Without ``TRITON_INTERPRET=1`` it does nothing.
"""

import os

import numpy as np


def apply_if_interpreting():
    """``apply()`` where ``TRITON_INTERPRET=1`` (a GPU machine runs no interpreter)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        apply()


def apply():
    """Make the interpreter's per-call patching of ``triton.language`` a no-op after its first.

    The triton 3.5.1 interpreter calls ``_patch_lang`` before every launch *and* every call of
    a ``@triton.jit`` helper inside a kernel: it walks ``triton.language`` (and ``.core``,
    ``.math``, ``tensor``) with ``inspect.getmembers`` and rebinds each builtin to an
    interpreted one. The rebinding is global and never undone, and a member once rebound is no
    builtin any more, so every call after a module's first finds nothing to change, yet it
    spent about a third of the suite's interpreter time walking the modules. The kernels run
    the same interpreted builtins either way: only the repeated walk is skipped. Also: the
    table of ``_get_np_dtype`` built once, and the integer-overflow checks that
    ``device_assert`` drops unread not built (see below).
    """
    from triton import language as tl
    from triton.runtime import interpreter

    real = getattr(interpreter, "_patch_lang", None)
    if real is None or getattr(real, "_moe_route_once", False):
        return
    patched = set()

    def patch_lang_once(fn):
        langs = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if langs and langs <= patched:
            return
        real(fn)
        patched.update(langs)

    patch_lang_once._moe_route_once = True
    interpreter._patch_lang = patch_lang_once

    # Likewise ``_get_np_dtype`` (called for every interpreted op) builds its table of
    # Triton -> numpy dtypes anew at each call: build it once, look it up the same way.
    real_np_dtype = interpreter._get_np_dtype
    table = {}

    def get_np_dtype(tt_dtype):
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(key, tl.pointer_type):
            return np.dtype(np.uint64)
        if key not in table:
            table[key] = real_np_dtype(key)
        return table[key]

    interpreter._get_np_dtype = get_np_dtype

    # The interpreter builds the overflow check of every integer add, sub and mul on 32 bits or
    # fewer (``TritonSemantic.binary_op_sanitize_overflow_impl``: casts to int64, the op again,
    # two comparisons and an ``and``, a few numpy operations and tl.tensor objects each) and
    # hands it to ``device_assert``, which returns without looking at it unless the options'
    # ``debug`` is set, and the interpreter's options never set it (``InterpreterOptions()``,
    # triton 3.5.1). The check took about a quarter of the kernels' interpreted time; it is
    # skipped under the same condition that ``device_assert`` drops it, so nothing that was
    # checked before goes unchecked (with ``debug`` on it runs as before).
    from triton.language.semantic import TritonSemantic

    real_sanitize = TritonSemantic.binary_op_sanitize_overflow_impl
    if not getattr(real_sanitize, "_moe_route_unread", False):

        def sanitize_overflow(self, lhs, rhs, binary_op):
            if isinstance(self.builder, interpreter.InterpreterBuilder) and not (
                self.builder.options.debug
            ):
                return None
            return real_sanitize(self, lhs, rhs, binary_op)

        sanitize_overflow._moe_route_unread = True
        sanitize_overflow._moe_route_real = real_sanitize  # tests/test_interpreter_patch.py
        TritonSemantic.binary_op_sanitize_overflow_impl = sanitize_overflow
