"""``bench --sweep decode``: the decode path's two kernels per tile configuration against
``fused_moe`` in a CUDA graph (the sorted path), 16 routings per graph (``--near``: the tiles near
the best; ``--layouts``: k- and n-contiguous weights; ``--slots``: more slots than the path
takes)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import ClassVar

import torch

import moe_route
from moe_route import tuning
from moe_route.kernels.triton.decode import moe_decode_triton
from moe_route.plan import epilogue_for

from ..shapes import MODELS, model_shape
from .common import Sweep, rel_err, short_error, tiny_shapes


class DecodeSweep(Sweep):
    name = "decode"
    help = (
        "the decode path's two kernels per tile configuration against the sorted path, CUDA "
        "graphs of 16 routings"
    )
    takes = ("quick", "shapes", "tokens", "near", "layouts", "slots")
    #: (model, T) of the default run; --tokens puts each of these models at those T
    DEFAULT = (("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 2), ("olmoe-1b-7b", 1), ("deepseek-v3", 1))
    SLOT_MODELS = ("qwen3-30b-a3b", "olmoe-1b-7b", "deepseek-v3", "mixtral-8x7b")
    SLOT_T = (2, 4, 8, 16, 32)
    GRIDS: ClassVar[dict] = {
        "full": {"up_n": [16, 32, 64], "up_k": [128, 256], "down_n": [16, 32],
                 "down_k": [128, 256], "num_warps": [4], "num_stages": [3, 4],
                 "split": [False, True]},
        "near": {"up_n": [32, 64], "up_k": [256], "down_n": [16, 32], "down_k": [256],
                 "num_warps": [4], "num_stages": [3, 4], "split": [False, True]},
        "quick": {"up_n": [16, 32], "up_k": [128], "down_n": [16, 32], "down_k": [128],
                  "num_warps": [4], "num_stages": [4], "split": [False, True]},
        "tiny": {"up_n": [16, 32], "up_k": [32], "down_n": [16], "down_k": [32],
                 "num_warps": [4], "num_stages": [2], "split": [False, True]},
    }  # fmt: skip

    def __init__(self, args, device):
        super().__init__(args, device)
        modes = [m for m in ("quick", "near", "layouts", "slots") if getattr(args, m)]
        if len(modes) > 1:
            raise ValueError(f"--sweep decode takes one of --quick, --near, --layouts, --slots "
                             f"(got {', '.join('--' + m for m in modes)})")  # fmt: skip
        self.mode = modes[0] if modes else "full"
        self.calls = 2 if self.cpu else 16
        self.base = tuning.decode_tiles(self.dtype, 0)  # (the tables' small-expert tiles)
        if self.mode in ("layouts", "slots"):
            self.configs = [self.base]
        else:
            grid = self.GRIDS["tiny" if self.cpu else self.mode]
            self.configs = [self.base]  # the tables' tiles first, each config once
            for values in itertools.product(*grid.values()):
                cfg = dataclasses.replace(self.base, **dict(zip(grid, values, strict=True)))
                if cfg not in self.configs:
                    self.configs.append(cfg)

    def candidate_shapes(self):
        tokens = self.args.tokens
        if self.cpu:
            return tiny_shapes(tokens or (1, 2))
        if self.mode == "slots":
            return [model_shape(m, T) for m in self.SLOT_MODELS for T in tokens or self.SLOT_T
                    if T * MODELS[m]["K"] <= 256]  # fmt: skip
        if tokens:
            models = dict.fromkeys(m for m, _ in self.DEFAULT)
            return [model_shape(m, T) for m in models for T in tokens]
        return [model_shape(m, T) for m, T in self.DEFAULT]

    def describe(self):
        layouts = "k- and n-contiguous weights" if self.mode == "layouts" else "k-contiguous"
        grid = "tiny" if self.cpu and self.mode not in ("layouts", "slots") else self.mode
        return [f"{len(self.configs)} tile configs ({grid} grid; the first is the tables'), "
                f"{layouts} weights, {self.calls} routings per figure"]  # fmt: skip

    def start(self):
        print(f"{self.device_name()}, {self.dtype}; each figure per call, over {self.calls} "
              f"routings{'' if self.cpu else ' in a CUDA graph'}")  # fmt: skip

    def run_shape(self, shape):
        layouts = ("k-contiguous", "n-contiguous") if self.mode == "layouts" else ("k-contiguous",)
        for layout in layouts:
            self.run_layout(shape, layout)

    def run_layout(self, shape, layout):
        T, H, inter, E, K = shape.T, shape.H, shape.I, shape.E, shape.K
        g = torch.Generator(device=self.device).manual_seed(self.args.seed)
        x = self.rand(T, H, generator=g)
        w1 = self.rand(E, 2 * inter, H, generator=g).mul_(0.02)
        w2 = self.rand(E, H, inter, generator=g).mul_(0.02)
        if layout == "n-contiguous":  # the layout of a transposed view (gpt-oss in transformers)
            w1, w2 = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in (w1, w2))
        routings = []
        for _ in range(self.calls):
            logits = torch.randn(T, E, device=self.device, generator=g)
            tw, ids = torch.softmax(logits, -1).topk(K, -1)
            routings.append((tw / tw.sum(-1, keepdim=True), ids.to(torch.int32)))
        epi = epilogue_for("swiglu", "concat")
        with torch.no_grad():
            want = moe_route.fused_moe(x, w1, w2, *routings[0])
            # (a captured call takes the sorted path)
            sorted_us = self.time_calls_us(
                [lambda r=r: moe_route.fused_moe(x, w1, w2, *r) for r in routings]
            )
        touched = K * T * (3 * H * inter) * 2
        label = f"{shape.label} {layout}"
        # on the CPU, eager calls: fused_moe takes the decode path where its plan says so
        what = "fused_moe, eager" if self.cpu else "sorted path"
        self.record(shape, layout=layout, config=what, us=sorted_us, rel_err=0.0,
                    status="baseline")  # fmt: skip
        print(f"== {label}: {what} {sorted_us:.1f} us; touched weights "
              f"{touched / 1e6:.0f} MB (~{touched / 3.0e12 * 1e6:.0f} us at 3 TB/s)")  # fmt: skip
        measured = []
        for cfg in self.configs:
            name = (f"up {cfg.up_n}x{cfg.up_k} down {cfg.down_n}x{cfg.down_k} w{cfg.num_warps} "
                    f"s{cfg.num_stages}{' per slot' if cfg.split else ''}")  # fmt: skip

            def call(r, cfg=cfg):
                return moe_decode_triton(x, w1, w2, r[0], r[1], None, None, None, epi, cfg)

            try:
                with torch.no_grad():
                    err = rel_err(call(routings[0]), want)
                    us = self.time_calls_us([lambda r=r, c=call: c(r) for r in routings])
            except Exception as exc:  # a config that does not compile
                print(f"   {name}: {short_error(exc, 80)}")
                self.record(shape, layout=layout, config=name, us=math.nan, rel_err=math.nan,
                            status=f"FAILED {short_error(exc, 80)}")  # fmt: skip
                continue
            current = cfg == self.base
            self.record(shape, layout=layout, config=name, us=us, rel_err=err,
                        status="current" if current else "ok")  # fmt: skip
            measured.append((us, err, name, current))
        measured.sort(key=lambda r: r[0])
        now = next((r[0] for r in measured if r[3]), float("nan"))
        print(f"   current {now:.1f} us")
        for us, err, name, _ in measured[:6]:
            print(f"   {us:7.1f} us  err {err:.1e}  {name}")
