"""Swap a Hugging Face transformers MoE model's experts to moe_route, check, and time it.

Builds a random-config Mixtral, Qwen3-MoE or gpt-oss model (no download), registers moe_route as
a transformers experts implementation (:mod:`moe_route.integrations.hf`), and runs the same
weights and tokens with ``experts_implementation`` = ``"eager"`` (the per-expert loop),
``"grouped_mm"`` (transformers' ``torch._grouped_mm`` path) and ``"moe_route"``, in float32,
bfloat16 and float16: it prints how each experts module maps onto moe_route, the median forward
time of each implementation, and checks the results. Exits non-zero on a mismatch.

    python examples/hf_swap.py                        # tiny Mixtral on CPU, three dtypes
    python examples/hf_swap.py --family gpt_oss       # clamped SwiGLU, interleaved, biases
    python examples/hf_swap.py --family qwen3_moe --size small --device cuda --dtype bfloat16

The swap itself is two lines::

    moe_route.integrations.hf.register()
    model.set_experts_implementation("moe_route")  # or at from_pretrained()

The checks, with tolerances derived from the dtype:

* every experts module, on the inputs it received in the eager run (so that every
  implementation sees the same routing): moe_route's output may be off the float64 result of
  the module's own forward by at most twice the eager implementation's error in that dtype plus
  ``2 eps(dtype)`` of the output's scale (moe_route rounds its result once);
* float32 only, the whole model's logits: within ``1000 eps(float32)`` of the scale of
  ``"eager"``'s. In bf16 / fp16 a rounding difference can flip a near-tie in a later layer's
  router, and then the runs route differently, so there the script reports the agreement of
  the next-token predictions instead.

On a CPU the kernels' ``"auto"`` backend is moe_route's reference (pure PyTorch); with
``TRITON_INTERPRET=1`` and ``--backend triton`` the Triton kernels run through the interpreter,
except in bfloat16, whose interpreted ``tl.dot`` is wrong: that dtype then uses the reference.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch

IMPLEMENTATIONS = ("eager", "grouped_mm", "moe_route")
DTYPES = ("float32", "bfloat16", "float16")

# (hidden, intermediate per expert, experts, top-k, layers, heads)
SIZES = {"tiny": (64, 96, 8, 2, 2, 4), "small": (1024, 2048, 16, 4, 4, 16)}


def build_model(family: str, size: str):
    from transformers import AutoModelForCausalLM, GptOssConfig, MixtralConfig, Qwen3MoeConfig

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
    elif family == "gpt_oss":
        config = GptOssConfig(
            intermediate_size=inter, num_local_experts=experts, num_experts_per_tok=top_k,
            layer_types=["full_attention"] * layers, **common,
        )  # fmt: skip
    else:
        config = Qwen3MoeConfig(
            intermediate_size=4 * hidden, moe_intermediate_size=inter, num_experts=experts,
            num_experts_per_tok=top_k, norm_topk_prob=True, decoder_sparse_step=1, **common,
        )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, experts_implementation="eager").eval()
    if family == "gpt_oss":  # its init leaves the expert biases and router at zero
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".mlp." in name:
                    p.normal_(0, 0.05)
    return model


def experts_modules(model):
    return {n: m for n, m in model.named_modules() if hasattr(m, "has_gate")}


def capture_experts_inputs(model, ids):
    """``{module name: (hidden_states, top_k_index, top_k_weights)}`` of one forward."""
    seen, hooks = {}, []
    for name, module in experts_modules(model).items():

        def hook(_mod, args, name=name):
            seen[name] = tuple(a.detach().clone() for a in args[:3])

        hooks.append(module.register_forward_pre_hook(hook))
    with torch.inference_mode():
        model(ids)
    for h in hooks:
        h.remove()
    return seen


def check_experts(model, inputs, backend):
    """Per experts module: ``(name, error, bound)`` of moe_route vs the float64 result."""
    from moe_route.integrations.hf import moe_route_experts_forward

    rows = []
    for name, module in experts_modules(model).items():
        x, idx, w = inputs[name]
        own_forward = type(module).forward.__wrapped__  # the class's eager forward
        with torch.no_grad():
            m64 = copy.deepcopy(module).to(torch.float64)
            exact = own_forward(m64, x.double(), idx, w.double())
            eager = own_forward(module, x, idx, w)
            ours = moe_route_experts_forward(module, x, idx, w, fallback="error", backend=backend)
        err = (ours.double() - exact).abs().max().item()
        base = (eager.double() - exact).abs().max().item()
        eps = torch.finfo(x.dtype).eps
        rows.append((name, err, 2 * base + 2 * eps * exact.abs().max().item()))
    return rows


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


def run_dtype(args, dtype, base_model, ids) -> bool:
    import moe_route
    import moe_route.integrations.hf as moe_hf

    device = ids.device
    backend = args.backend
    choice = moe_route.arch.backend_for(device, backend).value
    if device.type == "cpu" and dtype == torch.bfloat16 and choice == "triton":
        backend = "reference"  # the interpreter's bf16 tl.dot is wrong
    moe_hf.register(backend=backend, fallback="error")
    model = copy.deepcopy(base_model).to(device, dtype)
    print(f"\n== {dtype}: moe_route backend {moe_route.arch.backend_for(device, backend).value}")

    logits, times = {}, {}
    with torch.inference_mode():
        for impl in IMPLEMENTATIONS:
            model.set_experts_implementation(impl)
            logits[impl] = model(ids).logits.float()
            times[impl] = time_forward(model, ids, device, args.warmup, args.iters)
    model.set_experts_implementation("eager")
    ref = logits["eager"]
    print(f"{'experts_implementation':<24}{'forward ms':>12}{'vs eager':>10}"
          f"{'max |logits - eager|':>24}{'same next token':>18}")  # fmt: skip
    for impl in IMPLEMENTATIONS:
        diff = (logits[impl] - ref).abs().max().item()
        same = (logits[impl].argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"{impl:<24}{times[impl] * 1e3:>12.2f}{times['eager'] / times[impl]:>9.2f}x"
              f"{diff:>24.2e}{same:>17.0%}")  # fmt: skip

    ok = True
    for name, err, bound in check_experts(model, capture_experts_inputs(model, ids), backend):
        good = err <= bound
        ok &= good
        print(f"  {name}: max |moe_route - float64| {err:.2e} (bound {bound:.2e}) "
              f"{'ok' if good else 'MISMATCH'}")  # fmt: skip
    if dtype == torch.float32:
        # The implementations differ only in summation order (the experts' and finalize's).
        tol = 1000 * torch.finfo(torch.float32).eps * max(ref.abs().max().item(), 1.0)
        bad = [i for i in IMPLEMENTATIONS if (logits[i] - ref).abs().max().item() > tol]
        ok &= not bad
        print(f"  logits {'agree' if not bad else 'MISMATCH ' + ', '.join(bad)} within {tol:.1e}")
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=("mixtral", "qwen3_moe", "gpt_oss"), default="mixtral")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=",".join(DTYPES), help=f"comma-separated, of {DTYPES}")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--backend", default="auto", help="moe_route backend: auto, triton, reference")
    args = p.parse_args(argv)
    dtypes = [d.strip() for d in args.dtype.split(",")]
    if any(d not in DTYPES for d in dtypes):
        p.error(f"--dtype {args.dtype!r}: expected a comma-separated subset of {DTYPES}")

    import moe_route.integrations.hf as moe_hf

    moe_hf.register(backend=args.backend)
    device = torch.device(args.device)
    model = build_model(args.family, args.size)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=device)
    print(f"{args.family} ({args.size}, random weights) on {device}; "
          f"{args.batch}x{args.seq} tokens")  # fmt: skip
    print(moe_hf.describe(model))

    failed = [d for d in dtypes if not run_dtype(args, getattr(torch, d), model, ids)]
    verdict = f"MISMATCH in {', '.join(failed)}" if failed else "OK"
    print(f"\n{verdict}: checked {', '.join(dtypes)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
