"""Tile configurations of the GEMM kernels, by problem size (no autotuning: nothing to sync
or recompile per ``T``). A plan asks once per (shapes, dtype, arch, token bucket) and caches.

``rows_per_expert`` comes from the token *bucket* (``T`` rounded up to a power of two), never
the exact ``T``, so every ``T`` in a bucket runs the same compiled kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import torch

from . import arch
from ._env import getenv
from .kernels.triton import cdiv
from .kernels.triton.act_backward import ActBackwardConfig, RowPassConfig
from .kernels.triton.decode import MAX_SLOTS, DecodeConfig
from .kernels.triton.gemm_mainloop import GemmConfig
from .kernels.triton.weight_grad import WeightGradConfig

#: Environment override of the GEMM kernels' persistent variant (benchmarking): unset or empty,
#: the tables below decide; ``0``, the per-tile kernel; ``N >= 1``, ``N`` persistent programs
#: per SM. Part of :func:`moe_route.arch.env_key`, so plans built under another value are not
#: reused.
PERSISTENT_ENV = "MOE_ROUTE_PERSISTENT"


#: The most expanded rows (``T * K``) the routing maps index: their row indices are int32.
MAX_EXPANDED_ROWS = 2**31 - 1


def token_bucket(T: int) -> int:
    """``T`` rounded up to a power of two (``0`` stays ``0``): the unit plans are cached on."""
    return 1 << (T - 1).bit_length() if T > 0 else 0


def token_buckets(max_tokens: int) -> list[int]:
    """Every bucket a call with ``1 <= T <= max_tokens`` tokens falls in (what a warm-up runs)."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r}: expected an int >= 1")
    return [1 << i for i in range((max_tokens - 1).bit_length() + 1)]


def warmup_buckets(
    max_tokens: int, top_k: int, w1: torch.Tensor, w2: torch.Tensor, backward: bool
) -> list[int]:
    """:func:`token_buckets` for a warm-up of the experts ``w1 [E, N1, H]``, ``w2 [E, H, I]``
    with ``top_k`` slots per token, bounded before anything runs (``ValueError`` otherwise).

    The largest bucket ``B`` (``max_tokens`` rounded up to a power of two) is the ``T`` of
    the last call, so ``B · top_k`` expanded rows must stay below ``2**31`` (the routing maps'
    row indices are int32): ``max_tokens`` is at most the largest power of two ``<= (2**31 -
    1) // top_k``. On a GPU, that call's activations must also fit the device's free memory:
    an estimate, ``B`` tokens in and out and their ``top_k`` copies through both GEMMs, in the
    weights' dtype, twice with ``backward`` (the gradients)."""
    buckets = token_buckets(max_tokens)
    largest = buckets[-1]
    if largest * top_k > MAX_EXPANDED_ROWS:
        most = 1 << ((MAX_EXPANDED_ROWS // top_k).bit_length() - 1)
        raise ValueError(
            f"max_tokens={max_tokens}: its bucket T={largest} with top_k={top_k} gives "
            f"T*top_k={largest * top_k} expanded rows, more than the int32 routing maps hold "
            f"(< 2**31): expected max_tokens <= {most}"
        )
    free = free_memory(w1.device)
    if free is not None:
        H, N1, inter = w2.shape[1], w1.shape[1], w2.shape[2]
        per_token = (2 * H + top_k * (2 * H + N1 + inter)) * w1.element_size()
        need = largest * per_token * (2 if backward else 1)
        if need > free:
            raise ValueError(
                f"max_tokens={max_tokens}: the warm-up of its bucket T={largest} needs about "
                f"{need / 2**30:.3g} GiB of activations but {w1.device} has "
                f"{free / 2**30:.3g} GiB free: expected a smaller max_tokens"
            )
    return buckets


def free_memory(device: torch.device) -> int | None:
    """Free bytes of a GPU's memory; None elsewhere (no bound is applied)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return None


def persistent_override() -> int | None:
    """``MOE_ROUTE_PERSISTENT`` as programs per SM, or None when unset (see
    :data:`PERSISTENT_ENV`)."""
    value = getenv(PERSISTENT_ENV).strip()
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(
            f"{PERSISTENT_ENV}={value!r}: expected an integer >= 0 (programs per SM of the "
            "persistent GEMM kernel; 0 for the per-tile kernel) or nothing"
        )
    return int(value)


def expert_bytes(w1_shape, w2_shape, itemsize: int = 1) -> int:
    """Bytes of one expert's weights as stored, ``W1[e]`` and ``W2[e]`` (``itemsize`` per
    element: one per FP8 weight, one per two MXFP4 ones, as their tensors hold them), the
    size the decode tables go by."""
    return (math.prod(w1_shape[1:]) + math.prod(w2_shape[1:])) * itemsize


def decode_config(bucket: int, top_k: int, num_experts: int, expert_bytes: int,
                  dtype: torch.dtype):  # fmt: skip
    """The decode path's tiles (:mod:`moe_route.kernels.triton.decode`), or None where the
    sorted path serves. Each slot reads its own expert's weights, so the path pays for slots
    that share an expert, which the sorted path reads once per tile: it takes up to
    ``min(16, E)`` slots, and up to ``min(64, E / 2)`` where one expert's weights (``W1[e]``
    and ``W2[e]``, ``expert_bytes``) are at most 16 MiB, small enough that the slots sharing
    an expert find its tiles in L2. Only eager calls take the path
    (:func:`moe_route.decode.decode_planned`), where it saves the maps and two launches of host
    time: docs/decisions.md, "Decode path threshold" and "Decode tiles".
    """
    if dtype == torch.float64:
        return None
    small = MAX_SLOTS if expert_bytes <= _SMALL_EXPERT_BYTES else 0
    if not _decode_takes(bucket * top_k, num_experts, small):
        return None
    return decode_tiles(dtype, expert_bytes)


def _decode_takes(slots: int, num_experts: int, small_slots: int) -> bool:
    """Whether the decode path takes ``slots`` slots: up to ``min(16, E)``, or up to
    ``min(small_slots, E / 2)`` where that is more (experts small enough for the slots that
    share one to find its tiles in L2; 0 where they are not)."""
    most = min(_DECODE_SLOTS, num_experts)
    return slots <= max(most, min(small_slots, num_experts // 2))


def quant_decode_config(bucket: int, top_k: int, num_experts: int, expert_bytes: int,
                        mxfp4: bool, cc: int | None) -> DecodeConfig | None:  # fmt: skip
    """The decode path's tiles on quantised experts, up to ``min(16, E)`` slots whatever the
    experts' size (``expert_bytes``: one per FP8 weight, one per two MXFP4 ones), FP8 experts
    of up to 16 MiB up to ``min(32, E / 2)``; past that the sorted path, whose device time an
    eager call then waits for rather than its host time (docs/decisions.md, "Quantised decode
    path: per slot, FP8 swapped" and "Quantised decode path: 32 slots on small FP8
    experts"). The second launch runs one program per slot and column
    tile (a program per token reads its slots one after another, too few loads in flight).
    FP8 steps by 128 along both reductions (its scale blocks); on SM90 its products are
    swapped, 64 weight rows by the token (an FP8 MMA rather than 16-bit ones on converted
    codes). MXFP4: GEMM1 32 columns wide, the sorted path's fastest 16-row tiles; experts
    over 16 MiB 64 columns by 256. Up to 8 slots FP8's path serves CUDA-graph capture too
    (``DecodeConfig.graphs``; docs/decisions.md, "FP8 decode path in CUDA graphs")."""
    small = _FP8_SMALL_SLOTS if not mxfp4 and expert_bytes <= _SMALL_EXPERT_BYTES else 0
    if not _decode_takes(bucket * top_k, num_experts, small):
        return None
    if mxfp4:
        return _DECODE_MXFP4 if expert_bytes <= _SMALL_EXPERT_BYTES else _DECODE_MXFP4_LARGE
    cfg = _DECODE_FP8_SM90 if cc == 90 else _DECODE_FP8
    return dataclasses.replace(cfg, graphs=True) if bucket * top_k <= _GRAPH_SLOTS else cfg


def decode_tiles(dtype: torch.dtype, expert_bytes: int) -> DecodeConfig:
    """The decode kernels' tiles for ``dtype`` and experts of ``expert_bytes``, at whatever
    number of slots (:func:`decode_config` says which calls take the path). 16-bit experts of
    up to 16 MiB run the second launch per slot, on 32x128 tiles (a program per token reads
    its slots one after another: too few loads in flight at a few tokens); larger ones keep
    one program per token, 64x256 and 32x256 (docs/decisions.md, "Decode path: second launch
    per slot")."""
    # float32 tiles take twice the shared memory: 3 stages of the 16-bit tiles would not fit
    if dtype == torch.float32:
        return _DECODE_FP32
    return _DECODE_PER_SLOT if expert_bytes <= _SMALL_EXPERT_BYTES else _DECODE


#: the slots the decode path takes whatever the experts' size, and the experts' size (bytes of
#: ``W1[e]`` and ``W2[e]``) up to which it takes up to :data:`MAX_SLOTS`
_DECODE_SLOTS = 16
_SMALL_EXPERT_BYTES = 16 << 20
#: the slots the decode path takes on FP8 experts of up to 16 MiB (and half the experts)
_FP8_SMALL_SLOTS = 32
#: the most slots at which FP8's decode path serves CUDA-graph capture too
_GRAPH_SLOTS = 8
_DECODE = DecodeConfig(up_n=64, up_k=256, down_n=32, down_k=256, num_warps=4, num_stages=3)
_DECODE_PER_SLOT = DecodeConfig(up_n=32, up_k=128, down_n=32, down_k=128, num_warps=4,
                                num_stages=4, split=True)  # fmt: skip
_DECODE_FP32 = DecodeConfig(up_n=32, up_k=128, down_n=16, down_k=128, num_warps=4, num_stages=4)
_DECODE_FP8 = DecodeConfig(up_n=64, up_k=128, down_n=32, down_k=128, num_warps=4, num_stages=4,
                           split=True)  # fmt: skip
_DECODE_FP8_SM90 = DecodeConfig(up_n=64, up_k=128, down_n=64, down_k=128, num_warps=4,
                                num_stages=4, split=True, swap=True)  # fmt: skip
_DECODE_MXFP4 = DecodeConfig(up_n=32, up_k=128, down_n=32, down_k=128, num_warps=4, num_stages=4,
                             split=True)  # fmt: skip
_DECODE_MXFP4_LARGE = DecodeConfig(up_n=64, up_k=256, down_n=32, down_k=256, num_warps=4,
                                   num_stages=4, split=True)  # fmt: skip


def gemm_config(rows_per_expert: float, gated: bool, dtype: torch.dtype, cc: int | None, *,
                kd: int | None = None, store_z: bool = False):  # fmt: skip
    """GEMM1 / GEMM2 / dX / fused-finalize tiles (``persistent`` as :data:`PERSISTENT_ENV`
    forces). ``kd``: the reduction's length, where the caller knows it; ``store_z``: GEMM1 also
    stores its pre-activation (training)."""
    cfg = _gemm_table(rows_per_expert, gated, dtype, cc, kd, store_z)
    forced = persistent_override()
    if forced is not None and forced != cfg.persistent:
        cfg = dataclasses.replace(cfg, persistent=forced)
    return cfg


def _gemm_table(rows_per_expert: float, gated: bool, dtype: torch.dtype, cc: int | None,
                kd: int | None = None, store_z: bool = False):  # fmt: skip
    """GEMM1 / GEMM2 / fused-finalize tiles.

    docs/decisions.md, "GEMM tiles".
    """
    tma = cc is not None and cc >= 90 and dtype in (torch.float16, torch.bfloat16)
    if dtype == torch.float64:  # gradcheck sizes; FMA products, small tiles
        return GemmConfig(16, 32, 16, 1, 4, 1)
    big_k = 64 if dtype != torch.float32 else 32
    if rows_per_expert <= 16:
        # Decode: no TMA descriptors, whose host time per launch exceeds the GEMM's at T <= 8
        # (docs/decisions.md, "GEMM tiles").
        return GemmConfig(16, 64, 128 if dtype != torch.float32 else 64, 1, 4, 4, False)
    if rows_per_expert <= 64:
        return GemmConfig(64, 64 if gated else 128, big_k, 4, 4, 4, tma)
    # One persistent program per SM wherever TMA serves: docs/decisions.md, "Persistent GEMM".
    persistent = 1 if tma else 0
    # From 512 rows per expert GEMM1 storing z takes 4 stages and the plain GEMMs with short
    # reductions store through TMA: docs/decisions.md, "TMA store and four-stage GEMM1".
    long_enough = tma and rows_per_expert >= 512
    # Groups of one expert's m-tiles, at most 16: docs/decisions.md, "Expert-grouped tile order".
    group = 16 if persistent else 8  # the persistent kernel's expert groups
    if gated:
        stages = 4 if long_enough and store_z else 3
        return GemmConfig(128, 128, big_k, group, 8, stages, tma, persistent=persistent)
    n = 256 if dtype != torch.float32 else 128
    tma_store = long_enough and kd is not None and kd <= 2048
    return GemmConfig(128, n, big_k, group, 8, 3, tma, persistent=persistent, tma_store=tma_store)


def quant_gemm_config(rows_per_expert: float, gated: bool, mxfp4: bool,
                      cc: int | None) -> GemmConfig:  # fmt: skip
    """Tiles of the grouped GEMM on quantised weights (:mod:`moe_route.kernels.triton.quant`).

    FP8: ``block_k`` is the scale block (128) and ``block_n`` 128, the activations' group (a
    gated GEMM1's epilogue quantises its output per tile). A block's scaled product needs a
    second float32 tile beside the accumulator, so a thread holds two 64-value tiles at
    128x128 on 8 warps; a gated GEMM1 computes gate and up as one product twice as wide, so it
    takes 64 rows. On SM90 FP8 reads its weights (and GEMM2 its input) through TMA. Up to 16
    rows per expert (decode) FP8 takes 16-row tiles on 4 warps after a quantiser launch
    (faster than quantising in the main loops at 32- or 64-column tiles: docs/decisions.md,
    "FP8 decode: quantiser launch again"); on SM90 with the operands swapped, the weights
    first, so that each step is FP8 MMAs of 64 weight rows by the 16 token rows instead of
    16-bit MMAs on converted codes (GEMM1 128 columns, GEMM2 64: "FP8 16-row tiles: weights
    first"), elsewhere (unmeasured there) 16x128.

    MXFP4 (the weights unpacked in the loader, pointer-fed): 16-row tiles up to 16 rows per
    expert, 64 columns and 3 stages, except a gated GEMM1 while the slots number under a
    quarter of the experts (few experts touched: 32 columns, twice the programs, 4 stages);
    above that 64x128 (gated) or 128x128 on 8 warps stepping 64 along ``K``.

    docs/decisions.md, "FP8 grouped GEMM tiles", "FP8 prefill: persistent kernel, TMA, one
    wide gated product", "FP8 decode tiles", "MXFP4 loader: nibbles as even and odd columns"
    and "Quantised 16-row tiles: MXFP4 at 64 columns"; ``python -m moe_route bench --sweep
    quant`` times the 16-row tiles.
    """
    if mxfp4:
        if gated and rows_per_expert < 0.25:
            return GemmConfig(16, 32, 128, 1, 4, 4)
        if rows_per_expert <= 16:
            return GemmConfig(16, 64, 128, 1, 4, 3)
        return GemmConfig(64 if gated else 128, 128, 64, 8, 8, 3)
    tma = cc is not None and cc >= 90
    if rows_per_expert <= 16:
        if cc == 90:  # the weights first: FP8 MMAs of 64 weight rows by 16 token rows
            return GemmConfig(16, 128 if gated else 64, 128, 1, 4, 4, swap_ab=True)
        return GemmConfig(16, 128, 128, 1, 4, 4)
    if rows_per_expert <= 64 and not gated:
        return GemmConfig(64, 128, 128, 8, 4, 3, tma)
    if gated:  # gate, up and a block's product live at once: 64 rows on 8 warps
        return GemmConfig(64, 128, 128, 8, 8, 4, tma)
    return GemmConfig(128, 128, 128, 8, 8, 4, tma)


def quant_in_loop(rows_per_expert: float, mxfp4: bool, cc: int | None,
                  expert_bytes: int) -> bool:  # fmt: skip
    """Whether FP8 GEMM1 quantises the tokens in its main loop rather than reading a quantiser
    launch's codes (``QuantConfigs.in_loop``): on SM90's swapped 16-row tiles (up to 16 rows
    per expert) for experts of up to 16 MiB (``expert_bytes``), whose eager calls wait on the
    host. It saves a launch and two buffers, 13-63 µs of host time per call, and costs 1-3 %
    of device time; larger experts keep the device time (docs/decisions.md, "FP8 sorted path:
    the tokens' codes from GEMM1's main loop")."""
    return (not mxfp4 and cc == 90 and rows_per_expert <= 16
            and expert_bytes <= _SMALL_EXPERT_BYTES)  # fmt: skip


def act_backward_config(rows_per_expert: float, dtype: torch.dtype, cc: int | None,
                        kd: int | None = None):  # fmt: skip
    """Step 1 of the backward (GEMM2's input gradient with the activation's backward): the fused
    kernel (z in, w*h and dz out: a register-heavy epilogue, run in two column halves) or the
    split (the forward GEMM2's plain tiles storing ``g``, then a pass over the rows), and the
    tiles of both. ``kd``: the GEMM's reduction (``H``), as :func:`gemm_config` takes it."""
    split = (
        cc is not None and cc >= 90 and dtype in (torch.float16, torch.bfloat16)
        and rows_per_expert > 64
    )  # fmt: skip
    # Split on SM90 above 64 rows per expert (0.84-0.99x the fused kernel's time), its GEMM
    # storing g through TMA where H allows: docs/decisions.md, "Activation backward: fused or
    # split" and "TMA store and four-stage GEMM1".
    return ActBackwardConfig(
        fused=_act_backward_fused(rows_per_expert, dtype, cc),
        gemm=gemm_config(rows_per_expert, False, dtype, cc, kd=kd),
        rows=_ROWS_FP64 if dtype == torch.float64 else RowPassConfig(),
        split=split,
    )


_ROWS_FP64 = RowPassConfig(block_m=16, block_n=64, num_warps=4)


def _act_backward_fused(rows_per_expert: float, dtype: torch.dtype, cc: int | None):
    tma = cc is not None and cc >= 90 and dtype in (torch.float16, torch.bfloat16)
    if dtype == torch.float64 or rows_per_expert <= 64:
        return _gemm_table(rows_per_expert, False, dtype, cc)
    # 128x128 on 8 warps, 4 stages, not persistent: docs/decisions.md, "Activation backward:
    # fused or split".
    return GemmConfig(128, 128, 64, 8, 8, 4, tma)


def weight_grad_config(rows_per_expert: float, n: int, kd: int, dtype: torch.dtype,
                       cc: int | None) -> WeightGradConfig:  # fmt: skip
    """Tiles of the weight-gradient kernels (``dW[e]`` being ``[n, kd]``).

    Why these tiles, and why an expand feeds the TMA kernel: docs/decisions.md, "Weight-gradient
    tiles", "Weight gradients at 17-128 rows per expert", "Weight gradients: pointer or TMA
    kernel" and "Warp-specialised weight gradient".
    """
    if dtype == torch.float64:
        return WeightGradConfig(16, 32, 32, 4, 1)
    if dtype == torch.float32:
        return WeightGradConfig(32, 64, 64, 4, 3)
    # Decode sizes (<= 16 rows per expert) take the pointer kernel too: the TMA route's two
    # expands and three descriptors cost more host time than the reduction takes.
    if cc is not None and cc >= 90 and 0.25 <= rows_per_expert <= 16:
        # On permuted rows from a quarter of a row per expert; below that a call is host-bound
        # and gathering saves the expands' launches: docs/decisions.md, "Weight gradients:
        # pointer or TMA kernel".
        return WeightGradConfig(16, 128, 128, 4, 4, permuted=True)
    if cc is None or cc < 90 or rows_per_expert <= 16:  # the pointer kernel (H200 sweep)
        if rows_per_expert <= 512:
            return WeightGradConfig(32, 128, 128, 4, 4)
        return WeightGradConfig(64, 256 if n >= 8192 else 128, 128, 8, 3)
    if rows_per_expert <= 128:
        # One program per SM with evict-first pointer stores of dW (TMA-stored dW lines evict
        # the operand rows from L2), wider tiles above 64 rows: docs/decisions.md, "Weight
        # gradients at 17-128 rows per expert".
        if rows_per_expert > 64:
            return WeightGradConfig(64, 128, 256, 8, 3, True, 1, flat=True, tma_store=False)
        return WeightGradConfig(64, 128, 128, 4, 4, True, 1, flat=True, tma_store=False)
    if rows_per_expert <= 512:
        return WeightGradConfig(64, 128, 256, 8, 3, True, 1, flat=True)
    cfg = WeightGradConfig(32, 128, 256, 8, 4, True, 1)
    along_kd = cdiv(kd, cfg.block_k) <= cdiv(n, cfg.block_n)  # fewer tiles along Kd
    return dataclasses.replace(cfg, k_fastest=along_kd)


# --------------------------------------------------------------------------- one GEMM's tiles
class GemmConfigs(NamedTuple):
    """The tile configs of one GEMM ``[M, Kd] @ W[e].T`` (``W [E, N_w, Kd]``) for a shape
    bucket, forward and backward."""

    forward: GemmConfig
    #: the forward when it also stores the pre-activation (training)
    forward_z: GemmConfig
    act_backward: ActBackwardConfig
    #: the input gradient's GEMM, ``dout [M, N_w] @ W[e]`` (its K is ``N_w``)
    dx: GemmConfig
    weight_grad: WeightGradConfig


@functools.cache
def gemm_configs(device: torch.device, dtype: torch.dtype, E: int, bucket_rows: int, gated: bool,
                 n_out: int, kd: int, env: tuple) -> GemmConfigs:  # fmt: skip
    """:class:`GemmConfigs` for one shape bucket (``N_w = 2 * n_out`` gated, else ``n_out``)."""
    cc = arch.compute_capability(device)
    rpe = bucket_rows / max(E, 1)
    n_w = n_out * (2 if gated else 1)
    return GemmConfigs(
        forward=gemm_config(rpe, gated, dtype, cc, kd=kd),
        forward_z=gemm_config(rpe, gated, dtype, cc, kd=kd, store_z=True),
        # GEMM2's input gradient reduces over GEMM1's Kd (H)
        act_backward=act_backward_config(rpe, dtype, cc, kd=kd),
        dx=gemm_config(rpe, False, dtype, cc, kd=n_w),
        weight_grad=weight_grad_config(rpe, n_w, kd, dtype, cc),
    )
