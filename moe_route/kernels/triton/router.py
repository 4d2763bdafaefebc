"""What the router kernels share: their limits, the block sizes, exact ``exp`` and division, and
the loading of logit rows.

The routers run in one launch each. Program ``p`` owns tokens ``[p*BLOCK_T, (p+1)*BLOCK_T)``
and holds their whole rows of ``E`` logits in registers, scored in float32 (float64 for float64
logits). Divisions round to nearest and ``exp`` is libdevice's (not the ``ex2.approx`` that
``tl.exp`` lowers to), so that scores sit within a few float32 ulps of torch's, or match its
bits where torch computes the same expression.

Each router owns its kernels, in its own module with its launchers:

* :mod:`.router_softmax` — softmax top-``K`` and its backward;
* :mod:`.router_gate` — the router's matmul fused with the softmax top-``K``
  (:class:`~.router_gate.GateLaunch`);
* :mod:`.router_sigmoid` — DeepSeek-V3's grouped sigmoid top-``K`` and its backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import next_pow2

#: Most experts one program holds (``BLOCK_E``, registers: a few ``[BLOCK_E]`` tiles over up to
#: 16 warps; the grouped sigmoid kernel's padded tile is at most twice as wide). Wider rows
#: would need a chunked selection; the public functions take the torch path above it on
#: ``backend="auto"`` and raise on ``backend="triton"``.
MAX_EXPERTS = 8192
#: Logits per program (``BLOCK_T * BLOCK_E``): 16 per thread of 4 warps, several tokens per
#: program at the usual ``E <= 256``.
TILE = 2048
#: Most tokens per program.
MAX_BLOCK_T = 16


def check_num_experts_supported(num_experts: int) -> None:
    """Raise ``ValueError`` (before any launch) if one program cannot hold ``E`` logits."""
    if num_experts > MAX_EXPERTS:
        raise ValueError(
            f"num_experts={num_experts}: the Triton router kernels hold a token's "
            f"{num_experts} logits in one program, at most {MAX_EXPERTS}; use backend='auto' "
            "(which takes the torch path above the limit) or backend='torch'"
        )


def _blocks(E: int) -> tuple[int, int, int]:
    """``(BLOCK_T, BLOCK_E, num_warps)`` for ``E`` experts (never from ``T``: no compile per
    token count)."""
    block_e = next_pow2(E)
    block_t = max(1, min(MAX_BLOCK_T, TILE // block_e))
    num_warps = max(4, min(16, block_t * block_e // 512))
    return block_t, block_e, num_warps


@triton.jit
def _exp(x, ACCURATE_EXP: tl.constexpr):
    # libdevice is not available to the interpreter, whose tl.exp is numpy's (accurate).
    if ACCURATE_EXP:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _div(a, b):
    # `/` on float32 lowers to div.full.f32 (2 ulp); float64 division is IEEE already.
    if a.dtype == tl.float32:
        return tl.math.div_rn(a, b)
    else:
        return a / b


@triton.jit
def _load_rows(logits_ptr, pid, T, E, stride_lt, stride_le, ACC: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
    """``(rows, cols, x)``: the program's rows, its columns and the logits in ``ACC``, padding
    columns ``-inf`` (they never win and add 0 to the sum), padding rows 0 (finite)."""
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    in_col = cols < E
    mask = (rows < T)[:, None] & in_col[None, :]
    # int64 offsets: a transposed [T, E] view has stride_le = T
    ptrs = (logits_ptr + rows.to(tl.int64)[:, None] * stride_lt
            + cols.to(tl.int64)[None, :] * stride_le)  # fmt: skip
    x = tl.load(ptrs, mask=mask, other=0.0).to(ACC)
    x = tl.where(in_col[None, :], x, float("-inf"))
    return rows, cols, x


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32
