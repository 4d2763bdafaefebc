"""Sweep of the grouped GEMM kernels on a GPU: the kernel and config the tuning tables choose
today (the per-tile kernel until they say otherwise) against the persistent kernel
(``GemmConfig.persistent``) over a small grid of tiles, at the standard MoE shapes in bf16,
with routing from random logits (top-k).

For each shape it times GEMM1 (gated swiglu, rows gathered from ``x`` as ``fused_moe`` runs
it, and on pre-permuted rows ``x_perm``, TMA-fed) and GEMM2 (``h @ W2``), each with
``triton.testing.do_bench`` (median), checks every persistent result against the tables'
output (relative Frobenius error; "MISMATCH" over 1e-2), and prints a table of TFLOP/s
(``2 * routed rows * N * K``; GEMM1's N is 2I), the best config per (shape, GEMM) and a
suggestion for ``moe_route/tuning.py`` (per rows-per-expert bucket, the config with the best
geometric-mean speedup over the shapes of that bucket). Writes ``gemm_sweep.csv`` under
``--out`` (default ``$OUT`` if set).

Usage (GPU; about 5 minutes on an H100, much of it compiling ~60 kernel variants; a budget
stops adding configs past ``--budget-s``)::

    python scripts/gemm_sweep.py            # 6 shapes
    python scripts/gemm_sweep.py --quick    # mixtral T=4096, qwen3 T=32768
    python scripts/gemm_sweep.py --smoke    # tiny, fp16, on the CPU through TRITON_INTERPRET=1
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import statistics
import sys
import time

if "--smoke" in sys.argv:  # before triton is imported: the interpreter is chosen at import
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import moe_route
from moe_route import arch, tuning
from moe_route.bench.shapes import MODELS
from moe_route.grouped_gemm import epilogue_for
from moe_route.kernels.triton import gemm_mainloop as gm
from moe_route.kernels.triton import grouped_gemm as gk

GemmConfig = gm.GemmConfig
QUICK = (("mixtral-8x7b", 4096), ("qwen3-30b-a3b", 32768))
SMOKE_MODEL = {"H": 32, "I": 32, "E": 4, "K": 2, "prefill": (24, 96)}
MISMATCH = 1e-2  # bf16 outputs of the same tile arithmetic: a real bug is O(1)


def _cfg(bm, bn, bk, group, warps, stages, programs=1, ws=False):
    return GemmConfig(bm, bn, bk, group, warps, stages, True, programs, ws)


# The persistent grid, after triton_kernels' Hopper choices (opt_flags: BLOCK_K a 1024-bit
# line, 8 warps for 128-wide tiles, as many stages as shared memory takes, GROUP_M 8). GEMM1's
# BN is half the MMA's N (gate and up in one accumulator). Every entry compiled ahead of time
# for sm_90a (Triton 3.5.1, arguments specialised as at launch, bias and swiglu) without spills
# or serialised wgmma; the 4-stage 128x128 GEMM1 and 128x256 GEMM2 take 229408 B of the
# H100's 232448 B of shared memory per block.
GRID = {
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
SMOKE_GRID = {
    "gemm1": [_cfg(16, 16, 16, 2, 4, 2), _cfg(16, 32, 16, 8, 4, 2, ws=True)],
    "gemm2": [_cfg(16, 32, 16, 2, 4, 2, programs=2)],
}
# gemm name -> (grid, gated, gathered)
GEMMS = {"gemm1": ("gemm1", True, True), "gemm1_xperm": ("gemm1", True, False),
         "gemm2": ("gemm2", False, False)}  # fmt: skip
# --training adds: GEMM1 also storing the pre-activation z, as the training forward runs it, and
# the backward's dX GEMM (dz @ W1, W1 read k-major through its transpose)
TRAINING_GEMMS = {"gemm1_z": ("gemm1", True, True), "dx": ("gemm2", False, False)}


def store_grid(base: GemmConfig) -> list[GemmConfig]:
    """``--store``: the tables' own tiles with the stores through TMA at 3 stages (4 leave no
    shared memory for the copies' staging; 2 ran slower everywhere: docs/decisions.md, "TMA store
    and four-stage GEMM1"), and with pointer stores at 4 stages."""
    return [dataclasses.replace(base, tma_store=True, num_stages=3),
            dataclasses.replace(base, num_stages=4)]  # fmt: skip


def name_of(cfg: GemmConfig) -> str:
    s = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}/g{cfg.group_m}"
    s += f"/w{cfg.num_warps}/s{cfg.num_stages}"
    if cfg.persistent:
        s += f"/p{cfg.persistent}" + ("/ws" if cfg.warp_specialize else "")
        s += "/ts" if cfg.tma_store else ""
    return s + ("" if cfg.use_tma else "/ptr")


def code_of(cfg: GemmConfig) -> str:
    fields = (cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, cfg.num_warps, cfg.num_stages)
    extra = f", persistent={cfg.persistent}" if cfg.persistent else ""
    extra += ", warp_specialize=True" if cfg.warp_specialize else ""
    extra += ", tma_store=True" if cfg.tma_store else ""
    tma = "tma" if cfg.use_tma else "False"  # tuning's variable: SM90+ and 16-bit
    return f"GemmConfig({', '.join(map(str, fields))}, {tma}{extra})"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` (float32 norms: outputs reach 1e9 elements), inf if ``out``
    holds a non-finite value (an element left unwritten stays NaN)."""
    if not torch.isfinite(out).all():
        return math.inf
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def timer(smoke: bool, rep_ms: int):
    if smoke:

        def once(fn):
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3

        return once
    import triton.testing

    return lambda fn: triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")


class Sweep:
    def __init__(self, args):
        self.smoke = args.smoke
        self.device = torch.device("cpu" if args.smoke else "cuda")
        self.dtype = torch.float16 if args.smoke else torch.bfloat16
        self.cc = arch.compute_capability(self.device)
        self.grid = SMOKE_GRID if args.smoke else GRID
        self.store = args.store
        self.rounds = args.rounds
        self.gemms = {**GEMMS, **TRAINING_GEMMS} if args.training else GEMMS
        self.time = timer(args.smoke, args.rep_ms)
        self.deadline = time.perf_counter() + args.budget_s
        self.rows: list[dict] = []
        self.skipped = 0

    def shapes(self, args):
        if self.smoke:
            return [("tiny", SMOKE_MODEL, T) for T in SMOKE_MODEL["prefill"]]
        chosen = QUICK if args.quick else [(m, T) for m in MODELS for T in MODELS[m]["prefill"]]
        picked = [(m, MODELS[m], T) for m, T in chosen if not args.shapes or
                  any(w in f"{m} T={T}" for w in args.shapes)]  # fmt: skip
        return picked

    def rand(self, *shape, scale=1.0):
        return torch.randn(*shape, device=self.device, dtype=self.dtype).mul_(scale)

    def run_shape(self, model, dims, T, weights):
        H, inter, E, K = dims["H"], dims["I"], dims["E"], dims["K"]
        g = torch.Generator(device=self.device).manual_seed(T)
        logits = torch.randn(T, E, generator=g, device=self.device)
        ids = logits.topk(K, dim=1).indices
        maps = moe_route.build_routing_maps(ids, E)
        offsets = maps.expert_first_token_offset
        d2s = maps.expanded_dest_row_to_expanded_source_row
        M = T * K
        routed = int(offsets[-1])  # one sync per shape, outside any timing
        rpe = tuning.token_bucket(M) / E
        x = self.rand(T, H)
        x_perm = moe_route.expand_rows(x, maps)
        w1, w2 = weights
        swiglu = epilogue_for("swiglu", "concat")
        h = None
        z, z_ref = None, None
        for gemm, (grid_name, gated, gather) in self.gemms.items():
            if gemm == "gemm2":
                a, w, n, kd, epi, dest = h, w2, H, inter, gm.IDENTITY, None
            elif gemm == "dx":  # dz stands in as random rows of z's shape
                a, w, n, kd, epi, dest = self.rand(M, 2 * inter), w1.transpose(1, 2), H, \
                    2 * inter, gm.IDENTITY, None  # fmt: skip
            else:
                a, w, n, kd, epi = (x if gather else x_perm), w1, 2 * inter, H, swiglu
                dest = d2s if gather else None
            if gemm == "gemm1_z":
                z = torch.empty(M, 2 * inter, device=self.device, dtype=self.dtype)
                z_ref = torch.empty_like(z)
            out_cols = n // 2 if gated else n
            flops = 2.0 * routed * n * kd

            def launcher(cfg, out, pre=None, a=a, w=w, epi=epi, dest=dest):
                return lambda: gk.grouped_gemm_triton(
                    a, w, offsets, out, cfg, epilogue=epi, dest_to_src=dest, num_rows=M,
                    pre_activation=pre,
                )  # fmt: skip

            base_cfg = tuning.gemm_config(rpe, gated, self.dtype, self.cc)
            ref = torch.full((M, out_cols), float("nan"), device=self.device, dtype=self.dtype)
            training_z = gemm == "gemm1_z"
            launcher(base_cfg, ref, z_ref if training_z else None)()
            row = dict(model=model, T=T, H=H, I=inter, E=E, K=K, rows_per_expert=rpe, gemm=gemm)
            kind = "tuning" + ("/p" if base_cfg.persistent else "")
            base = {**row, "kernel": kind, "config": name_of(base_cfg), "code": code_of(base_cfg),
                    "rel_err": 0.0, "status": "baseline"}  # fmt: skip
            if gemm == "gemm1":
                h = ref  # GEMM2's input: the real activations
            out = torch.empty_like(ref)
            # Every candidate checked against the tables' output first, then all of them timed
            # in turns over --rounds rounds (a drift of the clocks spreads over all of them).
            timed = [(base, launcher(base_cfg, ref, z_ref if training_z else None))]
            grid = store_grid(base_cfg) if self.store else self.grid[grid_name]
            for cfg in grid:
                if cfg.warp_specialize and gather:
                    continue  # the gathered A is read by pointers: no warp specialisation
                if time.perf_counter() > self.deadline:
                    self.skipped += 1
                    continue
                entry = {**row, "kernel": "persistent", "config": name_of(cfg),
                         "code": code_of(cfg)}  # fmt: skip
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
                    msg = (
                        f"{type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
                    )
                    self.rows.append({**entry, "ms": math.nan, "tflops": math.nan,
                                      "speedup": math.nan, "rel_err": math.nan,
                                      "status": f"FAILED {msg}"})  # fmt: skip
                    continue
                status = "ok" if err <= MISMATCH else "MISMATCH"
                timed.append(({**entry, "rel_err": err, "status": status}, run))
            samples = [[] for _ in timed]
            for _ in range(self.rounds):
                for i, (_, run) in enumerate(timed):
                    samples[i].append(self.time(run))
            base_ms = statistics.median(samples[0])
            for (entry, _), got in zip(timed, samples, strict=True):
                ms = statistics.median(got)
                self.rows.append({**entry, "ms": ms, "tflops": flops / ms / 1e9,
                                  "speedup": base_ms / ms})  # fmt: skip
            self.print_block(model, T, gemm)

    def print_block(self, model, T, gemm):
        rows = [r for r in self.rows if (r["model"], r["T"], r["gemm"]) == (model, T, gemm)]
        print(f"\n{model} T={T} {gemm}  (rows/expert {rows[0]['rows_per_expert']:.0f})")
        print(
            f"  {'kernel':<11}{'config':<30}{'ms':>9}{'TFLOP/s':>9}{'x':>7}{'rel err':>10}  status"
        )
        for r in rows:
            print(f"  {r['kernel']:<11}{r['config']:<30}{r['ms']:>9.3f}{r['tflops']:>9.1f}"
                  f"{r['speedup']:>7.2f}{r['rel_err']:>10.2g}  {r['status']}")  # fmt: skip
        sys.stdout.flush()

    def run(self, args):
        shapes = self.shapes(args)
        weights_of = {}
        for model, dims, T in shapes:
            if model not in weights_of:
                weights_of.clear()  # one model's weights at a time (deepseek's are 22 GB)
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                H, inter, E = dims["H"], dims["I"], dims["E"]
                weights_of[model] = (self.rand(E, 2 * inter, H, scale=H**-0.5),
                                     self.rand(E, H, inter, scale=inter**-0.5))  # fmt: skip
            self.run_shape(model, dims, T, weights_of[model])

    # ------------------------------------------------------------------ summary
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
        dev = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        dtype = str(self.dtype).split(".")[-1]
        print("\nSuggested tail of tuning.py's GEMM table (rows_per_expert > 64; gemm1 is")
        print("the gathered GEMM1 that fused_moe runs; gemm1_xperm is in the table and the CSV):\n")
        print(f"    # NOTE: {dev}, {dtype} (scripts/gemm_sweep.py, {time.strftime('%Y-%m-%d')}):")
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

    def write_csv(self, out_dir):
        if not out_dir:
            return
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "gemm_sweep.csv")
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(self.rows[0]))
            writer.writeheader()
            writer.writerows(self.rows)
        print(f"\nwrote {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="two shapes: " + str(QUICK))
    p.add_argument("--smoke", action="store_true", help="tiny fp16 shape on the CPU (interpreter)")
    p.add_argument(
        "--training",
        action="store_true",
        help="also GEMM1 storing z (training forward) and the backward's dX GEMM",
    )
    p.add_argument(
        "--store",
        action="store_true",
        help="instead of the grid: the tables' config with TMA stores, 2-4 stages",
    )
    p.add_argument("--shapes", nargs="*", help="keep shapes whose 'model T=...' contains a word")
    p.add_argument("--rep-ms", type=int, default=40, help="do_bench repetition time per config")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time the configs in turns this many rounds (median; rep-ms each)",
    )
    p.add_argument("--budget-s", type=float, default=280.0,
                   help="stop adding persistent configs after this many seconds")  # fmt: skip
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for gemm_sweep.csv")
    args = p.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        p.error("needs a CUDA device (or --smoke for the CPU interpreter)")
    sweep = Sweep(args)
    started = time.perf_counter()
    print(f"device {sweep.device} (cc {sweep.cc}), {gm.num_sms(sweep.device)} SMs, "
          f"{sweep.dtype!s}")  # fmt: skip
    sweep.run(args)
    sweep.best()
    sweep.suggest()
    sweep.write_csv(args.out)
    print(
        f"\n{time.perf_counter() - started:.0f} s"
        + (f"; {sweep.skipped} configs skipped past --budget-s" if sweep.skipped else "")
    )
    bad = [r for r in sweep.rows if r["status"] == "MISMATCH"]
    for r in bad:
        print(f"MISMATCH: {r['model']} T={r['T']} {r['gemm']} {r['config']} rel {r['rel_err']:.3g}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
