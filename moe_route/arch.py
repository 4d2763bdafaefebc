"""Run-time choice of implementation, decided lazily per tensor device and cached.

Two questions are answered here, never at import time and never from "device 0":

* **backend** — which implementation runs an op on a given device:
  ``"triton"`` (compiled Triton kernels on CUDA, or the Triton interpreter on CPU when
  ``TRITON_INTERPRET=1`` is set) or ``"reference"`` (the pure-PyTorch oracle of
  :mod:`moe_route.reference`, the CPU fallback).
* **finalize path** — ``"standalone"`` (GEMM2 writes permuted rows, a separate
  finalize kernel reduces them) or ``"fused"`` (finalize inside GEMM2's epilogue, SM90+,
  float atomics: only when the caller passes ``deterministic=False``).

Environment overrides (read on every call, so tests may set them with ``monkeypatch``):

``MOE_ROUTE_BACKEND``   ``auto`` (default) | ``triton`` | ``reference``
``MOE_ROUTE_FINALIZE``  ``auto`` (default) | ``fused`` | ``standalone``
``MOE_ROUTE_ARCH``      pretend compute capability, e.g. ``80`` or ``90`` (testing only)
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

BACKENDS = ("triton", "reference")
FINALIZE_PATHS = ("fused", "standalone")

# NOTE: on an H200 the atomic epilogue-fused finalize ran 0.4-0.9x the speed of GEMM2 plus the
# standalone finalize at every standard shape (bench/bench_moe.py), so "auto" does not pick it.
# Flip this when a fused epilogue beats the standalone pair.
FUSED_FINALIZE_WINS = False


def triton_interpreter_enabled() -> bool:
    """True when Triton kernels are interpreted on the CPU (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


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
    forced = os.environ.get("MOE_ROUTE_ARCH", "")
    if forced:
        return int(forced)
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = _cuda_capability(index)
    return major * 10 + minor


def _env_choice(name: str, allowed: tuple[str, ...]) -> str:
    value = os.environ.get(name, "auto").strip().lower() or "auto"
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


def backend_for(device: torch.device | str, requested: str = "auto") -> Choice:
    """Which implementation runs an op whose tensors live on ``device``.

    ``requested`` is the caller's ``backend=`` argument; ``MOE_ROUTE_BACKEND`` overrides an
    ``"auto"`` request for the whole process.
    """
    device = torch.device(device)
    if requested not in ("auto", *BACKENDS):
        raise ValueError(f"backend={requested!r}: expected 'auto' or one of {BACKENDS}")
    source = f"backend={requested!r}"
    if requested == "auto":
        requested = _env_choice("MOE_ROUTE_BACKEND", BACKENDS)
        source = f"MOE_ROUTE_BACKEND={requested}"
    if requested == "reference":
        return Choice("reference", source)
    ok, err = _triton_importable()
    if device.type == "cuda":
        if not ok:
            if requested == "triton":
                raise ValueError(f"{source} but {err}")
            return Choice("reference", err)
        return Choice("triton", "CUDA device")
    if triton_interpreter_enabled() and ok:
        return Choice("triton", f"{device.type} device with TRITON_INTERPRET=1 (interpreter)")
    if requested == "triton":
        raise ValueError(
            f"{source} but the tensors are on {device}: Triton needs a CUDA device, or "
            "TRITON_INTERPRET=1 (set before importing moe_route) to interpret on the CPU"
        )
    return Choice("reference", f"{device.type} device without TRITON_INTERPRET=1")


def finalize_path_for(
    device: torch.device | str, requested: str = "auto", deterministic: bool = True
) -> Choice:
    """Which finalize path applies on ``device``: ``"fused"`` (SM90+) or ``"standalone"``.

    ``requested`` is the caller's argument (``"auto"``, ``"fused"``, ``"standalone"``);
    ``MOE_ROUTE_FINALIZE`` overrides it for the whole process. The fused path accumulates
    with float atomics, so it is taken only when the caller gives up determinism
    (``deterministic=False``); ``"auto"`` with ``deterministic=True`` stays standalone.
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
            raise ValueError(
                f"{source} with deterministic=True: the epilogue-fused finalize reduces with "
                "float atomics; pass deterministic=False to allow it, or use 'standalone'"
            )
        return Choice("fused", source)
    cc = compute_capability(device)
    where = f"SM{cc}" if cc is not None else torch.device(device).type
    if cc is None or cc < 90:
        return Choice("standalone", f"{where} is below SM90: standalone finalize kernel")
    if deterministic:
        return Choice(
            "standalone", f"{where}: deterministic=True keeps the standalone (atomic-free) kernel"
        )
    if not FUSED_FINALIZE_WINS:
        return Choice(
            "standalone",
            f"{where}: the atomic epilogue-fused finalize measured slower than GEMM2 + standalone "
            "finalize (bench/data/moe_h200.csv); finalize='fused' still forces it",
        )
    return Choice("fused", f"{where} >= SM90, deterministic=False: finalize in GEMM2's epilogue")


def describe(device: torch.device | str) -> dict[str, str]:
    """Everything ``python -m moe_route info`` prints for one device."""
    device = torch.device(device)
    backend = backend_for(device)
    path = finalize_path_for(device)
    fast = finalize_path_for(device, deterministic=False)
    cc = compute_capability(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "device": f"{device} ({name})",
        "compute capability": f"SM{cc}" if cc is not None else "-",
        "backend": f"{backend.value}  [{backend.why}]",
        "finalize path": f"{path.value}  [{path.why}]",
        "  deterministic=False": f"{fast.value}  [{fast.why}]",
    }
