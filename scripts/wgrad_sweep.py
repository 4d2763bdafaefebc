"""Weight-gradient kernel sweep (GPU): dW1 = dz^T x_perm and dW2 = dout_perm^T (w h) at the
training shapes, the pointer kernel reading token rows through the maps (the old route) and
the TMA kernel on permuted rows over a few tile configurations, against ``torch._grouped_mm``
computing the same per-expert products and a dense ``mm`` of the same FLOPs, all in this
process. Relative error of every variant against the first.

    PYTHONPATH=. python scripts/wgrad_sweep.py [--shapes mixtral qwen3 deepseek] [--quick]
                                               [--tokens T] [--extra] [--candidates]

``--pointer`` adds the pointer kernel at larger tiles (``POINTER_WIDE``), on the permuted rows
and gathering the token rows through the maps, beside the TMA kernel (which needs them
permuted: an expand, timed here too).

``--tokens`` replaces each model's training size (e.g. 256: 16 rows per expert at qwen3 and
deepseek, where the plan takes the pointer kernel; a few pointer tilings are swept there too).
"""

import argparse
import dataclasses

import torch
import triton

from moe_route import build_routing_maps
from moe_route.bench.harness import Ceilings
from moe_route.bench.shapes import TRAINING_SHAPES as SHAPES
from moe_route.bench.shapes import model_shape
from moe_route.kernels.triton.weight_grad import WeightGradConfig, expert_weight_grad_triton
from moe_route.reference import topk_routing_reference
from moe_route.tuning import weight_grad_config

# block_r, block_n, block_k, warps, stages, persistent programs per SM, flat loop
TMA_CONFIGS = [
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
]
# --extra: more programs per SM and shorter row steps (less padding of short reductions: an
# expert's last step computes zeros past its rows), for deepseek-v3's 128 rows per expert
EXTRA_TMA_CONFIGS = [
    (32, 128, 128, 4, 3, 2, True),
    (32, 128, 128, 4, 2, 3, True),
    (64, 128, 128, 4, 2, 3, True),
    (16, 128, 128, 4, 4, 2, True),
    (16, 128, 128, 4, 3, 3, True),
    (32, 256, 128, 8, 4, 1, True),
]
# --candidates: only these, each in both tile orders
CANDIDATES = [(64, 128, 256, 8, 3, 1, True), (64, 256, 128, 8, 3, 1, True),
              (32, 256, 128, 8, 4, 1, True)]  # fmt: skip
# block_r, block_n, block_k, warps, stages: the pointer kernel (permuted rows, no gather)
POINTER_CONFIGS = [
    (32, 128, 128, 4, 4),
    (16, 128, 128, 4, 4),
    (32, 128, 64, 4, 4),
    (32, 64, 128, 4, 4),
    (64, 128, 128, 8, 3),
]
# --pointer: the pointer kernel at the TMA kernel's tile sizes
POINTER_WIDE = [
    (64, 128, 256, 8, 3),
    (32, 128, 256, 8, 4),
    (64, 256, 128, 8, 3),
    (32, 128, 128, 4, 4),
    (64, 128, 128, 4, 3),
]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--quick", action="store_true", help="only the plan's configuration")
    ap.add_argument("--tokens", type=int, help="tokens instead of each model's training size")
    ap.add_argument("--extra", action="store_true", help="also EXTRA_TMA_CONFIGS")
    ap.add_argument("--candidates", action="store_true", help="only CANDIDATES, both orders")
    ap.add_argument("--pointer", action="store_true", help="the pointer kernel, POINTER_WIDE")
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    cc = torch.cuda.get_device_capability()
    cc = cc[0] * 10 + cc[1]
    configs = [] if args.quick else TMA_CONFIGS + (EXTRA_TMA_CONFIGS if args.extra else [])
    if args.candidates:
        configs = CANDIDATES
    ceilings = Ceilings.measure(dev)
    dense, copy = ceilings.mm_flops_per_s, ceilings.copy_bytes_per_s
    print(f"{torch.cuda.get_device_name()}: dense bf16 mm {dense / 1e12:.0f} TFLOP/s, "
          f"copy {copy / 1e12:.2f} TB/s")  # fmt: skip
    for name in args.shapes:
        s = SHAPES[name] if args.tokens is None else model_shape(SHAPES[name].model, args.tokens)
        T, H, inter, E, K = s.T, s.H, s.I, s.E, s.K
        M = T * K
        _, ids = topk_routing_reference(torch.randn(T, E, device=dev), K)
        maps = build_routing_maps(ids, E)
        _, d2s, _, off = maps.tensors()
        x = torch.randn(T, H, device=dev, dtype=dt)
        dout = torch.randn(T, H, device=dev, dtype=dt)
        x_perm = x[d2s % T]
        dout_perm = dout[d2s % T]
        dz = torch.randn(M, 2 * inter, device=dev, dtype=dt)
        wh = torch.randn(M, inter, device=dev, dtype=dt)
        rpe = M / E
        for which, (a, b, tok, gather_a) in {
            "dW1": (dz, x_perm, x, False),
            "dW2": (dout_perm, wh, dout, True),
        }.items():
            N, KD = a.shape[1], b.shape[1]
            flops = 2 * M * N * KD
            # the roofline: the larger of the MMA time and the bytes (operands in, dW out)
            nbytes = (M * (N + KD) + E * N * KD) * a.element_size()
            roof = max(flops / dense, nbytes / copy)
            dw = torch.empty(E, N, KD, device=dev, dtype=dt)
            results = []
            plan_cfg = weight_grad_config(rpe, N, KD, dt, cc)
            old = dataclasses.replace(plan_cfg, use_tma=False, persistent=0)

            def run_old(old=old, a=a, b=b, tok=tok, gather_a=gather_a, dw=dw, off=off, d2s=d2s,
                        M=M):  # fmt: skip
                if gather_a:
                    expert_weight_grad_triton(tok, b, off, dw, old, dest_to_src=d2s,
                                              a_gather=True, num_rows=M)  # fmt: skip
                else:
                    expert_weight_grad_triton(a, tok, off, dw, old, dest_to_src=d2s,
                                              b_gather=True, num_rows=M)  # fmt: skip

            run_old()
            ref = dw[:8].clone()  # errors over the first 8 experts (deepseek's dW is 15 GB)
            results.append((f"pointer+gather {old.block_r}x{old.block_n}x{old.block_k}",
                            bench(run_old), 0.0))  # fmt: skip
            offs = off[1:].to(torch.int32)
            try:
                gm = torch._grouped_mm(a.t(), b, offs=offs)[:8].clone()
                results.append(("torch._grouped_mm", bench(lambda a=a, b=b, offs=offs: (
                    torch._grouped_mm(a.t(), b, offs=offs))), rel(gm, ref)))  # fmt: skip
            except Exception as exc:
                print(f"  _grouped_mm failed: {type(exc).__name__}: {exc}")
            variants = [plan_cfg, dataclasses.replace(plan_cfg, k_fastest=not plan_cfg.k_fastest)]
            variants += [WeightGradConfig(*c[:5], True, c[5], flat=c[6]) for c in configs]
            if args.candidates:
                variants += [dataclasses.replace(v, k_fastest=False) for v in variants[2:]]
            if rpe <= 16 and not args.quick:
                variants += [WeightGradConfig(*c) for c in POINTER_CONFIGS]
            if args.pointer:
                variants += [WeightGradConfig(*c) for c in POINTER_WIDE]
                rows, idx = (x_perm if which == "dW1" else dout_perm), (d2s % T).long()
                expand = lambda tok=tok, idx=idx, rows=rows: torch.index_select(
                    tok, 0, idx, out=rows
                )
                results.append(
                    ("expand (index_select of the TMA kernel's rows)", bench(expand), 0.0)
                )
                for c in POINTER_WIDE:
                    cfg = WeightGradConfig(*c)

                    def gathered(c=cfg, a=a, b=b, tok=tok, gather_a=gather_a, dw=dw, off=off,
                                 d2s=d2s, M=M):  # fmt: skip
                        if gather_a:
                            expert_weight_grad_triton(tok, b, off, dw, c, dest_to_src=d2s,
                                                      a_gather=True, num_rows=M)  # fmt: skip
                        else:
                            expert_weight_grad_triton(a, tok, off, dw, c, dest_to_src=d2s,
                                                      b_gather=True, num_rows=M)  # fmt: skip

                    dw.fill_(float("nan"))
                    gathered()
                    results.append((f"pointer+gather {c[0]}x{c[1]}x{c[2]} w{c[3]} s{c[4]}",
                                    bench(gathered), rel(dw[:8], ref)))  # fmt: skip
            for c in variants:
                try:
                    dw.fill_(float("nan"))

                    def run(c=c, a=a, b=b, dw=dw, off=off, d2s=d2s, M=M):
                        expert_weight_grad_triton(a, b, off, dw, c, dest_to_src=d2s, num_rows=M)

                    run()
                    err = rel(dw[:8], ref)
                    order = "along Kd" if c.k_fastest else "along N"
                    kind = "tma" if c.use_tma else "pointer"
                    label = (f"{kind} {c.block_r}x{c.block_n}x{c.block_k} w{c.num_warps} "
                             f"s{c.num_stages} p{c.persistent} {order}"
                             f"{' flat' if c.flat else ''}")  # fmt: skip
                    if c == plan_cfg:
                        label = "plan: " + label
                    results.append((label, bench(run), err))
                except Exception as exc:
                    print(f"  {c}: {type(exc).__name__}: {str(exc)[:200]}")
            bound = "MMA" if flops / dense > nbytes / copy else "bytes"
            print(f"{name} T={T} {which} [{E}x{N}x{KD}] over {M} rows "
                  f"(roofline {roof * 1e6:.0f} us, {bound}):")  # fmt: skip
            for label, t, err in results:
                print(f"  {label:45s} {t * 1e6:9.1f} us {flops / t / 1e12:6.0f} TFLOP/s "
                      f"{flops / t / dense:5.0%} of dense {roof / t:5.0%} of roof  "
                      f"rel err {err:.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
