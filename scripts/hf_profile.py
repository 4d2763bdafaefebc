"""Where the transformers Qwen3-MoE prefill spends its time per experts implementation
(bench/bench_hf.py's model): torch.profiler over a few prefills, the top CUDA kernels and CPU
ops, and fused_moe alone on one layer's operands."""

import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import bench_hf

import moe_route
import moe_route.integrations.hf as moe_hf

moe_hf.register()
model = bench_hf.build(4, vocab=1024)
T = int(os.environ.get("PREFILL", "2048"))
prompt = torch.randint(0, 1024, (1, T), device="cuda")
with torch.no_grad():
    for impl in ("grouped_mm", "moe_route"):
        model.set_experts_implementation(impl)
        for _ in range(3):
            model(prompt, use_cache=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                model(prompt, use_cache=True)
            torch.cuda.synchronize()
        print(f"===== {impl}")
        ka = prof.key_averages()
        print(ka.table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
        print(ka.table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))
    experts = model.model.layers[0].mlp.experts
    plan = moe_hf.plan_for(experts)
    w1, w2, b1, b2 = moe_hf._operands(experts, plan)
    print("plan", plan, "w1", tuple(w1.shape), w1.stride(), "w2", tuple(w2.shape), w2.stride())
    x = torch.randn(T, 2048, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(T, 128, device="cuda")
    tw, ids = torch.topk(logits.softmax(-1), 8)
    print("tw", tw.dtype, "ids", ids.dtype)
    from triton.testing import do_bench

    def call():
        return moe_route.fused_moe(
            x, w1, w2, tw, ids, activation=plan.activation, gate_up_layout=plan.gate_up_layout
        )

    print(f"fused_moe alone T={T}: {do_bench(call, warmup=50, rep=300) * 1e3:.1f} us")
