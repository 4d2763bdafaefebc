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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Rows per range a bounded descriptor addresses.
_ROW_SPAN = 1 << 30
#: The two leading dimensions' extent (any value past what the coordinates reach).
_BIG = 0x7FFF0000


def tma_ok(t: torch.Tensor) -> bool:
    """Whether TMA can address ``t``: unit last stride, 16-byte aligned base and strides."""
    es = t.element_size()
    return (
        t.stride(-1) == 1
        and t.data_ptr() % 16 == 0
        and all((st * es) % 16 == 0 for st in t.stride()[:-1])
    )


def bounded_rows_descriptor(t: torch.Tensor, block: list[int]):
    """A descriptor over the rows of ``t [M, C]`` or ``[M, P, C]`` (``tma_ok``; at most
    ``2^30`` rows) for :func:`load_rows` / :func:`store_rows`, boxes of ``block`` (one entry per
    dimension of ``t``)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    s = t.stride(0)
    return TensorDescriptor(t, [_BIG, _BIG, _ROW_SPAN, *t.shape[1:]], [2**34 - s, s, *t.stride()],
                            [1, 1, *block])  # fmt: skip


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
