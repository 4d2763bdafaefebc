"""Run a transformers model's FP8 experts (FineGrainedFP8 layout) on moe_route.

Builds a tiny random Qwen3-MoE (no download) in bfloat16, quantises its experts into
transformers' ``FP8Experts`` exactly as an FP8 checkpoint (Qwen3-MoE FP8, DeepSeek-V3) is
stored, e4m3 ``gate_up_proj`` / ``down_proj`` with a float32 ``weight_scale_inv`` per 128x128
block, runs it with ``experts_implementation="moe_route"`` (one ``fused_moe(...,
quant="fp8")`` call per layer, on the module's own tensors) and prints how far its logits are
from the bf16 model's experts'::

    python examples/fp8_experts.py                  # CPU: moe_route's torch backend
    python examples/fp8_experts.py --device cuda    # the Triton FP8 kernels

transformers' own FP8 implementations need CUDA kernels from the Hugging Face hub; moe_route's
run on the CPU too. The check, per experts module on the inputs its bf16 twin received: the FP8
output stays within ``2^-3`` of the bf16 output's scale (e4m3 rounds each weight and each
token by at most ``2^-4`` of itself; both are quantised). Exits non-zero otherwise. The
logits' next-token agreement is printed too (a whole model's router may flip a near-tie once
anything upstream rounds differently).
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch

from moe_route.integrations import hf as moe_hf


def build_model(device, dtype):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, intermediate_size=512, moe_intermediate_size=128,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    with torch.no_grad():  # widen the small init so that the experts matter in the logits
        for name, p in model.named_parameters():
            if "experts" in name:
                p.normal_(0.0, 0.06)
    return model.to(device, dtype).eval()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default="auto", help="moe_route backend: auto, triton, torch")
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args(argv)

    name = moe_hf.register("moe_route_fp8_example", backend=args.backend)
    model = build_model(args.device, torch.bfloat16)
    fp8 = moe_hf.to_fp8_experts(copy.deepcopy(model), "fp8")
    print(moe_hf.describe(fp8, name))
    fp8.set_experts_implementation(name)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=g)
    ids = ids.to(args.device)

    # Each experts module on the inputs its bf16 twin received (the same routing for both: a
    # whole model's router may flip a near-tie once anything upstream rounds differently).
    seen = {}

    def keep(module, inputs, output):
        seen[module] = (inputs, output)

    hooks = [m.register_forward_hook(keep) for n, m in model.named_modules()
             if n.endswith(".experts")]  # fmt: skip
    with torch.no_grad():
        ref_logits = model(ids).logits.float()
        out_logits = fp8(ids).logits.float()
        err = scale = 0.0
        pairs = zip(
            (m for n, m in model.named_modules() if n.endswith(".experts")),
            (m for n, m in fp8.named_modules() if n.endswith(".experts")),
            strict=True,
        )
        for bf16, fp8_experts in pairs:
            inputs, want = seen[bf16]
            got = fp8_experts(*inputs).float()
            err = max(err, (got - want.float()).abs().max().item())
            scale = max(scale, want.float().abs().max().item())
    for h in hooks:
        h.remove()
    agree = (out_logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    print(f"max |moe_route fp8 - bf16| over the experts' outputs = {err:.4f} (their scale "
          f"{scale:.3f}: {err / scale:.2%}); next-token agreement {agree:.0%}")  # fmt: skip
    if not err <= 2.0**-3 * scale:
        print("FAIL: beyond e4m3's error of weights and tokens")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
