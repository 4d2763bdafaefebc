"""Where the host time of one Triton launch goes (H100 host; Triton 3.6): Triton's
``kernel[grid]``, the compiled kernel's ``run``, ``run`` with integer pointers instead of tensors,
and the raw C launcher with pre-built TMA descriptors. Also dumps the launcher's structure so the
direct path in ``moe_route.kernels.triton`` can be checked against this Triton version."""

import inspect
import os
import sys
import time

import torch

import moe_route
from moe_route import reference as R
from moe_route.kernels import triton as kt

out_dir = os.environ.get("OUT", ".")
T, H, inter, E, K = 1, 2048, 1024, 64, 8
x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
w1 = torch.randn(E, 2 * inter, H, device="cuda", dtype=torch.bfloat16) * 0.02
w2 = torch.randn(E, H, inter, device="cuda", dtype=torch.bfloat16) * 0.02
tw, ids = R.topk_routing_reference(torch.randn(T, E, device="cuda"), K, renormalize=True)
for _ in range(5):
    moe_route.fused_moe(x, w1, w2, tw, ids)
torch.cuda.synchronize()

recorded = []
orig = kt.ThinKernel.launch


def spy(self, key, grid, args, constexprs):
    recorded.append((self, key, grid, args, constexprs()))
    return orig(self, key, grid, args, constexprs)


kt.ThinKernel.launch = spy
moe_route.fused_moe(x, w1, w2, tw, ids)
kt.ThinKernel.launch = orig
torch.cuda.synchronize()


def per_call(fn, n=300):
    for _ in range(20):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return dt


idx = torch.arange(T, device="cuda")
print(f"index_select host us: {per_call(lambda: x.index_select(0, idx)):.1f}")
with open(os.path.join(out_dir, "launcher_structure.txt"), "w") as f:
    for self, key, *_ in recorded:
        device = torch.cuda.current_device()
        compiled, _ = self._compiled[(device, key)]
        run = compiled.run
        f.write(f"== {self.fn.__name__}: run={type(run)} attrs={sorted(vars(run))}\n")
        launch = getattr(run, "launch", None)
        f.write(f"   launch={launch!r}\n")
        code = getattr(launch, "__code__", None)
        if code is not None:
            f.write(f"   freevars={code.co_freevars}\n")
        f.write(f"   signature={getattr(compiled.src, 'signature', None)}\n")
    try:
        from triton.backends.nvidia import driver as nvd

        src = inspect.getsource(nvd)
        for name in ("def wrap_handle_tensordesc", "def make_tensordesc_arg", "class CudaLauncher"):
            i = src.find(name)
            f.write(f"\n----- {name}\n{src[i : i + 2600]}\n")
        i = src.find("getPointer(PyObject")
        f.write(f"\n----- getPointer\n{src[i : i + 1600]}\n")
    except Exception as exc:  # pragma: no cover
        f.write(f"source not found: {exc}\n")


def probe_one(self, key, grid, args, cx):
    device = torch.cuda.current_device()
    compiled, values = self._compiled[(device, key)]
    stream = torch._C._cuda_getCurrentRawStream(device)
    g = (*grid, 1, 1)

    def via_triton():
        self.fn[grid](*args, **cx)

    def via_run(a=args):
        compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata,
                     None, None, None, *a, *values)  # fmt: skip

    int_args = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
    row = [per_call(via_triton), per_call(via_run)]
    try:
        row.append(per_call(lambda: via_run(int_args)))
    except Exception as exc:
        print("int pointers refused:", exc, file=sys.stderr)
        row.append(float("nan"))
    tma = any(type(a).__name__ == "TensorDescriptor" for a in args)
    name = self.fn.__name__ + (" (tma)" if tma else "")
    print(f"{name:28} {row[0]:12.1f} {row[1]:8.1f} {row[2]:13.1f} {len(args):7d}")


print(f"{'kernel':28} {'kernel[grid]':>12} {'run':>8} {'run int ptrs':>13} {'n args':>7}")
for self, key, grid, args, cx in recorded:
    probe_one(self, key, grid, args, cx)

from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

desc_us = per_call(lambda: TensorDescriptor.from_tensor(w1, [1, 64, 64]))
print(f"TensorDescriptor.from_tensor us: {desc_us:.1f}")
print(f"fused_moe host us: {per_call(lambda: moe_route.fused_moe(x, w1, w2, tw, ids)):.1f}")
