"""The memory-bound stages (the ``routing`` group): routing maps, expand, finalize.

Each is timed against the PyTorch code it replaces, on every backend of
:func:`~.context._variants` (moe_route's, and CuPy where it works), and checked bit for bit
(maps, expand) or to the dtype's tolerance (finalize).
"""

from __future__ import annotations

import moe_route

from . import baselines as B
from .context import Context, _exact, _maps_tuple, _tol, _variants, rel_err
from .shapes import Shape


def stage_maps(shape: Shape, ctx: Context) -> None:
    """Routing maps from top-k ids, against the ``argsort`` pipeline."""
    inp = ctx.inputs(shape)
    ids, E, N = inp.topk_ids, shape.E, shape.T * shape.K
    nbytes = N * 4 + 3 * N * 4 + (E + 1) * 8  # read the ids, write three maps and the offsets
    ref = B.argsort_maps(ids, E)
    ctx.measure("maps", shape, "torch argsort", lambda: B.argsort_maps(ids, E), nbytes)
    for impl, backend in _variants(ctx):
        ctx.measure(
            "maps", shape, impl,
            lambda b=backend: moe_route.build_routing_maps(ids, E, backend=b), nbytes,
            check=lambda m: _exact(ref)(_maps_tuple(m)),
        )  # fmt: skip


def stage_expand(shape: Shape, ctx: Context) -> None:
    """Expand rows (permute ``x`` into expert order), against ``index_select``."""
    inp = ctx.inputs(shape)
    x, maps = inp.x, inp.maps
    T, N, es = shape.T, shape.T * shape.K, x.element_size()
    d2s = maps.expanded_dest_row_to_expanded_source_row
    nbytes = T * shape.H * es + N * shape.H * es + N * 4  # read x once, write N rows, one map
    ref = B.torch_expand(x, d2s)
    ctx.measure("expand", shape, "torch gather", lambda: B.torch_expand(x, d2s), nbytes)
    for impl, backend in _variants(ctx):
        ctx.measure(
            "expand", shape, impl, lambda b=backend: moe_route.expand_rows(x, maps, backend=b),
            nbytes, check=_exact(ref),
        )  # fmt: skip


def stage_finalize(shape: Shape, ctx: Context) -> None:
    """finalizeMoeRouting (gather, weight, K-way sum, bias), against gather + weighted sum."""
    inp = ctx.inputs(shape)
    maps, w = inp.maps, inp.topk_weights
    T, H, N = shape.T, shape.H, shape.T * shape.K
    y = inp.randn(N, H)
    bias = inp.randn(H)
    es = y.element_size()
    s2d = maps.expanded_source_row_to_expanded_dest_row
    # Read N permuted rows, the weights and two maps, write T rows; the [H] bias is noise.
    nbytes = N * H * es + T * H * es + N * 12 + H * es
    ref = B.torch_finalize(y, w, s2d, bias)
    ctx.measure(
        "finalize", shape, "torch gather+sum", lambda: B.torch_finalize(y, w, s2d, bias), nbytes
    )
    for impl, backend in _variants(ctx):
        ctx.measure(
            "finalize", shape, impl,
            lambda b=backend: moe_route.finalize_moe_routing(y, w, maps, bias, backend=b), nbytes,
            check=lambda out: rel_err(out, ref), tol=_tol(ctx),
        )  # fmt: skip
