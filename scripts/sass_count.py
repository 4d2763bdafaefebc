"""Compile the weight-gradient TMA kernel for sm_90 without a GPU and count its SASS
instructions per basic block (Triton's bundled ptxas and nvdisasm; needs no device).

ncu showed the kernel at deepseek-v3 T=4096 issue-bound: one warpgroup per SM issuing one
instruction every 3.8 cycles, ~776 instructions per warp per output tile, of which ~20 are
MMAs. This shows where they are, so that a change to the loop can be judged before it is timed.

    python scripts/sass_count.py [--block-r 64 --block-n 128 --block-k 128 --warps 4
                                  --stages 4 --n 4096 --kd 7168] [--sass FILE]
"""

import argparse
import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moe_route.kernels.triton import weight_grad as wg


def compile_kernel(args):
    fn = wg._expert_weight_grad_tma_kernel
    box_a, box_b = [1, 1, args.block_r, args.block_n], [1, 1, args.block_r, args.block_k]
    types = {
        "a_desc": f"tensordesc<bf16{box_a}>", "b_desc": f"tensordesc<bf16{box_b}>",
        "dw_desc": f"tensordesc<bf16{[1, args.block_n, args.block_k]}>", "dw_ptr": "*bf16",
        "db_ptr": "*bf16", "offsets_ptr": "*i64", "dest_to_src_ptr": "*i32",
        "scale_ptr": "*bf16",
    }  # fmt: skip
    constexprs = dict(
        A_SCALE=False, HAS_DBIAS=False, DW_DESC=True, K_FASTEST=True, FLAT=True,
        ASM_OFFSETS=True, N=args.n, KD=args.kd, BLOCK_R=args.block_r, BLOCK_N=args.block_n,
        BLOCK_K=args.block_k, BLOCK_E=wg._BLOCK_E,
    )  # fmt: skip
    signature = {}
    for p in fn.params:
        signature[p.name] = "constexpr" if p.is_constexpr else types.get(p.name, "i32")
    src = ASTSource(fn, signature, constexprs={k: v for k, v in constexprs.items()
                                                if k in signature})  # fmt: skip
    opts = {"num_warps": args.warps, "num_stages": args.stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def main():
    ap = argparse.ArgumentParser()
    for name, default in (("block-r", 64), ("block-n", 128), ("block-k", 128), ("warps", 4),
                          ("stages", 4), ("n", 4096), ("kd", 7168)):  # fmt: skip
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--sass", help="also write the SASS here")
    args = ap.parse_args()
    compiled = compile_kernel(args)
    nvdisasm = Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
    if args.sass:
        Path(args.sass).write_text(sass)
    blocks, current = [], ("entry", Counter())
    for line in sass.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line)
        if label:
            blocks.append(current)
            current = (label.group(1), Counter())
            continue
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if m:
            current[1][m.group(3)] += 1
            if m.group(3) == "BRA":  # a block ends at a branch, taken or not
                blocks.append(current)
                current = (f"+{m.group(1)}", Counter())
    blocks.append(current)
    print(f"shared {compiled.metadata.shared} B")
    for label, counts in blocks:
        total = sum(counts.values())
        top = ", ".join(f"{k} {v}" for k, v in counts.most_common(6))
        if total:
            print(f"{label:8s} {total:5d}  {top}")


if __name__ == "__main__":
    main()
