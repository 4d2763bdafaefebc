"""Command line: ``python -m moe_route {info,demo,bench}``.

``info`` says which implementation runs on each visible device and why; ``demo`` walks the
golden 3-token example of DESIGN.md and one random routing through maps → expand → experts →
finalize and compares the result with the reference. ``bench`` runs the benchmark suite
(:mod:`moe_route.bench.suite`; ``python -m moe_route bench --help``), or with ``--sweep NAME``
one of the tuning sweeps (:mod:`moe_route.bench.sweeps`).
"""

from __future__ import annotations

import argparse
import sys

import torch

import moe_route
from moe_route import arch, reference


def cmd_info(_args) -> int:
    import platform

    try:
        import triton

        triton_version = triton.__version__
    except Exception as exc:  # pragma: no cover - depends on the install
        triton_version = f"unavailable ({exc})"
    print(f"moe_route {moe_route.__version__}")
    print(f"python {platform.python_version()}, torch {torch.__version__}, triton {triton_version}")
    print(f"TRITON_INTERPRET={'1' if arch.triton_interpreter_enabled() else '0'}")
    devices = [torch.device("cpu")]
    devices += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    for device in devices:
        print()
        for key, value in arch.describe(device).items():
            print(f"  {key:<20} {value}")
    return 0


def _print_tables(topk_ids: torch.Tensor, topk_weights: torch.Tensor, maps) -> None:
    T, K = topk_ids.shape
    s2d = maps.expanded_source_row_to_expanded_dest_row.tolist()
    d2s = maps.expanded_dest_row_to_expanded_source_row.tolist()
    e4s = maps.expert_for_source_row.tolist()
    print(f"  T={T} tokens, K={K} slots, E={maps.num_experts} experts; source row s = k*T + t")
    print("  source row s | token t | slot k | expert | weight | -> dest row")
    for s in range(T * K):
        k, t = divmod(s, T)
        e = e4s[s]
        tag = f"{e:>6}" if e >= 0 else "  drop"
        w = float(topk_weights[t, k])
        print(f"  {s:>12} | {t:>7} | {k:>6} | {tag} | {w:6.3f} | {s2d[s]:>3}")
    print("  permuted (dest) order, grouped by expert:")
    print("  dest row d | source row | token | expert")
    for d in range(T * K):
        s = d2s[d]
        e = e4s[s]
        print(f"  {d:>10} | {s:>10} | {s % T:>5} | {e if e >= 0 else 'drop':>6}")
    print(f"  expert_first_token_offset = {maps.expert_first_token_offset.tolist()}")


def _run_chain(x, w1, w2, topk_weights, topk_ids, *, activation, show: bool) -> float:
    E = w1.shape[0]
    maps = moe_route.build_routing_maps(topk_ids, E)
    if show:
        _print_tables(topk_ids, topk_weights, maps)
    offsets = maps.expert_first_token_offset
    x_perm = moe_route.expand_rows(x, maps)
    h = reference.grouped_gemm_reference(x_perm, w1, offsets, activation=activation)
    y_perm = reference.grouped_gemm_reference(h, w2, offsets)
    out = moe_route.finalize_moe_routing(y_perm, topk_weights, maps)
    ref = reference.moe_forward_reference(
        x.double(), w1.double(), w2.double(), topk_weights.double(), topk_ids, activation=activation
    )
    return (out.double() - ref).abs().max().item()


def cmd_demo(args) -> int:
    device = torch.device(args.device)
    backend = arch.backend_for(device)
    print(f"moe_route {moe_route.__version__} demo on {device}: backend {backend.value}")
    print(f"  ({backend.why}); experts run as the reference per-expert GEMMs")
    gen = torch.Generator().manual_seed(args.seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    print("\n== golden example (DESIGN.md): T=3, K=2, E=3 ==")
    ids = torch.tensor([[0, 1], [0, 2], [1, 2]], dtype=torch.int32, device=device)
    weights = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.55, 0.45]], device=device)
    H, inter, E = 8, 4, 3
    x, w1, w2 = rand(3, H), rand(E, 2 * inter, H, scale=0.3), rand(E, H, inter, scale=0.3)
    err = _run_chain(x, w1, w2, weights, ids, activation="swiglu", show=True)
    print(f"  max |moe_route - reference| = {err:.3e}")
    worst = err

    print("\n== random routing: T=11, K=3, E=5, some slots dropped ==")
    T, K, E, H, inter = 11, 3, 5, 24, 16
    logits = rand(T, E)
    weights, ids = reference.topk_routing_reference(logits, K, renormalize=True)
    drop = torch.rand(T, K, generator=gen).to(device) < 0.15
    ids = torch.where(drop, torch.full_like(ids, -1), ids)
    x, w1, w2 = rand(T, H), rand(E, 2 * inter, H, scale=0.2), rand(E, H, inter, scale=0.2)
    err = _run_chain(x, w1, w2, weights, ids, activation="swiglu", show=True)
    print(f"  max |moe_route - reference| = {err:.3e}")
    worst = max(worst, err)

    ok = worst < 1e-4
    print(f"\n{'OK' if ok else 'MISMATCH'}: largest difference to the reference {worst:.3e}")
    return 0 if ok else 1


DESCRIPTION = """\
moe_route: GPU kernels for the token path of mixture-of-experts layers
(routing maps, expand, grouped GEMMs, finalize), with a pure-PyTorch reference.
"""

EPILOG = """\
examples:
  python -m moe_route info
  python -m moe_route demo --device cpu
  python -m moe_route bench --quick
  python -m moe_route bench --list
  python -m moe_route bench --sweep gemm --quick

'python -m moe_route COMMAND --help' shows the options of one command.
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moe_route",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    sub.add_parser(
        "info",
        help="which implementation and finalize path run on each device, and why",
        description="Print the versions, then per device the backend, the finalize path and "
        "why they were chosen, and which backends are usable there.",
    )
    demo = sub.add_parser(
        "demo",
        help="the golden example and a random routing through the whole chain, checked "
        "against the reference",
        description="Walk the golden 3-token example and one random routing (some slots "
        "dropped) through maps, expand, experts and finalize, print the routing tables, and "
        "compare with the reference. Exit status 1 on a mismatch.",
    )
    demo.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="device to run on (default: cuda when available, else cpu)",
    )
    demo.add_argument("--seed", type=int, default=0, help="seed of the random case (default 0)")
    bench = sub.add_parser(
        "bench",
        help="benchmark suite: every stage against the per-expert PyTorch loop; tables, "
        "CSV/JSON, plots",
        description="Measure the copy bandwidth and matmul rate, then time every stage (and "
        "forward + backward) next to the per-expert PyTorch loop and the torch._grouped_mm "
        "pipeline. Without a GPU: a small CPU comparison. With --sweep NAME: one tuning sweep "
        "of tile configurations instead.",
    )
    from moe_route.bench.suite import add_arguments as add_bench_arguments
    from moe_route.bench.suite import run as cmd_bench

    add_bench_arguments(bench)
    args = parser.parse_args(argv)
    return {"info": cmd_info, "demo": cmd_demo, "bench": cmd_bench}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
