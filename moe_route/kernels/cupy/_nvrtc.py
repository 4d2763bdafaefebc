"""Compile this package's CUDA C sources with NVRTC through CuPy, and launch them on torch's stream.

Kernels are compiled lazily, on their first launch on a device, and cached: per instantiation
here (a ``RawKernel`` per source file and template arguments, i.e. per dtype), per device by
CuPy, and on disk by CuPy (``~/.cupy/kernel_cache``, keyed on the source text and the options;
the options carry a hash of every ``.cu``/``.cuh`` file here, so editing an included header
recompiles too).

Launches go to torch's current stream of the tensors' device (wrapped as a
``cupy.cuda.ExternalStream``), so they order with the surrounding torch work and are captured
by ``torch.cuda.graph``. Arguments are passed by value and must match the kernel's parameter
types: pointers as ``numpy.uint64``, ``long long`` as ``numpy.int64``, ``int`` as
``numpy.int32``.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numpy as np
import torch

from . import import_cupy

SOURCE_DIR = Path(__file__).resolve().parent


@functools.cache
def _sources_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted(SOURCE_DIR.glob("*.cu*")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def _module(source: str, name_expressions: tuple[str, ...]):
    cupy = import_cupy()
    return cupy.RawModule(
        code=(SOURCE_DIR / source).read_text(),
        options=(
            "--std=c++17",
            f"--include-path={SOURCE_DIR}",
            f"-DMOE_ROUTE_SOURCES_{_sources_hash()}",
        ),
        name_expressions=name_expressions,
    )


class KernelCompileError(RuntimeError):
    """NVRTC rejected one of the package's kernels (a broken install or an unsupported GPU)."""


@functools.cache
def kernel(source: str, name: str, device_index: int):
    """The ``RawKernel`` ``name`` (a name expression such as ``"expand_rows<Bytes16, 8>"``) of
    ``source``, compiled for device ``device_index``."""
    cupy = import_cupy()
    module = _module(source, (name,))
    try:
        with cupy.cuda.Device(device_index):
            return module.get_function(name)
    except cupy.cuda.compiler.CompileException as exc:
        raise KernelCompileError(
            f"NVRTC failed to compile {name} from moe_route/kernels/cupy/{source} for "
            f"cuda:{device_index}: {exc}"
        ) from exc


def ptr(t: torch.Tensor | None) -> np.uint64:
    """A kernel pointer argument (``nullptr`` for ``None``)."""
    return np.uint64(0 if t is None else t.data_ptr())


def ints(*values: int) -> tuple[np.int64, ...]:
    return tuple(np.int64(v) for v in values)


def int32s(what: str, *values: int) -> tuple[np.int32, ...]:
    """``int`` kernel arguments; raises ``ValueError`` (before any launch) if one does not fit."""
    if any(not -(2**31) <= v < 2**31 for v in values):
        raise ValueError(
            f"{what} {values}: the CuPy kernels take strides below 2**31 elements; use "
            "backend='triton' for such layouts"
        )
    return tuple(np.int32(v) for v in values)


class _StreamHandle:
    """A raw ``cudaStream_t`` in the CUDA stream protocol (``cupy.cuda.Stream.from_external``)."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


@functools.lru_cache(maxsize=64)
def _external_stream(handle: int, device_index: int):
    stream = import_cupy().cuda.Stream
    if hasattr(stream, "from_external"):  # CuPy >= 14 (ExternalStream is deprecated there)
        return stream.from_external(_StreamHandle(handle))
    return import_cupy().cuda.ExternalStream(handle, device_index)


def launch(
    k, device: torch.device, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0
) -> None:
    """Launch kernel ``k`` on torch's current stream of ``device``."""
    cupy = import_cupy()
    stream = torch.cuda.current_stream(device)
    with cupy.cuda.Device(device.index), _external_stream(stream.cuda_stream, device.index):
        if shared_mem > 48 * 1024:  # beyond the default limit a kernel must opt in
            k.max_dynamic_shared_size_bytes = shared_mem
        k(grid, block, args, shared_mem=shared_mem)


def max_shared_memory(device: torch.device) -> int:
    """Largest dynamic shared memory one block may opt in to on ``device``, in bytes."""
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def probe(device_index: int) -> str:
    """Compile one kernel for ``device_index``; return a description of the NVRTC in use.

    Raises whatever stops the CuPy backend there (no GPU visible to CuPy, NVRTC failure).
    """
    cupy = import_cupy()
    kernel("expand.cu", "expand_rows<Bytes16, 1>", device_index)
    major, minor = cupy.cuda.nvrtc.getVersion()
    return f"CuPy {cupy.__version__}, NVRTC {major}.{minor}"
