"""How much the row tiles' padding costs (GPU): ``fused_moe`` forward and forward + backward at
the training shapes with the routing of random logits (each expert's rows a multiple of
``BLOCK_M`` only by chance: the last m-tile of every expert is partly empty) against a balanced
routing (``T*K/E`` rows per expert, exactly), timed in alternating rounds in one process.

The GEMMs multiply ``sum_e cdiv(rows_e, BLOCK_M) * BLOCK_M`` rows; this prints that over
``T*K`` (the padding factor) for 128- and 64-row tiles next to the measured time ratio.

    PYTHONPATH=. python scripts/tile_waste.py [--shapes qwen3 deepseek] [--tokens T]
                                              [--rounds 5] [--forward]
"""

import argparse
import statistics

import torch
import triton
from step_kernels import training_case  # scripts/, first on the path when run as a script

import moe_route
from moe_route.bench.stages import TRAINING_SHAPES as SHAPES


def padding(ids: torch.Tensor, E: int, block_m: int) -> float:
    rows = torch.bincount(ids.flatten().long(), minlength=E)
    return float((rows + block_m - 1).div(block_m, rounding_mode="floor").sum() * block_m) / (
        ids.numel()
    )


def balanced_ids(T: int, K: int, E: int, device) -> torch.Tensor:
    """Slot ``(t, k)`` to expert ``(t*K + k) mod E``: ``T*K/E`` rows each when ``E`` divides
    ``T*K``, the ``K`` experts of a token distinct (``K <= E``)."""
    slots = torch.arange(T * K, device=device).view(T, K)
    return (slots % E).to(torch.int32)


def run_shape(name, tokens, rounds, forward_only):
    (T, H, inter, E, K), x, w1, w2, tw, rand_ids = training_case(name, tokens)
    dev, dt = x.device, x.dtype
    routings = {"random": rand_ids, "balanced": balanced_ids(T, K, E, dev)}
    flops = 2 * T * K * 3 * H * inter
    print(f"\n{name} T={T} H={H} I={inter} E={E} K={K}")
    for r, ids in routings.items():
        print(f"  {r:<9} padding: 128-row tiles {padding(ids, E, 128):.3f}x, "
              f"64-row {padding(ids, E, 64):.3f}x")  # fmt: skip
    leaves = [t.requires_grad_() for t in (x, w1, w2, tw)]  # no copies: deepseek's are 22 GB
    dout = torch.randn(T, H, device=dev, dtype=dt)

    def forward(ids):
        def run():
            with torch.no_grad():
                return moe_route.fused_moe(x, w1, w2, tw, ids)

        return run

    def step(ids):
        return lambda: torch.autograd.grad(moe_route.fused_moe(*leaves, ids), leaves, dout)

    cases = {(r, "forward"): forward(ids) for r, ids in routings.items()}
    if not forward_only:
        cases.update({(r, "fwd+bwd"): step(ids) for r, ids in routings.items()})
    times = {k: [] for k in cases}
    for _ in range(rounds):
        for k, fn in cases.items():
            times[k].append(triton.testing.do_bench(fn, warmup=3, rep=100, return_mode="median"))
    for what in ("forward", "fwd+bwd"):
        if ("random", what) not in times:
            continue
        rnd = statistics.median(times[("random", what)])
        bal = statistics.median(times[("balanced", what)])
        mult = 1 if what == "forward" else 3
        print(f"  {what:<8} random {rnd * 1e3:8.0f} us ({mult * flops / rnd * 1e-9:4.0f} TF/s)"
              f"  balanced {bal * 1e3:8.0f} us ({mult * flops / bal * 1e-9:4.0f} TF/s)"
              f"  random/balanced {rnd / bal:.3f}")  # fmt: skip


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="*", default=["qwen3", "deepseek"], choices=list(SHAPES))
    p.add_argument("--tokens", type=int, nargs="*", default=[None])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--forward", action="store_true", help="the inference forward only")
    args = p.parse_args()
    for name in args.shapes:
        for T in args.tokens:
            run_shape(name, T, args.rounds, args.forward)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
