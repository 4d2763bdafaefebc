"""``bench --sweep gemm``: GEMM1 / GEMM2 tiles, the tables' config against the persistent
kernel over a grid; the best config per shape and a suggested tail of ``tuning.gemm_config``'s
table (``--training``: also GEMM1 storing ``z`` and dX; ``--store``: the tables' tiles with TMA
stores)."""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time
from typing import ClassVar

import torch

import moe_route
from moe_route import tuning
from moe_route.kernels.triton import gemm_mainloop as gm
from moe_route.kernels.triton.grouped_gemm import grouped_gemm_triton
from moe_route.plan import epilogue_for

from ..shapes import MODELS, Shape, model_shape
from .common import Sweep, rel_err, short_error, tiny_shapes

GemmConfig = gm.GemmConfig


def _cfg(bm, bn, bk, group, warps, stages, programs=1, ws=False):
    return GemmConfig(bm, bn, bk, group, warps, stages, True, programs, ws)


class GemmSweep(Sweep):
    name = "gemm"
    help = (
        "GEMM1 / GEMM2: the tables' config against the persistent kernel over a grid of tiles; "
        "best config per shape, a suggested tuning.py tail"
    )
    takes = ("quick", "shapes", "tokens", "training", "store", "rep_ms", "rounds", "time_limit")
    rep_ms, warmup = 40, 10
    QUICK = (("mixtral-8x7b", 4096), ("qwen3-30b-a3b", 32768))
    MISMATCH = 1e-2  # bf16 outputs of the same tile arithmetic: a real bug is O(1)

    # The persistent grid, after triton_kernels' Hopper choices (opt_flags: BLOCK_K a 1024-bit
    # line, 8 warps for 128-wide tiles, as many stages as shared memory takes, GROUP_M 8).
    # GEMM1's BN is half the MMA's N (gate and up in one accumulator). Every entry compiled
    # ahead of time for sm_90a (Triton 3.5.1, arguments specialised as at launch, bias and
    # swiglu) without spills or serialised wgmma; the 4-stage 128x128 GEMM1 and 128x256 GEMM2
    # take 229408 B of the H100's 232448 B of shared memory per block.
    GRID: ClassVar[dict] = {
        "gemm1": [
            _cfg(128, 128, 64, 8, 8, 3),
            _cfg(128, 128, 64, 8, 8, 4),
            _cfg(128, 64, 64, 8, 8, 4),
            _cfg(64, 128, 64, 8, 8, 4),
            _cfg(64, 64, 64, 8, 4, 4, programs=2),
            _cfg(128, 128, 64, 8, 8, 3, ws=True),
        ],
        "gemm2": [
            _cfg(128, 256, 64, 8, 8, 3),
            _cfg(128, 256, 64, 8, 8, 4),
            _cfg(128, 128, 64, 8, 8, 4),
            _cfg(64, 256, 64, 8, 8, 4),
            _cfg(64, 128, 64, 8, 4, 4, programs=2),
            _cfg(128, 256, 64, 8, 8, 3, ws=True),
        ],
    }
    TINY_GRID: ClassVar[dict] = {
        "gemm1": [_cfg(16, 16, 16, 2, 4, 2), _cfg(16, 32, 16, 8, 4, 2, ws=True)],
        "gemm2": [_cfg(16, 32, 16, 2, 4, 2, programs=2)],
    }
    # gemm name -> (grid, gated, gathered)
    GEMMS: ClassVar[dict] = {"gemm1": ("gemm1", True, True), "gemm1_xperm": ("gemm1", True, False),
             "gemm2": ("gemm2", False, False)}  # fmt: skip
    # --training adds: GEMM1 also storing the pre-activation z, as the training forward runs
    # it, and the backward's dX GEMM (dz @ W1, W1 read k-major through its transpose)
    TRAINING_GEMMS: ClassVar[dict] = {
        "gemm1_z": ("gemm1", True, True),
        "dx": ("gemm2", False, False),
    }

    def __init__(self, args, device):
        super().__init__(args, device)
        self.grid = self.TINY_GRID if self.cpu else self.GRID
        self.gemms = {**self.GEMMS, **self.TRAINING_GEMMS} if args.training else self.GEMMS
        self.deadline = time.perf_counter() + args.time_limit
        self.skipped = 0
        self.weights: dict = {}

    def candidate_shapes(self):
        tokens = self.args.tokens
        if self.cpu:
            return tiny_shapes(tokens or (24, 96))
        prefill = [m for m in MODELS if MODELS[m]["prefill"]]
        if tokens:
            return [model_shape(m, T) for m in prefill for T in tokens]
        if self.args.quick:
            return [model_shape(m, T) for m, T in self.QUICK]
        return [model_shape(m, T) for m in prefill for T in MODELS[m]["prefill"]]

    def describe(self):
        if self.args.store:
            return ["grid: the tables' config of each GEMM with TMA stores at 3 stages, and "
                    "with pointer stores at 4 stages"]  # fmt: skip
        return [f"{g}: {', '.join(map(self.name_of, cfgs))}" for g, cfgs in self.grid.items()]

    def start(self):
        print(f"device {self.device_name()} (cc {self.cc}), {gm.num_sms(self.device)} SMs, "
              f"{self.dtype}; GEMMs {', '.join(self.gemms)}")  # fmt: skip

    @staticmethod
    def store_grid(base: GemmConfig) -> list[GemmConfig]:
        """``--store``: the tables' own tiles with the stores through TMA at 3 stages (4 leave no
        shared memory for the copies' staging; 2 ran slower everywhere: docs/decisions.md, "TMA
        store and four-stage GEMM1"), and with pointer stores at 4 stages."""
        return [dataclasses.replace(base, tma_store=True, num_stages=3),
                dataclasses.replace(base, num_stages=4)]  # fmt: skip

    @staticmethod
    def name_of(cfg: GemmConfig) -> str:
        s = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}/g{cfg.group_m}"
        s += f"/w{cfg.num_warps}/s{cfg.num_stages}"
        if cfg.persistent:
            s += f"/p{cfg.persistent}" + ("/ws" if cfg.warp_specialize else "")
            s += "/ts" if cfg.tma_store else ""
        return s + ("" if cfg.use_tma else "/ptr")

    @staticmethod
    def code_of(cfg: GemmConfig) -> str:
        fields = (cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, cfg.num_warps,
                  cfg.num_stages)  # fmt: skip
        extra = f", persistent={cfg.persistent}" if cfg.persistent else ""
        extra += ", warp_specialize=True" if cfg.warp_specialize else ""
        extra += ", tma_store=True" if cfg.tma_store else ""
        tma = "tma" if cfg.use_tma else "False"  # tuning's variable: SM90+ and 16-bit
        return f"GemmConfig({', '.join(map(str, fields))}, {tma}{extra})"

    def model_weights(self, shape: Shape):
        if shape.model not in self.weights:
            self.weights.clear()  # one model's weights at a time (deepseek's are 22 GB)
            self.release()
            H, inter, E = shape.H, shape.I, shape.E
            self.weights[shape.model] = (self.rand(E, 2 * inter, H, scale=H**-0.5),
                                         self.rand(E, H, inter, scale=inter**-0.5))  # fmt: skip
        return self.weights[shape.model]

    def run_shape(self, shape):
        T, H, inter, E, K = shape.T, shape.H, shape.I, shape.E, shape.K
        _, _, maps = self.routing(shape, seed=self.args.seed + T)
        offsets = maps.expert_first_token_offset
        d2s = maps.expanded_dest_row_to_expanded_source_row
        M = T * K
        routed = int(offsets[-1])  # one sync per shape, outside any timing
        rpe = tuning.token_bucket(M) / E
        x = self.rand(T, H)
        x_perm = moe_route.expand_rows(x, maps)
        w1, w2 = self.model_weights(shape)
        swiglu = epilogue_for("swiglu", "concat")
        h = z = z_ref = None
        for gemm, (grid_name, gated, gather) in self.gemms.items():
            if gemm == "gemm2":
                a, w, n, kd, epi, dest = h, w2, H, inter, gm.IDENTITY, None
            elif gemm == "dx":  # dz stands in as random rows of z's shape
                a, w, n, kd, epi, dest = (self.rand(M, 2 * inter), w1.transpose(1, 2), H,
                                          2 * inter, gm.IDENTITY, None)  # fmt: skip
            else:
                a, w, n, kd, epi = (x if gather else x_perm), w1, 2 * inter, H, swiglu
                dest = d2s if gather else None
            training_z = gemm == "gemm1_z"
            if training_z:
                z = torch.empty(M, 2 * inter, device=self.device, dtype=self.dtype)
                z_ref = torch.empty_like(z)
            out_cols = n // 2 if gated else n
            flops = 2.0 * routed * n * kd

            def launcher(cfg, out, pre=None, a=a, w=w, epi=epi, dest=dest):
                return lambda: grouped_gemm_triton(
                    a, w, offsets, out, cfg, epilogue=epi, dest_to_src=dest, num_rows=M,
                    pre_activation=pre,
                )  # fmt: skip

            base_cfg = tuning.gemm_config(rpe, gated, self.dtype, self.cc)
            ref = torch.full((M, out_cols), float("nan"), device=self.device, dtype=self.dtype)
            launcher(base_cfg, ref, z_ref if training_z else None)()
            if gemm == "gemm1":
                h = ref  # GEMM2's input: the real activations
            row = {"rows_per_expert": rpe, "gemm": gemm}
            kind = "tuning" + ("/p" if base_cfg.persistent else "")
            base = {**row, "kernel": kind, "config": self.name_of(base_cfg),
                    "code": self.code_of(base_cfg), "rel_err": 0.0,
                    "status": "baseline"}  # fmt: skip
            out = torch.empty_like(ref)
            # Every candidate checked against the tables' output first, then all of them timed
            # in turns over --rounds rounds (a drift of the clocks spreads over all of them).
            timed = [(base, launcher(base_cfg, ref, z_ref if training_z else None))]
            grid = self.store_grid(base_cfg) if self.args.store else self.grid[grid_name]
            for cfg in grid:
                if cfg.warp_specialize and gather:
                    continue  # the gathered A is read by pointers: no warp specialisation
                if time.perf_counter() > self.deadline:
                    self.skipped += 1
                    continue
                entry = {**row, "kernel": "persistent", "config": self.name_of(cfg),
                         "code": self.code_of(cfg)}  # fmt: skip
                try:
                    out.fill_(float("nan"))
                    if training_z:
                        z.fill_(float("nan"))
                    run = launcher(cfg, out, z if training_z else None)
                    run()
                    err = rel_err(out, ref)
                    if training_z:
                        err = max(err, rel_err(z, z_ref))
                except Exception as exc:  # out of shared memory, a compiler failure, ...
                    self.record(shape, **entry, rel_err=math.nan,
                                status=f"FAILED {short_error(exc, 80)}", ms=math.nan,
                                tflops=math.nan, speedup=math.nan)  # fmt: skip
                    continue
                status = "ok" if err <= self.MISMATCH else "MISMATCH"
                timed.append(({**entry, "rel_err": err, "status": status}, run))
            samples = [[] for _ in timed]
            for _ in range(self.args.rounds):
                for i, (_, run) in enumerate(timed):
                    samples[i].append(self.time_ms(run))
            base_ms = statistics.median(samples[0])
            for (entry, _), got in zip(timed, samples, strict=True):
                ms = statistics.median(got)
                self.record(shape, **entry, ms=ms, tflops=flops / ms / 1e9, speedup=base_ms / ms)
            self.print_block(shape, gemm)

    def print_block(self, shape, gemm):
        rows = [r for r in self.rows if (r["model"], r["T"], r["gemm"]) ==
                (shape.model, shape.T, gemm)]  # fmt: skip
        print(f"\n{shape.label} {gemm}  (rows/expert {rows[0]['rows_per_expert']:.0f})")
        print(f"  {'kernel':<11}{'config':<30}{'ms':>9}{'TFLOP/s':>9}{'x':>7}{'rel err':>10}"
              "  status")  # fmt: skip
        for r in rows:
            print(f"  {r['kernel']:<11}{r['config']:<30}{r['ms']:>9.3f}{r['tflops']:>9.1f}"
                  f"{r['speedup']:>7.2f}{r['rel_err']:>10.2g}  {r['status']}")  # fmt: skip
        sys.stdout.flush()

    def finish(self):
        self.best()
        self.suggest()
        if self.skipped:
            print(f"\n{self.skipped} configs skipped past --time-limit")
        for r in self.rows:
            if r["status"] == "MISMATCH":
                print(f"MISMATCH: {r['model']} T={r['T']} {r['gemm']} {r['config']} "
                      f"rel {r['rel_err']:.3g}")  # fmt: skip

    def best(self):
        print("\nBest per (shape, GEMM):")
        keys = sorted({(r["model"], r["T"], r["gemm"]) for r in self.rows}, key=str)
        for key in keys:
            rows = [r for r in self.rows if (r["model"], r["T"], r["gemm"]) == key]
            good = [r for r in rows if r["status"] in ("ok", "baseline")]
            top = max(good, key=lambda r: r["tflops"])
            print(f"  {key[0]} T={key[1]} {key[2]:<12} {top['kernel']:<11}{top['config']:<30}"
                  f"{top['tflops']:7.1f} TFLOP/s  {top['speedup']:.2f}x")  # fmt: skip

    def suggest(self):
        """Per GEMM kind and rows-per-expert bucket: the config (the tables' own included)
        with the best geometric-mean speedup over the bucket's shapes, as code for the
        ``rows_per_expert > 64`` tail of ``tuning.gemm_config``'s table."""
        dev = "cpu" if self.cpu else torch.cuda.get_device_name(self.device)
        dtype = str(self.dtype).split(".")[-1]
        print("\nSuggested tail of tuning.py's GEMM table (rows_per_expert > 64; gemm1 is")
        print("the gathered GEMM1 that fused_moe runs; gemm1_xperm is in the table and the CSV):\n")
        print(f"    # NOTE: {dev}, {dtype} (python -m moe_route bench --sweep gemm, "
              f"{time.strftime('%Y-%m-%d')}):")  # fmt: skip
        print("    # geometric-mean speedup over the previous tables' config")
        for gemm, indent in (("gemm1", "        "), ("gemm2", "    ")):
            if gemm == "gemm1":
                print("    if gated:")
            rows = [r for r in self.rows if r["gemm"] == gemm]
            buckets = sorted({r["rows_per_expert"] for r in rows})
            for i, rpe in enumerate(buckets):
                at = [r for r in rows if r["rows_per_expert"] == rpe]
                shapes = sorted({(r["model"], r["T"]) for r in at})
                scores = {}
                for code in {r["code"] for r in at}:
                    ok = [r for r in at if r["code"] == code and r["status"] in ("ok", "baseline")]
                    if len(ok) == len(shapes):  # ran and matched at every shape of the bucket
                        scores[code] = math.exp(sum(math.log(r["speedup"]) for r in ok) / len(ok))
                if not scores:
                    print(f"{indent}# {gemm}, {rpe:.0f} rows/expert: no config ran everywhere")
                    continue
                code = max(scores, key=scores.get)
                where = ", ".join(f"{m} T={T}" for m, T in shapes)
                print(f"{indent}# {gemm} at {where} ({rpe:.0f} rows/expert): {scores[code]:.2f}x")
                if i < len(buckets) - 1:
                    print(f"{indent}if rows_per_expert <= {rpe:.0f}:\n{indent}    return {code}")
                else:
                    print(f"{indent}return {code}")
