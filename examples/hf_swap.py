"""Swap a Hugging Face transformers MoE model's experts to moe_route, check, and time it.

Builds a random-config Mixtral or Qwen3-MoE model (no download), registers moe_route as a
transformers experts implementation (:mod:`moe_route.integrations.hf`), and runs the same
weights and tokens with ``experts_implementation`` = ``"eager"`` (the per-expert loop),
``"grouped_mm"`` (transformers' ``torch._grouped_mm`` path) and ``"moe_route"``: it prints how
each experts module maps onto moe_route, how far each implementation's logits are from
``"eager"``, and the median forward time of each.

    python examples/hf_swap.py                        # tiny Mixtral, float32 on CPU
    python examples/hf_swap.py --family qwen3_moe --size small --device cuda --dtype bfloat16

The swap itself is two lines::

    moe_route.integrations.hf.register()
    model.set_experts_implementation("moe_route")  # or at from_pretrained()

Logits agree to float32 rounding in float32. In bf16 a rounding difference can flip a near-tie
in a later layer's router, so a few tokens may then take another expert: the script reports the
agreement of the next-token predictions there, and checks logits only in float32.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

IMPLEMENTATIONS = ("eager", "grouped_mm", "moe_route")

# (hidden, intermediate per expert, experts, top-k, layers, heads)
SIZES = {"tiny": (64, 96, 8, 2, 2, 4), "small": (1024, 2048, 16, 4, 4, 16)}


def build_model(family: str, size: str):
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    hidden, inter, experts, top_k, layers, heads = SIZES[size]
    common = dict(
        vocab_size=1024, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4), head_dim=hidden // heads,
        max_position_embeddings=4096,
    )  # fmt: skip
    if family == "mixtral":
        config = MixtralConfig(
            intermediate_size=inter, num_local_experts=experts, num_experts_per_tok=top_k,
            **common,
        )  # fmt: skip
    else:
        config = Qwen3MoeConfig(
            intermediate_size=4 * hidden, moe_intermediate_size=inter, num_experts=experts,
            num_experts_per_tok=top_k, norm_topk_prob=True, decoder_sparse_step=1, **common,
        )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, experts_implementation="eager").eval()


def time_forward(model, ids, device, warmup, iters):
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        model(ids)
    sync()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        model(ids)
        sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=("mixtral", "qwen3_moe"), default="mixtral")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16, float16")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--backend", default="auto", help="moe_route backend: auto, triton, reference")
    args = p.parse_args(argv)

    import moe_route
    import moe_route.integrations.hf as moe_hf

    moe_hf.register(backend=args.backend)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = build_model(args.family, args.size).to(device, dtype)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=device)
    print(f"{args.family} ({args.size}, random weights) on {device}, {dtype}; "
          f"{args.batch}x{args.seq} tokens; moe_route backend "
          f"{moe_route.arch.backend_for(device, args.backend).value}")  # fmt: skip
    for name, how in moe_hf.describe(model).items():
        print(f"  {name}: {how}")

    logits, times = {}, {}
    with torch.inference_mode():
        for impl in IMPLEMENTATIONS:
            model.set_experts_implementation(impl)
            logits[impl] = model(ids).logits.float()
            times[impl] = time_forward(model, ids, device, args.warmup, args.iters)

    ref = logits["eager"]
    scale = ref.abs().max().item()
    print(f"\n{'experts_implementation':<24}{'forward ms':>12}{'vs eager':>10}"
          f"{'max |logits - eager|':>24}{'same next token':>18}")  # fmt: skip
    for impl in IMPLEMENTATIONS:
        diff = (logits[impl] - ref).abs().max().item()
        same = (logits[impl].argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"{impl:<24}{times[impl] * 1e3:>12.2f}{times['eager'] / times[impl]:>9.2f}x"
              f"{diff:>24.2e}{same:>17.0%}")  # fmt: skip

    if dtype != torch.float32:
        return 0
    # float32: the three implementations differ only in summation order.
    tol = 1e-4 * max(scale, 1.0)
    bad = [i for i in IMPLEMENTATIONS if (logits[i] - ref).abs().max().item() > tol]
    print(f"\n{'OK' if not bad else 'MISMATCH ' + ', '.join(bad)}: logits agree within {tol:.1e}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
