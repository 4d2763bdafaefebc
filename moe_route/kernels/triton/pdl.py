"""Programmatic dependent launch (SM90+): a kernel launched with it may start while the kernel
before it in the stream is still finishing, and waits for that kernel's completion (and the
visibility of its writes) where it says so.

Every kernel that takes ``PDL`` calls :func:`wait_previous` before its first read or write of
global memory that an earlier kernel may touch (its inputs, its outputs: the allocator hands
out memory an earlier kernel may still read), and releases the next kernel there too. Since a
kernel releases the next one only after its own wait, everything before it in the stream has
completed when the next one starts; so a kernel launched right after one of ours may read,
before its wait, what that kernel does not write (e.g. GEMM2's weights while GEMM1 finishes),
which :func:`prefetch_l2` uses.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def wait_previous(PDL: tl.constexpr):
    """With ``PDL``: wait until the previous kernel has completed, then let the next start."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask for the 128-byte lines at ``ptrs`` to be brought into L2 (no value comes back)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)  # fmt: skip
