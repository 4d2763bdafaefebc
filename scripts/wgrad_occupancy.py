"""Weight-gradient tiles against how many programs an SM holds at once (GPU).

``ncu`` showed the plan's tiles at deepseek-v3 T=4096 (64-row steps, 128x128 tiles, 4 warps,
4 stages, "2 programs per SM") holding one program per SM: 164 KB of shared memory each, so
the 264 programs run as two waves of one warpgroup per SM, which issues on 26 % of cycles while
the kernel reaches 67 % of the DRAM and 66 % of the L2 throughput. This times tile configs
in alternating rounds (one process, CUDA events, medians) and prints each variant's shared
memory, registers and the programs an SM holds, with the write rate of ``dW`` against a fill of
the same tensor timed in the same rounds.

    PYTHONPATH=. python scripts/wgrad_occupancy.py [--shape deepseek] [--which dw1 dw2]
                                                   [--rounds 5]
"""

import argparse
import statistics

import torch

from moe_route import build_routing_maps
from moe_route.kernels.triton import weight_grad as wg
from moe_route.kernels.triton.weight_grad import WeightGradConfig, expert_weight_grad_triton
from moe_route.moe import _plan_for
from moe_route.reference import topk_routing_reference

SHAPES = {  # T, H, I, E, K
    "mixtral": (4096, 4096, 14336, 8, 2),
    "qwen3": (8192, 2048, 768, 128, 8),
    "deepseek": (4096, 7168, 2048, 256, 8),
}
# block_r, block_n, block_k, warps, stages, programs per SM, flat
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=list(SHAPES), default="deepseek")
    ap.add_argument("--which", nargs="+", default=["dw1", "dw2"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only-plan", action="store_true", help="no other configs")
    ap.add_argument("--configs", type=int, nargs="+", help="these entries of CONFIGS only")
    ap.add_argument("--tokens", type=int, help="tokens instead of the model's training size")
    ap.add_argument("--dump", help="write the plan variant's TTGIR, PTX and cubin here, no timing")
    args = ap.parse_args()
    T, H, inter, E, K = SHAPES[args.shape]
    T = args.tokens or T
    dev, dt = "cuda", torch.bfloat16
    M = T * K
    _, ids = topk_routing_reference(torch.randn(T, E, device=dev), K)
    _, d2s, _, off = build_routing_maps(ids, E).tensors()
    w1 = torch.empty(E, 2 * inter, H, device=dev, dtype=dt)
    w2 = torch.empty(E, H, inter, device=dev, dtype=dt)
    plan = _plan_for(torch.empty(T, H, device=dev, dtype=dt), w1, w2, K, "swiglu", "concat",
                     "standalone", True, False, "auto").configs  # fmt: skip
    for which in args.which:
        if which == "dw1":  # dW1 = dz^T x_perm
            a, b, dw = torch.randn(M, 2 * inter, device=dev, dtype=dt), None, w1
            b, planned = torch.randn(M, H, device=dev, dtype=dt), plan.wgrad1
        else:  # dW2 = dout_perm^T (w h)
            a, dw = torch.randn(M, H, device=dev, dtype=dt), w2
            b, planned = torch.randn(M, inter, device=dev, dtype=dt), plan.wgrad2
        cfgs = {"plan": planned}
        chosen = [CONFIGS[i] for i in args.configs] if args.configs else CONFIGS
        for c in [] if args.only_plan else chosen:
            cfgs[str(c)] = WeightGradConfig(*c[:5], use_tma=True, persistent=c[5], flat=c[6])
        outs, fns = {}, {}
        try:  # a scratch copy of the kernel file before a change, for an A/B in one process
            from moe_route.kernels.triton import _wg_before as old_module
        except ImportError:
            old_module = None
        for name, cfg in cfgs.items():
            before = {id(v) for v in _variants()}
            expert_weight_grad_triton(a, b, off, dw, cfg, dest_to_src=d2s, num_rows=M)
            outs[name] = dw[:8].clone()
            new = [v for v in _variants() if id(v) not in before]
            fns[name] = (cfg, new[0].compiled if new else None)
        if old_module is not None:
            old_module.expert_weight_grad_triton(
                a, b, off, dw, planned, dest_to_src=d2s, num_rows=M
            )
            outs["before"] = dw[:8].clone()
            fns["before"] = (planned, None)
        ref = outs["plan"]
        if args.dump:
            compiled = fns["plan"][1]
            for ext in ("ttgir", "ptx", "cubin"):
                mode = "wb" if ext == "cubin" else "w"
                with open(f"{args.dump}/{args.shape}_{which}.{ext}", mode) as f:
                    f.write(compiled.asm[ext])
            continue
        fns["fill"] = (None, None)
        samples = {name: [] for name in fns}
        order = list(fns)
        for r in range(args.rounds):
            for name in order[r % len(order) :] + order[: r % len(order)]:
                cfg = fns[name][0]
                ev = []
                for _ in range(4):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                    s.record()
                    if cfg is None:
                        dw.fill_(1.0)
                    elif name == "before":
                        old_module.expert_weight_grad_triton(a, b, off, dw, cfg, dest_to_src=d2s,
                                                         num_rows=M)  # fmt: skip
                    else:
                        expert_weight_grad_triton(a, b, off, dw, cfg, dest_to_src=d2s,
                                                  num_rows=M)  # fmt: skip
                    e.record()
                    ev.append((s, e))
                torch.cuda.synchronize()
                samples[name] += [s.elapsed_time(e) * 1e3 for s, e in ev[1:]]
        gb = dw.numel() * dw.element_size() / 1e9
        print(f"{args.shape} T={T} {which}: dW {list(dw.shape)}, {gb:.2f} GB written")
        print(f"  plan {planned}")
        print(f"  {'config':36s} {'us':>8s} {'TB/s':>6s} {'smem KB':>8s} {'regs':>5s} "
              f"{'per SM':>6s} {'rel err':>8s}")  # fmt: skip
        for name, (cfg, compiled) in fns.items():
            us = statistics.median(samples[name])
            smem = regs = fit = None
            if compiled is not None:
                smem = compiled.metadata.shared
                regs = compiled.n_regs
                threads = cfg.num_warps * 32
                fit = min(SMEM_PER_SM // (smem + 1024), REGS_PER_SM // (regs * threads))
            err = "" if name == "fill" else f"{_rel(outs[name], ref):.1e}"
            print(f"  {name:36s} {us:8.0f} {gb / us * 1e3:6.2f} "
                  f"{'' if smem is None else smem // 1024:>8} {regs or '':>5} {fit or '':>6} "
                  f"{err:>8s}")  # fmt: skip


def _variants():
    return [run for _, runs in wg._WEIGHT_GRAD_TMA._entries.values() for run in runs.values()]


def _rel(x, y):
    return ((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-30)).item()


if __name__ == "__main__":
    main()
