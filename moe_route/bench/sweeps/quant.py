"""``bench --sweep quant``: the tiles of the grouped GEMMs on quantised experts per
configuration, the experts step of ``fused_moe`` (maps given) in CUDA graphs and the host time
of its eager call, against the tables' tiles (``tuning.quant_gemm_config``). By default the
16-row tiles (up to 16 rows per expert: decode) on FP8 (128-block) and MXFP4 weights, and
where eager calls of the size take the two-launch decode path its tiles too, 16 routings per
graph, against the touched weights' read time at the copy rate; ``--prefill`` the MXFP4 tiles
of prefill sizes (the FP8 ones run the SM90 kernel's fixed tiles there), GEMM1's tiles then
GEMM2's, against the same FLOPs at the dense bf16 matmul rate."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import ClassVar

import torch

from moe_route import tuning
from moe_route.kernels.triton.decode import DecodeConfig
from moe_route.kernels.triton.decode_quant import QuantDecodeLaunch
from moe_route.kernels.triton.gemm_mainloop import GemmConfig
from moe_route.kernels.triton.moe import moe_forward_quant_triton
from moe_route.plan import quant_plan_for
from moe_route.quant import as_quant

from ..quant import HOST_QUEUE_CALLS
from ..shapes import model_shape
from ..timing import time_host
from .common import Sweep, rel_err, short_error, tiny_shapes


def random_experts(fmt: str, E: int, N: int, K: int, device, g) -> tuple:
    """``(w, scale)`` of ``E`` random ``[N, K]`` experts as ``fmt`` stores them, made from codes
    (no quantiser pass over gigabytes of 16-bit weights): e4m3 codes of either sign below
    the NaN code with float32 scales per 128x128 block, or any e2m1 byte with ue8m0
    exponents near 2^-6."""
    if fmt == "mxfp4":
        w = torch.randint(0, 256, (E, N, K // 2), device=device, dtype=torch.uint8, generator=g)
        s = torch.randint(118, 124, (E, N, K // 32), device=device, dtype=torch.uint8,
                          generator=g)  # fmt: skip
        return w, s
    codes = torch.randint(0, 0x7E, (E, N, K), device=device, dtype=torch.uint8, generator=g)
    codes |= torch.randint(0, 2, (E, N, K), device=device, dtype=torch.uint8, generator=g) << 7
    s = torch.rand(E, -(-N // 128), -(-K // 128), device=device, generator=g) * 1e-3 + 1e-4
    return codes.view(torch.float8_e4m3fn), s


class QuantSweep(Sweep):
    name = "quant"
    help = (
        "the tiles of the GEMMs on FP8 and MXFP4 experts against the tables' tiles: decode "
        "sizes against the weight-read time (--prefill: MXFP4 at prefill sizes), CUDA graphs"
    )
    takes = ("quick", "shapes", "tokens", "prefill")
    #: (model, T) of the default run; --tokens puts each of these models at those T
    DEFAULT = (("deepseek-v3", 1), ("deepseek-v3", 8), ("deepseek-v3", 64),
               ("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 64))  # fmt: skip
    PREFILL = (("mixtral-8x7b", 4096), ("qwen3-30b-a3b", 4096))
    #: MXFP4 prefill tiles ``(block_m, block_n, block_k, num_warps, num_stages)``, those that
    #: ptxas compiles for sm_90a without spills or serialised wgmma: GEMM1's (gated), timed
    #: beside the tables' GEMM2, then GEMM2's beside the tables' GEMM1
    PREFILL_TILES: ClassVar[dict] = {
        "gemm1": [(64, 128, 64, 8, 3), (64, 128, 128, 8, 3), (128, 64, 128, 8, 3),
                  (128, 64, 32, 8, 4), (64, 64, 128, 4, 3), (64, 128, 64, 8, 4)],
        "gemm2": [(128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (128, 128, 32, 8, 4),
                  (64, 128, 64, 4, 3), (128, 128, 64, 8, 4), (64, 128, 128, 8, 3),
                  (128, 64, 128, 8, 3)],
        "tiny": [(32, 16, 32, 4, 2), (16, 32, 32, 4, 2)],
    }  # fmt: skip
    #: GEMM1's (gated) and GEMM2's columns, the ``K`` step (FP8: the 128-column scale block
    #: only) and the stages of 16-row tiles on 4 warps
    GRIDS: ClassVar[dict] = {
        "full": {"gemm1_n": [32, 64, 128], "gemm2_n": [64, 128], "block_k": [128, 256],
                 "num_stages": [3, 4]},
        "quick": {"gemm1_n": [32, 64, 128], "gemm2_n": [64, 128], "block_k": [128],
                  "num_stages": [4]},
        "tiny": {"gemm1_n": [16, 32], "gemm2_n": [16, 32], "block_k": [128],
                 "num_stages": [2]},
    }  # fmt: skip

    #: FP8's swapped 16-row tiles ``(num_warps, num_stages, gemm1_n, gemm2_n)`` (GEMM1 at
    #: 128 columns, the group its epilogue quantises), each pair timed beside the tables'
    #: tiles of the other GEMM too
    SWAPPED: ClassVar[dict] = {
        "full": [(4, 4, 128, 64), (4, 4, 128, 128), (4, 6, 128, 64), (4, 3, 128, 64)],
        "tiny": [(4, 2, 128, 32)],
    }  # fmt: skip

    #: the decode path's (eager calls') GEMM1 columns, GEMM2 columns, ``K`` step and second
    #: launch per token or per slot (``swapped_n``: GEMM2's columns where SM90's FP8 products
    #: are swapped, 64 weight rows at least)
    DECODE_GRIDS: ClassVar[dict] = {
        "full": {"up_n": [32, 64, 128], "down_n": [16, 32, 64], "k": [128, 256],
                 "split": [False, True], "swapped_n": [64, 128],
                 "launch": [(8, 4), (4, 3), (4, 6), (8, 6)]},
        "quick": {"up_n": [32, 64], "down_n": [16, 32], "k": [128, 256], "split": [False, True],
                  "swapped_n": [64, 128], "launch": [(8, 4), (4, 6)]},
        "tiny": {"up_n": [16, 32], "down_n": [16], "k": [128], "split": [False, True],
                 "swapped_n": [64], "launch": [(8, 4)]},
    }  # fmt: skip

    def __init__(self, args, device):
        super().__init__(args, device)
        self.prefill = bool(getattr(args, "prefill", False))
        if self.prefill and args.quick:
            raise ValueError("--sweep quant takes one of --quick, --prefill")
        self.grid = self.GRIDS["tiny" if self.cpu else "quick" if args.quick else "full"]
        self.formats = ("mxfp4",) if self.prefill else ("fp8", "mxfp4")
        self.calls = 1 if self.prefill else 2 if self.cpu else 16

    def configs(self, fmt: str, rows: float,
                expert_bytes: int = 0) -> list[tuple[GemmConfig, GemmConfig, bool]]:  # fmt: skip
        """``(gemm1, gemm2, in_loop)`` (``expert_bytes``: as :func:`tuning.expert_bytes`): the
        tables' first, then on FP8 the same tiles with the other source of the tokens' codes
        (a quantiser launch, or GEMM1's main loop: ``in_loop``), then the grid's tiles, each
        once (FP8: GEMM1 128 columns wide, the group its epilogue quantises), their operands
        swapped where the tables swap them, the tokens' codes from where the tables take
        them. FP8 then: the unswapped 16x128 tiles, and the swapped ones of :attr:`SWAPPED`,
        both GEMMs and each beside the other unswapped."""
        mx = fmt == "mxfp4"
        first = (tuning.quant_gemm_config(rows, True, mx, self.cc),
                 tuning.quant_gemm_config(rows, False, mx, self.cc))  # fmt: skip
        in_loop = tuning.quant_in_loop(rows, mx, self.cc, expert_bytes)
        out = [(*first, in_loop)] + ([] if mx else [(*first, not in_loop)])
        if self.prefill:
            gemm1, gemm2 = out[0][:2]
            tiles = self.PREFILL_TILES
            for which in ("gemm1", "gemm2"):
                for bm, bn, bk, warps, stages in tiles["tiny" if self.cpu else which]:
                    cfg = GemmConfig(bm, bn, bk, 8, warps, stages)
                    pair = (cfg, gemm2, False) if which == "gemm1" else (gemm1, cfg, False)
                    if pair not in out:
                        out.append(pair)
            return out
        swap = out[0][0].swap_ab
        for n1, n2, bk, stages in itertools.product(*self.grid.values()):
            if not mx and (bk != 128 or n1 != 128):
                continue
            tiles = (GemmConfig(16, n1, bk, 1, 4, stages, swap_ab=swap),
                     GemmConfig(16, n2, bk, 1, 4, stages, swap_ab=swap), in_loop)  # fmt: skip
            if tiles not in out:
                out.append(tiles)
        if mx:
            return out
        # FP8: the weights as the products' first operand (MMAs of 64 weight rows on SM90),
        # beside the tiles the tables take where they do not swap
        u1, u2 = (tuning.quant_gemm_config(rows, gated, False, None) for gated in (True, False))
        if (u1, u2, in_loop) not in out:
            out.append((u1, u2, in_loop))
        for warps, stages, n1, n2 in self.SWAPPED["tiny" if self.cpu else "full"]:
            s1 = dataclasses.replace(u1, block_n=n1, num_warps=warps, num_stages=stages,
                                     swap_ab=True)  # fmt: skip
            s2 = dataclasses.replace(u2, block_n=n2, num_warps=warps, num_stages=stages,
                                     swap_ab=True)  # fmt: skip
            for pair in ((s1, s2, in_loop), (s1, u2, in_loop), (u1, s2, in_loop)):
                if pair not in out:
                    out.append(pair)
        return out

    def candidate_shapes(self):
        tokens = self.args.tokens
        default = self.PREFILL if self.prefill else self.DEFAULT
        if self.cpu:
            shapes = tiny_shapes(tokens or ((64,) if self.prefill else (1,)))
        elif tokens:
            models = dict.fromkeys(m for m, _ in default)
            shapes = [model_shape(m, T) for m in models for T in tokens]
        else:
            shapes = [model_shape(m, T) for m, T in default]
        wrong = [s.label for s in shapes if (s.T * s.K / s.E > 16) != self.prefill]
        if wrong:
            what = "more than 16 rows per expert (T*K/E > 16)" if self.prefill else (
                "up to 16 rows per expert (T*K/E <= 16; --prefill: more)")  # fmt: skip
            raise ValueError(f"the sweep covers {what}; {', '.join(wrong)} do not")
        return shapes

    def describe(self):
        if self.prefill:
            grid = "tiny" if self.cpu else "prefill"
            counts = f"mxfp4 {len(self.configs('mxfp4', 64.0))}"
        else:
            grid = "tiny" if self.cpu else "quick" if self.args.quick else "full"
            counts = ", ".join(f"{fmt} {len(self.configs(fmt, 1.0))}" for fmt in self.formats)
            decode = []
            for fmt in self.formats:
                table = tuning.quant_decode_config(1, 1, 16, 0, fmt == "mxfp4", self.cc)
                decode.append(f"{fmt} {len(self.decode_configs(fmt, table))}")
            counts += f"; the decode path's tiles where eager calls take it: {', '.join(decode)}"
        return [f"tile pairs per format ({grid} grid; the first is the tables'): {counts}; "
                f"{self.calls} routing(s) per figure"]  # fmt: skip

    def start(self):
        print(f"{self.device_name()}, {self.dtype} tokens; each figure per call, over "
              f"{self.calls} routings{'' if self.cpu else ' in a CUDA graph'}")  # fmt: skip

    def run_shape(self, shape):
        for fmt in self.formats:
            self.run_format(shape, fmt)
            self.release()

    def run_format(self, shape, fmt: str):
        T, H, inter, E, K = shape.T, shape.H, shape.I, shape.E, shape.K
        g = torch.Generator(device=self.device).manual_seed(self.args.seed)
        x = self.rand(T, H, generator=g)
        w1, s1 = random_experts(fmt, E, 2 * inter, H, self.device, g)
        w2, s2 = random_experts(fmt, E, H, inter, self.device, g)
        per_expert = sum(t[0].numel() * t.element_size() for t in (w1, s1, w2, s2))
        routings, touched = [], 0
        for i in range(self.calls):
            tw, ids, maps = self.routing(shape, seed=self.args.seed + i)
            routings.append((tw, ids, maps))
            touched += ids.unique().numel()
        plan = quant_plan_for(x, w1, w2, K, "swiglu", "concat", as_quant(fmt), "auto")
        base = plan.configs
        label = f"{shape.label} {fmt}"
        if self.prefill:  # the floor: the same FLOPs at the dense bf16 matmul rate
            flops = 2 * T * K * 3 * H * inter
            floor_us = flops / self.ceilings.mm_flops_per_s * 1e6
            what = "the dense bf16 time"
            print(f"== {label}: {flops / 1e12:.2f} TFLOP per call, {floor_us:.1f} us at the "
                  f"dense bf16 rate")  # fmt: skip
        else:  # the floor: the touched experts' bytes at the copy rate
            touched_bytes = touched / self.calls * per_expert
            floor_us = touched_bytes / self.ceilings.copy_bytes_per_s * 1e6
            what = "the read time"
            print(f"== {label}: touched weights {touched_bytes / 1e6:.0f} MB per call, "
                  f"{floor_us:.1f} us at the copy rate")  # fmt: skip
        variants = []  # (name, call on a routing, the tables' choice)
        size = tuning.expert_bytes(w1.shape, w2.shape)
        for i, (gemm1, gemm2, in_loop) in enumerate(self.configs(fmt, T * K / E, size)):
            cfg = dataclasses.replace(base, gemm1=gemm1, gemm2=gemm2, in_loop=in_loop)
            name = f"gemm1 {_tile(gemm1)} gemm2 {_tile(gemm2)}"
            if in_loop:
                name += ", GEMM1 quantising the tokens"

            prepared = {}  # the variant's prepared launches, kept as an eager call keeps them

            def call(r, cfg=cfg, launches=prepared):
                tw, _ids, maps = r
                tables = (maps.expanded_source_row_to_expanded_dest_row,
                          maps.expanded_dest_row_to_expanded_source_row,
                          maps.expert_for_source_row, maps.expert_first_token_offset)  # fmt: skip
                return moe_forward_quant_triton(x, w1, s1, w2, s2, tw, None, None, None, tables,
                                                cfg, launches)  # fmt: skip

            variants.append((name, call, i == 0))
        if plan.decode is not None:  # eager calls of this size take the two-launch decode path
            for dcfg in self.decode_configs(fmt, plan.decode):
                launch = QuantDecodeLaunch(x, w1, s1, w2, s2, *routings[0][:2], None, None, None,
                                           base.epilogue, dcfg, base.x_group,
                                           base.w_block_rows, base.ue8m0)  # fmt: skip

                def call(r, launch=launch):
                    tw, ids, _maps = r
                    return launch(x, w1, w2, tw, ids, None, None, None, s1, s2)

                name = (
                    f"decode path: up {dcfg.up_n}x{dcfg.up_k} down {dcfg.down_n}x"
                    f"{dcfg.down_k} w{dcfg.num_warps} s{dcfg.num_stages}"
                    f"{' per slot' if dcfg.split else ''}"
                    f"{' swapped' if dcfg.swap else ''}"
                )
                variants.append((name + (" (eager calls)" if dcfg == plan.decode else ""), call,
                                 False))  # fmt: skip
        want, measured = None, []
        # a change of tiles reorders float32 sums: a few roundings of the 16-bit outputs
        tol = 4 * torch.finfo(self.dtype).eps
        for name, call, current in variants:
            try:
                with torch.no_grad():
                    out = call(routings[0])
                    err = 0.0 if want is None else rel_err(out, want)
                    want = out if want is None else want
                    us = self.time_calls_us([lambda r=r, c=call: c(r) for r in routings])
                    host_us = self.host_us(lambda c=call: c(routings[0]))
            except Exception as exc:  # a config that does not compile
                print(f"   {name}: {short_error(exc, 80)}")
                failed = f"FAILED {short_error(exc, 80)}"
                self.record(shape, format=fmt, config=name, us=math.nan, rel_err=math.nan,
                            over_floor=math.nan, host_us=math.nan, status=failed)  # fmt: skip
                continue
            status = "current" if current else "ok" if err < tol else "MISMATCH"
            self.record(shape, format=fmt, config=name, us=us, rel_err=err,
                        over_floor=us / floor_us, host_us=host_us, status=status)  # fmt: skip
            measured.append((us, err, name, current, host_us))
        measured.sort(key=lambda r: r[0])
        now = next((r[0] for r in measured if r[3]), float("nan"))
        print(f"   tables' tiles {now:.1f} us ({now / floor_us:.2f}x {what})")
        for us, err, name, _, host_us in measured[:8]:
            print(f"   {us:7.1f} us  {us / floor_us:5.2f}x  host {host_us:6.1f} us  "
                  f"err {err:.1e}  {name}")  # fmt: skip

    def host_us(self, fn) -> float:
        """Host time of one eager call of ``fn`` (its launches prepared by a first call), over
        five loops of the ``quant`` stage's :data:`.quant.HOST_QUEUE_CALLS` calls; NaN on the
        CPU, where the interpreter runs the kernels."""
        if self.cpu:
            return math.nan
        return time_host(fn, self.device, calls=HOST_QUEUE_CALLS, repeats=5,
                         warmup=2).median_s * 1e6  # fmt: skip

    def decode_configs(self, fmt: str, tables: DecodeConfig) -> list[DecodeConfig]:
        """The decode path's tiles: the tables' first, then the tables' tiles on the grid's other
        warps and stages, then the grid's tiles (``K`` steps of 128 on FP8, whose kernels
        quantise per 128-column group; MXFP4 also 256), on SM90's FP8 both unswapped and
        swapped."""
        grid = self.DECODE_GRIDS["tiny" if self.cpu else "quick" if self.args.quick else "full"]
        swaps = (False, True) if fmt != "mxfp4" and self.cc == 90 else (False,)
        out = [tables]
        out += [dataclasses.replace(tables, num_warps=w, num_stages=s) for w, s in grid["launch"]
                if (w, s) != (tables.num_warps, tables.num_stages)]  # fmt: skip
        for up_n, k, split, swap in itertools.product(grid["up_n"], grid["k"], grid["split"],
                                                      swaps):  # fmt: skip
            if k != 128 and fmt != "mxfp4":
                continue
            for down_n in grid["swapped_n"] if swap else grid["down_n"]:
                cfg = dataclasses.replace(tables, up_n=up_n, up_k=k, down_n=down_n, down_k=k,
                                          split=split, swap=swap)  # fmt: skip
                if cfg not in out:
                    out.append(cfg)
        return out


def _tile(cfg: GemmConfig) -> str:
    """``16x32x128 w4 s4``: rows, columns, ``K`` step, warps, stages."""
    return (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} "
            f"s{cfg.num_stages}{' swapped' if cfg.swap_ab else ''}")  # fmt: skip
