"""Every public op, forward and backward, on inputs of every memory layout.

Each float input (and the gradient fed to the backward) is given as a view of a leaf in one
layout: ``contiguous``; ``cols`` (every other column of a wider leaf); ``transposed`` (storage in
reversed dimension order); ``expand0`` / ``expand1`` (stride 0 along the first / last dimension,
so the values repeat along it); ``offset`` (a window of a flat buffer starting one element in,
an odd storage offset); and ``mixed`` (each input in a different one of those). The op's result
and the gradients of the leaves must match the reference backend run on contiguous copies of
the same values (``.contiguous()`` is differentiable, so the oracle's gradients reach its
leaves through torch's own copy). Integer tables are compared exactly.

A launcher that addressed one tensor through another's strides (as the finalize backward once
wrote ``d y_perm`` with ``y_perm``'s strides: out of bounds for a column slice, wrong for a
stride-0 ``y_perm``) fails here. On the CPU the Triton kernels run under the interpreter
(fp32, and fp16 for the GEMMs: the interpreter's bf16 ``tl.dot`` is wrong); on a GPU the same
tests run compiled.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from helpers import DEVICE, assert_tables_equal, maps_tables, requires_triton
from moe_cases import TOL, assert_matches

import moe_route

LAYOUTS = ("contiguous", "cols", "transposed", "expand0", "expand1", "offset")
T, K, E, H, INTER = 7, 2, 4, 12, 6


def _values(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).to(DEVICE)
    return torch.randint(-1, E, shape, generator=g).to(dtype).to(DEVICE)


def laid_out(values: torch.Tensor, layout: str, *, grad: bool):
    """``(leaf, view)``: ``view`` has ``values.shape`` and the given layout, and is made from
    ``leaf`` by differentiable ops. Its values are ``values``' except for the stride-0 layouts,
    which repeat the first slice along the expanded dimension."""
    v = values
    rev = tuple(reversed(range(v.dim())))
    if layout == "contiguous":
        leaf = v.clone()
    elif layout == "cols":
        leaf = torch.zeros(*v.shape[:-1], 2 * v.shape[-1], dtype=v.dtype, device=v.device)
        leaf[..., ::2] = v
    elif layout == "transposed":
        leaf = v.permute(rev).contiguous()
    elif layout == "expand0":
        leaf = v[:1].clone()
    elif layout == "expand1":
        leaf = v[..., :1].clone()
    elif layout == "offset":
        leaf = torch.zeros(v.numel() + 1, dtype=v.dtype, device=v.device)
        leaf[1:] = v.reshape(-1)
    else:
        raise ValueError(layout)
    leaf.requires_grad_(grad)
    view = {
        "contiguous": lambda: leaf,
        "cols": lambda: leaf[..., ::2],
        "transposed": lambda: leaf.permute(rev),
        "expand0": lambda: leaf.expand(v.shape),
        "expand1": lambda: leaf.expand(v.shape),
        "offset": lambda: leaf[1:].view(v.shape),
    }[layout]()
    assert view.shape == v.shape
    if layout.startswith("expand") and v.numel() > 1:
        assert 0 in view.stride(), layout
    if layout == "offset":
        assert view.storage_offset() == 1
    return leaf, view


def layouts_for(names, layout):
    """One layout per input; ``mixed`` gives each input a different one, in turn."""
    if layout != "mixed":
        return dict.fromkeys(names, layout)
    cycle = itertools.cycle(LAYOUTS[1:])
    return {name: next(cycle) for name in names}


@functools.cache
def _maps():
    """The routing of the ops that take maps (some slots dropped, some experts empty)."""
    ids = torch.tensor([[0, 1], [1, -1], [3, 0], [-1, -1], [1, 0], [3, 1], [0, -1]])
    return moe_route.build_routing_maps(ids.to(DEVICE), E, backend="reference")


def _maps_op(i, be):
    return maps_tables(moe_route.build_routing_maps(i["topk_ids"], E, backend=be))


def _expand_op(i, be):
    return moe_route.expand_rows(i["x"], _maps(), backend=be)


def _gemm_op(i, be):
    return moe_route.grouped_gemm(
        i["a"], i["w"], _maps(), bias=i["bias"], activation="swiglu", backend=be
    )


def _gemm_gather_op(i, be):
    return moe_route.grouped_gemm(
        i["x"], i["w"], _maps(), bias=i["bias"], activation="swiglu",
        gate_up_layout="interleaved", gather=True, backend=be,
    )  # fmt: skip


def _finalize_op(i, be):
    return moe_route.finalize_moe_routing(
        i["y_perm"], i["topk_weights"], _maps(), i["bias"], backend=be
    )


def _fused_op(i, be, finalize="auto"):
    return moe_route.fused_moe(
        i["x"], i["w1"], i["w2"], i["topk_weights"], i["topk_ids"], b1=i["b1"], b2=i["b2"],
        bias=i["bias"], finalize=finalize, backend=be,
    )  # fmt: skip


def _fused_epilogue_op(i, be):
    return _fused_op(i, be, finalize="fused")  # GEMM2's epilogue reduces (ordered)


N1 = 2 * INTER  # swiglu: gate and up rows
# op -> (its call, its inputs: name -> (shape, integer?)); every float input is differentiable.
OPS = {
    "build_routing_maps": (_maps_op, {"topk_ids": ((T, K), True)}),
    "expand_rows": (_expand_op, {"x": ((T, H), False)}),
    "grouped_gemm": (
        _gemm_op,
        {"a": ((T * K, H), False), "w": ((E, N1, H), False), "bias": ((E, N1), False)},
    ),
    "grouped_gemm_gather": (
        _gemm_gather_op,
        {"x": ((T, H), False), "w": ((E, N1, H), False), "bias": ((E, N1), False)},
    ),
    "finalize_moe_routing": (
        _finalize_op,
        {"y_perm": ((T * K, H), False), "topk_weights": ((T, K), False), "bias": ((T, H), False)},
    ),
    "fused_moe": (
        _fused_op,
        {
            "x": ((T, H), False),
            "w1": ((E, N1, H), False),
            "w2": ((E, H, INTER), False),
            "topk_weights": ((T, K), False),
            "topk_ids": ((T, K), True),
            "b1": ((E, N1), False),
            "b2": ((E, H), False),
            "bias": ((H,), False),
        },
    ),
}
OPS["fused_moe_fused_finalize"] = (_fused_epilogue_op, OPS["fused_moe"][1])
GEMM_OPS = ("grouped_gemm", "grouped_gemm_gather", "fused_moe")


def _build(op, layout, dtype, *, grad):
    """Views of every input in its layout, their leaves, and the oracle's own leaves and
    contiguous copies of the same values."""
    spec = OPS[op][1]
    chosen = layouts_for(list(spec), layout)
    views, leaves, ref_views, ref_leaves = {}, {}, {}, {}
    for seed, (name, (shape, integer)) in enumerate(spec.items()):
        vals = _values(shape, torch.int64 if integer else dtype, seed)
        if name == "topk_weights":
            vals = vals.abs()  # router weights: non-negative, but any finite value works
        if name in ("w", "w1", "w2"):
            vals = vals / shape[-1] ** 0.5
        g = grad and not integer
        leaves[name], views[name] = laid_out(vals, chosen[name], grad=g)
        ref_leaves[name], rv = laid_out(vals, chosen[name], grad=g)
        ref_views[name] = rv.contiguous()
    return views, leaves, ref_views, ref_leaves


def _check_float(actual, expected, dtype, what):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    if expected.abs().max() == 0:
        assert torch.equal(actual, expected), what
        return
    rows = actual.shape[0] if actual.dim() > 1 else 1  # assert_matches wants a 2-D view
    assert_matches(
        actual.reshape(rows, -1), expected.reshape(rows, -1), TOL[dtype], what=what, device=None
    )


# The interpreter's bf16 tl.dot is wrong: bf16 GEMMs run on a GPU only.
LOW_PRECISION = (torch.float16,) + ((torch.bfloat16,) if DEVICE.type == "cuda" else ())
ALL_LAYOUTS = (*LAYOUTS, "mixed")
# Compiled, a layout's strides and alignment select the kernel's specialisation (divisibility
# by 16 bytes) and whether TMA may read it, which depend on the element size: every layout in
# each dtype. The interpreter specialises on nothing and the CPU takes no TMA path, so a 16-bit
# GEMM in a given layout runs the float32 case's code and address arithmetic with another
# element type: there the Triton backend's 16-bit dtypes take "mixed" only (each input in
# another layout, the incoming gradient stride-0), float32 every layout.
LOW_LAYOUTS = {
    "reference": ALL_LAYOUTS,
    "triton": ALL_LAYOUTS if DEVICE.type == "cuda" else ("mixed",),
}
CASES = [
    (op, layout, torch.float32, backend)
    for backend in ("reference", "triton")
    for op in OPS
    for layout in ALL_LAYOUTS
] + [
    (op, layout, dtype, backend)
    for backend in ("reference", "triton")
    for dtype in LOW_PRECISION
    for op in GEMM_OPS
    for layout in LOW_LAYOUTS[backend]
]


@pytest.mark.parametrize(
    ("op", "layout", "dtype", "backend"),
    [pytest.param(*c, marks=requires_triton if c[3] == "triton" else ()) for c in CASES],
    ids=[f"{o}-{lay}-{str(d)[6:]}-{b}" for o, lay, d, b in CASES],
)
def test_layouts_forward_backward(op, layout, dtype, backend):
    call = OPS[op][0]
    with torch.no_grad():  # the inference path (fused_moe runs a different chain without grad)
        views, _, ref_views, _ = _build(op, layout, dtype, grad=False)
        out, ref = call(views, backend), call(ref_views, "reference")
    if op == "build_routing_maps":
        assert_tables_equal(out, ref, what=f"{layout}: ")
        return
    _check_float(out, ref, dtype, f"{op} forward (no grad)")

    views, leaves, ref_views, ref_leaves = _build(op, layout, dtype, grad=True)
    out, ref = call(views, backend), call(ref_views, "reference")
    _check_float(out.detach(), ref.detach(), dtype, f"{op} forward")
    # The incoming gradient in the same layout family (stride 0 included, as from a .sum()).
    dout_layout = layout if layout != "mixed" else "expand0"
    _, dout = laid_out(_values(out.shape, dtype, seed=123), dout_layout, grad=False)
    out.backward(dout)
    ref.backward(dout.contiguous())
    for name, leaf in leaves.items():
        if leaf.requires_grad:
            assert leaf.grad is not None, f"{op}: no gradient for {name}"
            _check_float(leaf.grad, ref_leaves[name].grad, dtype, f"{op}: d {name} ({layout})")
