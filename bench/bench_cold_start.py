"""Cold start: the wall time of the first call at each new token bucket, on an empty Triton
cache, in a fresh process per measurement.

    python bench/bench_cold_start.py [--tokens 100,700,1300] [--out DIR]

Each measurement starts a new Python process with its own empty ``TRITON_CACHE_DIR`` and
times (``time.perf_counter`` around the call and a device synchronise) the first
``fused_moe`` inference call at each of ``--tokens`` in turn (each a new power-of-two
bucket), then a second call at the same ``T`` (compiled by then), on Qwen3-30B-A3B's expert
shapes (H 2048, I 768, E 128, K 8, bf16), with the time of each kernel's first launch (its
compile) listed. ``--repeat N`` runs it in N fresh processes.

``--hf`` adds the same through a transformers Qwen3-MoE model (two decoder layers at the real
widths, random weights) switched to ``experts_implementation="moe_route"``: the first prefill
of ``T`` tokens, which is what a serving process meets; and, as the yardstick of what the
model's first forward costs without moe_route, the same model on transformers' own
``"grouped_mm"`` experts (path ``hf grouped_mm``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

H, INTER, E, K = 2048, 768, 128, 8


PATHS = ("fused_moe", "hf", "hf grouped_mm")


def _child(tokens: list[int], path: str) -> dict:
    import time

    import torch

    import moe_route
    from moe_route.kernels import triton as kt

    first = kt.ThinKernel._first_launch
    compiles = []

    def timed(self, *args):
        t0 = time.perf_counter()
        first(self, *args)
        compiles.append(f"{self.fn.__name__} {time.perf_counter() - t0:.2f}")

    kt.ThinKernel._first_launch = timed
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    times = {}
    if path != "fused_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        import moe_route.integrations.hf as moe_hf

        moe_hf.register()

        cfg = Qwen3MoeConfig(
            hidden_size=H, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=K,
            num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4,
            intermediate_size=6144, vocab_size=1024, head_dim=128,
        )  # fmt: skip
        model = Qwen3MoeForCausalLM(cfg).to(dev, torch.bfloat16).eval()
        model.set_experts_implementation("moe_route" if path == "hf" else "grouped_mm")
        for T in tokens:
            ids = torch.randint(0, 1024, (1, T), device=dev, generator=g)
            for attempt in ("first", "again"):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.no_grad():
                    model(ids)
                torch.cuda.synchronize()
                times[f"{T}:{attempt}"] = time.perf_counter() - t0
            times[f"{T}:compiles"] = compiles[:]
            compiles.clear()
        return times
    w1 = torch.randn(E, 2 * INTER, H, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    w2 = torch.randn(E, H, INTER, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    for T in tokens:
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g)
        logits = torch.randn(T, E, device=dev, generator=g)
        weights, ids = moe_route.softmax_topk(logits, K)
        for attempt in ("first", "again"):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.no_grad():
                moe_route.fused_moe(x, w1, w2, weights, ids)
            torch.cuda.synchronize()
            times[f"{T}:{attempt}"] = time.perf_counter() - t0
        times[f"{T}:compiles"] = compiles[:]
        compiles.clear()
    return times


def _measure(tokens: list[int], path: str) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        # the child imports moe_route from this checkout, as the parent's caller does
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        pythonpath = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, TRITON_CACHE_DIR=cache, PYTHONPATH=pythonpath)
        arg = ",".join(map(str, tokens))
        cmd = [sys.executable, __file__, "--child", path, "--tokens", arg]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="100,700,1300")
    ap.add_argument("--hf", action="store_true")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--child", choices=PATHS, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.child:
        print(json.dumps(_child(tokens, args.child)))
        return
    rows = []
    for _ in range(args.repeat):
        for path in PATHS if args.hf else PATHS[:1]:
            rows.append({"path": path, **_measure(tokens, path)})
    cols = [f"{T}:{a}" for T in tokens for a in ("first", "again")]
    print("| path | " + " | ".join(f"T={c} s" for c in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for r in rows:
        print(f"| {r['path']} | " + " | ".join(f"{r[c]:.2f}" for c in cols) + " |")
    for r in rows:
        for T in tokens:
            print(f"{r['path']} T={T} compiles (s): {', '.join(r[f'{T}:compiles'])}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "cold_start.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
