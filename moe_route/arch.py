"""Run-time choice of implementation, decided lazily per tensor device and cached.

Two questions are answered here, never at import time and never from "device 0":

* **backend** — which implementation runs an op on a given device:
  ``"triton"`` (compiled Triton kernels on CUDA, or the Triton interpreter on CPU when
  ``TRITON_INTERPRET=1`` is set), ``"cupy"`` (CUDA C kernels of the memory-bound stages —
  routing maps, expand, standalone finalize — compiled by NVRTC through CuPy, an optional
  dependency; the other stages run Triton) or ``"torch"`` (the pure-PyTorch implementation of
  :mod:`moe_route.kernels.torch_impl`, the CPU backend; ``"reference"`` is accepted as its
  former name). ``"auto"`` picks Triton on CUDA, except the routing maps at the sizes where the
  CuPy kernels measured faster (when CuPy is installed), and the torch backend elsewhere.
* **finalize path** — ``"standalone"`` (GEMM2 writes permuted rows, a separate
  finalize kernel reduces them), ``"fused"`` (finalize inside GEMM2's epilogue: the last row
  of each token to arrive reduces the token in ``k`` order, deterministic) or
  ``"fused_atomic"`` (the epilogue adds with float atomics: only on an explicit
  ``finalize="fused"`` with ``deterministic=False``).

Environment overrides (read on every call and part of every plan's cache key, so tests may set
them with ``monkeypatch``):

``MOE_ROUTE_BACKEND``   ``auto`` (default) | ``triton`` | ``cupy`` | ``torch``
``MOE_ROUTE_FINALIZE``  ``auto`` (default) | ``fused`` | ``standalone``
``MOE_ROUTE_ARCH``      pretend compute capability, e.g. ``80`` or ``90`` (testing only)
``MOE_ROUTE_PERSISTENT``  GEMM1 / GEMM2 kernel: ``0`` per-tile, ``N`` persistent with ``N``
                        programs per SM (benchmarking; unset: :mod:`moe_route.tuning` decides)
``MOE_ROUTE_COMM_SMS``  SMs the persistent GEMMs leave free for the communication kernels that
                        overlap them (expert parallelism with ``ep_chunks``); default 0
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ._env import flag, getenv, reader
from .kernels.cupy import cupy_install_hint, import_cupy  # noqa: F401  (re-exported)

BACKENDS = ("triton", "cupy", "torch")
#: Accepted backend names that mean another one.
BACKEND_ALIASES = {"reference": "torch"}
FINALIZE_PATHS = ("fused", "standalone")

# Whether the ordered fused finalize beats GEMM2 + the standalone finalize on SM90 ("auto"
# follows it; the atomic mode never wins): docs/decisions.md, "Finalize path".
FUSED_FINALIZE_WINS = False


def triton_interpreter_enabled() -> bool:
    """True when Triton kernels are interpreted on the CPU (``TRITON_INTERPRET=1``)."""
    return flag("TRITON_INTERPRET")


@functools.cache
def _triton_importable() -> tuple[bool, str]:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the install
        return False, f"triton failed to import: {exc}"
    return True, ""


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def compute_capability(device: torch.device) -> int | None:
    """Compute capability as an integer (``90`` for SM90) of a CUDA device, else ``None``.

    ``MOE_ROUTE_ARCH`` overrides the answer for CUDA devices (and only for them).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    forced = getenv("MOE_ROUTE_ARCH")
    if forced:
        return int(forced)
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = _cuda_capability(index)
    return major * 10 + minor


def _env_choice(name: str, allowed: tuple[str, ...]) -> str:
    value = getenv(name, "auto").strip().lower() or "auto"
    value = BACKEND_ALIASES.get(value, value) if name == "MOE_ROUTE_BACKEND" else value
    if value != "auto" and value not in allowed:
        raise ValueError(
            f"environment variable {name}={value!r}: expected 'auto' or one of {allowed}"
        )
    return value


@dataclass(frozen=True)
class Choice:
    """An answer together with the reason, so ``python -m moe_route info`` can explain it."""

    value: str
    why: str


# CuPy's maps only where device time dominates its host cost: docs/decisions.md, "CuPy backend".
CUPY_MAPS_MIN_LARGE_SLOTS = 131072


def _cupy_maps_faster(slots: int) -> bool:
    return slots >= CUPY_MAPS_MIN_LARGE_SLOTS


@functools.cache
def _cupy_usable() -> bool:
    """CuPy imports (cached: "auto" asks on every call and must not pay for a failed import)."""
    try:
        import_cupy()
    except Exception:  # not installed, or installed without working CUDA libraries
        return False
    return True


def backend_for(
    device: torch.device | str, requested: str = "auto", *, op: str = "", slots: int = 0
) -> Choice:
    """Which implementation runs an op whose tensors live on ``device``.

    ``requested`` is the caller's ``backend=`` argument; ``MOE_ROUTE_BACKEND`` overrides an
    ``"auto"`` request for the whole process. ``op="routing_maps"`` with its ``slots`` (``T*K``)
    lets ``"auto"`` pick the CuPy kernels where they measured faster (see the note above).
    """
    device = torch.device(device)
    check_backend_name(requested)
    source = f"backend={requested!r}"
    requested = BACKEND_ALIASES.get(requested, requested)
    if requested == "auto":
        requested = _env_choice("MOE_ROUTE_BACKEND", BACKENDS)
        source = f"MOE_ROUTE_BACKEND={requested}"
    if requested == "torch":
        return Choice("torch", source)
    if requested == "cupy":
        if device.type != "cuda":  # CuPy would not help: say what would
            raise ValueError(
                f"{source} but the tensors are on {device}: the CuPy kernels need a CUDA device "
                "(use backend='torch' or 'auto' on the CPU)"
            )
        try:
            import_cupy()
        except ImportError as exc:
            raise ImportError(f"{source}: {exc}") from exc
        return Choice("cupy", source)
    if (
        requested == "auto"
        and op == "routing_maps"
        and device.type == "cuda"
        and _cupy_maps_faster(slots)
        and _cupy_usable()
    ):
        return Choice("cupy", f"CUDA device; CuPy routing maps measured faster at {slots} slots")
    ok, err = _triton_importable()
    if device.type == "cuda":
        if not ok:
            if requested == "triton":
                raise ValueError(f"{source} but {err}")
            return Choice("torch", err)
        return Choice("triton", "CUDA device")
    if triton_interpreter_enabled() and ok:
        return Choice("triton", f"{device.type} device with TRITON_INTERPRET=1 (interpreter)")
    if requested == "triton":
        raise ValueError(
            f"{source} but the tensors are on {device}: Triton needs a CUDA device, or "
            "TRITON_INTERPRET=1 (set before importing moe_route) to interpret on the CPU"
        )
    return Choice("torch", f"{device.type} device without TRITON_INTERPRET=1")


def check_backend_name(requested: object) -> str:
    """Raise ``ValueError`` unless ``requested`` names a backend (or ``"auto"``)."""
    if requested not in ("auto", *BACKENDS, *BACKEND_ALIASES):
        raise ValueError(
            f"backend={requested!r}: expected 'auto' or one of {BACKENDS} ('reference' is the "
            "former name of 'torch')"
        )
    return requested


def resolve_backend(device: torch.device | str, requested: str) -> str:
    """The backend an op runs on, for the ``backend`` string it was given: the names of
    :data:`BACKENDS` as they are (what the public functions pass), ``"auto"`` and the aliases
    as the public functions resolve them on ``device`` (:func:`cached_backend`); anything else
    raises ``ValueError``. Every op entry point (an ``Op`` object, ``torch.ops.moe_route.*``)
    reads its ``backend`` through this, so no name falls through to another backend."""
    if requested in BACKENDS:
        return requested
    return cached_backend(torch.device(device), requested)


def finalize_path_for(
    device: torch.device | str, requested: str = "auto", deterministic: bool = True
) -> Choice:
    """Which finalize path applies on ``device``: ``"fused"``, ``"fused_atomic"`` or
    ``"standalone"``.

    ``requested`` is the caller's argument (``"auto"``, ``"fused"``, ``"standalone"``);
    ``MOE_ROUTE_FINALIZE`` overrides it for the whole process. Both ``"fused"`` and
    ``"standalone"`` give the same bits on every run; ``"fused_atomic"`` (float atomics) is
    taken only for an explicit ``"fused"`` with ``deterministic=False``. ``"auto"`` takes the
    fused epilogue on SM90+ where it measured faster than the standalone pair, else standalone.
    """
    if requested not in ("auto", *FINALIZE_PATHS):
        raise ValueError(f"finalize={requested!r}: expected 'auto', 'fused' or 'standalone'")
    forced = _env_choice("MOE_ROUTE_FINALIZE", FINALIZE_PATHS)
    source = f"finalize={requested!r}"
    if forced != "auto":
        requested, source = forced, f"MOE_ROUTE_FINALIZE={forced}"
    if requested == "standalone":
        return Choice("standalone", source)
    if requested == "fused":
        if deterministic:
            return Choice("fused", f"{source}: ordered epilogue reduction, deterministic")
        return Choice("fused_atomic", f"{source} with deterministic=False: float atomics")
    cc = compute_capability(device)
    where = f"SM{cc}" if cc is not None else torch.device(device).type
    if cc is None or cc < 90:
        return Choice("standalone", f"{where} is below SM90: standalone finalize kernel")
    if not FUSED_FINALIZE_WINS:
        return Choice(
            "standalone",
            f"{where}: the epilogue-fused finalize measured slower than GEMM2 + standalone "
            "finalize (bench/bench_moe.py); finalize='fused' still forces it",
        )
    return Choice("fused", f"{where}: finalize in GEMM2's epilogue (ordered, measured faster)")


def backend_availability(device: torch.device | str) -> dict[str, Choice]:
    """For each backend, ``Choice("yes" | "no", why)`` on ``device``.

    For CuPy on a CUDA device this compiles one kernel (once per process and device), so it
    tells apart "CuPy missing", "no GPU visible to CuPy" and "NVRTC failed".
    """
    device = torch.device(device)
    found = {"torch": Choice("yes", "pure PyTorch, any device")}
    ok, err = _triton_importable()
    if not ok:
        found["triton"] = Choice("no", err)
    elif device.type == "cuda":
        found["triton"] = Choice("yes", "compiled for the GPU")
    elif triton_interpreter_enabled():
        found["triton"] = Choice("yes", "TRITON_INTERPRET=1: interpreted on the CPU")
    else:
        found["triton"] = Choice("no", "needs a CUDA device, or TRITON_INTERPRET=1")
    found["cupy"] = _cupy_availability(device)
    return {name: found[name] for name in BACKENDS}


def _cupy_availability(device: torch.device) -> Choice:
    if device.type != "cuda":
        return Choice("no", "needs a CUDA device")
    try:
        import_cupy()
    except ImportError as exc:
        return Choice("no", str(exc))
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _probe_cupy(index)


@functools.cache
def _probe_cupy(index: int) -> Choice:
    from .kernels.cupy import _nvrtc

    cupy = import_cupy()
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # a CUDARuntimeError: no driver, no device
        return Choice("no", f"CuPy sees no GPU: {exc}")
    if index >= count:
        return Choice("no", f"CuPy sees {count} GPU(s), not cuda:{index}")
    try:
        return Choice("yes", _nvrtc.probe(index))
    except Exception as exc:  # NVRTC missing or failing, a driver too old for its output, ...
        return Choice("no", f"compiling a kernel with NVRTC failed: {type(exc).__name__}: {exc}")


def env_cached(fn):
    """``fn(*args)`` cached on its (hashable) arguments and :func:`env_key`: the decisions the
    public functions take on every call (backend, finalize path, ...), answered once per
    configuration and again whenever an environment override changes. Exceptions are not
    cached (a bad argument raises on every call); ``.cache_clear()`` empties the cache."""
    cache: dict = {}

    @functools.wraps(fn)
    def cached(*args):
        key = (*args, env_key())
        chosen = cache.get(key)
        if chosen is None:
            chosen = cache[key] = fn(*args)
        return chosen

    cached.cache_clear = cache.clear
    return cached


def cached_backend(device: torch.device, requested: str = "auto") -> str:
    """:func:`backend_for`'s answer (the value), cached on the device, the request and the
    environment overrides: what the public functions ask on every call."""
    if requested == "cupy":  # asks whether CuPy imports every time (tests hide it)
        return backend_for(device, requested).value
    return _cached_backend(device, requested)


@env_cached
def _cached_backend(device: torch.device, requested: str) -> str:
    return backend_for(device, requested).value


#: The environment overrides a plan depends on.
ENV_OVERRIDES = (
    "MOE_ROUTE_BACKEND", "MOE_ROUTE_FINALIZE", "MOE_ROUTE_ARCH", "TRITON_INTERPRET",
    "MOE_ROUTE_PERSISTENT", "MOE_ROUTE_COMM_SMS",
)  # fmt: skip


_read_overrides = reader(ENV_OVERRIDES)


def env_key() -> tuple:
    """The values of :data:`ENV_OVERRIDES` (part of every plan cache key; raw, see
    :func:`moe_route._env.reader`)."""
    return _read_overrides()


def describe(device: torch.device | str) -> dict[str, str]:
    """Everything ``python -m moe_route info`` prints for one device."""
    device = torch.device(device)
    try:
        backend = backend_for(device)
        chosen = f"{backend.value}  [{backend.why}]"
    except (ValueError, ImportError) as exc:  # e.g. MOE_ROUTE_BACKEND=cupy without CuPy
        chosen = f"none  [{exc}]"
    path = finalize_path_for(device)
    cc = compute_capability(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    info = {
        "device": f"{device} ({name})",
        "compute capability": f"SM{cc}" if cc is not None else "-",
        "backend": chosen,
    }
    if chosen.startswith("triton") and device.type == "cuda":
        large = CUPY_MAPS_MIN_LARGE_SLOTS
        which = "cupy" if _cupy_usable() else "triton (cupy if CuPy were installed)"
        info["  routing maps"] = f"{which} at T*K >= {large} slots [measured faster]"
    for backend_name, available in backend_availability(device).items():
        info[f"  {backend_name}"] = f"{available.value:<4} [{available.why}]"
    info["finalize path"] = f"{path.value}  [{path.why}]"
    return info


# --------------------------------------------------------------------------- maps backend
def maps_backend(device: torch.device, backend: str, bucket: int, K: int,
                 num_experts: int) -> str:  # fmt: skip
    """The backend that builds maps for a token ``bucket`` (a power of two) into
    ``num_experts`` (the bucket's slots decide). Where ``"auto"`` picked the CuPy kernels for
    speed but ``E`` is past what they hold, the GEMMs' backend (Triton) builds them; an
    explicit ``"cupy"`` (argument or ``MOE_ROUTE_BACKEND``) stays, and
    :func:`check_kernel_limits` raises."""
    chosen = backend_for(device, backend, op="routing_maps", slots=bucket * K).value
    if chosen == "cupy":
        general = backend_for(device, backend).value
        if general != "cupy":
            from .kernels.cupy.routing_maps import max_num_experts

            if num_experts > max_num_experts(K, device):
                return general
    return chosen


def check_kernel_limits(chosen: str, E: int, K: int, device: torch.device) -> None:
    """Raise before any launch if the maps kernels of ``chosen`` cannot hold ``E`` experts."""
    if chosen == "triton":
        from .kernels.triton.routing_maps import check_num_experts_supported
    elif chosen == "cupy":
        from .kernels.cupy.routing_maps import check_num_experts_supported
    else:
        return  # the torch backend takes any E
    check_num_experts_supported(E, K, device)
