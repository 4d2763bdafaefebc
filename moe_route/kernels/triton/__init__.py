"""Triton kernels and their launchers, one file per stage, and the thin launch they share.

A launcher computes the grid and the constexpr flags and launches; it trusts its inputs (the
public functions in :mod:`moe_route` validate them, once per call). A kernel only computes.

:class:`ThinKernel` is how every launcher launches. Triton's ``kernel[grid](...)`` binds and
specialises every argument on every call (26 µs of host time for a 20-argument kernel on an
H100 host), where calling the compiled kernel's launcher directly with the tensors' addresses
costs 6 µs (docs/decisions.md, "Thin launches"). A launcher knows which of its arguments can
change the compiled variant (dtypes, strides, constexprs — the *launch key*; :class:`ThinKernel`
adds the alignment), so after the first launch with a key it calls the compiled kernel straight
away. Arguments that vary with the token count are marked ``do_not_specialize`` in the kernels,
so a new ``T`` never compiles a new variant.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
import warnings
from concurrent.futures import Executor, Future

import torch
import triton

from ..._env import flag, getenv
from .tma import Descriptor


def interpreting() -> bool:
    return flag("TRITON_INTERPRET")


#: Triton decides at decoration (import) time whether a ``@triton.jit`` function is
#: interpreted, so the answer of the launch path is fixed at import too.
INTERPRETING = interpreting()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)``; plain Python (``triton.cdiv`` costs 2 µs of host time per call)."""
    return -(-a // b)


def cuda_index(device: torch.device) -> int:
    """The CUDA device index of ``device`` (the current device for a bare ``"cuda"``)."""
    return torch.cuda.current_device() if device.index is None else device.index


@functools.cache
def shared_memory_optin(index: int) -> int:
    """The most shared memory one block may opt in to on CUDA device ``index``, in bytes."""
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``); plain Python, like :func:`cdiv`."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def launch_key_part(cls):
    """Class decorator for a frozen dataclass that launchers put in launch keys (a config, an
    epilogue): its hash is computed once per object and kept, since a launch hashes its key
    (the generated ``__hash__`` builds a tuple of every field at each call). Equality stays
    the dataclass's. Fields must be immutable (frozen), and hash alike in every process
    (numbers, bools, None, nested such objects; no strings)."""
    names = tuple(f.name for f in dataclasses.fields(cls))

    def __hash__(self):
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, n) for n in names))
            object.__setattr__(self, "_hash", h)
        return h

    cls.__hash__ = __hash__
    return cls


class LaunchKey:
    """A launch key computed once and launched many times (a prepared launcher's): its hash is
    the tuple's, computed at construction, and a dict lookup with the same object compares by
    identity first, so a launch does not hash or compare the ~20 fields again (0.9 µs per
    launch on an H100 host, docs/decisions.md, "Thin launches"). Equal to another key only if the
    other is a :class:`LaunchKey` of an equal tuple."""

    __slots__ = ("_hash", "fields")

    def __init__(self, fields: tuple):
        self.fields = fields
        self._hash = hash(fields)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return isinstance(other, LaunchKey) and self.fields == other.fields

    def __repr__(self):
        return f"LaunchKey{self.fields!r}"


#: ``MOE_ROUTE_CHECK_LAUNCHES=1`` (read at import; the GPU tests set it): every thin launch
#: also asks Triton which variant its own launch would pick, and raises if that is not the one
#: launched. Slow (Triton's argument binding on every launch); for tests.
CHECK_LAUNCHES = flag("MOE_ROUTE_CHECK_LAUNCHES")

#: every :class:`ThinKernel` made (for :func:`launch_keys`)
KERNELS: list[ThinKernel] = []

#: True while a :func:`compiling_ahead` pass runs: launches compile, nothing runs
_AHEAD = False
#: ``MOE_ROUTE_COMPILE_AHEAD=0`` compiles each variant at its first launch, one after another,
#: in this process (for hosts where forking is unwelcome).
COMPILE_AHEAD_ENV = "MOE_ROUTE_COMPILE_AHEAD"


def compiling_ahead():
    """A context in which every :class:`ThinKernel` launch of a variant not launched before
    compiles it in a child process and launches nothing; on exit, every compile has finished
    and the variants are loaded. None where it cannot run: inside such a pass (which covers
    what runs within it), without ``os.fork`` or Triton's asynchronous compile, or with
    ``MOE_ROUTE_COMPILE_AHEAD=0``.

    A signature's first call runs its launch sequence once inside it, on the buffers it
    allocates, then for real: the variants compile side by side instead of one after the
    other (docs/decisions.md, "Cold start"). Nothing may read what the pass "wrote"."""
    if _AHEAD or not hasattr(os, "fork") or getenv(COMPILE_AHEAD_ENV, "1") in ("", "0"):
        return None
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return None
    return _ahead(AsyncCompileMode)


@contextlib.contextmanager
def _ahead(mode):
    global _AHEAD
    with mode(_ForkedCompiles()):
        _AHEAD = True
        try:
            yield
        finally:
            _AHEAD = False


class _ForkedCompiles(Executor):
    """Runs each submitted compile in a process forked for it, then once more here.

    Triton holds the GIL through most of a compile, so compiles on threads barely overlap; in
    forked children they do. A child only compiles (Triton's ``compile`` for an explicit
    target touches no CUDA, which a forked child must not), and builds the variant's launcher,
    into Triton's on-disk cache, and exits; the parent's own compile of the same source then
    finds the cache entry and loads it. A child that fails leaves the parent to compile (and
    report) as it would have."""

    def submit(self, fn, /, *args, **kwargs):
        future: Future = Future()
        with warnings.catch_warnings():  # Python 3.12+ warns of forking a threaded process
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _build_launcher(fn(*args, **kwargs))
                code = 0
            finally:
                os._exit(code)
        threading.Thread(target=_reap, args=(pid, future, fn, args, kwargs), daemon=True).start()
        return future


def _build_launcher(compiled) -> None:
    """Build ``compiled``'s C launcher: a small C module per argument signature that Triton
    compiles with the host compiler and keeps in its on-disk cache, else built by the parent
    at the variant's first launch (0.2-0.4 s each, one after another)."""
    from triton.runtime.driver import driver

    driver.active.launcher_cls(compiled.src, compiled.metadata)


def _reap(pid: int, future: Future, fn, args, kwargs) -> None:
    """Wait for the child ``pid`` (GIL released), then run ``fn`` here: a cache hit where the
    child compiled, the whole compile where it did not."""
    os.waitpid(pid, 0)
    try:
        future.set_result(fn(*args, **kwargs))
    except BaseException as exc:  # handed to whoever waits on the future
        future.set_exception(exc)


class ThinKernel:
    """A ``@triton.jit`` function launched through a cache of its compiled variants.

    ``launch(key, grid, args, constexprs)``: ``args`` is the tuple of the kernel's runtime
    arguments in order; ``constexprs`` a callable returning its ``tl.constexpr`` parameters and
    launch options (``num_warps``, ``num_stages``) as a dict, called only when ``key`` is
    launched for the first time (building ~25 keyword arguments on every launch cost more than
    the lookup). ``key`` must determine everything Triton specialises on except the alignment
    of the tensors (argument dtypes, integers equal to 1 or divisible by 16 unless marked
    ``do_not_specialize``, the constexprs, which arguments are tensors); ``None`` takes
    Triton's own path.

    After a key's first launch (through Triton, which compiles or finds the variant), later
    launches with that key call the compiled kernel's C launcher directly, with the tensors'
    addresses as integers: the C launcher then neither calls ``data_ptr()`` nor asks the
    driver whether each address is device memory (the public functions checked the devices).
    The same addresses give the alignment the variant was specialised on (16 bytes), part of
    the cache key, so an unaligned view gets its own variant.
    """

    def __init__(self, fn):
        self.fn = fn
        # key -> (pack, variants): pack(args) -> (args with addresses, alignment); variants
        # (device, alignment) -> launch function. Keyed on ``key`` alone first, so a launch
        # hashes the (long) key once.
        self._entries: dict = {}
        KERNELS.append(self)
        params = getattr(fn, "params", None)
        if params is None:  # the interpreter wraps the function differently
            params = fn.fn.params if hasattr(fn, "fn") and hasattr(fn.fn, "params") else []
        self._constexpr_names = tuple(p.name for p in params if p.is_constexpr)

    def launch(self, key, grid: tuple, args: tuple, constexprs) -> None:
        if _AHEAD:
            self._compile_ahead(key, grid, args, constexprs)
            return
        if key is None or INTERPRETING:
            self.fn[grid](*_for_triton(args), **constexprs())
            return
        entry = self._entries.get(key)
        if entry is not None and not _hooks_set():
            packed, alignment = entry[0](args)
            device = _current_device()
            run = entry[1].get((device, alignment))
            if run is not None:
                if CHECK_LAUNCHES:
                    self._check_variant(run, key, args, constexprs)
                g = (*grid, 1, 1)
                run(g[0], g[1], g[2], _current_stream(device), packed)
                return
        self._first_launch(key, grid, args, constexprs)

    def _first_launch(self, key, grid: tuple, args: tuple, constexprs) -> None:
        """Triton's own launch (compiles or finds the variant); remembered for the next one."""
        cx = constexprs()
        compiled = self.fn[grid](*_for_triton(args), **cx)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = (_packer(args), {})
        values = tuple(cx[name] for name in self._constexpr_names)
        run = _direct_launch(compiled, values, len(args))
        entry[1][(_current_device(), entry[0](args)[1])] = run

    def _compile_ahead(self, key, grid: tuple, args: tuple, constexprs) -> None:
        """Triton's warm-up of this launch's variant (its compile handed to the
        :func:`compiling_ahead` pass), unless the variant was launched before."""
        entry = self._entries.get(key) if key is not None else None
        if entry is None or (_current_device(), entry[0](args)[1]) not in entry[1]:
            self.fn.warmup(*_for_triton(args), grid=grid, **constexprs())

    def variant(self, key, device: int, alignment: tuple):
        """The launch function of a variant launched before (KeyError if none)."""
        return self._entries[key][1][(device, alignment)]

    def forget(self) -> None:
        """Forget every launched variant: the next launch of each key goes through Triton (a
        cache lookup there, no compile) and builds its launch function again."""
        self._entries.clear()

    def variants(self) -> int:
        """How many (device, key, alignment) variants this kernel has launched."""
        return sum(len(v) for _, v in self._entries.values())

    def _check_variant(self, run, key, args: tuple, constexprs) -> None:
        """Raise unless Triton's own launch would run the variant the thin launch runs (the key
        missed something Triton specialises on: an integer equal to 1, say)."""
        from triton.runtime.jit import compute_cache_key

        cx = constexprs()  # with the options JITFunction.run adds (Triton 3.5, 3.6)
        cx["debug"] = cx.get("debug", self.fn.debug) or triton.knobs.runtime.debug
        if hasattr(triton.knobs.compilation, "instrumentation_mode"):
            cx["instrumentation_mode"] = triton.knobs.compilation.instrumentation_mode
        kernel_cache, key_cache, _, _, binder = self.fn.device_caches[_current_device()]
        _, specialization, options = binder(*_for_triton(args), **cx)
        chosen = kernel_cache.get(compute_cache_key(key_cache, specialization, options))
        if hasattr(chosen, "result"):  # an asynchronous compile's future
            chosen = chosen.result()
        if chosen is not run.compiled:
            raise AssertionError(
                f"{self.fn.__name__}: launch key {key!r} maps to a variant compiled for other "
                f"arguments than these (Triton's specialisation: {specialization})"
            )


def _packer(args: tuple):
    """``pack(args) -> (args', alignment)``: ``args`` with every tensor (at the positions where
    ``args`` has one) replaced by its address, and each address modulo 16. Generated once per
    launch key, so that a launch runs one straight-line function (a loop over the arguments
    cost a microsecond more per launch)."""
    where = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    reads = "".join(f"    p{i} = a[{i}].data_ptr()\n" for i in where)
    items = ", ".join(f"p{i}" if i in where else f"a[{i}]" for i in range(len(args)))
    mods = ", ".join(f"p{i} & 15" for i in where)
    source = f"def pack(a):\n{reads}    return ({items},), ({mods},)\n"
    scope: dict = {}
    exec(compile(source, "<moe_route thin launch>", "exec"), scope)
    return scope["pack"]


def _for_triton(args: tuple) -> tuple:
    """``args`` with every :class:`.tma.Descriptor` as Triton's own ``TensorDescriptor``."""
    if not any(isinstance(a, Descriptor) for a in args):
        return args
    return tuple(a.triton() if isinstance(a, Descriptor) else a for a in args)


def _direct_launch(compiled, values: tuple, n_args: int):
    """``run(gx, gy, gz, stream, args)`` for one compiled variant: its C launcher called
    directly when the variant needs no scratch memory (Triton's Python wrapper around it only
    allocates that), else its ``run``. Tensor-descriptor arguments are expanded into what the
    C launcher takes by :func:`_descriptor_expander` (cached encodings) where Triton's
    launcher has the known shape, else by Triton's own wrapper."""
    run, function, meta = compiled.run, compiled.function, compiled.packed_metadata
    launch = getattr(run, "launch", None)
    scratch = (getattr(run, "global_scratch_size", 1), getattr(run, "profile_scratch_size", 1))
    if launch is not None and scratch == (0, 0):
        coop, pdl = run.launch_cooperative_grid, run.launch_pdl
        raw, expand = _descriptor_expander(launch, n_args)
        if expand is not None:

            def direct(gx, gy, gz, stream, args):
                raw(gx, gy, gz, stream, function, coop, pdl, None, None, meta, None, None, None,
                    *expand(args), *values)  # fmt: skip

        else:

            def direct(gx, gy, gz, stream, args):
                launch(gx, gy, gz, stream, function, coop, pdl, None, None, meta, None, None,
                       None, *args, *values)  # fmt: skip

        direct.compiled = compiled
        direct.expands_descriptors = expand is not None
        return direct

    def through_run(gx, gy, gz, stream, args):
        run(gx, gy, gz, stream, function, meta, None, None, None, *args, *values)

    through_run.compiled = compiled
    return through_run


#: Encoded descriptors one compiled variant keeps per descriptor argument (then it starts over).
DESCRIPTOR_CACHE = 256


def _descriptor_expander(launch, n_args: int):
    """``(c_launcher, expand)``: ``expand(args)`` gives the runtime arguments with each
    tensor-descriptor argument replaced by its encoding (the CUtensorMap, shape and strides:
    what Triton's ``make_tensordesc_arg`` makes), cached per argument on the descriptor's
    address, shape and strides (the box, dtype and swizzle are the variant's). ``(launch,
    None)`` when the variant takes no descriptor or Triton's launch wrapper is not the one
    this reads (Triton 3.5 / 3.6: ``wrap_handle_tensordesc``'s closure)."""
    code, closure = getattr(launch, "__code__", None), getattr(launch, "__closure__", None)
    if code is None or closure is None:  # the C launcher itself: no descriptor arguments
        return launch, None
    cells = dict(zip(code.co_freevars, closure, strict=True))
    try:
        raw = cells["launcher"].cell_contents
        where = sorted(cells["tensordesc_indices"].cell_contents)
        metas = cells["tensordesc_meta"].cell_contents
    except (KeyError, ValueError):
        return launch, None
    if not where or len(metas) != len(where) or any(m is None for m in metas):
        return launch, None
    if where[-1] >= n_args:  # a descriptor among the constexprs: not a layout this knows
        return launch, None
    from triton.backends.nvidia.driver import make_tensordesc_arg

    scope = {f"e{i}": _encoder(make_tensordesc_arg, m) for i, m in zip(where, metas, strict=True)}
    items = ", ".join(f"*e{i}(a[{i}])" if i in where else f"a[{i}]" for i in range(n_args))
    exec(compile(f"def expand(a):\n    return ({items},)\n", "<moe_route expand>", "exec"),
         scope)  # fmt: skip
    return raw, scope["expand"]


def _encoder(make, meta):
    """``enc(desc)``: Triton's encoding of ``desc`` for one descriptor argument of a variant,
    remembered on ``(address, shape, strides, padding)`` (the CUtensorMap holds nothing else
    that varies; it keeps no reference to the tensor). ``desc``: a :class:`.tma.Descriptor`,
    or Triton's ``TensorDescriptor`` (its lists made tuples for the key)."""
    cache: dict = {}

    def enc(d):
        k = (d.base.data_ptr(), tuple(d.shape), tuple(d.strides), d.padding)
        hit = cache.get(k)
        if hit is None:
            if len(cache) >= DESCRIPTOR_CACHE:
                cache.clear()
            hit = cache[k] = tuple(make(d, meta))
        return hit

    return enc


# torch.cuda.current_device() in Python around them costs 0.5 µs per launch (CPU builds lack
# them; the interpreter never launches through here).
_current_device = getattr(torch._C, "_cuda_getDevice", None)
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def launch_keys() -> int:
    """How many (device, launch key, alignment) variants all thin kernels have launched: a new
    one means a compile or, at best, Triton's own cache lookup (the tests count them across
    token counts)."""
    return sum(k.variants() for k in KERNELS)


_RUNTIME = triton.knobs.runtime


def _hooks_set() -> bool:
    """A profiler (e.g. proton) hooks launches: take Triton's path, which calls the hooks."""
    enter, leave = _RUNTIME.launch_enter_hook, _RUNTIME.launch_exit_hook
    return bool(getattr(enter, "calls", enter)) or bool(getattr(leave, "calls", leave))


def int_key(*values: int) -> tuple[tuple[bool, bool], ...]:
    """What Triton specialises a (specialisable) integer argument on: ``== 1``, ``% 16 == 0``."""
    return tuple((v == 1, v % 16 == 0) for v in values)
