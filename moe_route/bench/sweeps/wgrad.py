"""``bench --sweep wgrad``: the weight gradients ``dW1 = dz^T x_perm`` and
``dW2 = dout_perm^T (w h)``: the pointer kernel gathering through the maps, the TMA kernel on
permuted rows over a few tiles, ``torch._grouped_mm``; % of a dense ``mm`` and of the roofline."""

from __future__ import annotations

import dataclasses
import math

import torch

from moe_route import tuning
from moe_route.kernels.triton.weight_grad import WeightGradConfig, expert_weight_grad_triton

from ..shapes import TRAINING_SHAPES, model_shape
from .common import Sweep, rel_err, short_error, tiny_shapes


class WgradSweep(Sweep):
    name = "wgrad"
    help = (
        "weight-gradient tiles (pointer kernel gathering, TMA kernel on permuted rows) against "
        "torch._grouped_mm and a dense mm"
    )
    takes = ("quick", "shapes", "tokens", "extra", "candidates", "pointer", "rep_ms")

    # block_r, block_n, block_k, warps, stages, persistent programs per SM, flat loop
    TMA = (
        (32, 128, 256, 8, 4, 1, False),
        (32, 256, 128, 8, 4, 1, False),
        (32, 128, 128, 4, 4, 2, False),
        (64, 128, 256, 8, 3, 1, False),
        (64, 128, 256, 8, 3, 1, True),
        (64, 256, 128, 8, 3, 1, True),
        (64, 128, 128, 4, 4, 2, True),
        (64, 128, 128, 4, 3, 2, True),
        (32, 128, 128, 4, 4, 2, True),
        (32, 128, 256, 8, 4, 1, True),
    )
    # --extra: more programs per SM and shorter row steps (less padding of short reductions:
    # an expert's last step computes zeros past its rows), for deepseek-v3's 128 rows per expert
    EXTRA = (
        (32, 128, 128, 4, 3, 2, True),
        (32, 128, 128, 4, 2, 3, True),
        (64, 128, 128, 4, 2, 3, True),
        (16, 128, 128, 4, 4, 2, True),
        (16, 128, 128, 4, 3, 3, True),
        (32, 256, 128, 8, 4, 1, True),
    )
    # --candidates: only these, each in both tile orders
    CANDIDATES = ((64, 128, 256, 8, 3, 1, True), (64, 256, 128, 8, 3, 1, True),
                  (32, 256, 128, 8, 4, 1, True))  # fmt: skip
    # block_r, block_n, block_k, warps, stages: the pointer kernel (permuted rows, no gather),
    # swept where the plan takes it (<= 16 rows per expert)
    POINTER = (
        (32, 128, 128, 4, 4),
        (16, 128, 128, 4, 4),
        (32, 128, 64, 4, 4),
        (32, 64, 128, 4, 4),
        (64, 128, 128, 8, 3),
    )
    # --pointer: the pointer kernel at the TMA kernel's tile sizes, on permuted rows and
    # gathering through the maps
    POINTER_WIDE = (
        (64, 128, 256, 8, 3),
        (32, 128, 256, 8, 4),
        (64, 256, 128, 8, 3),
        (32, 128, 128, 4, 4),
        (64, 128, 128, 4, 3),
    )
    # the CPU's tiny case: one of each kind
    TINY_TMA = ((16, 32, 32, 4, 2, 1, False), (16, 32, 32, 4, 2, 2, True))
    TINY_POINTER = ((16, 32, 32, 4, 2),)
    TINY_WIDE = ((16, 32, 16, 4, 2),)

    def candidate_shapes(self):
        if self.cpu:
            return tiny_shapes(self.args.tokens or (24,))
        base = list(TRAINING_SHAPES.values())
        if self.args.tokens:
            return [model_shape(s.model, T) for s in base for T in self.args.tokens]
        return base

    def tables(self):
        """``(tma, pointer, pointer_wide)`` tile lists of this run."""
        a = self.args
        if self.cpu:
            tma, pointer, wide = self.TINY_TMA, self.TINY_POINTER, self.TINY_WIDE
            candidates = self.TINY_TMA[1:]
        else:
            tma = self.TMA + (self.EXTRA if a.extra else ())
            pointer, wide, candidates = self.POINTER, self.POINTER_WIDE, self.CANDIDATES
        if a.candidates:
            tma = candidates
        return ([] if a.quick else tma), pointer, wide

    def describe(self):
        tma, pointer, wide = self.tables()
        lines = [
            "the plan's config, in both tile orders; the pointer kernel gathering (the plan's "
            "tiles); torch._grouped_mm",
            f"TMA tiles (block_r, block_n, block_k, warps, stages, programs/SM, flat): {tma}",
        ]
        if not self.args.quick:
            lines.append(f"pointer tiles at <= 16 rows per expert: {pointer}")
        if self.args.pointer:
            lines.append(f"--pointer: {wide}, permuted and gathering")
        return lines

    def start(self):
        c = self.ceilings
        print(f"{self.device_name()}: dense mm {c.mm_flops_per_s / 1e12:.1f} TFLOP/s, "
              f"copy {c.copy_bytes_per_s / 1e12:.2f} TB/s")  # fmt: skip

    def run_shape(self, shape):
        T, H, inter, E, K = shape.T, shape.H, shape.I, shape.E, shape.K
        M = T * K
        dense, copy = self.ceilings.mm_flops_per_s, self.ceilings.copy_bytes_per_s
        _, _, maps = self.routing(shape)
        _, d2s, _, off = maps.tensors()
        x, dout = self.rand(T, H), self.rand(T, H)
        x_perm, dout_perm = x[d2s % T], dout[d2s % T]
        dz, wh = self.rand(M, 2 * inter), self.rand(M, inter)
        rpe = M / E
        tma, pointer, wide = self.tables()
        for which, (a, b, tok, gather_a) in {
            "dW1": (dz, x_perm, x, False),
            "dW2": (dout_perm, wh, dout, True),
        }.items():
            N, KD = a.shape[1], b.shape[1]
            flops = 2 * M * N * KD
            # the roofline: the larger of the MMA time and the bytes (operands in, dW out)
            nbytes = (M * (N + KD) + E * N * KD) * a.element_size()
            roof = max(flops / dense, nbytes / copy)
            dw = torch.empty(E, N, KD, device=self.device, dtype=self.dtype)
            results = []

            def gathered(cfg, a=a, b=b, tok=tok, gather_a=gather_a, dw=dw):
                """The pointer kernel reading the token rows through the maps."""
                if gather_a:
                    return lambda: expert_weight_grad_triton(
                        tok, b, off, dw, cfg, dest_to_src=d2s, a_gather=True, num_rows=M
                    )
                return lambda: expert_weight_grad_triton(
                    a, tok, off, dw, cfg, dest_to_src=d2s, b_gather=True, num_rows=M
                )

            plan_cfg = tuning.weight_grad_config(rpe, N, KD, self.dtype, self.cc)
            old = dataclasses.replace(plan_cfg, use_tma=False, persistent=0)
            run_old = gathered(old)
            run_old()
            ref = dw[:8].clone()  # errors over the first 8 experts (deepseek's dW is 15 GB)
            results.append((f"pointer+gather {old.block_r}x{old.block_n}x{old.block_k}",
                            self.time_ms(run_old), 0.0))  # fmt: skip
            offs = off[1:].to(torch.int32)
            try:
                grouped = torch._grouped_mm(a.t(), b, offs=offs)[:8].clone()
                ms = self.time_ms(
                    lambda a=a, b=b, offs=offs: torch._grouped_mm(a.t(), b, offs=offs)
                )
                results.append(("torch._grouped_mm", ms, rel_err(grouped, ref)))
            except Exception as exc:
                print(f"  torch._grouped_mm failed: {short_error(exc, 200)}")
            variants = [plan_cfg, dataclasses.replace(plan_cfg, k_fastest=not plan_cfg.k_fastest)]
            variants += [WeightGradConfig(*c[:5], True, c[5], flat=c[6]) for c in tma]
            if self.args.candidates:
                variants += [dataclasses.replace(v, k_fastest=False) for v in variants[2:]]
            if rpe <= 16 and not self.args.quick:
                variants += [WeightGradConfig(*c) for c in pointer]
            if self.args.pointer:
                variants += [WeightGradConfig(*c) for c in wide]
                rows, idx = (x_perm if which == "dW1" else dout_perm), (d2s % T).long()

                def expand(tok=tok, idx=idx, rows=rows):
                    torch.index_select(tok, 0, idx, out=rows)

                results.append(("expand (index_select of the TMA kernel's rows)",
                                self.time_ms(expand), 0.0))  # fmt: skip
                for c in wide:
                    cfg = WeightGradConfig(*c)
                    run = gathered(cfg)
                    dw.fill_(float("nan"))
                    run()
                    results.append((f"pointer+gather {c[0]}x{c[1]}x{c[2]} w{c[3]} s{c[4]}",
                                    self.time_ms(run), rel_err(dw[:8], ref)))  # fmt: skip
            for c in variants:
                order = "along Kd" if c.k_fastest else "along N"
                kind = "tma" if c.use_tma else "pointer"
                label = (f"{kind} {c.block_r}x{c.block_n}x{c.block_k} w{c.num_warps} "
                         f"s{c.num_stages} p{c.persistent} {order}"
                         f"{' flat' if c.flat else ''}")  # fmt: skip
                if c == plan_cfg:
                    label = "plan: " + label

                def run(c=c, a=a, b=b, dw=dw):
                    expert_weight_grad_triton(a, b, off, dw, c, dest_to_src=d2s, num_rows=M)

                try:
                    dw.fill_(float("nan"))
                    run()
                    err = rel_err(dw[:8], ref)
                    results.append((label, self.time_ms(run), err))
                except Exception as exc:
                    print(f"  {label}: {short_error(exc, 200)}")
                    self.record(shape, gemm=which, impl=label, us=math.nan, tflops=math.nan,
                                of_dense=math.nan, of_roof=math.nan, rel_err=math.nan,
                                status=f"FAILED {short_error(exc, 80)}")  # fmt: skip
            bound = "MMA" if flops / dense > nbytes / copy else "bytes"
            print(f"{shape.label} {which} [{E}x{N}x{KD}] over {M} rows "
                  f"(roofline {roof * 1e6:.0f} us, {bound}):")  # fmt: skip
            for label, ms, err in results:
                t = ms * 1e-3
                self.record(shape, gemm=which, impl=label, us=t * 1e6, tflops=flops / t / 1e12,
                            of_dense=flops / t / dense, of_roof=roof / t, rel_err=err,
                            status="ok")  # fmt: skip
                print(f"  {label:45s} {t * 1e6:9.1f} us {flops / t / 1e12:6.0f} TFLOP/s "
                      f"{flops / t / dense:5.0%} of dense {roof / t:5.0%} of roof  "
                      f"rel err {err:.1e}")  # fmt: skip
            del dw
