"""The torch backend's shared helpers: the dtype helpers (``_as``, ``_compute_dtype``), the one
place it interprets an activation (``_activation``), the experts' row ranges (``_Segments``)
and the GEMMs over them (``_segment_mm``, ``_segment_outer``, ``_segment_sum``), the zero tail
of dropped rows and the ordered ``k`` sum."""

from __future__ import annotations

import bisect
import functools
import itertools

import torch

from ... import reference

# torch._grouped_mm from a few rows, a matmul per expert below: docs/decisions.md, "Torch
# backend on the CPU".
_GROUPED_MM_DTYPES = (torch.float32,)
_GROUPED_MM_MIN_ROWS = 3


def _activation(z, activation, gate_up_layout, dh=None):
    """``act(z)``, or given ``dh`` the gradient w.r.t. ``z``: the reference's functions, with the
    activation as the ops pass it."""
    if dh is None:
        return reference.activation_reference(z, activation, gate_up_layout)
    return reference.activation_backward_reference(z, dh, activation, gate_up_layout)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without the call when it has that dtype (a microsecond a call here)."""
    return t if t.dtype == dtype else t.to(dtype)


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


class _Segments:
    """The experts' row ranges: ``bounds`` is the host copy of ``expert_first_token_offset``
    (read once: a sync on a GPU), ``n`` the routed rows; the tensors derived from it are made
    on first use and shared by the GEMMs of one call."""

    def __init__(self, offsets: torch.Tensor):
        self.offsets = offsets
        self.bounds: list[int] = offsets.tolist()
        self.n = self.bounds[-1]
        self.E = len(self.bounds) - 1

    @functools.cached_property
    def ends32(self) -> torch.Tensor:
        """``torch._grouped_mm``'s ``offs``: int32 group ends."""
        return self.offsets[1:].to(torch.int32)

    @functools.cached_property
    def counts(self) -> torch.Tensor:
        return torch.diff(self.offsets)

    @functools.cached_property
    def runs(self) -> list[tuple[int, int, int]]:
        """``(e, lo, hi)`` of each expert with rows. With fewer rows than experts (decode) the
        experts are found from the rows, by bisection, not by a walk over all ``E``."""
        b = self.bounds
        if self.n >= self.E:
            return [(e, lo, hi) for e, (lo, hi) in enumerate(itertools.pairwise(b)) if lo < hi]
        runs, d = [], 0
        while d < self.n:
            e = bisect.bisect_right(b, d) - 1  # the last expert starting at or before row d
            runs.append((e, d, b[e + 1]))
            d = b[e + 1]
        return runs

    def per_row(self, table: torch.Tensor) -> torch.Tensor:
        """``table[e]`` repeated for each row of expert ``e``: ``[n, ...]``."""
        return torch.repeat_interleave(table, self.counts, dim=0, output_size=self.n)


# --------------------------------------------------------------------------- segment GEMMs
def _pitch_ok(m: torch.Tensor) -> bool:
    """``torch._grouped_mm``'s layout rule: unit stride in one of the last two dims, the other
    a leading dimension (at least that dim's extent: no stride-0 broadcast) of a multiple of
    16 bytes; no stride-0 batch of several matrices."""
    if m.dim() == 3 and m.stride(0) == 0 and m.shape[0] > 1:
        return False
    rows, cols = m.stride()[-2:]
    n_rows, n_cols = m.shape[-2:]
    if cols == 1 and rows >= max(n_cols, 1):
        return rows * m.element_size() % 16 == 0
    if rows == 1 and cols >= max(n_rows, 1):
        return cols * m.element_size() % 16 == 0
    return False


@functools.cache
def _grouped_mm_on_cpu() -> bool:
    """Whether this torch has ``torch._grouped_mm`` for CPU float32 (2.13 does; older ones
    lack it or run it on CUDA only)."""
    try:
        a, b = torch.ones(4, 4), torch.ones(2, 4, 4)
        out = torch._grouped_mm(a, b, offs=torch.tensor([2, 4], dtype=torch.int32))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return bool((out == 4).all())


def _grouped_mm_ok(a: torch.Tensor, b: torch.Tensor, out_cols: int, rows: int) -> bool:
    return (
        rows >= _GROUPED_MM_MIN_ROWS
        and a.device.type == "cpu"
        and a.dtype in _GROUPED_MM_DTYPES
        and b.dtype == a.dtype
        and _pitch_ok(a)
        and _pitch_ok(b)
        and out_cols * a.element_size() % 16 == 0
        and _grouped_mm_on_cpu()
    )


def _segment_mm(rows, w, seg, bias=None):
    """``z[d] = rows[d] @ w[e].T (+ bias[e])`` for the rows ``d`` of each expert ``e``.

    ``rows`` ``[n, Kd]`` in the compute dtype; ``w`` ``[E, N, Kd]`` any strides and dtype
    (16-bit experts are upcast one at a time). Returns ``[n, N]``.
    """
    N, cdt = w.shape[1], rows.dtype
    wt = w.transpose(1, 2)
    if w.dtype == cdt and _grouped_mm_ok(rows, wt, N, seg.n):
        z = torch._grouped_mm(rows, wt, offs=seg.ends32)
        if bias is not None:
            z += seg.per_row(_as(bias, cdt))
        return z
    z = rows.new_empty(seg.n, N)
    for e, lo, hi in seg.runs:
        if bias is None:
            torch.mm(rows[lo:hi], _as(wt[e], cdt), out=z[lo:hi])
        else:
            torch.addmm(_as(bias[e], cdt), rows[lo:hi], _as(wt[e], cdt), out=z[lo:hi])
    return z


def _segment_outer(a, b, seg):
    """``out[e] = a[lo:hi].T @ b[lo:hi]`` over each expert's rows (zero for an expert without
    rows): ``[E, a.shape[1], b.shape[1]]`` in ``a.dtype``."""
    if _grouped_mm_ok(a.t(), b, b.shape[1], seg.n):
        return torch._grouped_mm(a.t(), b, offs=seg.ends32)
    out = a.new_zeros(seg.E, a.shape[1], b.shape[1])
    for e, lo, hi in seg.runs:
        torch.mm(a[lo:hi].t(), b[lo:hi], out=out[e])
    return out


def _segment_sum(a, seg):
    """``out[e] = Σ a[lo:hi]``: ``[E, a.shape[1]]`` (zero for an expert without rows)."""
    return torch.segment_reduce(a, "sum", lengths=seg.counts, axis=0, unsafe=True)


def _with_zero_tail(head: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """``[rows, ...]`` in ``dtype``: ``head`` then zeros (the rows of dropped slots)."""
    if head.shape[0] == rows:
        return _as(head, dtype)
    out = head.new_empty(rows, *head.shape[1:], dtype=dtype)
    out[: head.shape[0]] = head
    out[head.shape[0] :] = 0
    return out


def _sum_slots(rows_kth: torch.Tensor, K: int) -> torch.Tensor:
    """``Σ_k rows_kth[k]`` in ascending ``k`` (the contract's order), as a new tensor."""
    if K == 1:
        return rows_kth[0].clone()
    acc = rows_kth[0] + rows_kth[1]
    for k in range(2, K):
        acc += rows_kth[k]
    return acc
