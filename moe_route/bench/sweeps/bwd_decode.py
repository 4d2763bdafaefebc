"""``bench --sweep bwd_decode``: the backward's dX and activation-backward GEMMs at decode
sizes, weights read transposed, against a k-contiguous copy; GB/s of the touched experts'
weights."""

from __future__ import annotations

import dataclasses
import math

import torch

from moe_route.kernels.triton.gemm_act_backward import grouped_gemm_act_backward_triton
from moe_route.kernels.triton.gemm_mainloop import GemmConfig
from moe_route.kernels.triton.grouped_gemm import grouped_gemm_triton

from ..shapes import model_shape
from .common import Sweep, short_error, tiny_shapes


class BwdDecodeSweep(Sweep):
    name = "bwd_decode"
    help = (
        "the backward's dX and activation-backward GEMMs at decode sizes, weights read "
        "transposed against a k-contiguous copy"
    )
    takes = ("shapes", "tokens", "rep_ms")
    rep_ms, warmup = 60, 10
    MODELS = ("olmoe-1b-7b", "qwen3-30b-a3b", "deepseek-v3")
    TOKENS = (1, 8, 64)
    CONFIGS = (  # block_m, block_n, block_k, group_m, warps, stages, tma
        (16, 64, 128, 1, 4, 4, False),
        (16, 128, 64, 1, 4, 4, False),
        (16, 128, 128, 1, 4, 3, False),
        (16, 256, 64, 1, 4, 4, False),
        (16, 64, 128, 1, 4, 4, True),
        (16, 128, 64, 1, 4, 4, True),
        (16, 128, 128, 1, 4, 3, True),
        (16, 256, 64, 1, 4, 4, True),
        (64, 128, 64, 1, 4, 4, True),
    )
    TINY_CONFIGS = ((16, 32, 32, 1, 4, 2, False), (16, 32, 32, 1, 4, 2, True))
    TOL = 2e-2  # bf16 outputs of sums in other orders

    def candidate_shapes(self):
        if self.cpu:
            return tiny_shapes(self.args.tokens or (1, 8))
        return [model_shape(m, T) for m in self.MODELS for T in self.args.tokens or self.TOKENS]

    def describe(self):
        configs = self.TINY_CONFIGS if self.cpu else self.CONFIGS
        return [
            "dX and act_bwd on the plan's tiles (dX also on a k-contiguous copy of W1)",
            f"(block_m, block_n, block_k, group_m, warps, stages, tma): {configs}",
        ]

    def start(self):
        print(f"{self.device_name()}: copy {self.ceilings.copy_bytes_per_s / 1e12:.2f} TB/s")
        print(f"{'shape':30} {'gemm':8} {'config':36} {'us':>8} {'GB/s':>7} {'of copy':>8}")

    def run_shape(self, shape):
        copy = self.ceilings.copy_bytes_per_s
        label, rows = self.variants(shape)
        for gemm, name, out, fn, nbytes, want in rows:
            try:
                fn()
                ok = torch.allclose(out.float(), want.float(), rtol=self.TOL, atol=self.TOL)
                t = self.time_ms(fn) * 1e-3
            except Exception as exc:  # a config that does not compile or fit
                print(f"{label:30} {gemm:8} {name[:36]:36} failed: {type(exc).__name__}")
                self.record(shape, gemm=gemm, config=name, us=math.nan, gb_s=math.nan,
                            status=f"FAILED {short_error(exc, 80)}")  # fmt: skip
                continue
            self.record(shape, gemm=gemm, config=name, us=t * 1e6, gb_s=nbytes / t / 1e9,
                        of_copy=nbytes / t / copy, status="ok" if ok else "MISMATCH")  # fmt: skip
            flag = "" if ok else "  MISMATCH"
            print(f"{label:30} {gemm:8} {name[:36]:36} {t * 1e6:8.1f} "
                  f"{nbytes / t / 1e9:7.0f} {nbytes / t / copy:8.0%}{flag}")  # fmt: skip

    def variants(self, shape):
        """``(label, rows)``: each row ``(gemm, config name, output, run, weight bytes,
        expected)``."""
        dev, dt = self.device, self.dtype
        T, H, inter, E, K = shape.T, shape.H, shape.I, shape.E, shape.K
        M = T * K
        tw, _, maps = self.routing(shape)
        _, d2s, _, off = maps.tensors()
        touched = int((off[1:] > off[:-1]).sum())
        w1 = self.rand(E, 2 * inter, H, scale=H**-0.5)
        w2t = self.rand(E, H, inter, scale=inter**-0.5).transpose(1, 2)
        x = self.rand(T, H)
        plan = self.plan_configs(x, w1, w2t.transpose(1, 2), K)
        dz, dout, z = self.rand(M, 2 * inter), self.rand(T, H), self.rand(M, 2 * inter)

        def dx(cfg, w):
            out = torch.empty(M, H, device=dev, dtype=dt)
            return out, lambda: grouped_gemm_triton(dz, w, off, out, cfg)

        def act(cfg):
            wh = torch.empty(M, inter, device=dev, dtype=dt)
            dzo = torch.empty_like(z)

            def run():
                grouped_gemm_act_backward_triton(
                    dout, w2t, off, d2s, z, tw, wh, dzo, cfg, epilogue=plan.epilogue
                )

            return dzo, run

        configs = self.TINY_CONFIGS if self.cpu else self.CONFIGS
        w1_bytes = touched * w1[0].numel() * w1.element_size()
        w2_bytes = touched * w2t[0].numel() * w2t.element_size()
        want_dx, run = dx(plan.dx, w1.transpose(1, 2))
        run()
        want_dz, run_act = act(plan.act_bwd.fused)
        run_act()
        rows = [
            ("dX", "K-contiguous copy", *dx(plan.dx, w1.transpose(1, 2).contiguous()), w1_bytes,
             want_dx),
            ("dX", f"plan {dataclasses.astuple(plan.dx)}", want_dx, run, w1_bytes, want_dx),
        ]  # fmt: skip
        rows += [("dX", str(c), *dx(GemmConfig(*c), w1.transpose(1, 2)), w1_bytes, want_dx)
                 for c in configs]  # fmt: skip
        rows.append(("act_bwd", f"plan {dataclasses.astuple(plan.act_bwd.fused)}", want_dz,
                     run_act, w2_bytes, want_dz))  # fmt: skip
        rows += [("act_bwd", str(c), *act(GemmConfig(*c)), w2_bytes, want_dz) for c in configs]
        return f"{shape.label} ({touched} experts)", rows
