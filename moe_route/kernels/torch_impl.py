"""The pure-PyTorch backend: every stage of the MoE token path, vectorised, for the CPU.

This is what runs where no Triton kernel can (the CPU by default; a GPU when asked for). It
keeps the semantics and data contract of :mod:`moe_route.reference`, which stays the oracle it
is tested against: arithmetic in float32 (float64 when an input is float64), results rounded
once to the activations' dtype, rows of dropped slots zero, the finalize sum in ascending ``k``.
Where the reference is written to be read, this is written to be fast at the sizes a CPU runs
(per-call overhead matters as much as arithmetic there):

* the expert GEMMs run over the routed rows only, as one ``torch._grouped_mm`` where torch
  supports it (CPU, float32, 16-byte aligned pitches), else one matmul per expert with rows;
* each GEMM-bearing function reads ``expert_first_token_offset`` to the host once (a memory
  read on the CPU) and every segment bound follows from it; the other stages are a few
  whole-tensor ops;
* float32 operands are used as they are (no copies); 16-bit operands are upcast per touched
  expert, so that GEMM1's activation sees the float32 result (one rounding, as the contract);
* the routing maps of CPU tensors are built in Python lists (a few slots) or NumPy, whose
  calls cost less than torch ops at these sizes; torch ops elsewhere.

On CUDA tensors it runs too (the "runs anywhere" path: torch ops, one matmul per expert). The
routing maps, expand, finalize and its backward read nothing there; the GEMMs and the MoE
forward / backward read the offsets (``_Segments``), which synchronises: this backend is not
capture-safe and must not run under CUDA-graph capture (the ops' fake implementations keep
``torch.compile`` tracing it; the Triton path is the one for graphs).

Activations are the oracles' own (:func:`moe_route.reference.activation_reference` and its
backward), reached through :func:`_activation` only, the one place this backend interprets
``activation`` / ``gate_up_layout``.

The functions take the routing tables as the ops pass them: ``src_to_dest``
(``expanded_source_row_to_expanded_dest_row``), ``dest_to_src``, ``expert_for_src`` and
``offsets`` (``expert_first_token_offset``), see :class:`moe_route.RoutingMaps`.
"""

from __future__ import annotations

import bisect
import functools
import itertools

import numpy as np
import torch

from .. import reference

# torch._grouped_mm from a few rows, a matmul per expert below: docs/decisions.md, "Torch
# backend on the CPU".
_GROUPED_MM_DTYPES = (torch.float32,)
_GROUPED_MM_MIN_ROWS = 3
# Routing maps in Python lists at small T, NumPy's sort at large T: docs/decisions.md, "Torch
# backend on the CPU".
_PYTHON_MAPS_MAX_SLOTS = 32
_INT16_MAX = 2**15 - 1


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


# --------------------------------------------------------------------------- routing maps
def routing_maps_torch(
    topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The four tables of :func:`moe_route.reference.routing_maps_reference`, by one stable
    sort of each slot's *bin*: its expert, or ``E + k`` for a dropped slot in column ``k``
    (token-major order inside a bin is then the contract's token-then-slot order, and the
    dropped bins ``E + k`` hold the dropped slots in source-row order). Ids outside
    ``[-1, E)`` count as dropped. No host synchronisation (CPU tensors go through NumPy).
    """
    if topk_ids.device.type == "cpu":
        if topk_ids.numel() <= _PYTHON_MAPS_MAX_SLOTS:
            return _routing_maps_python(topk_ids, num_experts)
        if num_experts + topk_ids.shape[1] <= _INT16_MAX:
            return _routing_maps_numpy(topk_ids, num_experts)
    return _routing_maps_sorted(topk_ids, num_experts)


def _routing_maps_sorted(topk_ids: torch.Tensor, E: int):
    """:func:`routing_maps_torch` in torch ops (any device, any E)."""
    T, K = topk_ids.shape
    N = T * K
    device = topk_ids.device
    routed = (topk_ids >= 0) & (topk_ids < E)  # before the int32 cast, which could wrap
    ids = _as(topk_ids, torch.int32)
    dropped_bins = torch.arange(E, E + K, dtype=torch.int32, device=device)
    bins = torch.where(routed, ids, dropped_bins)  # [T, K]: token-major i = t*K + k
    sorted_bins, order = torch.sort(bins.reshape(N), stable=True)
    rows = torch.arange(N, dtype=torch.int32, device=device)
    source_of = rows.view(K, T).t().reshape(N)  # s = k*T + t of token-major slot i
    dest_to_src = source_of[order]
    src_to_dest = torch.empty_like(dest_to_src)
    src_to_dest[dest_to_src] = rows
    expert_for_src = torch.where(routed, ids, -1).t().reshape(N)
    experts = torch.arange(E + 1, dtype=torch.int32, device=device)
    offsets = torch.searchsorted(sorted_bins, experts)  # bins below e: e's first dest row
    return src_to_dest, dest_to_src, expert_for_src, offsets


def _routing_maps_python(topk_ids: torch.Tensor, E: int):
    """:func:`_routing_maps_sorted` on a few slots in Python lists: the same bins and stable
    order, and four tensors built at the end."""
    T, K = topk_ids.shape
    flat = topk_ids.reshape(-1).tolist()  # token-major: i = t*K + k
    bins = [e if 0 <= e < E else E + i % K for i, e in enumerate(flat)]
    dest_to_src = [(i % K) * T + i // K for i in sorted(range(T * K), key=bins.__getitem__)]
    src_to_dest = [0] * (T * K)
    for d, s in enumerate(dest_to_src):
        src_to_dest[s] = d
    expert_for_src = [bins[t * K + k] for k in range(K) for t in range(T)]
    counts = [0] * (E + 1)
    for b in bins:
        if b < E:
            counts[b + 1] += 1
    return (
        torch.tensor(src_to_dest, dtype=torch.int32),
        torch.tensor(dest_to_src, dtype=torch.int32),
        torch.tensor([b if b < E else -1 for b in expert_for_src], dtype=torch.int32),
        torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int64),
    )


def _routing_maps_numpy(topk_ids: torch.Tensor, E: int):
    """:func:`_routing_maps_sorted` in NumPy, for CPU tensors with ``E + K`` below 2**15: a
    NumPy call costs a fraction of a torch op's overhead, and int16 bins get NumPy's radix
    sort (stable, linear)."""
    T, K = topk_ids.shape
    N = T * K
    ids = topk_ids.numpy()  # a view, any strides
    routed = (ids >= 0) & (ids < E)
    bins = np.where(routed, ids, np.arange(E, E + K)).astype(np.int16).reshape(N)
    order = np.argsort(bins, kind="stable")
    rows = np.arange(N, dtype=np.int32)
    dest_to_src = rows.reshape(K, T).T.reshape(N)[order]
    src_to_dest = np.empty(N, dtype=np.int32)
    src_to_dest[dest_to_src] = rows
    expert_for_src = np.where(routed, ids, -1).T.astype(np.int32).reshape(N)
    offsets = np.searchsorted(bins[order], np.arange(E + 1, dtype=np.int16))
    return (
        torch.from_numpy(src_to_dest),
        torch.from_numpy(dest_to_src),
        torch.from_numpy(expert_for_src),
        torch.from_numpy(offsets.astype(np.int64, copy=False)),
    )


def rank_maps_torch(ids: torch.Tensor, local_experts: int, ranks: int, capacity: int,
                    tokens: int):  # fmt: skip
    """:func:`moe_route.kernels.triton.rank_maps.rank_maps_triton` in torch ops:
    ``(s2d, d2s, efs, off, ids_out)`` of the rank maps of ``ids [T_ids, K]`` over ``tokens``
    tokens (``capacity`` 0: the exact layout)."""
    T_ids = ids.shape[0]
    T, W, C, dev = tokens, ranks, capacity, ids.device
    d = torch.arange(W, device=dev)
    owner = torch.where(ids >= 0, torch.div(ids, local_experts, rounding_mode="floor"), -1)
    goes = (owner.unsqueeze(-1) == d).any(1)  # [T_ids, W]
    if T_ids < T:
        goes = torch.cat([goes, goes.new_zeros(T - T_ids, W)])
    t = torch.arange(T, device=dev).unsqueeze(1)
    seen = goes.to(torch.int64).cumsum(0)  # tokens up to t going to d
    count = seen[-1] if T else torch.zeros(W, dtype=torch.int64, device=dev)
    if C == 0:
        first = count.cumsum(0) - count
        routed = count.sum()
        idle = routed + (d * T - first) + (t - seen)
        row = torch.where(goes, first + seen - 1, idle)
        keep = goes
        off = torch.cat([first, routed.view(1)])
    else:
        p = torch.where(goes, seen - 1, count + t - seen)
        row = torch.where(p < C, d * C + p, W * C + d * (T - C) + p - C)
        keep = goes & (p < C)
        off = torch.arange(W + 1, device=dev, dtype=torch.int64) * C
    s2d = row.t().reshape(-1).to(torch.int32)  # source row d*T + t
    src = (d.unsqueeze(1) * T + t.t()).reshape(-1).to(torch.int32)
    d2s = torch.empty_like(s2d).scatter_(0, s2d.long(), src)
    efs = torch.where(keep, d, -1).t().reshape(-1).to(torch.int32)
    kept = torch.gather(keep[:T_ids], 1, owner.clamp(0, W - 1).long()) & (ids >= 0) & (owner < W)
    return s2d, d2s, efs, off, torch.where(kept, ids, -1)


# --------------------------------------------------------------------------- expand
def expand_rows_torch(
    x: torch.Tensor, dest_to_src: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """``x_perm[d] = x[dest_to_src[d] mod T]`` for routed rows, zero for dropped ones."""
    if x.device.type != "cpu":
        return _expand_rows_masked(x, dest_to_src, offsets)
    T = x.shape[0]
    n = offsets[-1].item()  # one host read (a memory read on the CPU)
    out = x.new_empty(dest_to_src.numel(), x.shape[1])
    if n:
        torch.index_select(x, 0, dest_to_src[:n] % T, out=out[:n])
    out[n:] = 0
    return out


def _expand_rows_masked(x, dest_to_src, offsets):
    """:func:`expand_rows_torch` without reading ``offsets`` (for GPU tensors): every row
    gathered, the dropped ones zeroed."""
    N, T = dest_to_src.numel(), x.shape[0]
    if T == 0:
        return x.new_zeros(N, x.shape[1])
    rows = x.index_select(0, dest_to_src % T)
    dropped = torch.arange(N, device=x.device) >= offsets[-1]
    return rows.masked_fill_(dropped.unsqueeze(1), 0)


# --------------------------------------------------------------------------- finalize
def _finalize_rows(rows, weights, routed, K, T):
    """``Σ_k weights[k, t] · rows[k*T + t]`` in ascending ``k``; with ``routed`` given, a
    dropped slot's term is zero whatever its row or weight holds (NaN included)."""
    terms = rows.view(K, T, rows.shape[1]) * weights.unsqueeze(-1)
    if routed is not None:
        terms = torch.where(routed.unsqueeze(-1), terms, 0)
    return _sum_slots(terms, K)


def finalize_torch(
    y_perm: torch.Tensor,
    topk_weights: torch.Tensor,
    src_to_dest: torch.Tensor,
    expert_for_src: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`moe_route.reference.finalize_moe_routing_reference`: ``out[t] = bias[t] +
    Σ_k w[t,k] · y_perm[dest(k*T+t)]`` over routed slots, ``k`` ascending, rounded once."""
    T, K = topk_weights.shape
    cdt = _compute_dtype(y_perm, topk_weights)
    if T == 0:
        return y_perm.new_empty(0, y_perm.shape[1])
    rows = _as(y_perm.index_select(0, src_to_dest), cdt)  # k-major: row k*T + t
    routed = expert_for_src.view(K, T) >= 0
    if y_perm.device.type == "cpu" and bool(routed.all()):  # a host read: CPU tensors only
        routed = None
    acc = _finalize_rows(rows, _as(topk_weights.t(), cdt), routed, K, T)
    if bias is not None:
        acc += _as(bias, cdt)
    return _as(acc, y_perm.dtype)


def finalize_backward_torch(
    dout: torch.Tensor,
    y_perm: torch.Tensor,
    topk_weights: torch.Tensor,
    src_to_dest: torch.Tensor,
    expert_for_src: torch.Tensor,
    *,
    need_dy: bool = True,
    need_dw: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(d y_perm, d topk_weights)`` of :func:`finalize_torch` (``None`` where not asked):
    ``dy[dest(k*T+t)] = w[t,k] dout[t]``, ``dw[t,k] = <dout[t], y_perm[dest]>`` for routed
    slots, zero for dropped ones (whatever their weight or row hold)."""
    T, K = topk_weights.shape
    cdt = _compute_dtype(dout, y_perm, topk_weights)
    g = _as(dout, cdt)
    routed = expert_for_src.view(K, T) >= 0
    dy = dw = None
    if need_dy:
        w = torch.where(routed, _as(topk_weights.t(), cdt), 0)
        rows = _as((w.unsqueeze(-1) * g).reshape(K * T, g.shape[1]), y_perm.dtype)  # k-major
        dy = torch.empty(y_perm.shape, dtype=y_perm.dtype, device=y_perm.device)
        dy.index_copy_(0, src_to_dest.long(), rows)
    if need_dw:
        rows = _as(y_perm.index_select(0, src_to_dest), cdt).view(K, T, y_perm.shape[1])
        dots = (rows * g).sum(-1)
        dw = _as(torch.where(routed, dots, 0).t().contiguous(), topk_weights.dtype)
    return dy, dw


# --------------------------------------------------------------------------- grouped GEMM
def _gathered_rows(a, dest_to_src, n, cdt):
    """The ``n`` routed rows in the compute dtype: ``a``'s first rows, or with ``dest_to_src``
    the token rows ``a[dest_to_src[d] mod T]``."""
    if dest_to_src is None:
        return _as(a[:n], cdt)
    return _as(a.index_select(0, dest_to_src[:n] % a.shape[0]), cdt)


def grouped_gemm_torch(
    a: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "identity",
    gate_up_layout: str = "concat",
    dest_to_src: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`moe_route.reference.grouped_gemm_reference`: ``out[d] = act(a[d] @ w[e].T +
    bias[e])`` for the routed rows of each expert, zero rows after them; with ``dest_to_src``,
    row ``d`` is ``a[dest_to_src[d] mod T]`` (``a`` is ``x [T, Kd]``; no ``x_perm`` is built,
    only the routed rows are gathered). ``[M, N_out]`` in ``a.dtype``."""
    M = dest_to_src.numel() if dest_to_src is not None else a.shape[0]
    seg = _Segments(offsets)
    cdt = _compute_dtype(a, w)
    rows = _gathered_rows(a, dest_to_src, seg.n, cdt)
    h = _activation(_segment_mm(rows, w, seg, bias), activation, gate_up_layout)
    return _with_zero_tail(h, M, a.dtype)


def grouped_gemm_backward_torch(
    dout: torch.Tensor,
    a: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    gate_up_layout: str,
    src_to_dest: torch.Tensor,
    dest_to_src: torch.Tensor,
    expert_for_src: torch.Tensor,
    gather: bool,
    *,
    need_da: bool = True,
    need_dw: bool = True,
    need_db: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(da, dw, db)`` of :func:`grouped_gemm_torch` given ``dout [M, N_out]`` (``None``
    where not asked), the torch branch of ``moe_route.grouped_gemm``'s backward:
    ``dz = act'(z) dout`` (``z`` recomputed), ``da[d] = dz[d] @ w[e]``, ``dw[e] = Σ dz^T a``,
    ``db[e] = Σ dz``; rows of dropped slots get a zero ``da``, an expert without rows zero
    ``dw``/``db``. With ``gather``, ``a`` is ``x [T, Kd]`` (row ``d`` read
    ``a[dest_to_src[d] mod T]``) and ``da`` is ``[T, Kd]``: the sum over each token's slots in
    ascending ``k`` (``expert_for_src`` is not read: dropped slots read ``da_perm``'s zero
    rows). Dtypes: ``a``'s, ``w``'s, ``w``'s."""
    seg = _Segments(offsets)
    n = seg.n
    cdt = _compute_dtype(dout, a, w)
    rows = _gathered_rows(a, dest_to_src if gather else None, n, cdt)
    dz = _as(dout[:n], cdt)
    if activation != "identity":
        z = _segment_mm(rows, w, seg, bias)
        dz = _activation(z, activation, gate_up_layout, dz)
    da = dw = db = None
    if need_da:
        da_perm = _segment_mm(dz, w.transpose(1, 2), seg)  # dz @ w[e]
        if not gather:
            da = _with_zero_tail(da_perm, a.shape[0], a.dtype)
        elif a.shape[0] == 0:
            da = a.new_zeros(a.shape)
        else:  # the K copies of each token, summed in k order (dropped ones read zero rows)
            T, Kd = a.shape
            K = src_to_dest.numel() // T
            full = _with_zero_tail(da_perm, src_to_dest.numel(), cdt)
            da = _as(_sum_slots(full.index_select(0, src_to_dest).view(K, T, Kd), K), a.dtype)
    if need_dw:
        dw = _as(_segment_outer(dz, rows, seg), w.dtype)
    if need_db:
        db = _as(_segment_sum(dz, seg), w.dtype)
    return da, dw, db


# --------------------------------------------------------------------------- whole chain
def moe_forward_torch(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    b1: torch.Tensor | None,
    b2: torch.Tensor | None,
    bias: torch.Tensor | None,
    src_to_dest: torch.Tensor,
    dest_to_src: torch.Tensor,
    expert_for_src: torch.Tensor,
    offsets: torch.Tensor,
    activation: str = "swiglu",
    gate_up_layout: str = "concat",
    *,
    keep_z: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The MoE forward that also returns GEMM1's pre-activation: ``(out [T, H], z [M, N1])``
    in ``x.dtype``, as the reference branch of ``moe_route::moe_experts``: ``z`` is rounded
    to ``x.dtype`` (it is what the backward gets) and ``h = act(z)`` is computed from it;
    GEMM2's rows stay in the compute dtype until the finalize sum is rounded once. Rows of
    ``z`` past the routed ones are zero. ``keep_z=False`` (inference) returns ``(out, None)``
    and skips building ``z``."""
    T = topk_weights.shape[0]
    M = dest_to_src.numel()
    cdt = _compute_dtype(x, w1, w2)
    seg = _Segments(offsets)
    n = seg.n
    z = _segment_mm(_gathered_rows(x, dest_to_src, n, cdt), w1, seg, b1)
    z_out = _with_zero_tail(z, M, x.dtype) if keep_z else None
    if x.dtype != cdt:  # the activation reads the rounded z, as the backward will
        z = z.to(x.dtype).to(cdt)
    y = _segment_mm(_activation(z, activation, gate_up_layout), w2, seg, b2)
    if T == 0:
        return x.new_empty(0, w2.shape[1]), z_out
    acc = _weighted_sum(y, topk_weights, src_to_dest, expert_for_src, bias, M, cdt)
    return _as(acc, x.dtype), z_out


def _weighted_sum(y, topk_weights, src_to_dest, expert_for_src, bias, M: int, cdt):
    """The finalize of the MoE forward in ``cdt``: ``Σ_k w[t,k] · y[dest(k*T+t)] + bias[t]``
    over the routed rows ``y [n, H]`` (``n <= M``; T > 0)."""
    T, K = topk_weights.shape
    weights = _as(topk_weights.t(), cdt)
    if y.shape[0] < M:  # dropped slots read zero rows, and their weights (NaN too) are masked
        y = _with_zero_tail(y, M, cdt)
        weights = torch.where(expert_for_src.view(K, T) >= 0, weights, 0)
    acc = _finalize_rows(y.index_select(0, src_to_dest), weights, None, K, T)
    if bias is not None:
        acc += _as(bias, cdt)
    return acc


def moe_backward_torch(
    dout: torch.Tensor,
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    b2: torch.Tensor | None,
    z: torch.Tensor,
    src_to_dest: torch.Tensor,
    dest_to_src: torch.Tensor,
    expert_for_src: torch.Tensor,
    offsets: torch.Tensor,
    activation: str = "swiglu",
    gate_up_layout: str = "concat",
    *,
    need_dx: bool = True,
    need_dw1: bool = True,
    need_dw2: bool = True,
    need_dtopk: bool = True,
) -> tuple[torch.Tensor | None, ...]:
    """Gradients of :func:`moe_forward_torch` (without ``bias``), the formulas of
    :func:`moe_route.reference.moe_backward_reference` (``z`` is the forward's pre-activation;
    ``b1`` is not needed, ``expert_for_src`` not read: dropped slots read zero rows):
    ``(dx, dw1, dw2, d_topk_weights, db1, db2)`` in the dtypes of their primals, ``dW`` of an
    expert with no rows exactly zero. ``need_dw1`` / ``need_dw2`` cover ``db1`` / ``db2``; a
    gradient not asked for is ``None``."""
    T, K = topk_weights.shape
    H = x.shape[1]
    M = dest_to_src.numel()
    cdt = _compute_dtype(dout, x, w1, w2, z)
    seg = _Segments(offsets)
    n = seg.n
    src = dest_to_src[:n]
    token = src % T if T else src
    w_row = _as(topk_weights.t().reshape(-1), cdt).index_select(0, src).unsqueeze(1)
    z_c = _as(z[:n], cdt)
    g_out = _as(dout, cdt).index_select(0, token)  # dout[t] of each routed row
    h = g = dz = None
    if need_dtopk or need_dw2:
        h = _activation(z_c, activation, gate_up_layout)
    if need_dtopk or need_dx or need_dw1:
        g = _segment_mm(g_out, w2.transpose(1, 2), seg)  # dout[t] @ W2[e]
    if need_dx or need_dw1:
        dz = _activation(z_c, activation, gate_up_layout, w_row * g)

    dx = dw1 = dw2 = dtopk = db1 = db2 = None
    if need_dtopk:
        dots = (g * h).sum(1)
        if b2 is not None:
            dots += (g_out * seg.per_row(_as(b2, cdt))).sum(1)
        dtopk = dots.new_zeros(M)  # source order k*T + t; dropped slots stay zero
        dtopk[src] = dots
        dtopk = _as(dtopk.view(K, T).t().contiguous(), topk_weights.dtype)
    if need_dw2:
        dy = w_row * g_out
        dw2 = _as(_segment_outer(dy, h, seg), w2.dtype)
        db2 = _as(_segment_sum(dy, seg), b2.dtype if b2 is not None else w2.dtype)
    if need_dx:
        dx_perm = _segment_mm(dz, w1.transpose(1, 2), seg)  # dz @ W1[e]
        if T == 0:
            dx = x.new_zeros(x.shape)
        else:
            full = _with_zero_tail(dx_perm, M, cdt)  # dropped slots read its zero rows
            dx = _as(_sum_slots(full.index_select(0, src_to_dest).view(K, T, H), K), x.dtype)
    if need_dw1:
        x_rows = _as(x, cdt).index_select(0, token)
        dw1 = _as(_segment_outer(dz, x_rows, seg), w1.dtype)
        db1 = _as(_segment_sum(dz, seg), w1.dtype)
    return dx, dw1, dw2, dtopk, db1, db2


# --------------------------------------------------------------------------- quantised experts
def moe_forward_quant_torch(
    x: torch.Tensor,
    w1: torch.Tensor,
    w1_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    b1: torch.Tensor | None,
    b2: torch.Tensor | None,
    bias: torch.Tensor | None,
    src_to_dest: torch.Tensor,
    dest_to_src: torch.Tensor,
    expert_for_src: torch.Tensor,
    offsets: torch.Tensor,
    activation: str,
    gate_up_layout: str,
    spec,
) -> torch.Tensor:
    """The MoE forward on quantised experts (:mod:`moe_route.quant`), the contract the Triton
    kernels keep: weights dequantised to float32; on FP8 the tokens quantised per token (per
    128 columns, or per row for ``fp8_channel``) by the reference quantiser and GEMM2's input
    ``act(z)`` quantised per 128 columns from its float32 value; on MXFP4 the activations stay
    16-bit (``act(z)`` rounded to ``x.dtype``, as GEMM2 reads it). Products and the finalize in
    float32, rounded once to ``x.dtype``."""
    from .. import quant
    from ..activations import as_activation

    T = topk_weights.shape[0]
    M = dest_to_src.numel()
    seg = _Segments(offsets)
    n = seg.n
    n1 = w1.shape[1]
    W1 = quant.dequantize_experts(w1, w1_scale, spec, x.shape[1])
    n_inter = n1 // 2 if as_activation(activation).gated else n1
    W2 = quant.dequantize_experts(w2, w2_scale, spec, n_inter)
    if spec.fp8:
        xq, xs = quant.quantize_fp8_rows(x, spec.act_group, ue8m0=spec.ue8m0)
        rows = quant.dequantize_fp8_rows(xq, xs, spec.act_group)
    else:
        rows = x.float()
    z = _segment_mm(_gathered_rows(rows, dest_to_src, n, torch.float32), W1, seg, b1)
    h = _activation(z, activation, gate_up_layout)
    if spec.fp8:
        hq, hs = quant.quantize_fp8_rows(h, quant.SCALE_K, ue8m0=spec.ue8m0)
        h = quant.dequantize_fp8_rows(hq, hs, quant.SCALE_K)
    else:
        h = h.to(x.dtype).float()
    y = _segment_mm(h, W2, seg, b2)
    if T == 0:
        return x.new_empty(0, x.shape[1])
    acc = _weighted_sum(y, topk_weights, src_to_dest, expert_for_src, bias, M, torch.float32)
    return _as(acc, x.dtype)
