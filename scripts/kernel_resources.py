"""Registers, spills and shared memory of the grouped GEMM kernels' variants, on any machine.

Compiles the three grouped GEMM kernels (forward, activation backward, fused finalize), the
quantised kernels of decode sizes (FP8 and MXFP4: 16-row tiles and the decode path, the tiles
``moe_route.tuning`` picks) and MXFP4's prefill tiles, and on SM90 the warp-specialised FP8
GEMM, ahead of time for a CUDA target (no GPU or driver needed:
the Triton wheel carries ptxas) and prints ptxas's resource report for each epilogue and tile
configuration. A spill or a register count
at the 255 ceiling shows before any device time is spent (the reason the ordered fused
finalize reduces in compacted row groups), and so does ptxas's warning that the wgmma
instructions are serialised ("WGMMA SERIALIZED"). Arguments are specialised as a launch at the
standard shapes specialises them (unit strides constant, the rest multiples of 16).

``--loops`` adds, for the quantised kernels, the SASS of each one's longest loop (the main
loop): its instruction count per iteration and the most frequent opcodes, which shows what a
change to a main loop costs before any device time is spent.

Usage: ``python scripts/kernel_resources.py [--arch 90] [--top-k 8] [--experts 256]
[--dtype bf16] [--loops]``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import inspect
import os
import re
import subprocess
import sys
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moe_route import tuning
from moe_route.activations import KIND_CODES
from moe_route.kernels.triton import (
    KERNELS,
    decode,
    decode_quant,
    gemm_act_backward,
    gemm_finalize,
    grouped_gemm,
    quant,
)

#: The modules of the kernels compiled here: importing one registers its ``ThinKernel``s.
KERNEL_MODULES = (grouped_gemm, gemm_act_backward, gemm_finalize, quant, decode, decode_quant)


def _kernel(name: str):
    """The ``@triton.jit`` function of a launched kernel, from the public registry of every
    ``ThinKernel`` (``moe_route.kernels.triton.KERNELS``), by its function's name."""
    for thin in KERNELS:
        if getattr(thin.fn, "__name__", None) == name:
            return thin.fn
    raise KeyError(f"no registered kernel named {name!r}")


GEMM = _kernel("_gemm_kernel")
GEMM_PERSISTENT = _kernel("_gemm_persistent_kernel")
GEMM_ACT_BWD = _kernel("_gemm_act_bwd_kernel")
GEMM_FINALIZE = _kernel("_gemm_finalize_kernel")

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)
CONFIGS = [
    (128, 256, 64, 8, 8, 3),
    (128, 128, 64, 8, 8, 4),
    (128, 128, 64, 8, 8, 3),
    (128, 256, 64, 8, 8, 4),
    (128, 128, 64, 8, 8, 2),
    (128, 256, 64, 8, 8, 2),
]
SWIGLU = dict(ACT=KIND_CODES["silu"], GATED=True)
#: Inkling2's soft-capped SwiGLU (the epilogue with the most arithmetic).
SOFTCAP = dict(SWIGLU, GATE_SOFTCAP=4.0, UP_SOFTCAP=25.0)
# name -> (kernel, the constexprs that select its epilogue)
VARIANTS = {
    "gemm2": (GEMM, dict()),
    "gemm1 swiglu gather": (GEMM, dict(SWIGLU, GATHER=True)),
    "gemm1 swiglu gather + z": (GEMM, dict(SWIGLU, GATHER=True, STORE_PRE=True)),
    "gemm2 bwd + swiglu bwd": (GEMM_ACT_BWD, dict(SWIGLU, W_KMAJOR=True)),
    "gemm1 softcap gather + z": (GEMM, dict(SOFTCAP, GATHER=True, STORE_PRE=True)),
    "gemm2 bwd + softcap bwd": (GEMM_ACT_BWD, dict(SOFTCAP, W_KMAJOR=True)),
    "gemm2 persistent": (GEMM_PERSISTENT, dict()),
    "gemm1 swiglu gather pers.": (GEMM_PERSISTENT, dict(SWIGLU, GATHER=True, ONE_DOT=1)),
    "gemm2 pers. TMA store": (GEMM_PERSISTENT, dict(OUT_DESC=True)),
    "gemm1 gather + z pers. TMA z": (
        GEMM_PERSISTENT,
        dict(SWIGLU, GATHER=True, ONE_DOT=1, STORE_PRE=True, Z_DESC=True),
    ),
    "gemm1 gather + z pers. TMA z+h": (
        GEMM_PERSISTENT,
        dict(SWIGLU, GATHER=True, ONE_DOT=1, STORE_PRE=True, Z_DESC=True, OUT_DESC=True),
    ),
    "gemm1 gather + z pers. TMA h": (
        GEMM_PERSISTENT,
        dict(SWIGLU, GATHER=True, ONE_DOT=1, STORE_PRE=True, OUT_DESC=True),
    ),
    "gemm2 + ordered finalize": (GEMM_FINALIZE, dict(ORDERED=True)),
    "gemm2 + atomic finalize": (GEMM_FINALIZE, dict(ORDERED=False)),
}
# Pointer parameters whose element type is not the activations' dtype.
POINTER_TYPES = {
    "offsets_ptr": "i64", "dest_to_src_ptr": "i32", "weights_ptr": "fp32",
    "partial_ptr": "fp32", "counter_ptr": "i32", "src_to_dest_ptr": "i32",
    "expert_for_src_ptr": "i32",
}  # fmt: skip


def _params(kernel):
    """``(name, is_constexpr)`` of the kernel's parameters, in order."""
    fn = kernel.fn if hasattr(kernel, "fn") else kernel
    return [
        (name, "constexpr" in str(p.annotation))
        for name, p in inspect.signature(fn).parameters.items()
    ]


def _launch_signature(fn, types: dict, unit=(), odd=()) -> tuple[dict, dict, dict]:
    """``(signature, attributes, constants)`` of ``fn`` as a launch specialises it: the
    argument types of ``types`` (other pointers float32, other integers i32); the integers
    named in ``unit`` (the unit strides) the constant 1, as Triton specialises an argument of
    1; every other pointer and integer a multiple of 16 but those named in ``odd``, the
    descriptors and the ``do_not_specialize`` ones."""
    sig, attrs, ones = {}, {}, {}
    for i, (name, is_const) in enumerate(_params(fn)):
        if is_const:
            sig[name] = "constexpr"
            continue
        if name in unit:
            sig[name], ones[name] = "constexpr", 1
            continue
        sig[name] = types.get(name, "*fp32" if name.endswith("_ptr") else "i32")
        if (not sig[name].startswith("tensordesc") and name not in fn.do_not_specialize
                and name not in odd):  # fmt: skip
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs, ones


def compile_variant(kernel, cfg, epilogue, *, arch, top_k, experts, dtype):
    bm, bn, bk, group_m, warps, stages = cfg
    const = dict(
        ACT=0, GATED=False, ALPHA=1.0, LIMIT=0.0, UP_OFFSET=0.0, GATE_SOFTCAP=0.0,
        UP_SOFTCAP=0.0, INTERLEAVED=False,
        HAS_BIAS=False, GATHER=False, STORE_PRE=False, ORDERED=False, FINAL_BIAS=False,
        TOP_K=top_k, ACC=tl.float32, DOT_PRECISION="tf32", W_KMAJOR=False, EVEN_K=True,
        E_POW2=triton.next_power_of_2(experts + 1), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        GROUP_M=group_m, RED_M=min(bm, gemm_finalize.RED_ROWS), WARP_SPECIALIZE=False, ONE_DOT=0,
        OUT_DESC=False, Z_DESC=False, A_PERMUTED=arch >= 90,
        SPLIT_EPILOGUE=bm * bn >= 4096 and bn >= 32,  # (as ActBackwardLaunch)
    )  # fmt: skip
    const.update(epilogue)
    # TMA loads as on SM90: A only when it is not gathered (the activation backward reads
    # dout permuted by an expand, A_PERMUTED, where TMA serves, as the launch sequence does).
    gathered = const["GATHER"] or (kernel is GEMM_ACT_BWD and not const["A_PERMUTED"])
    const["A_DESC"] = arch >= 90 and not gathered
    const["W_DESC"] = arch >= 90
    atomic_out = kernel is GEMM_FINALIZE and not const["ORDERED"]
    if atomic_out:
        const["TOP_K"] = 1  # as the launcher: the atomic mode needs no K
    params = _params(kernel)
    missing = [n for n, is_const in params if is_const and n not in const]
    if missing:
        raise KeyError(f"no value for the constexprs {missing}")
    # As a launch at the standard shapes specialises them: unit strides become constants,
    # pointers and the other integers are known multiples of 16 (except the token-dependent
    # ones, never specialised).
    unit = {"stride_ak", "stride_on", "stride_bn", "stride_yn", "stride_fh", "stride_wkk",
            "stride_wn" if const["W_KMAJOR"] else "stride_wk"}  # fmt: skip
    # the router weights' row stride is K: a multiple of 16 only where K is
    odd = set() if top_k % 16 == 0 else {"stride_wt"}
    w_block = f"[1, {bk}, {bn}]" if const["W_KMAJOR"] else f"[1, {bn}, {bk}]"
    if const["ONE_DOT"]:  # gate and up rows in one box (the persistent kernel's gated GEMM1)
        w_block = f"[1, 2, {bn}, {bk}]" if const["ONE_DOT"] == 1 else f"[1, {2 * bn}, {bk}]"
    descs = {
        "a_desc": (const["A_DESC"], f"[{bm}, {bk}]"),
        "w_desc": (const["W_DESC"], w_block),
        "out_desc": (const["OUT_DESC"], f"[1, 1, {bm}, {bn}]"),
        "z_desc": (const["Z_DESC"],
                   f"[1, 1, {bm}, 1, {bn}]" if const["GATED"] else f"[1, 1, {bm}, {bn}]"),
    }  # fmt: skip
    types = {}
    for name, _ in params:
        if name in descs:
            on, block = descs[name]
            types[name] = f"tensordesc<{dtype}{block}>" if on else f"*{dtype}"
        elif name == "final_ptr":
            types[name] = "*fp32" if atomic_out else f"*{dtype}"
        elif name.endswith("_ptr"):
            types[name] = "*" + POINTER_TYPES.get(name, dtype)
    sig, attrs, ones = _launch_signature(kernel, types, unit, odd)
    const = {name: const[name] for name, is_const in params if is_const} | ones
    src = ASTSource(kernel, sig, constexprs=const, attrs=attrs)
    target = GPUTarget("cuda", arch, 32)
    return triton.compile(src, target=target, options=dict(num_warps=warps, num_stages=stages))


#: The CUDA tools the Triton wheel carries (ptxas, cuobjdump).
NV_BIN = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin")


def ptxas_report(kernel, arch) -> str:
    ptxas = os.path.join(NV_BIN, "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    run = subprocess.run([ptxas, "-v", f"--gpu-name={gpu}", f.name, "-o", os.devnull],
                         capture_output=True, text=True, check=True)  # fmt: skip
    os.unlink(f.name)
    lines = [ln.split("info    :")[-1].strip() for ln in run.stderr.splitlines()]
    report = "; ".join(ln for ln in lines if "registers" in ln or "spill" in ln)
    if "wgmma.mma_async instructions are serialized" in run.stderr:  # ptxas warning C7515
        report = "WGMMA SERIALIZED; " + report
    return report


def loop_report(kernel) -> str:
    """The main loop of ``kernel``'s SASS (the innermost loop that issues tensor-core
    instructions, else the longest loop): instructions per iteration and the six most
    frequent opcodes (cuobjdump from the Triton wheel)."""
    tool = os.path.join(NV_BIN, "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    run = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True)
    os.unlink(f.name)
    code = [(int(m[1], 16), m[2].strip()) for m in
            re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", run.stdout)]  # fmt: skip
    loops = [(int(m[1], 16), addr) for addr, text in code
             if (m := re.search(r"BRA (0x[0-9a-f]+)", text)) and int(m[1], 16) < addr]  # fmt: skip
    if not loops:
        return "no loop"

    def body(span):
        return [text for addr, text in code if span[0] <= addr <= span[1]]

    mma = [span for span in loops if any("MMA" in t for t in body(span))]
    span = (
        min(mma, key=lambda sp: sp[1] - sp[0]) if mma else max(loops, key=lambda sp: sp[1] - sp[0])
    )
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
                              for t in body(span))  # fmt: skip
    top = ", ".join(f"{op} {n}" for op, n in ops.most_common(6))
    return f"main loop {len(body(span))} instructions: {top}"


#: The quantised kernels' strides that are 1 at a launch on contiguous operands (the
#: innermost dimension of the tokens, weights, scales, biases, routing tables and outputs).
UNIT_STRIDES = frozenset({
    "stride_ak", "stride_ask", "stride_wk", "stride_sk", "stride_on", "stride_bn", "stride_xh",
    "stride_ik", "stride_hn", "stride_b2n", "stride_wkk", "stride_bh", "stride_oh",
})  # fmt: skip


def _odd(fmt: str) -> frozenset:
    """The integers not a multiple of 16 at the standard shapes: the routing tables' row
    stride ``K`` (8), and on 128-block FP8 the scale rows' lengths (``ceil(H / 128)``: 56 at
    DeepSeek-V3's H = 7168; 6 at Qwen3's I = 768)."""
    odd = {"stride_it", "stride_wt"}
    if fmt == "fp8":
        odd |= {"stride_asm", "stride_osm", "stride_sn"}
    return frozenset(odd)


def compile_quant_decode(name: str, *, arch: int, experts: int, fmt: str,
                         swap: bool | None = None, in_loop: bool = False):  # fmt: skip
    """One kernel of decode sizes on quantised experts, as ``moe_route`` launches it (16-row
    tiles of the sorted path's GEMMs, FP8 ones reading the codes of a quantiser launch and of
    GEMM1's epilogue; the decode path's two kernels, FP8 ones quantising in their main
    loops), gated SwiGLU; ``fmt``: ``"fp8"`` (128-row weight blocks), ``"fp8_channel"`` or
    ``"mxfp4"`` (bf16 activations); ``swap``: the FP8 products' operands swapped or not,
    whatever the tables say; ``in_loop``: FP8 GEMM1 quantising the bf16 tokens in its main
    loop (``QuantConfigs.in_loop``)."""
    mx = fmt == "mxfp4"
    gemm1 = tuning.quant_gemm_config(8, True, mx, arch)
    gemm2 = tuning.quant_gemm_config(8, False, mx, arch)
    dec = tuning.quant_decode_config(1, 8, experts, 1, mx, arch)
    sn = 128 if fmt == "fp8" else 1
    act = dict(ALPHA=1.0, LIMIT=0.0, UP_OFFSET=0.0, GATE_SOFTCAP=0.0, UP_SOFTCAP=0.0,
               INTERLEAVED=False, HAS_BIAS=False, UE8M0=False, UPCAST=False, SN=sn)  # fmt: skip
    a_quant = 0 if mx else 2 if fmt == "fp8_channel" else 1
    dec_swap = (dec.swap if swap is None else swap) and not mx
    w = "*u8" if mx else "*fp8e4nv"
    ws = "*u8" if mx else "*fp32"
    if name.startswith("gemm"):
        gated = name == "gemm1"
        cfg = gemm1 if gated else gemm2
        kernel = _kernel("_quant_gemm_kernel")
        const = dict(act, ACT=KIND_CODES["silu"] if gated else 0, GATED=gated, GATHER=gated,
                     MXFP4=mx, OUT_FP8=gated and not mx, A_DESC=False, W_DESC=False,
                     SPLIT=1 if gated else 0, A_QUANT=a_quant if gated and in_loop else 0,
                     SWAP=cfg.swap_ab and not mx if swap is None else swap,
                     E_POW2=triton.next_power_of_2(experts + 1), BLOCK_M=cfg.block_m,
                     BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m)  # fmt: skip
        rows = "*bf16" if mx else "*fp8e4nv"  # the tokens, GEMM1's output and GEMM2's input
        a = "*bf16" if gated and in_loop else rows
        types = dict(a_ptr=a, a_desc=a, as_ptr="*fp32", w_ptr=w, w_desc=w, ws_ptr=ws,
                     bias_ptr="*bf16", out_ptr=rows if gated else "*bf16", os_ptr="*fp32",
                     offsets_ptr="*i64", dest_to_src_ptr="*i32")  # fmt: skip
        warps, stages = cfg.num_warps, cfg.num_stages
    elif name == "decode up":
        kernel = _kernel("_decode_up_quant_kernel")
        const = dict(act, ACT=KIND_CODES["silu"], GATED=True, TOP_K=8, MXFP4=mx,
                     A_QUANT=a_quant, SWAP=dec_swap, BLOCK_M=16, BLOCK_N=dec.up_n,
                     BLOCK_K=dec.up_k)  # fmt: skip
        types = dict(x_ptr="*bf16", w_ptr=w, ws_ptr=ws, b_ptr="*bf16", ids_ptr="*i32",
                     h_ptr="*bf16" if mx else "*fp32")  # fmt: skip
        warps, stages = dec.num_warps, dec.num_stages
    else:  # the decode path's second kernel
        kernel = _kernel("_decode_down_kernel")
        const = dict(TOP_K=8, HAS_B2=False, HAS_BIAS=False, ACC=tl.float32, OUT_ACC=tl.float32,
                     DOT_PRECISION="tf32", BLOCK_M=16, BLOCK_N=dec.down_n, BLOCK_K=dec.down_k,
                     COUNTS=False, SLOTS=64, FP8=not mx, MXFP4=mx, SN=sn, UE8M0=False,
                     UPCAST=False, SPLIT=dec.split, SWAP=dec_swap)  # fmt: skip
        types = dict(h_ptr="*bf16" if mx else "*fp32", w_ptr=w, ws_ptr=ws, b2_ptr="*bf16",
                     ids_ptr="*i32", tw_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16",
                     counts_ptr="*i64")  # fmt: skip
        warps, stages = dec.num_warps, dec.num_stages
    sig, attrs, ones = _launch_signature(kernel, types, UNIT_STRIDES, _odd(fmt))
    src = ASTSource(kernel, sig, constexprs=const | ones, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=warps, num_stages=stages))  # fmt: skip


def compile_mxfp4_prefill(gated: bool, *, arch: int, experts: int):
    """The MXFP4 grouped GEMM at prefill sizes (the tiles ``moe_route.tuning`` picks at 512
    rows per expert), gated SwiGLU GEMM1 gathering bf16 tokens, or GEMM2."""
    cfg = tuning.quant_gemm_config(512, gated, True, arch)
    const = dict(ALPHA=1.0, LIMIT=0.0, UP_OFFSET=0.0, GATE_SOFTCAP=0.0, UP_SOFTCAP=0.0,
                 INTERLEAVED=False, HAS_BIAS=False, UE8M0=False, UPCAST=False, SN=1,
                 ACT=KIND_CODES["silu"] if gated else 0, GATED=gated, GATHER=gated, MXFP4=True,
                 OUT_FP8=False, A_DESC=False, W_DESC=False, SPLIT=0, A_QUANT=0, SWAP=False,
                 E_POW2=triton.next_power_of_2(experts + 1), BLOCK_M=cfg.block_m,
                 BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m)  # fmt: skip
    kernel = _kernel("_quant_gemm_kernel")
    types = dict(a_ptr="*bf16", a_desc="*bf16", w_ptr="*u8", w_desc="*u8", ws_ptr="*u8",
                 bias_ptr="*bf16", out_ptr="*bf16", offsets_ptr="*i64",
                 dest_to_src_ptr="*i32")  # fmt: skip
    sig, attrs, ones = _launch_signature(kernel, types, UNIT_STRIDES, _odd("mxfp4"))
    src = ASTSource(kernel, sig, constexprs=const | ones, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=cfg.num_warps,
                                       num_stages=cfg.num_stages))  # fmt: skip


def compile_fp8_sm90(gated: bool, gather: bool, channel: bool, *, arch: int, experts: int):
    """The warp-specialised FP8 GEMM (Gluon, ``kernels/triton/quant_sm90.py``) as its launch
    specialises it: gated GEMM1 (gathering the token codes or not) or GEMM2, 128-row block or
    per-channel weight scales."""
    from triton.experimental.gluon import _runtime
    from triton.experimental.gluon import language as gl

    from moe_route.kernels.triton import quant_sm90 as q

    fn = q._fp8_sm90_kernel
    a_rows, w_rows = 2 * q.WG_M.value, (q.GATE_N.value if gated else q.WG_N.value)

    def desc(rows):
        layout = gl.NVMMASharedLayout.get_default_for([rows, q.BLOCK_K.value], gl.float8e4nv)
        return f"tensordesc<fp8e4nv[{rows}, {q.BLOCK_K.value}],{layout!r}>"

    const = dict(ACT=KIND_CODES["silu"] if gated else 0, GATED=gated, ALPHA=1.0, LIMIT=0.0,
                 UP_OFFSET=0.0, GATE_SOFTCAP=0.0, UP_SOFTCAP=0.0, HAS_BIAS=False,
                 GATHER=gather, SN=1 if channel else q.BLOCK_K.value, OUT_FP8=gated,
                 UE8M0=False, E_POW2=triton.next_power_of_2(experts + 1), STAGES=4,
                 GROUP_M=8)  # fmt: skip
    types = dict(a_desc="*fp8e4nv" if gather else desc(a_rows), w_desc=desc(w_rows),
                 a_ptr="*fp8e4nv", out_ptr="*fp8e4nv" if gated else "*bf16",
                 bias_ptr="*bf16", offsets_ptr="*i64", d2s_ptr="*i32")  # fmt: skip
    sig, attrs, ones = _launch_signature(fn, types, UNIT_STRIDES, _odd("fp8"))
    src = _runtime.GluonASTSource(fn, sig, constexprs=const | ones, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=4))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=256, help="E (the in-kernel tile search)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--loops", action="store_true",
                   help="also the quantised kernels' main loops in SASS")  # fmt: skip
    args = p.parse_args(argv)
    print(f"Triton {triton.__version__}, sm_{args.arch}, {args.dtype}, K={args.top_k}, "
          f"E={args.experts}")  # fmt: skip
    for name, (kernel, epilogue) in VARIANTS.items():
        for cfg in CONFIGS:
            try:
                k = compile_variant(kernel, cfg, epilogue, arch=args.arch, top_k=args.top_k,
                                    experts=args.experts, dtype=args.dtype)  # fmt: skip
                report = f"{ptxas_report(k, args.arch)}; {k.metadata.shared} B shared"
            except Exception as exc:  # a variant this Triton cannot build for the target
                report = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            print(f"{name:<26} {'/'.join(map(str, cfg)):<18} {report}")
    quant = []  # (label, tiles, compile)
    for fmt in ("fp8", "fp8_channel", "mxfp4") if args.arch >= 89 else ("mxfp4",):
        for name in ("gemm1", "gemm2", "decode up", "decode down"):
            build = functools.partial(compile_quant_decode, name, arch=args.arch,
                                      experts=args.experts, fmt=fmt)  # fmt: skip
            quant.append((f"{fmt} {name}", "16 rows", build))
            if fmt != "mxfp4" and args.arch == 90:
                # the tables' swapped tiles, against the same tiles unswapped
                build = functools.partial(compile_quant_decode, name, arch=args.arch,
                                          experts=args.experts, fmt=fmt, swap=False)  # fmt: skip
                quant.append((f"{fmt} {name} unswapped", "16 rows", build))
    for gated in (True, False):
        build = functools.partial(compile_mxfp4_prefill, gated, arch=args.arch,
                                  experts=args.experts)  # fmt: skip
        quant.append((f"mxfp4 gemm{1 if gated else 2}", "512 rows", build))
    for label, tiles, build in quant:
        try:
            k = build()
            report = f"{ptxas_report(k, args.arch)}; {k.metadata.shared} B shared"
            if args.loops:
                report += f"\n{'':<45} {loop_report(k)}"
        except Exception as exc:  # a variant this Triton cannot build for the target
            report = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        print(f"{label:<26} {tiles:<18} {report}")
    if args.arch >= 90:
        for gated, gather, channel in ((True, True, False), (True, False, False),
                                       (False, False, False), (True, True, True),
                                       (False, False, True)):  # fmt: skip
            name = ("fp8 sm90 gemm1" + (" gather" if gather else "") if gated
                    else "fp8 sm90 gemm2") + (" channel" if channel else "")  # fmt: skip
            try:
                k = compile_fp8_sm90(gated, gather, channel, arch=args.arch,
                                     experts=args.experts)  # fmt: skip
                report = f"{ptxas_report(k, args.arch)}; {k.metadata.shared} B shared"
                if args.loops:
                    report += f"\n{'':<45} {loop_report(k)}"
            except Exception as exc:  # a Triton without this Gluon API
                report = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            print(f"{name:<26} {'ws 2x4+1 warps':<18} {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
