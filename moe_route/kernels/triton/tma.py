"""TMA (Hopper tensor-memory-accelerator) descriptors over row ranges, shared by the kernels.

An expert's rows are a range ``[lo, lo + size)`` of a permuted ``[M, ...]`` tensor. A TMA box
read or written at a row of that range must not touch the next expert's rows: a *bounded rows
descriptor* gives each access a bounds check at ``lo + size`` itself, so the hardware reads
zeros past it and drops the writes past it. Every access then is one whole-box TMA copy, which
the software pipeliner overlaps (loads) or which runs while the program goes on (stores).

How: ``t [M, C...]`` seen as ``[_, _, 2^30, C...]`` with row strides ``(2^64/2^30 - s, s, s)``
(``s`` the row stride). At coordinates ``(2^30, lo + size, 2^30 - size + i, c...)`` the address
is ``(lo + i) * s + c`` modulo 2^64, and the third coordinate is in bounds exactly when
``i < size``. (The trick is the one of ``triton.tools.ragged_tma``; TMA takes 5 dimensions, so
``t`` has at most 3.)

The launchers pass :class:`Descriptor` objects (a tensor seen with a shape, strides and a box):
cheap to build, encoded once per address by the thin launch (see the class).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: The element types the kernels read and write through TMA.
TMA_DTYPES = (torch.float16, torch.bfloat16)
#: Rows per range a bounded descriptor addresses.
_ROW_SPAN = 1 << 30
#: The two leading dimensions' extent (any value past what the coordinates reach).
_BIG = 0x7FFF0000


class Descriptor:
    """A host-side TMA descriptor: a tensor, the shape and strides (elements) it is seen with,
    the box. What :class:`moe_route.kernels.triton.ThinKernel` passes for a
    ``tl.tensor_descriptor`` argument: Triton's own ``TensorDescriptor`` (:meth:`triton`) for a
    launch through Triton, and after that the encoded descriptor from a cache keyed on the
    address, shape and strides, so that a launch neither validates nor re-encodes a
    descriptor it has seen (the weights' every call; the activations' whenever the allocator
    hands back the same block).

    Building and encoding descriptors at each launch took a quarter of the launch sequences'
    host time (docs/decisions.md, "Thin launches").

    The launchers check what TMA needs (:func:`tma_ok`) before they build one."""

    __slots__ = ("base", "block_shape", "shape", "strides")
    padding = "zero"

    def __init__(self, base: torch.Tensor, shape, strides, block_shape):
        self.base = base
        self.shape = tuple(shape)
        self.strides = tuple(strides)
        self.block_shape = tuple(block_shape)

    def triton(self):
        """Triton's ``TensorDescriptor`` of the same view (validated by its constructor)."""
        from triton.tools.tensor_descriptor import TensorDescriptor

        return TensorDescriptor(self.base, list(self.shape), list(self.strides),
                                list(self.block_shape))  # fmt: skip

    def __repr__(self) -> str:
        return f"Descriptor(shape={self.shape}, strides={self.strides}, box={self.block_shape})"


class GluonDescriptor(Descriptor):
    """A :class:`Descriptor` for a Gluon kernel, which takes Gluon's ``TensorDescriptor``: the
    same view with the default NVMMA shared layout of its box (the layout the kernel's
    shared-memory ring is allocated with)."""

    __slots__ = ()

    def triton(self):
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        dtype = {torch.float8_e4m3fn: gl.float8e4nv, torch.bfloat16: gl.bfloat16,
                 torch.float16: gl.float16}[self.base.dtype]  # fmt: skip
        layout = gl.NVMMASharedLayout.get_default_for(list(self.block_shape), dtype)
        return TensorDescriptor(self.base, list(self.shape), list(self.strides),
                                list(self.block_shape), layout)  # fmt: skip


def descriptor(t: torch.Tensor, block) -> Descriptor:
    """A descriptor over the whole of ``t`` (``tma_ok``), boxes of ``block``."""
    return Descriptor(t, t.shape, t.stride(), block)


def layout_ok(t: torch.Tensor, strides: tuple[int, ...]) -> bool:
    """Whether TMA can address ``t``'s storage seen with ``strides`` (elements): unit last
    stride, 16-byte aligned base and strides."""
    es = t.element_size()
    if strides[-1] != 1 or t.data_ptr() % 16:
        return False
    return all((st * es) % 16 == 0 for st in strides[:-1])


def tma_ok(t: torch.Tensor) -> bool:
    """Whether TMA can address ``t``: unit last stride, 16-byte aligned base and strides."""
    return layout_ok(t, t.stride())


def bounded_rows_descriptor(t: torch.Tensor, block, *, parts: int = 0) -> Descriptor:
    """A descriptor over the rows of ``t [M, C]`` or ``[M, P, C]`` (``tma_ok``; at most
    ``2^30`` rows) for :func:`load_rows` / :func:`store_rows`, boxes of ``block`` (one entry per
    dimension of ``t``). ``parts``: ``t [M, P*C]`` (row-contiguous columns) seen as ``[M, P, C]``
    (a ``[M, 2, N]`` pre-activation: gate half, then up half), without a view."""
    s = t.stride(0)
    if parts:
        cols = t.shape[1] // parts
        shape, strides = (parts, cols), (s, cols * t.stride(1), t.stride(1))
    else:
        shape, strides = tuple(t.shape[1:]), t.stride()
    return Descriptor(t, (_BIG, _BIG, _ROW_SPAN, *shape), (2**34 - s, s, *strides), (1, 1, *block))


@triton.jit
def load_rows(desc, lo, size, i, c, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows ``lo + i ..`` (columns ``c ..``) of a 2-D :func:`bounded_rows_descriptor`, zeros
    from row ``lo + size`` on."""
    span: tl.constexpr = 1 << 30
    block = desc.load([span, lo + size, span - size + i, c])
    return block.reshape(BLOCK_R, BLOCK_C)


@triton.jit
def store_rows(desc, lo, size, c, data, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``data [BLOCK_R, BLOCK_C]`` into rows ``lo ..`` (columns ``c ..``) of a 2-D
    :func:`bounded_rows_descriptor`, the rows from ``lo + size`` on (and the columns past the
    tensor) left as they are. Asynchronous: the program goes on while the copy runs."""
    span: tl.constexpr = 1 << 30
    desc.store([span, lo + size, span - size, c],
               data.to(desc.dtype).reshape(1, 1, BLOCK_R, BLOCK_C))  # fmt: skip


@triton.jit
def store_rows_part(desc, lo, size, p, c, data, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """:func:`store_rows` into part ``p`` of a 3-D ``[M, P, C]`` descriptor (e.g. the gate or
    the up half of a pre-activation ``[M, 2, N]``: a partial column tile stops at ``N``)."""
    span: tl.constexpr = 1 << 30
    desc.store([span, lo + size, span - size, p, c],
               data.to(desc.dtype).reshape(1, 1, BLOCK_R, 1, BLOCK_C))  # fmt: skip
