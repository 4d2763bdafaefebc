"""The router's matmul fused with the softmax top-``K``: one launch from ``x`` to the routing.

:func:`gate_softmax_topk_triton` serves an inference ``MoELayer`` at up to 64 tokens
(:func:`moe_route.routing.route_softmax_fused`). A program computes its 16 tokens' logits
``x G^T`` (float32 MMAs over ``H``, so it reads the whole gate: only gates up to 256 experts and
1 MiB), stores them in the logits' dtype and routes the stored values with the softmax kernel's
own selection (:func:`~.router_softmax._select_softmax`): the ids and weights are those of the
softmax top-k on those logits, bit for bit. It saves a matmul launch, the host time that matters
at decode sizes.

:class:`GateLaunch` is the launch prepared for one configuration of arguments;
:func:`gate_softmax_topk_triton` the one-shot launcher.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import INTERPRETING, LaunchKey, ThinKernel, cdiv, int_key, next_pow2
from .router_softmax import _select_softmax

#: The router's matmul fused with the softmax top-k (:func:`gate_softmax_topk_triton`): one
#: program per 16 tokens reads the whole gate weight, so only where that is small.
GATE_MAX_EXPERTS = 256
GATE_MAX_BYTES = 1 << 20
_GATE_BLOCK_T = 16  # the smallest M of an MMA


@triton.jit(do_not_specialize=["T"])
def _gate_softmax_topk_kernel(
    x_ptr, g_ptr, logits_ptr, w_ptr, ids_ptr, T, E, H, stride_xt, stride_xh, stride_ge,
    stride_gh, K: tl.constexpr, K_POW2: tl.constexpr, RENORMALIZE: tl.constexpr,
    ACCURATE_EXP: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Program ``p``: tokens ``[p*BLOCK_T, (p+1)*BLOCK_T)``. Their logits ``x G^T`` summed in
    float32 over ``H`` (one MMA per ``BLOCK_H`` step), rounded to the logits' dtype and
    stored, then routed from the stored values by :func:`_select_softmax`."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    hs = tl.arange(0, BLOCK_H)
    row_ok = rows < T
    col_ok = cols < E
    rows64 = rows.to(tl.int64)
    x_ptrs = x_ptr + rows64[:, None] * stride_xt + hs[None, :] * stride_xh
    g_ptrs = g_ptr + cols.to(tl.int64)[None, :] * stride_ge + hs[:, None] * stride_gh
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h_ok = h0 + hs < H
        a = tl.load(x_ptrs, mask=row_ok[:, None] & h_ok[None, :], other=0.0)
        b = tl.load(g_ptrs, mask=h_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_H * stride_xh
        g_ptrs += BLOCK_H * stride_gh
    logits = acc.to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + rows64[:, None] * E + cols[None, :], logits,
             mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip
    x = tl.where(col_ok[None, :], logits.to(tl.float32), float("-inf"))
    _select_softmax(x, rows, cols, w_ptr, ids_ptr, T, E, K, K_POW2, RENORMALIZE, tl.float32,
                    ACCURATE_EXP, BLOCK_T, BLOCK_E)  # fmt: skip


_GATE = ThinKernel(_gate_softmax_topk_kernel)


def gate_fits(num_experts: int, gate_bytes: int) -> bool:
    """Whether :func:`gate_softmax_topk_triton` takes a gate of this size."""
    return num_experts <= GATE_MAX_EXPERTS and gate_bytes <= GATE_MAX_BYTES


class GateLaunch:
    """:func:`gate_softmax_topk_triton` prepared for one configuration of arguments (dtypes,
    strides, ``E``, ``H``, ``k``; not ``T``): a call allocates the three outputs and launches.
    Keeps no tensor."""

    def __init__(self, x: torch.Tensor, gate_weight: torch.Tensor, k: int, renormalize: bool,
                 logits_dtype: torch.dtype):  # fmt: skip
        H = x.shape[1]
        E = gate_weight.shape[0]
        self.E, self.k, self.logits_dtype = E, k, logits_dtype
        block_e = max(16, next_pow2(E))
        # One program reads the whole gate, so what it keeps in flight sets the speed; 256
        # experts take 64-wide steps for shared memory (docs/decisions.md, "One-launch router").
        block_h = 32 if x.dtype == torch.float32 else (128 if block_e <= 128 else 64)
        stages = 3 if x.dtype == torch.float32 else 4
        precision = "ieee" if x.dtype == torch.float32 else "tf32"  # (tf32: ignored for 16-bit)
        sx, sg = x.stride(), gate_weight.stride()
        self.key = LaunchKey((x.dtype, gate_weight.dtype, logits_dtype, k, renormalize, block_e,
                              int_key(E, H, *sx, *sg)))  # fmt: skip
        self.tail = (E, H, *sx, *sg)
        self.constexprs = lambda: dict(
            K=k, K_POW2=next_pow2(k), RENORMALIZE=renormalize, ACCURATE_EXP=not INTERPRETING,
            DOT_PRECISION=precision, BLOCK_T=_GATE_BLOCK_T, BLOCK_E=block_e, BLOCK_H=block_h,
            num_warps=4, num_stages=stages,
        )  # fmt: skip

    def __call__(self, x: torch.Tensor, gate_weight: torch.Tensor):
        """``(logits [T, E], weights [T, K] float32, ids [T, K] int32)``, new and contiguous."""
        T = x.shape[0]
        logits = x.new_empty(T, self.E, dtype=self.logits_dtype)
        weights = x.new_empty(T, self.k, dtype=torch.float32)
        ids = x.new_empty(T, self.k, dtype=torch.int32)
        self.fill(x, gate_weight, logits, weights, ids)
        return logits, weights, ids

    def fill(self, x, gate_weight, logits, weights, ids) -> None:
        """The launch into given outputs (contiguous, of the prepared dtypes)."""
        T = x.shape[0]
        if T:
            _GATE.launch(self.key, (cdiv(T, _GATE_BLOCK_T),),
                         (x, gate_weight, logits, weights, ids, T, *self.tail),
                         self.constexprs)  # fmt: skip


def gate_softmax_topk_triton(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    k: int,
    renormalize: bool,
    logits: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> None:
    """``logits = x @ gate_weight^T`` (``[T, E]``, contiguous, in its own dtype: float32 or
    ``x``'s) and its softmax top-``k`` into ``weights [T, K]`` float32 and ``ids [T, K]``
    int32 (contiguous), in one launch: what ``softmax_topk(linear(x, gate_weight), k)`` gives
    on the logits this kernel stores (summed in another order than a matmul library's).
    ``x [T, H]`` and ``gate_weight [E, H]``: one 16- or 32-bit dtype, any strides; the gate
    within :func:`gate_fits`. Prepares its :class:`GateLaunch` on every call."""
    GateLaunch(x, gate_weight, k, renormalize, logits.dtype).fill(x, gate_weight, logits,
                                                                   weights, ids)  # fmt: skip
