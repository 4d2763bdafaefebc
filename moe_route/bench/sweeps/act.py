"""``bench --sweep act``: GEMM2's backward with the activation's backward, tiles on gathered
and permuted ``dout``, then the same GEMM with a plain store and the epilogue's bytes at the
copy rate (its share of the time)."""

from __future__ import annotations

import math

import torch

from moe_route.kernels.triton.gemm_act_backward import grouped_gemm_act_backward_triton
from moe_route.kernels.triton.gemm_mainloop import GemmConfig
from moe_route.kernels.triton.grouped_gemm import grouped_gemm_triton

from ..shapes import TRAINING_SHAPES, model_shape
from .common import Sweep, rel_err, short_error, tiny_shapes


class ActSweep(Sweep):
    name = "act"
    help = (
        "GEMM2's backward with the activation's backward: tiles (dout gathered and permuted), "
        "then the same GEMM with a plain store and the epilogue's bytes"
    )
    takes = ("shapes", "tokens", "rep_ms")
    # block_m, block_n, block_k, group_m, warps, stages (TMA-fed, dout permuted)
    CONFIGS = (
        (128, 128, 64, 8, 8, 4),
        (128, 128, 64, 8, 8, 3),
        (64, 128, 64, 8, 4, 4),
        (128, 64, 64, 8, 4, 4),
        (64, 64, 64, 8, 4, 4),
        (128, 256, 64, 8, 8, 3),
    )
    # the plain GEMM on the persistent kernel
    PLAIN = ((128, 128, 64, 8, 8, 3), (128, 256, 64, 8, 8, 3))
    TINY_CONFIGS = ((16, 32, 32, 2, 4, 2),)
    TINY_PLAIN = ((16, 32, 32, 2, 4, 2),)

    def candidate_shapes(self):
        if self.cpu:
            return tiny_shapes(self.args.tokens or (24,))
        base = list(TRAINING_SHAPES.values())
        if self.args.tokens:
            return [model_shape(s.model, T) for s in base for T in self.args.tokens]
        return base

    def describe(self):
        configs, plain = (self.TINY_CONFIGS, self.TINY_PLAIN) if self.cpu else \
            (self.CONFIGS, self.PLAIN)  # fmt: skip
        return ["the plan's fused tiles, dout gathered and permuted",
                f"permuted, TMA (block_m, block_n, block_k, group_m, warps, stages): {configs}",
                f"the plain GEMM on the plan's tiles and persistent at {plain}; the epilogue's "
                "bytes copied"]  # fmt: skip

    def start(self):
        print(f"{self.device_name()}: dense mm {self.ceilings.mm_flops_per_s / 1e12:.1f} TFLOP/s")

    def run_shape(self, shape):
        T, H, inter, E, K = shape.T, shape.H, shape.I, shape.E, shape.K
        M = T * K
        dense = self.ceilings.mm_flops_per_s
        tw, _, maps = self.routing(shape)
        _, d2s, _, off = maps.tensors()
        x = self.rand(T, H)
        w1 = torch.empty(E, 2 * inter, H, device=self.device, dtype=self.dtype)
        w2t = self.rand(E, H, inter, scale=H**-0.5).transpose(1, 2)
        plan = self.plan_configs(x, w1, w2t.transpose(1, 2), K)
        dout = self.rand(T, H)
        dout_perm = dout[d2s % T]
        z = self.rand(M, 2 * inter)
        wh, dz = torch.empty(M, inter, device=self.device, dtype=self.dtype), torch.empty_like(z)
        flops = 2 * M * H * inter

        def run(cfg, permuted):
            return grouped_gemm_act_backward_triton(
                dout_perm if permuted else dout, w2t, off, d2s, z, tw, wh, dz, cfg,
                epilogue=plan.epilogue, permuted=permuted,
            )  # fmt: skip

        fused = plan.act_bwd.fused
        ref = [t.clone() for t in (run(fused, False), wh, dz)]
        print(f"{shape.label}: dz [{M}x{2 * inter}] from [{M}x{H}] @ [{H}x{inter}] per expert")
        configs = self.TINY_CONFIGS if self.cpu else self.CONFIGS
        variants = [("plan, gathered", fused, False), ("plan, permuted", fused, True)]
        variants += [(f"permuted {c}", GemmConfig(*c, use_tma=True), True) for c in configs]
        for label, cfg, permuted in variants:
            try:
                wh.fill_(float("nan"))
                dz.fill_(float("nan"))
                part = run(cfg, permuted)
                same = part.shape != ref[0].shape or torch.equal(part, ref[0])
                same = same and torch.equal(wh, ref[1]) and torch.equal(dz, ref[2])
                err = max(rel_err(dz, ref[2]), rel_err(wh, ref[1]))
                t = self.time_ms(lambda cfg=cfg, permuted=permuted: run(cfg, permuted)) * 1e-3
            except Exception as exc:
                print(f"  {label}: {short_error(exc, 160)}")
                self.record(shape, impl=label, us=math.nan, tflops=math.nan, of_dense=math.nan,
                            rel_err=math.nan, status=f"FAILED {short_error(exc, 80)}")  # fmt: skip
                continue
            verdict = "equal" if same else "DIFFERS"
            self.record(shape, impl=label, us=t * 1e6, tflops=flops / t / 1e12,
                        of_dense=flops / t / dense, rel_err=err, status=verdict)  # fmt: skip
            print(f"  {label:40s} {t * 1e6:8.1f} us {flops / t / 1e12:5.0f} TFLOP/s "
                  f"{flops / t / dense:4.0%} of dense  {verdict} (rel err {err:.1e})")  # fmt: skip
        self.split_costs(shape, dout_perm, w2t, off, fused, (z, dz, wh), flops)

    def split_costs(self, shape, dout_perm, w2t, off, act_bwd, epilogue_tensors, flops):
        """Where the time goes: the same GEMM with a plain store (``g = dout @ W2[e]`` in 16
        bits, no activation epilogue), on the plan's tiles and persistent, and the epilogue's
        bytes (``z`` read, ``dz`` and ``w*h`` written) copied at the copy rate."""
        dense = self.ceilings.mm_flops_per_s
        M, inter = dout_perm.shape[0], w2t.shape[1]
        g = dout_perm.new_empty(M, inter)
        plain = [("plain GEMM, plan's tiles", act_bwd)]
        plain += [(f"plain GEMM, persistent {c}", GemmConfig(*c, use_tma=True, persistent=1))
                  for c in (self.TINY_PLAIN if self.cpu else self.PLAIN)]  # fmt: skip
        for label, cfg in plain:
            try:
                t = self.time_ms(
                    lambda cfg=cfg: grouped_gemm_triton(dout_perm, w2t, off, g, cfg)
                ) * 1e-3  # fmt: skip
            except Exception as exc:
                print(f"  {label}: {short_error(exc, 160)}")
                continue
            self.record(shape, impl=label, us=t * 1e6, tflops=flops / t / 1e12,
                        of_dense=flops / t / dense, status="plain")  # fmt: skip
            print(f"  {label:40s} {t * 1e6:8.1f} us {flops / t / 1e12:5.0f} TFLOP/s "
                  f"{flops / t / dense:4.0%} of dense")  # fmt: skip
        epi_bytes = sum(t.numel() * t.element_size() for t in epilogue_tensors)
        src = torch.empty(epi_bytes // 4, device=self.device, dtype=torch.float32)
        dst = torch.empty_like(src)
        t = self.time_ms(lambda: dst.copy_(src)) * 1e-3
        self.record(shape, impl="epilogue bytes, copied", us=t * 1e6, status="copy")
        print(f"  {'epilogue bytes, copied':40s} {t * 1e6:8.1f} us ({epi_bytes / 1e6:.0f} MB "
              "read and written)")  # fmt: skip
