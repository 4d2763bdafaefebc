"""CuPy arrays in, CuPy arrays out: zero-copy conversion through DLPack.

The public functions accept ``cupy.ndarray`` wherever they take a tensor. Such an argument is
viewed as a torch tensor with :func:`torch.from_dlpack` (same memory, same strides: no copy),
the op runs on torch tensors, and a tensor result goes back to the caller as a ``cupy.ndarray``
viewing the result's memory (:func:`cupy.from_dlpack`). Both directions are stream-ordered
(DLPack's ``stream`` handshake makes the consumer's stream wait for the producer's on the GPU),
never a host synchronisation.

CuPy is never imported here unless the caller passed a CuPy array, so none of this needs CuPy
installed.
"""

from __future__ import annotations

import torch


def is_cupy(obj: object) -> bool:
    """``obj`` is a CuPy array (checked by type, without importing CuPy)."""
    return type(obj).__module__.partition(".")[0] == "cupy" and hasattr(obj, "__dlpack__")


def any_cupy(*objs: object) -> bool:
    return any(is_cupy(o) for o in objs)


def as_torch(obj):
    """A CuPy array as a torch tensor on the same memory; anything else unchanged."""
    return torch.from_dlpack(obj) if is_cupy(obj) else obj


def as_cupy(t: torch.Tensor):
    """A torch tensor as a CuPy array on the same memory."""
    from .kernels.cupy import import_cupy

    return import_cupy().from_dlpack(t)
