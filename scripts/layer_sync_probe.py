"""An inference MoELayer (qwen3-30b-a3b's MoE sizes, bf16) at T = 1, 8, 64: whether a call
synchronises the host (sync debug mode), its eager latency (do_bench) and where the device
time goes (torch.profiler, five calls)."""

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

import moe_route

layer = moe_route.MoELayer(2048, 768, 128, 8, device="cuda", dtype=torch.bfloat16).eval()
for T in (1, 8, 64):
    x = torch.randn(T, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(5):
            layer(x)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            layer(x)
            print(f"T={T}: no host sync")
        except RuntimeError as exc:
            print(f"T={T}: host sync: {str(exc)[:200]}")
        finally:
            torch.cuda.set_sync_debug_mode("default")
        print(f"T={T}: eager {do_bench(lambda x=x: layer(x), warmup=20, rep=200) * 1e3:.1f} us")
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                layer(x)
            torch.cuda.synchronize()
        ka = prof.key_averages()
        print(ka.table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=50))
