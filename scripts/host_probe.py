"""Where an eager call's host time goes: public ops, Triton's launch path, the custom-op layer.

Run on a GPU: ``python scripts/host_probe.py``. Host µs per call = ``time.perf_counter`` around
``N`` calls with no synchronisation inside the loop (after warm-up), divided by ``N``. Prints
one table; the numbers decide how thin the eager path has to be (issue: dispatch layer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import moe_route
from moe_route.bench.harness import time_host

N = 300


def host_us(fn, n: int = N) -> float:
    """Host µs per call: the suite's :func:`moe_route.bench.harness.time_host` (median of 3
    loops of ``n`` unsynchronised calls)."""
    return time_host(fn, "cuda", calls=n, warmup=20).median_s * 1e6


@triton.jit
def _probe_kernel(a, b, c, d, e, f, g, h, n0, n1, n2, n3, n4, n5, n6, n7, n8, n9,
                  X: tl.constexpr, Y: tl.constexpr, Z: tl.constexpr,
                  BLOCK: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(a + offs, mask=offs < n0, other=0.0)
    tl.store(b + offs, v + X + Y + Z, mask=offs < n0)


@torch.library.custom_op("probe::noop", mutates_args=())
def _noop_op(
    x: torch.Tensor, y: torch.Tensor, z: torch.Tensor, flag: bool, name: str
) -> torch.Tensor:
    return x.new_empty(4)


@_noop_op.register_fake
def _(x, y, z, flag, name):
    return x.new_empty(4)


def main() -> None:
    dev = torch.device("cuda")
    rows: list[tuple[str, float]] = []
    T, H, I, E, K = 64, 2048, 1024, 64, 8  # noqa: E741
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    w1 = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) * 0.02
    logits = torch.randn(T, E, device=dev)
    tw, ids = moe_route.reference.topk_routing_reference(logits, K, renormalize=True)
    maps = moe_route.build_routing_maps(ids, E)
    xp = moe_route.expand_rows(x, maps)
    h = moe_route.grouped_gemm(x, w1, maps, activation="swiglu", gather=True)
    y = moe_route.grouped_gemm(h, w2, maps)
    idx = torch.randint(0, T, (T * K,), device=dev)
    rows.append(("index_select [T*K, H]", host_us(lambda: torch.index_select(x, 0, idx))))
    rows.append(("torch.empty", host_us(lambda: torch.empty(T * K, H, device=dev))))
    rows.append(("build_routing_maps", host_us(lambda: moe_route.build_routing_maps(ids, E))))
    rows.append(("expand_rows", host_us(lambda: moe_route.expand_rows(x, maps))))
    rows.append(
        ("finalize_moe_routing", host_us(lambda: moe_route.finalize_moe_routing(y, tw, maps)))
    )
    rows.append(
        (
            "grouped_gemm GEMM1 swiglu gather",
            host_us(lambda: moe_route.grouped_gemm(x, w1, maps, activation="swiglu", gather=True)),
        )
    )
    rows.append(("grouped_gemm GEMM2", host_us(lambda: moe_route.grouped_gemm(h, w2, maps))))
    rows.append(("fused_moe", host_us(lambda: moe_route.fused_moe(x, w1, w2, tw, ids))))
    del xp

    a = torch.randn(4096, device=dev)
    b = torch.empty_like(a)
    ints = [4096, 7, 16, 32, 4096, 1, 2, 3, 5, 6]
    ptrs = [a, b, a, b, a, b, a, b]
    kernel = _probe_kernel[(4,)](*ptrs, *ints, X=1.0, Y=2.0, Z=3.0, BLOCK=1024)
    rows.append(
        (
            "triton kernel[grid](18 args)",
            host_us(lambda: _probe_kernel[(4,)](*ptrs, *ints, X=1.0, Y=2.0, Z=3.0, BLOCK=1024)),
        )
    )
    args = (*ptrs, *ints, 1.0, 2.0, 3.0, 1024)
    idx_dev = torch.cuda.current_device()

    def direct():
        stream = torch._C._cuda_getCurrentRawStream(idx_dev)
        kernel.run(4, 1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None,
                   *args)  # fmt: skip

    try:
        rows.append(("compiled.run direct (18 args)", host_us(direct)))
    except Exception as exc:  # the launcher's signature differs in this Triton
        rows.append((f"compiled.run direct FAILED {type(exc).__name__}: {exc}"[:90], float("nan")))
    rows.append(("raw stream lookup", host_us(lambda: torch._C._cuda_getCurrentRawStream(idx_dev))))
    z = torch.empty(4, device=dev)
    rows.append(("custom_op no-op (3 tensors)", host_us(lambda: _noop_op(z, z, z, True, "x"))))
    rows.append(("plain python no-op fn", host_us(lambda: _noop_op._init_fn(z, z, z, True, "x"))))
    rows.append(("is_compiling()", host_us(torch.compiler.is_compiling)))

    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    print(f"{'what':<44} {'host µs/call':>12}")
    for name, us in rows:
        print(f"{name:<44} {us:12.1f}")


if __name__ == "__main__":
    main()
