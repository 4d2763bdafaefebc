"""Tile configurations of the GEMM kernels, by problem size (no autotuning: nothing to sync
or recompile per ``T``). A plan asks once per (shapes, dtype, arch, token bucket) and caches.

``rows_per_expert`` comes from the token *bucket* (``T`` rounded up to a power of two), never
the exact ``T``, so every ``T`` in a bucket runs the same compiled kernels.
"""

from __future__ import annotations

import dataclasses

import torch

from ._env import getenv
from .kernels.triton import cdiv
from .kernels.triton.act_backward import ActBackwardConfig, RowPassConfig
from .kernels.triton.decode import MAX_SLOTS, DecodeConfig
from .kernels.triton.grouped_gemm import GemmConfig
from .kernels.triton.weight_grad import WeightGradConfig

#: Environment override of the GEMM kernels' persistent variant (benchmarking): unset or empty,
#: the tables below decide; ``0``, the per-tile kernel; ``N >= 1``, ``N`` persistent programs
#: per SM. Part of :func:`moe_route.arch.env_key`, so plans built under another value are not
#: reused.
PERSISTENT_ENV = "MOE_ROUTE_PERSISTENT"


def token_bucket(T: int) -> int:
    """``T`` rounded up to a power of two (``0`` stays ``0``): the unit plans are cached on."""
    return 1 << (T - 1).bit_length() if T > 0 else 0


def token_buckets(max_tokens: int) -> list[int]:
    """Every bucket a call with ``1 <= T <= max_tokens`` tokens falls in (what a warm-up runs)."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r}: expected an int >= 1")
    return [1 << i for i in range((max_tokens - 1).bit_length() + 1)]


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


def decode_config(bucket: int, top_k: int, num_experts: int, expert_bytes: int,
                  dtype: torch.dtype):  # fmt: skip
    """The decode path's tiles (:mod:`moe_route.kernels.triton.decode`), or None where the
    sorted path serves. Each slot reads its own expert's weights, so the path pays for slots
    that share an expert, which the sorted path reads once per tile: it takes up to
    ``min(16, E)`` slots, and up to ``min(64, E / 2)`` where one expert's weights (``W1[e]``
    and ``W2[e]``, ``expert_bytes``) are at most 16 MiB, small enough that the slots sharing
    an expert find its tiles in L2.

    NOTE: H100, bf16 (scripts/decode_sweep.py, 2026-11-26; device time, CUDA graphs over 16
    routings): 64x256 GEMM1 tiles and 32x256 GEMM2 tiles, 3 stages, were best or within 1 %
    of it at every shape: qwen3 T=1 46.4 us (the sorted path 41.4; the tiles before, 32x128 /
    16x128 / 4 stages, 59.7), qwen3 T=2 64.0 (64.1), H2048 I1024 E64 T=1 57.9 (50.3),
    deepseek-v3 T=1 245 (268). GEMM2 has one program per (token, 32 columns), 64 at H=2048 and
    T=1: fewer than the SMs, which is what the sorted path's per-expert programs still win
    on. So only eager calls take the path (:func:`moe_route.moe.decode_planned`), where it saves
    the maps and two launches of host time.

    NOTE: H100, bf16 (scripts/decode_sweep.py --slots, 2026-11-24), decode against sorted, us:
    qwen3 (9 MiB per expert, E=128) T=4 102 / 105, T=8 175 / 175, T=16 310 / 269; olmoe
    (12 MiB, E=64) T=4 126 / 126, T=8 206 / 192, T=16 345 / 251; deepseek-v3 (84 MiB, E=256)
    T=2 462 / 488, T=4 901 / 913, T=8 1782 / 1691; mixtral (336 MiB, E=8, K=2) T=2 423 / 402,
    T=4 666 / 634. Equal up to E/2 slots where the experts are small; with large experts the
    sorted path pulls ahead from 64 slots (deepseek-v3) or is 5 % ahead already (mixtral,
    where 8 slots share 8 experts: left as it was, the path saves ~70 us of host time there).
    """
    if dtype == torch.float64:
        return None
    most = min(_DECODE_SLOTS, num_experts)
    if expert_bytes <= _SMALL_EXPERT_BYTES:
        most = max(most, min(MAX_SLOTS, num_experts // 2))
    if bucket * top_k > most:
        return None
    return decode_tiles(dtype)


def decode_tiles(dtype: torch.dtype) -> DecodeConfig:
    """The decode kernels' tiles for ``dtype``, at whatever size (:func:`decode_config` says
    which calls take the path)."""
    # float32 tiles take twice the shared memory: 3 stages of the 16-bit tiles would not fit
    return _DECODE_FP32 if dtype == torch.float32 else _DECODE


#: the slots the decode path takes whatever the experts' size, and the experts' size (bytes of
#: ``W1[e]`` and ``W2[e]``) up to which it takes up to :data:`MAX_SLOTS`
_DECODE_SLOTS = 16
_SMALL_EXPERT_BYTES = 16 << 20
_DECODE = DecodeConfig(up_n=64, up_k=256, down_n=32, down_k=256, num_warps=4, num_stages=3)
_DECODE_FP32 = DecodeConfig(up_n=32, up_k=128, down_n=16, down_k=128, num_warps=4, num_stages=4)


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

    NOTE: H200, bf16 (bench/data/gemm_sweep_h200.csv): TMA lifted GEMM1 from 77-80 % to
    87-93 % of the dense rate at mixtral and GEMM2 from 73-81 % to 90-98 %; 16-row tiles
    serve decode (<= 16 rows per expert), 64-row tiles up to 64.
    """
    tma = cc is not None and cc >= 90 and dtype in (torch.float16, torch.bfloat16)
    if dtype == torch.float64:  # gradcheck sizes; FMA products, small tiles
        return GemmConfig(16, 32, 16, 1, 4, 1)
    big_k = 64 if dtype != torch.float32 else 32
    if rows_per_expert <= 16:
        # Decode: no TMA descriptors. Each costs ~10-20 µs of host time per launch (built in
        # Python, converted by Triton's launcher), more than the GEMM itself at T <= 8.
        return GemmConfig(16, 64, 128 if dtype != torch.float32 else 64, 1, 4, 4, False)
    if rows_per_expert <= 64:
        return GemmConfig(64, 64 if gated else 128, big_k, 4, 4, 4, tma)
    # NOTE: H100, bf16 (scripts/gemm_sweep.py --quick, 2026-11-24, errors 0 against the per-tile
    # kernel): the persistent kernel with one program per SM and the same tiles ran GEMM1 at
    # 674 / 671 TFLOP/s (mixtral T=4096 / qwen3 T=32768; 1.03x / 1.19x the per-tile kernel),
    # GEMM1 on x_perm at 692 / 697 (1.04x / 1.15x) and GEMM2 at 670 / 618 (1.06x / 1.12x).
    persistent = 1 if tma else 0
    # NOTE: H100, bf16 (scripts/gemm_sweep.py --training --store --rounds 7, 2026-11-24; each
    # config timed in turns, medians; results bitwise equal). From 512 rows per expert:
    # - GEMM1 storing z, 4 stages instead of 3: qwen3 T=8192 1.10x (3 runs: 1.09-1.11),
    #   mixtral T=4096 1.05x (1.03-1.05), qwen3 / deepseek-v3 / mixtral at 2048-8192 rows
    #   1.00-1.04x; at 128 rows (deepseek-v3 T=4096) 0.72x. The same without z: 0.94-1.01x.
    # - the plain GEMMs (GEMM2, dX) with a reduction of <= 2048 storing through TMA (the
    #   store overlapping the next tile's main loop, 3 stages: 4 leave no shared memory for
    #   its staging): qwen3 T=8192 GEMM2 / dX 1.04x / 1.04x, T=32768 1.06x / 1.09x,
    #   deepseek-v3 T=16384 GEMM2 1.03x; longer reductions 0.95-1.02x, 128 rows 0.95-0.98x.
    #   GEMM1 storing z through TMA ran 0.82-0.99x, without z 0.97-1.04x.
    #   (bench/data/gemm_sweep_store_h100.csv.) Whole calls (scripts/tuning_ab.py, same
    #   process, order flipped every round): qwen3 T=8192 fwd+bwd 1.014x, forward 1.020x, T=32768
    #   forward 1.024x; mixtral and deepseek-v3 within the noise, which an unchanged mixtral
    #   forward put at 2.5 %.
    long_enough = tma and rows_per_expert >= 512
    # NOTE: H100, bf16 (scripts/tuning_ab.py, 2026-11-24, random routing, same bits): the
    # persistent kernel's tiles in groups of one expert's m-tiles instead of 8 consecutive
    # m-tiles across experts (which read a straddled expert's weight columns once per group it
    # is in; the kernel's order before commit 60e6299, no longer an option): fwd+bwd
    # deepseek-v3 T=4096 1.061x, mixtral T=4096 1.020x, qwen3 T=8192 1.007x; forward
    # deepseek-v3 T=16384 1.054x, mixtral T=16384 1.044x, qwen3 T=16384 0.991x. Groups of up
    # to 16 m-tiles against 8: mixtral T=4096 fwd+bwd 1.024x, T=32768 forward 1.084x, qwen3
    # T=32768 1.008x (equal elsewhere: the same order); 32 against 16: mixtral T=16384 0.99x,
    # T=32768 1.06x; 64: T=32768 1.03x.
    group = 16 if persistent else 8  # the persistent kernel's expert groups
    if gated:
        stages = 4 if long_enough and store_z else 3
        return GemmConfig(128, 128, big_k, group, 8, stages, tma, persistent=persistent)
    n = 256 if dtype != torch.float32 else 128
    tma_store = long_enough and kd is not None and kd <= 2048
    return GemmConfig(128, n, big_k, group, 8, 3, tma, persistent=persistent, tma_store=tma_store)


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
    # NOTE: H100, bf16 (scripts/act_bwd_split.py, 2026-11-27, dout permuted): fused kernel /
    # split (plain persistent GEMM 128x256 + row pass on 16x128 tiles, 4 warps) at qwen3
    # T=8192 655 / 574 us (0.88x; the row pass 208 us, 98 % of the copy rate), mixtral T=4096
    # 2198 / 1857 (0.84x), deepseek-v3 T=4096 3510 / 3459 (0.99x). Row tiles of 32 / 64 rows
    # or 256 columns streamed at 75-93 % of the copy rate. The split rounds g to the input
    # dtype before the activation's backward (dz differs from the fused kernel's by 0.2-0.4 %
    # of its largest value; torch's autograd of the same layer rounds it too).
    # NOTE: H100 (scripts/tuning_ab.py --change dgemm2-store, 2026-11-24): the split's plain
    # GEMM storing g through TMA where H <= 2048, as GEMM2 and dX do (gemm_config's kd): qwen3
    # fwd+bwd 1.001x at T=8192, 1.014x at T=32768 (9 / 5 alternating rounds, same bits); the
    # GEMM itself 394 -> 382 us at T=8192 (scripts/step_kernels.py, separate runs).
    # NOTE: H100 (scripts/tuning_ab.py on a trial patch, not kept, 2026-11-25, 9 rounds): the
    # split's plain GEMM reading dout through the maps (33 MB at qwen3 T=8192, L2-resident)
    # instead of its permuted copy (still made for dW2): fwd+bwd qwen3 T=8192 0.982x, T=32768
    # 1.004x, T=2048 1.015x, deepseek-v3 T=4096 0.985x, mixtral 1.011x (forward passes, which
    # the change does not touch, moved by up to 2.6 % in the same rounds): not taken.
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
    # NOTE: H100, bf16 (scripts/act_bwd_sweep.py, 2026-11-24, epilogue in two column halves):
    # 128x128 tiles on 8 warps, 4 stages, at all three training shapes: mixtral T=4096 2330 us
    # (64x128 on 4 warps 2946), qwen3 T=8192 653 us (64x128 on 4 warps 719), deepseek-v3
    # T=4096 3584 us (4006). A persistent variant (the GEMMs' flattened tile loop) ran
    # 1.2-3x slower at every shape and was dropped.
    # NOTE: H100, 2026-11-25 (scripts/act_bwd_sweep.py, ncu): at qwen3 T=8192 / mixtral T=4096
    # the kernel takes 663 / 2205 us, the same GEMM with a plain store 468 / 1774 us: the
    # epilogue (503 MB / 1.17 GB of z, dz and w*h) does not overlap the main loop, one program
    # per SM (195 registers, 131 KB of shared memory). An L2 prefetch of the tile's z before
    # the main loop made it 7 % / 4 % slower.
    return GemmConfig(128, 128, 64, 8, 8, 4, tma)


def weight_grad_config(rows_per_expert: float, n: int, kd: int, dtype: torch.dtype,
                       cc: int | None) -> WeightGradConfig:  # fmt: skip
    """Tiles of the weight-gradient kernels (``dW[e]`` being ``[n, kd]``).

    NOTE: H100, bf16 (scripts/wgrad_sweep.py, 2026-11-24, against torch._grouped_mm in the same
    run; the TMA kernel with bounded-row descriptors):
    - > 512 rows per expert (mixtral T=4096): a loop per tile, 32-row steps, 128x256 tiles on
      8 warps, one program per SM, consecutive tiles along the dimension with fewer tiles
      (the running programs then share the other operand's slices in L2): dW1 [28672 x 4096]
      3170 us (85 % of dense; _grouped_mm 3538), dW2 [4096 x 14336] 1583 us (86 %;
      _grouped_mm 1650). The flat loop's best there: 3525 / 1837 us.
    - <= 512 rows: the flat loop (the next tile's loads under the current tile's last
      steps). qwen3 T=8192 (512 rows): 64-row steps, 128x256 tiles on 8 warps, one program
      per SM: dW1 / dW2 767 / 435 us (_grouped_mm 818 / 415; a loop per tile at its best
      825 / 437). deepseek-v3 T=4096 (128 rows, writing a 15 / 7.5 GB gradient): 64-row
      steps, 128x128 tiles on 4 warps, 2 programs per SM: dW1 / dW2 6741 / 3638 us, 79 / 76 %
      of their bound (_grouped_mm 6735 / 3837; a loop per tile 7504 / 4095).

    NOTE: H100, bf16 (scripts/wgrad_sweep.py on a trial patch, not kept, 2026-11-27): the TMA
    kernel reading the token rows through the maps with pointer loads (the other operand
    through TMA) instead of an expand ran 1.3-2.7x slower at every training shape (qwen3
    T=8192 dW1 / dW2 1450 / 772 us against 776 / 417 on permuted rows, the expands 116 /
    115 us), so the launch sequence keeps the expand. Storing the permuted rows from the GEMM
    that gathers them anyway cost about what the expand costs (step 1 fused: +116 us at
    qwen3; its plain GEMM: +88 us).
    NOTE: H100, bf16 (scripts/wgrad_sweep.py --quick --pointer, 2026-11-27, qwen3 T=8192): the
    pointer kernel gathering the token rows through the maps at the TMA kernel's tiles and
    four others took dW1 / dW2 1230-1758 / 751-954 us, the same kernel on permuted rows 887-1010
    / 463-508, the TMA kernel 749 / 391 and an index_select of the rows 165: the expand stays.

    NOTE: H100, bf16 (scripts/wgrad_ws.py of commit 243e9c4, a trial kept in the history
    only, 2026-11-25): a warp-specialised Gluon kernel (one warp issuing the TMA loads into
    a ring of slots, one wgmma warpgroup multiplying and TMA-storing; bitwise equal to the TMA
    kernel with the same tiles) against these tables, alternating rounds. 64x128x128 tiles,
    4 stages: qwen3 T=4096 (256 rows) dW1 / dW2 1.12x / 1.08x (two runs), deepseek-v3 T=8192
    (256 rows) dW2 1.12x, deepseek-v3 T=4096 dW2 1.09-1.14x (four runs) but T=2048 / 3000
    0.87x / 0.89x, deepseek-v3 dW1 0.78-0.93x at every T (its TMA store crowds L2 as in the
    NOTE below; pointer stores from the accumulator's layout ran 2.5x slower, through a layout
    conversion 0.98x), qwen3 T=8192 0.97-1.01x. 64x128x256 on 8 warps, 3 stages: qwen3
    T=32768 1.05x / 1.08x, deepseek-v3 T=8192 1.07x / 1.05x, 0.79-0.93x at <= 128 rows. Mixtral
    T=4096 dW1 1.02-1.06x with 64x256x128 tiles on 8 warps, dW2 0.96x, T=8192 0.87-0.95x. Two
    MMA warpgroups taking turns (ping-pong, two rings of 2-4 slots) ran 1.3-1.9x slower. ncu
    of these tables' kernels at qwen3 T=8192 (boost clock): tensor pipe active 62 % (dW2) /
    65 % (dW1), DRAM 59 / 52 %, L2 66 / 61 %, issue slots 22 / 23 %, SM clock 1.73 GHz: bound
    by neither memory nor issue. With the loads and the epilogue off the MMA warps and no gain,
    the instruction stream is not what holds them back; not taken.
    """
    if dtype == torch.float64:
        return WeightGradConfig(16, 32, 32, 4, 1)
    if dtype == torch.float32:
        return WeightGradConfig(32, 64, 64, 4, 3)
    # Decode sizes (<= 16 rows per expert) take the pointer kernel too: the TMA route's two
    # expands and three descriptors cost more host time than the reduction takes.
    if cc is not None and cc >= 90 and 0.25 <= rows_per_expert <= 16:
        # NOTE: H100, bf16 (scripts/wgrad_sweep.py --tokens 8 / 64 / 128 / 256, 2026-11-24):
        # gathering the token rows through the maps cost the pointer kernel 5-24 % against
        # the same kernel on permuted rows, 16-row steps, 128x128 tiles (dW1 + dW2, gathered
        # -> permuted: qwen3 T=8 431 -> 390 us, T=64 524 -> 431, T=256 549 -> 474; deepseek-v3
        # T=8 7237 -> 6866, T=64 8319 -> 7066, T=128 8605 -> 7201, T=256 8820 -> 7362;
        # torch._grouped_mm 477 / 549 / 542, 7695 / 7924 / 7973 / 8463; 32x64 tiles were 2-3 %
        # faster at qwen3, 1-3 % slower at deepseek-v3). Below a quarter of a row per expert
        # (T <= 4 at qwen3) a call is host-bound and the gather saves the expands' launches.
        # NOTE: H100 (scripts/wgrad_occupancy.py --only-plan against the kernel before, 6
        # rounds, 2026-11-25): dW stored evict-first (see _store_dw) took these tiles' dW1 / dW2
        # at qwen3 T=64 from 282 / 156 to 260 / 134 us, T=256 307 / 171 -> 304 / 159, T=8
        # 258 / 132 -> 255 / 129; deepseek-v3 T=64, 256 within 0.5 % (3.1-3.2 TB/s already).
        return WeightGradConfig(16, 128, 128, 4, 4, permuted=True)
    if cc is None or cc < 90 or rows_per_expert <= 16:  # the pointer kernel (H200 sweep)
        if rows_per_expert <= 512:
            return WeightGradConfig(32, 128, 128, 4, 4)
        return WeightGradConfig(64, 256 if n >= 8192 else 128, 128, 8, 3)
    if rows_per_expert <= 128:
        # NOTE: H100, bf16 (scripts/wgrad_sweep.py --extra / --candidates, 2026-11-24, 128 rows
        # per expert): the <= 512 rows tiles (64x128x256 on 8 warps, one program per SM) ran
        # qwen3 T=2048 dW1 / dW2 at 359 / 197 us against 404 / 214 here, deepseek-v3 T=2048 at
        # 7001 / 3368 against 7565 / 3391, but deepseek-v3 T=4096 dW1 at 7185-8014 against 6743
        # (dW2 3212-3607 against 3572); mixtral T=512 equal. Shorter row steps (16, 32) and 3
        # programs per SM were slower everywhere. The same config ran up to 12 % apart between
        # two sweeps (clocks at the power limit), so no change without an alternating A/B.
        # Writing zeros runs at 3.29 TB/s there (copy 2.97): deepseek-v3's dW1 / dW2 at 6.7 /
        # 3.6 ms take 1.5x / 1.6x the time of their writes alone (15 / 7.5 GB).
        # NOTE: H100 (ncu on scripts/wgrad_occupancy.py --ncu, 2026-11-24, deepseek-v3 T=4096
        # dW1): these tiles take 164 KB of shared memory, so an SM holds ONE program and the
        # "2 per SM" launch runs as two waves. That one warpgroup issues an instruction every
        # 3.8 cycles (~776 per warp per output tile, ~20 of them MMAs; scripts/sass_count.py
        # shows the row step's index arithmetic and the epilogue's register zeroing), while
        # DRAM and L2 run at 67 % / 66 % of peak and the tensor pipe at 43 %: latency- and
        # issue-bound, not bound by L2 reads. Compile-time N and KD (the kernel's docstring)
        # took ~45 instructions off each row step: same bits, alternating rounds
        # (scripts/wgrad_occupancy.py, 7 rounds) dW1 / dW2 deepseek-v3 6603 -> 6354 / 3517 ->
        # 3438 us, qwen3 T=8192 761 -> 726 / 407 -> 384, mixtral (a loop per tile) unchanged.
        # Two resident programs per SM (32-row steps, 4 stages, 96 KB) then ran deepseek-v3
        # T=4096 1.02x / 1.14x, T=2048 1.07x / 1.03x, qwen3 T=2048 1.12x / 1.07x, mixtral
        # T=512 1.12x / 1.10x, but deepseek-v3 T=3000 0.79x / 0.92x and qwen3 T=1024 1.04x /
        # 0.97x: not taken. 64-row steps in 2 stages (two resident programs), 128x64 tiles and
        # 8 warps were 1.1-1.6x slower.
        # NOTE: H100 (scripts/wgrad_occupancy.py --tokens / --balanced / --skew / --module,
        # ncu, 2026-11-25): those tiles (TMA store, "2 per SM", i.e. two waves) ran deepseek-v3
        # dW1 from 6.0 ms (T=4096, every expert 128 rows) to 8.5 ms (T=3000, random routing),
        # the same 15 GB written. ncu at T=3000: 8.28 ms and 6.1 GB read from DRAM at the
        # boost clock (L2 hit rate 78 %) against 5.88 ms and 0.96 GB at the base clock (96 %):
        # the dirty dW lines fill L2 faster than DRAM drains them and evict the operand rows
        # that the next tiles read again. One wave (one program per SM, each operand row read
        # from DRAM once) and dW written by pointer stores marked evict-first, dW1 + dW2 in
        # alternating rounds, ms, before -> after: deepseek-v3 T=1024 10.1 -> 8.8, 2048 10.9 ->
        # 9.1, 3000 11.8 -> 9.1, 3500 10.1-10.9 -> 9.4, 4096 9.9 -> 10.3 (random routing; with
        # uneven experts, logits offset by N(0, 0.2) per expert, 11.4 -> 10.4); qwen3 T=1536
        # 0.556 -> 0.518, 2048 0.618 -> 0.565; mixtral T=512 1.26 -> 1.30, 400 1.16 -> 1.13.
        # One wave with the TMA store was between the two (deepseek-v3 T=3000 9.8, 4096 10.3).
        # ncu at T=3000, boost clock, after: dW1 5.63 ms, 0.54 GB read from DRAM (the operands
        # once), L2 hit rate 97.5 %. In the <= 512 rows bucket below (4-8 row steps per tile,
        # compute-bound) pointer stores were 0-7 % slower (deepseek-v3 T=6000 / 8192, qwen3
        # T=4096 / 8192 with uneven experts), so it keeps its TMA store.
        # NOTE: H100 (scripts/wgrad_occupancy.py --extra, 5 rounds in turns, same bits,
        # 2026-11-25): above 64 rows, 128x256 tiles on 8 warps (3 stages, pointer stores) against
        # these, dW1 / dW2: deepseek-v3 T=4096 6318 / 3240 against 6839 / 3381 us (1.08x /
        # 1.04x), T=3000 1.09x / 1.03x, T=4096 skewed (0.2) 1.07x / 1.01x; qwen3 T=2048 1.01x /
        # 1.02x; mixtral T=512 1.02x / 1.08x. The same tiles with the TMA store ran dW1 at 8696
        # us (as in the NOTE above) and 256x128 tiles 1.0-1.09x. At 64 rows they ran qwen3
        # T=1024 0.96x / 0.97x, deepseek-v3 T=2048 0.99x / 0.98x (mixtral T=256 1.03x / 1.04x):
        # those keep 128x128 on 4 warps. Fewer L2 reads per byte of dW written (1.5 against 2)
        # is the likely reason; not profiled. In the whole step (scripts/step_kernels.py,
        # deepseek-v3 T=4096, processes alternating before / after, two each): dW1 6649 / 6556
        # -> 5874 / 5939 us, dW2 3389 / 3204 -> 3085 / 3105, the step by do_bench 28999 /
        # 28853 -> 28141 / 28053, as a CUDA graph 29096 / 28862 -> 28182 / 28152 (1.03x).
        # scripts/tuning_ab.py --change wgrad-wide (7 rounds) read fwd+bwd 1.014x there, 0.986x
        # at T=3000 and 0.984x at qwen3 T=2048: within its rounds' spread.
        if rows_per_expert > 64:
            return WeightGradConfig(64, 128, 256, 8, 3, True, 1, flat=True, tma_store=False)
        return WeightGradConfig(64, 128, 128, 4, 4, True, 1, flat=True, tma_store=False)
    if rows_per_expert <= 512:
        return WeightGradConfig(64, 128, 256, 8, 3, True, 1, flat=True)
    cfg = WeightGradConfig(32, 128, 256, 8, 4, True, 1)
    along_kd = cdiv(kd, cfg.block_k) <= cdiv(n, cfg.block_n)  # fewer tiles along Kd
    return dataclasses.replace(cfg, k_fastest=along_kd)
