"""Weight-gradient tiles against how many programs an SM holds at once, and against what they
do to L2 (GPU). This times tile configs in turns (one process, eager launches,
:func:`moe_route.bench.harness.time_interleaved`: rounds in a rotating order, medians) and
prints each variant's shared memory, registers and the programs an SM holds, with the write
rate of ``dW`` against a fill of the same tensor timed in the same rounds (the write bound of
these kernels at few rows per expert, where ``dW`` is larger than everything they read).

    PYTHONPATH=. python scripts/wgrad_occupancy.py [--shape deepseek] [--tokens T]
        [--which dw1 dw2] [--rounds 5] [--balanced | --skew 0.2]
        [--only-plan | --configs [0 2 ...] --extra 64,128,128,4,4,1,1,0 ...] [--module NAME]
    PYTHONPATH=. python scripts/wgrad_occupancy.py --dump DIR   # the plan's TTGIR, PTX, cubin
    ncu --clock-control none --kernel-name regex:"weight_grad" --launch-skip 1 \
        --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --metrics dram__bytes_read.sum python scripts/wgrad_occupancy.py --ncu --which dw1

``--ncu``: two launches of the plan's kernel (and two fills), nothing else. Keep
``--clock-control none``: at ncu's default (base clock) the TMA-stored 17-128-row tiles read 0.96 GB
from DRAM at deepseek-v3 T=3000 and 6.1 GB at the boost clock (their dirty ``dW`` lines
crowding the operands out of L2), and the timing runs at the boost clock (see the tuning
NOTE of :func:`moe_route.tuning.weight_grad_config`). ``--extra``: configs as the CONFIGS
tuples; ``--module``: time them with the launcher of a scratch copy of ``weight_grad.py`` in
``moe_route/kernels/triton/`` (a kernel variant). A/B against the kernel before a change: copy
the old ``weight_grad.py`` to ``moe_route/kernels/triton/_wg_before.py`` (scratch, not
committed); its launcher is then timed with the plan's tiles as ``before``. ``--balanced`` /
``--skew``: routing with equal rows per expert / uneven rows (the default is uniform random).
"""

import argparse
import importlib
from dataclasses import replace

import torch

from moe_route import build_routing_maps
from moe_route.bench.harness import time_interleaved
from moe_route.bench.stages import TRAINING_SHAPES, Inputs, model_shape
from moe_route.kernels.triton import weight_grad as wg
from moe_route.kernels.triton.weight_grad import WeightGradConfig
from moe_route.moe import _plan_for

# block_r, block_n, block_k, warps, stages, programs per SM, flat[, tma_store (default 1)]
CONFIGS = [
    (64, 128, 128, 4, 2, 2, True),
    (32, 128, 128, 4, 4, 2, True),
    (32, 128, 128, 4, 3, 2, True),
    (64, 128, 128, 8, 2, 2, True),
    (64, 128, 64, 4, 3, 2, True),
    (64, 128, 64, 4, 2, 3, True),
    (64, 128, 256, 8, 3, 1, True),
]
SMEM_PER_SM = 228 * 1024
REGS_PER_SM = 65536


def operands(shape, which, balanced=False, skew=0.0, dev="cuda", dt=torch.bfloat16):
    """``(a, b, dw, offsets, dest_to_src, planned config)`` of dW1 (``dz^T x_perm``) or dW2
    (``dout_perm^T (w h)``) at ``shape``, random operands and routing (``balanced``: token
    ``t``'s experts ``t*K .. t*K + K-1`` mod ``E``, so every expert gets the same rows, to
    within one; ``skew``: the bench's uneven routing, :attr:`moe_route.bench.stages.Shape.skew`)."""
    T, H, inter, E, K = shape.T, shape.H, shape.I, shape.E, shape.K
    M = T * K
    if balanced:
        ids = (torch.arange(M, device=dev) % E).view(T, K)
    else:
        ids = Inputs(replace(shape, skew=skew), torch.device(dev), dt).topk_ids
    _, d2s, _, off = build_routing_maps(ids, E).tensors()
    w1 = torch.empty(E, 2 * inter, H, device=dev, dtype=dt)
    w2 = torch.empty(E, H, inter, device=dev, dtype=dt)
    plan = _plan_for(torch.empty(T, H, device=dev, dtype=dt), w1, w2, K, "swiglu", "concat",
                     "standalone", True, False, "auto").configs  # fmt: skip
    if which == "dw1":
        a, b = torch.randn(M, 2 * inter, device=dev, dtype=dt), torch.randn(M, H, device=dev,
                                                                             dtype=dt)  # fmt: skip
        return a, b, w1, off, d2s, plan.wgrad1
    a, b = torch.randn(M, H, device=dev, dtype=dt), torch.randn(M, inter, device=dev, dtype=dt)
    return a, b, w2, off, d2s, plan.wgrad2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=list(TRAINING_SHAPES), default="deepseek")
    ap.add_argument("--tokens", type=int, help="tokens instead of the model's training size")
    ap.add_argument("--which", nargs="+", default=["dw1", "dw2"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--balanced",
        action="store_true",
        help="every expert the same rows (T*K/E) instead of random routing",
    )
    ap.add_argument(
        "--skew",
        type=float,
        default=0.0,
        help="std of a per-expert offset of the router logits (uneven experts)",
    )
    ap.add_argument("--only-plan", action="store_true", help="no other configs")
    ap.add_argument("--configs", type=int, nargs="*", help="these entries of CONFIGS only")
    ap.add_argument(
        "--extra",
        nargs="+",
        default=[],
        metavar="R,N,K,WARPS,STAGES,PER_SM,FLAT[,TMA_STORE]",
        help="more configs, written as the CONFIGS tuples (FLAT, TMA_STORE: 0 or 1)",
    )
    ap.add_argument("--dump", help="write the plan variant's TTGIR, PTX and cubin here, no timing")
    ap.add_argument("--ncu", action="store_true", help="two launches of the plan's kernel only")
    ap.add_argument("--module", help="time the --configs / --extra tiles with the launcher of "
                    "this (scratch) module of moe_route/kernels/triton instead")  # fmt: skip
    args = ap.parse_args()
    other = wg
    if args.module:
        other = importlib.import_module(f"moe_route.kernels.triton.{args.module}")
    shape = TRAINING_SHAPES[args.shape]
    if args.tokens:
        shape = model_shape(shape.model, args.tokens)
    try:  # a scratch copy of the kernel file before a change (see the module doc)
        from moe_route.kernels.triton import _wg_before as old_module
    except ImportError:
        old_module = None
    for which in args.which:
        a, b, dw, off, d2s, planned = operands(shape, which, args.balanced, args.skew)
        M = a.shape[0]

        def launch(cfg, module=wg, a=a, b=b, dw=dw, off=off, d2s=d2s, M=M):
            module.expert_weight_grad_triton(a, b, off, dw, cfg, dest_to_src=d2s, num_rows=M)

        if args.ncu:
            for _ in range(2):
                dw.fill_(1.0)
                launch(planned)
            torch.cuda.synchronize()
            continue
        cfgs = {"plan": planned}
        chosen = [CONFIGS[i] for i in args.configs] if args.configs is not None else CONFIGS
        chosen = chosen + [tuple(int(v) for v in e.split(",")) for e in args.extra]
        for c in [] if args.only_plan else chosen:
            cfgs[str(c)] = WeightGradConfig(
                *c[:5],
                use_tma=True,
                persistent=c[5],
                flat=bool(c[6]),
                tma_store=bool(c[7]) if len(c) > 7 else True,
            )
        outs, entries = {}, {}
        for name, cfg in cfgs.items():
            module = wg if name == "plan" else other
            seen = {id(v) for v in _variants(module)}
            launch(cfg, module)
            outs[name] = dw[:8].clone()
            new = [v for v in _variants(module) if id(v) not in seen]
            entries[name] = (lambda cfg=cfg, m=module: launch(cfg, m),
                             new[0].compiled if new else None, cfg)  # fmt: skip
        if args.dump:
            compiled = entries["plan"][1]
            for ext in ("ttgir", "ptx", "cubin"):
                with open(f"{args.dump}/{args.shape}_{which}.{ext}",
                          "wb" if ext == "cubin" else "w") as f:  # fmt: skip
                    f.write(compiled.asm[ext])
            continue
        if old_module is not None:
            launch(planned, old_module)
            outs["before"] = dw[:8].clone()
            entries["before"] = (lambda c=planned: launch(c, old_module), None, planned)
        entries["fill"] = (lambda dw=dw: dw.fill_(1.0), None, None)
        timed = time_interleaved({name: e[0] for name, e in entries.items()}, "cuda",
                                 use_graph=False, rounds=args.rounds)  # fmt: skip
        gb = dw.numel() * dw.element_size() / 1e9
        routing = " balanced" if args.balanced else f" skew {args.skew}" if args.skew else ""
        print(f"{args.shape} T={shape.T}{routing} {which}: dW {list(dw.shape)}, {gb:.2f} GB")
        print(f"  plan {planned}")
        print(f"  {'config':36s} {'us':>8s} {'TB/s':>6s} {'smem KB':>8s} {'regs':>5s} "
              f"{'per SM':>6s} {'rel err':>8s}")  # fmt: skip
        for name, (_, compiled, cfg) in entries.items():
            us = timed[name][0].median_s * 1e6
            smem = regs = fit = None
            if compiled is not None:
                smem, regs = compiled.metadata.shared, compiled.n_regs
                threads = cfg.num_warps * 32
                fit = min(SMEM_PER_SM // (smem + 1024), REGS_PER_SM // (regs * threads))
            err = "" if name == "fill" else f"{_rel(outs[name], outs['plan']):.1e}"
            print(f"  {name:36s} {us:8.0f} {gb / us * 1e3:6.2f} "
                  f"{'' if smem is None else smem // 1024:>8} {regs or '':>5} {fit or '':>6} "
                  f"{err:>8s}")  # fmt: skip


def _variants(module):
    table = module._WEIGHT_GRAD_TMA._entries.values()
    return [run for _, runs in table for run in runs.values()]


def _rel(x, y):
    return ((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-30)).item()


if __name__ == "__main__":
    main()
