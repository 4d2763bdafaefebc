"""A tuning-table change on and off, in one process (GPU). For each training shape:
``fused_moe`` forward without grad, and forward + backward (``torch.autograd.grad`` of x, w1,
w2 and the router weights), each timed with CUDA events in turns between the two tables over
``--rounds`` rounds (median; the order flips every round), and the outputs' bitwise equality
(``False`` is expected where the change rounds differently, e.g. a fused against a split step).

Changes (``--change``):

- ``refinements``: GEMM1 storing z on 4 stages and the TMA-stored GEMM2 / dX
  (``moe_route.tuning.gemm_config``), against the same tables without them;
- ``dgemm2-store``: the split activation backward's plain GEMM (``g = dout @ W2[e]``) storing
  through TMA where its reduction allows (``act_backward_config(kd=H)``), against pointer
  stores;
- ``expert-groups-A-B``: the persistent GEMMs' expert groups of at most A m-tiles against at
  most B;
- ``wgrad-wide``: the weight gradients' 128x256 tiles on 8 warps above 64 up to 128
  rows per expert (``moe_route.tuning.weight_grad_config``), against 128x128 on 4 warps.

    PYTHONPATH=. python scripts/tuning_ab.py [--change refinements] [--shapes qwen3 mixtral
                                             deepseek] [--rounds 7] [--tokens T] [--forward-only]
"""

import argparse
import dataclasses
import statistics

import torch

import moe_route
from moe_route import tuning
from moe_route.bench.harness import time_cuda
from moe_route.bench.shapes import TRAINING_SHAPES as SHAPES
from moe_route.reference import topk_routing_reference

_TABLE = tuning.gemm_config
_ACT_BWD = tuning.act_backward_config
_WGRAD = tuning.weight_grad_config


def without_refinements(rows_per_expert, gated, dtype, cc, kd=None, store_z=False):
    """The table as it was: no 4-stage GEMM1 for z, no TMA stores."""
    return _TABLE(rows_per_expert, gated, dtype, cc)  # no kd: no TMA store; no store_z: 3 stages


def act_backward_without_kd(rows_per_expert, dtype, cc, kd=None):
    """Step 1's configs as if its reduction were unknown: no TMA store for the plain GEMM."""
    return _ACT_BWD(rows_per_expert, dtype, cc)


def expert_groups_of(size):
    """The table with expert groups of at most ``size`` m-tiles."""

    def table(rows_per_expert, gated, dtype, cc, kd=None, store_z=False):
        cfg = _TABLE(rows_per_expert, gated, dtype, cc, kd, store_z)
        return dataclasses.replace(cfg, group_m=size) if cfg.persistent else cfg

    return table


def wgrad_narrow(rows_per_expert, n, kd, dtype, cc):
    """The weight-gradient table with its 64-row tiles (128x128 on 4 warps) up to 128 rows per
    expert."""
    if 64 < rows_per_expert <= 128:
        return _WGRAD(64.0, n, kd, dtype, cc)
    return _WGRAD(rows_per_expert, n, kd, dtype, cc)


#: change -> (attribute of moe_route.tuning, before, after)
CHANGES = {
    "expert-groups-8-16": ("gemm_config", expert_groups_of(8), expert_groups_of(16)),
    "expert-groups-16-32": ("gemm_config", expert_groups_of(16), expert_groups_of(32)),
    "expert-groups-16-64": ("gemm_config", expert_groups_of(16), expert_groups_of(64)),
    "refinements": ("gemm_config", without_refinements, _TABLE),
    "dgemm2-store": ("act_backward_config", act_backward_without_kd, _ACT_BWD),
    "wgrad-wide": ("weight_grad_config", wgrad_narrow, _WGRAD),
}


def use(attr, fn):
    setattr(tuning, attr, fn)
    moe_route.plan.clear_plans()


def passes(shape, T):
    """``[(label, fn)]``: the forward without grad and forward + backward at ``shape``."""
    H, inter, E, K = shape.H, shape.I, shape.E, shape.K
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    w1 = torch.randn(E, 2 * inter, H, device="cuda", dtype=torch.bfloat16, generator=g)
    w2 = torch.randn(E, H, inter, device="cuda", dtype=torch.bfloat16, generator=g)
    w1.mul_(H**-0.5)
    w2.mul_(inter**-0.5)
    tw, ids = topk_routing_reference(torch.randn(T, E, device="cuda", generator=g), K,
                                     renormalize=True)  # fmt: skip
    leaves = [t.requires_grad_() for t in (x, w1, w2, tw)]
    dout = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)

    def forward():
        with torch.no_grad():
            return (moe_route.fused_moe(x, w1, w2, tw, ids),)

    def step():
        out = moe_route.fused_moe(x, w1, w2, tw, ids)
        return torch.autograd.grad(out, leaves, dout)

    return [("forward", forward), ("fwd+bwd", step)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--change", choices=list(CHANGES), default="refinements")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, help="T instead of each shape's training size")
    ap.add_argument("--forward-only", action="store_true")
    args = ap.parse_args()
    attr, before_fn, after_fn = CHANGES[args.change]
    tables = (("before", before_fn), ("after", after_fn))
    print(f"{'shape':<26}{'pass':<10}{'before us':>11}{'after us':>11}{'x':>7}  bitwise")
    for name in args.shapes:
        shape = SHAPES[name]
        T = args.tokens or shape.T
        chosen = passes(shape, T)[: 1 if args.forward_only else 2]
        for label, fn in chosen:
            use(attr, before_fn)
            first = [t.cpu() for t in fn()]  # off the GPU: deepseek-v3's gradients are 22 GB
            use(attr, after_fn)
            same = all(torch.equal(p, q.cpu()) for p, q in zip(first, fn(), strict=True))
            del first
            times = {key: [] for key, _ in tables}
            # in turns, the order flipped every round (ABBA): under sustained load the clocks
            # sag, and whichever runs second in every round would pay for it
            for r in range(args.rounds):
                for key, table in tables if r % 2 == 0 else tables[::-1]:
                    use(attr, table)
                    times[key].append(time_cuda(fn, use_graph=False, inner=1, outer=3).median_s)
            before, after = (statistics.median(times[k]) * 1e6 for k in ("before", "after"))
            print(f"{shape.model + ' T=' + str(T):<26}{label:<10}{before:>11.0f}{after:>11.0f}"
                  f"{before / after:>7.3f}  {same}")  # fmt: skip
        del chosen
        torch.cuda.empty_cache()
    use(attr, after_fn)


if __name__ == "__main__":
    main()
