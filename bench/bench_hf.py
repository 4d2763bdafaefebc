"""A real client: a transformers Qwen3-MoE model (4 decoder layers at Qwen3-30B-A3B's MoE sizes,
random weights, bf16) run eagerly with each experts implementation: prefill of 2048 tokens and
decode steps with a KV cache. CUDA only.

    python bench/bench_hf.py [--layers 4] [--prefill 2048] [--decode 32] [--rounds 3]
                             [--impls eager grouped_mm moe_route] [--quant fp8]

``--quant fp8`` (or ``fp8_ue8m0``): the same model with its experts quantised into
transformers' ``FP8Experts`` (:func:`moe_route.integrations.hf.to_fp8_experts`, the layout of
an FP8 checkpoint), timed with the implementations of transformers' FP8 table (default
``batched_mm grouped_mm moe_route``). transformers' own FP8 functions load their kernels from
the Hugging Face hub; where one cannot run, the table says why and goes on without it.

Times are CUDA-event medians over repeats after warm-up (prefill: whole forward; decode: one
token per step with the cache, averaged over the steps), same model, same inputs, same
process; the implementations take turns for ``--rounds`` rounds and each figure is the median
over the rounds; the table gives each implementation's time and its speed relative to
``grouped_mm``.
"""

from __future__ import annotations

import argparse
import statistics

import torch


def build(layers: int, vocab: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=8192,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()


def time_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--impls", nargs="+", default=None,
                   help="default: eager grouped_mm moe_route (bf16), batched_mm grouped_mm "
                        "moe_route (--quant)")  # fmt: skip
    p.add_argument("--quant", default=None, help="quantise the experts: fp8, fp8_ue8m0")
    args = p.parse_args(argv)
    impls = args.impls or (
        ["batched_mm", "grouped_mm", "moe_route"] if args.quant else
        ["eager", "grouped_mm", "moe_route"]
    )  # fmt: skip

    import moe_route.integrations.hf as moe_hf

    moe_hf.register()
    model = build(args.layers, vocab=1024)
    if args.quant:
        model = moe_hf.to_fp8_experts(model, args.quant)
    g = torch.Generator(device="cuda").manual_seed(1)
    prompt = torch.randint(0, 1024, (1, args.prefill), device="cuda", generator=g)

    def prefill():
        return model(prompt, use_cache=True)

    def decode(out):
        cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(args.decode):
            step = model(tok, past_key_values=cache, use_cache=True)
            cache, tok = step.past_key_values, step.logits[:, -1:].argmax(-1)

    def measure(impl: str, warm: bool) -> tuple[float, float]:
        model.set_experts_implementation(impl)
        if warm:  # compiles
            for _ in range(2):
                decode(prefill())
        prefill_ms = time_ms(prefill, args.repeats)
        both_ms = time_ms(lambda: decode(prefill()), max(2, args.repeats // 3))
        return prefill_ms, (both_ms - prefill_ms) / args.decode

    # The implementations take turns, round after round, so that a drift of the machine (clocks,
    # other processes) spreads over all of them; each figure is the median over the rounds.
    runs: dict[str, list[tuple[float, float]]] = {impl: [] for impl in impls}
    with torch.no_grad():
        for r in range(args.rounds):
            for impl in list(runs):
                try:
                    runs[impl].append(measure(impl, warm=r == 0))
                except Exception as exc:  # e.g. transformers' FP8 kernels are not on this host
                    print(f"{impl:12} skipped: {type(exc).__name__}: {str(exc)[:160]}")
                    del runs[impl]
    rows = {}
    for impl, got in runs.items():
        pf, dc = (statistics.median(v) for v in zip(*got, strict=True))
        rows[impl] = (pf, dc)
        spread = max(g[0] for g in got) / min(g[0] for g in got)
        print(f"{impl:12} prefill {pf:8.2f} ms (max/min {spread:4.2f})   "
              f"decode {dc * 1e3:8.1f} us/token")  # fmt: skip
    base = rows.get("grouped_mm")
    if base:
        print("\nrelative to grouped_mm (higher is faster):")
        for impl, (pf, dc) in rows.items():
            print(f"{impl:12} prefill {base[0] / pf:5.2f}x   decode {base[1] / dc:5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
