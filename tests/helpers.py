"""Shared test helpers: device choice, tolerances, random routings, poison, invariant checks.

Tolerances are derived from the arithmetic the contract prescribes rather than picked to pass:
finalize accumulates in float32 and rounds once to the output dtype, so against a float64
reference the error of one output element is at most

    rounding:      1 ulp of the result     <= eps(dtype) * |ref|
    accumulation:  (K + 2) float32 roundings of the terms' magnitudes
                   <= (K + 2) * eps(float32) * scale,  scale = bias + Σ_k |w| · |y|

One *ulp* and not half of one: under ``TRITON_INTERPRET=1`` (triton 3.5.1) the interpreter
converts float32 -> bfloat16 by truncation instead of round-to-nearest-even, so an interpreted
bf16 result may sit a full ulp (2**-7 relative) from the exact value where a GPU would be
within half an ulp. float16 conversion rounds to nearest in the interpreter (numpy).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moe_route
from moe_route import arch
from moe_route.reference import finalize_moe_routing_reference

#: Where the Triton kernels run: the GPU when there is one, else the CPU under the interpreter.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

#: Triton kernels can run on DEVICE (compiled on CUDA, interpreted on the CPU).
TRITON_OK = DEVICE.type == "cuda" or arch.triton_interpreter_enabled()

requires_triton = pytest.mark.skipif(
    not TRITON_OK, reason="Triton kernels need a CUDA device or TRITON_INTERPRET=1"
)

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INT_SENTINEL = -7  # never a valid map entry (entries are >= -1)


# ----------------------------------------------------------------------------- tolerances
def ulp_rtol(dtype: torch.dtype) -> float:
    """Relative size of one ulp of ``dtype`` (its machine epsilon, 2**-p)."""
    return torch.finfo(dtype).eps


def accumulation_rtol(top_k: int) -> float:
    """Bound on float32 accumulation error of ``K`` products plus a bias, relative to scale."""
    return (top_k + 2) * torch.finfo(torch.float32).eps


def router_weight_rtol(dtype: torch.dtype, num_experts: int, top_k: int) -> float:
    """Bound on the relative distance of two implementations' softmax top-k weights.

    Each computes ``w = exp(x - max) / D`` in ``dtype`` (float32 or float64): ``exp`` within
    2 ulps (libdevice; numpy and torch's CPU kernels 1), ``D`` a sum of at most ``E`` positive
    such terms in an order of its own (``(E - 1)`` roundings), the renormalisation over the
    ``K`` chosen another ``K`` roundings and a division or a reciprocal (1 ulp): at most
    ``(E + K + 6)`` ulps each, twice that between two of them.
    """
    return 2 * (num_experts + top_k + 6) * torch.finfo(dtype).eps


def sigmoid_router_rtol(dtype: torch.dtype, top_k: int) -> float:
    """Bound on the relative distance of two implementations' grouped sigmoid router weights.

    Each computes ``s = 1 / (1 + exp(-x))`` in ``dtype`` (float32 or float64): ``exp`` within
    2 ulps, the sum and the division one rounding each, so ``s`` within 4 ulps; renormalised,
    a sum of ``K`` such positive terms in an order of its own (``K - 1`` roundings), ``+ 1e-20``
    and a division (2), the scaling factor (1): at most ``(K + 8)`` ulps each, twice that
    between two of them.
    """
    return 2 * (top_k + 8) * torch.finfo(dtype).eps


def sigmoid_router_grad_atol(
    dtype: torch.dtype, top_k: int, scale: float, grad: torch.Tensor
) -> float:
    """Absolute bound on the distance of two implementations' ``dlogits`` of the grouped
    sigmoid router (``dtype``: the score dtype), for the weights' gradient ``grad``.

    ``dlogits[id_k] = s_k (1 - s_k) (γ_k - Σ_j γ_j w_j) / D`` with ``γ = scale · grad``,
    ``w = u / D`` and ``s_k <= D``, so ``|dlogits| <= 2 γmax`` (``γmax = scale · max|grad|``).
    One implementation's error: ``Σ_j γ_j w_j`` ``(2K + 9)`` ulps of ``γmax`` (``K`` roundings
    of the sum, the weights' ``K + 8``), the subtraction, division and the sigmoid factor
    (``1 - s`` carries ``s``'s 4 ulps absolute) about 11 more: ``2 (K + 10)`` ulps of
    ``γmax``; twice that between two.
    """
    gmax = grad.abs().max().item() if grad.numel() else 0.0
    return 4 * (top_k + 10) * torch.finfo(dtype).eps * scale * gmax


def subnormal_atol(dtype: torch.dtype) -> float:
    """Spacing of the subnormals of ``dtype``: an absolute floor for results near zero."""
    fi = torch.finfo(dtype)
    return fi.smallest_normal * fi.eps


def assert_close_to_reference(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    rtol: float,
    atol: float | torch.Tensor = 0.0,
    name: str = "output",
) -> None:
    """``|actual - expected| <= rtol * |expected| + atol`` elementwise, NaN only where expected.

    ``expected`` should be the float64 reference; ``atol`` may be a tensor (e.g. a per-element
    accumulation bound). On failure the message gives the max relative and absolute error, the
    worst element and how many elements are out of bounds.
    """
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    atol_t = torch.as_tensor(atol, dtype=torch.float64).to("cpu")
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    if not torch.equal(nan_a, nan_e):
        bad = (nan_a != nan_e).nonzero()[:5].tolist()
        raise AssertionError(
            f"{name}: NaN pattern differs at {int((nan_a != nan_e).sum())} elements, e.g. {bad}"
        )
    a, e = a.masked_fill(nan_e, 0.0), e.masked_fill(nan_e, 0.0)
    err = (a - e).abs()
    bound = rtol * e.abs() + atol_t
    over = err > bound
    if a.numel() == 0 or not bool(over.any()):
        return
    rel = err / e.abs().clamp_min(torch.finfo(torch.float64).tiny)
    worst = int((err - bound).argmax())
    idx = np.unravel_index(worst, tuple(a.shape))
    raise AssertionError(
        f"{name}: {int(over.sum())}/{a.numel()} elements out of tolerance "
        f"(rtol={rtol:.3g}); max abs err {err.max().item():.3g}, max rel err "
        f"{rel.max().item():.3g}; worst at {tuple(int(i) for i in idx)}: actual "
        f"{a.reshape(-1)[worst].item()!r}, expected {e.reshape(-1)[worst].item()!r}, "
        f"bound {bound.reshape(-1)[worst].item():.3g}"
    )


def finalize_expected(y_perm, topk_weights, maps, bias=None):
    """float64 reference of finalize and the per-element error scale ``bias + Σ|w||y|``."""
    s2d, efs = maps.expanded_source_row_to_expanded_dest_row, maps.expert_for_source_row
    d = torch.float64
    b64 = None if bias is None else bias.to(d)
    exact = finalize_moe_routing_reference(y_perm.to(d), topk_weights.to(d), s2d, efs, b64)
    babs = None if bias is None else bias.to(d).abs()
    scale = finalize_moe_routing_reference(
        y_perm.to(d).abs(), topk_weights.to(d).abs(), s2d, efs, babs
    )
    return exact, scale


def assert_finalize_close(out, y_perm, topk_weights, maps, bias=None, *, name="finalize"):
    """Check a finalize result against the float64 reference with the bound of the module doc."""
    exact, scale = finalize_expected(y_perm, topk_weights, maps, bias)
    dtype = out.dtype
    # Near zero each of the K + 2 float32 roundings loses up to a subnormal spacing, not eps
    # relative; the output's own rounding adds one spacing of its dtype.
    floor = (maps.top_k + 2) * subnormal_atol(torch.float32) + subnormal_atol(dtype)
    atol = accumulation_rtol(maps.top_k) * scale.cpu() + floor
    assert_close_to_reference(out, exact, rtol=ulp_rtol(dtype), atol=atol, name=name)


# ----------------------------------------------------------------------------- routings
def random_topk_ids(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    *,
    drop_prob: float = 0.0,
    distinct: bool = True,
    dtype: torch.dtype = torch.int64,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> torch.Tensor:
    """``[T, K]`` expert ids: distinct per token (as top-k gives) or arbitrary with repeats;
    each slot dropped (``-1``) with probability ``drop_prob``."""
    g = torch.Generator().manual_seed(seed)
    T, K, E = num_tokens, top_k, num_experts
    if distinct:
        ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]
    else:
        ids = torch.randint(0, E, (T, K), generator=g)
    if drop_prob > 0:
        ids = ids.masked_fill(torch.rand(T, K, generator=g) < drop_prob, -1)
    return ids.to(dtype).to(device)


def random_weights(
    num_tokens: int, top_k: int, *, dtype=torch.float32, device="cpu", seed: int = 0
) -> torch.Tensor:
    """Router weights: a softmax over ``K`` random logits per token (rows sum to ~1)."""
    g = torch.Generator().manual_seed(seed + 1)
    return torch.softmax(torch.randn(num_tokens, top_k, generator=g), dim=-1).to(dtype).to(device)


def randn(*shape, dtype=torch.float32, device="cpu", seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 2)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).to(device)


def strided_copy(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values as ``t`` (2-D) in a non-contiguous layout.

    ``"transposed"``: column-major storage; ``"cols"``: every other column of a wider tensor;
    ``"rows"``: every other row of a taller tensor; ``"contiguous"``: a plain copy.
    """
    if layout == "contiguous":
        return t.clone()
    if layout == "transposed":
        out = t.t().contiguous().t()
    elif layout == "cols":
        wide = torch.full_like(t, 0).repeat(1, 2)
        wide[:, ::2] = t
        out = wide[:, ::2]
    elif layout == "rows":
        tall = torch.full_like(t, 0).repeat(2, 1)
        tall[::2] = t
        out = tall[::2]
    else:
        raise ValueError(layout)
    torch.testing.assert_close(out, t, rtol=0, atol=0, equal_nan=True)
    assert out.numel() <= 1 or not out.is_contiguous() or min(t.shape) <= 1
    return out


# ----------------------------------------------------------------------------- poison
def poisoned(shape, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """A tensor whose every element is a value no kernel writes: NaN, or ``INT_SENTINEL``."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, INT_SENTINEL, dtype=dtype, device=device)


def poisoned_maps_outputs(num_slots: int, num_experts: int, device="cpu"):
    """Preallocated outputs of ``routing_maps_triton``, every element a sentinel."""
    return (
        poisoned((num_slots,), torch.int32, device),
        poisoned((num_slots,), torch.int32, device),
        poisoned((num_slots,), torch.int32, device),
        poisoned((num_experts + 1,), torch.int64, device),
    )


def triton_maps(topk_ids: torch.Tensor, num_experts: int, *, tile: int | None = None):
    """Run the Triton routing-map launcher into poisoned outputs; return the four tables."""
    from moe_route.kernels.triton.routing_maps import routing_maps_triton

    outs = poisoned_maps_outputs(topk_ids.numel(), num_experts, topk_ids.device)
    routing_maps_triton(topk_ids, num_experts, *outs, tile=tile)
    return outs


def maps_tables(maps: moe_route.RoutingMaps):
    return (
        maps.expanded_source_row_to_expanded_dest_row,
        maps.expanded_dest_row_to_expanded_source_row,
        maps.expert_for_source_row,
        maps.expert_first_token_offset,
    )


TABLE_NAMES = (
    "expanded_source_row_to_expanded_dest_row",
    "expanded_dest_row_to_expanded_source_row",
    "expert_for_source_row",
    "expert_first_token_offset",
)


def assert_tables_equal(actual, expected, *, what: str = "") -> None:
    """Exact equality of the four routing tables, dtype included."""
    for name, a, e in zip(TABLE_NAMES, actual, expected, strict=True):
        assert a.dtype == e.dtype, f"{what}{name}: dtype {a.dtype} != {e.dtype}"
        assert torch.equal(a.cpu(), e.cpu()), (
            f"{what}{name} differs:\n  actual   {a.cpu().tolist()}\n  expected {e.cpu().tolist()}"
        )


# ----------------------------------------------------------------------------- invariants
def check_routing_invariants(tables, topk_ids: torch.Tensor, num_experts: int) -> None:
    """Assert every property of DESIGN.md's data contract, computed independently of the
    reference (numpy, from the ids alone)."""
    s2d_t, d2s_t, efs_t, off_t = tables
    ids = topk_ids.cpu().numpy().astype(np.int64)
    T, K = ids.shape
    N, E = T * K, num_experts
    for name, t in zip(TABLE_NAMES[:3], (s2d_t, d2s_t, efs_t), strict=True):
        assert t.dtype == torch.int32 and tuple(t.shape) == (N,), f"{name}: {t.dtype} {t.shape}"
    assert off_t.dtype == torch.int64 and tuple(off_t.shape) == (E + 1,), off_t
    s2d, d2s = s2d_t.cpu().numpy().astype(np.int64), d2s_t.cpu().numpy().astype(np.int64)
    efs, off = efs_t.cpu().numpy().astype(np.int64), off_t.cpu().numpy()
    rows = np.arange(N)

    # Two inverse permutations of range(N).
    assert np.array_equal(np.sort(s2d), rows), f"src_to_dest is not a permutation: {s2d}"
    assert np.array_equal(np.sort(d2s), rows), f"dest_to_src is not a permutation: {d2s}"
    assert np.array_equal(s2d[d2s], rows) and np.array_equal(d2s[s2d], rows), "not inverses"

    # expert_for_source_row is topk_ids read k-major (s = k*T + t), out-of-range ids -> -1.
    routed_ids = np.where((ids >= 0) & (ids < E), ids, -1)
    assert np.array_equal(efs, routed_ids.T.reshape(-1)), (
        f"expert_for_source_row {efs} != k-major ids {routed_ids.T.reshape(-1)}"
    )

    # Offsets are the exclusive cumulative histogram of the routed experts.
    counts = np.bincount(efs[efs >= 0], minlength=E)
    expected_off = np.concatenate([[0], np.cumsum(counts)])
    assert np.array_equal(off, expected_off), f"offsets {off} != cumulative histogram"
    routed = int(off[E])

    # Dest order: experts contiguous and ascending, matching the offsets ...
    expert_of_dest = efs[d2s]
    for e in range(E):
        seg = expert_of_dest[off[e] : off[e + 1]]
        assert (seg == e).all(), f"dest rows [{off[e]}, {off[e + 1]}) hold experts {seg}, not {e}"
        # ... inside an expert token ascending, then slot k ascending (strictly: keys unique).
        src = d2s[off[e] : off[e + 1]]
        token_major = (src % max(T, 1)) * K + src // max(T, 1)
        assert (np.diff(token_major) > 0).all(), f"expert {e}: (t, k) not ascending: {src}"
    # Dropped slots sit after every routed row, in ascending source-row order.
    assert (expert_of_dest[routed:] == -1).all(), "a routed row sits after offset[E]"
    assert (np.diff(d2s[routed:]) > 0).all(), f"dropped rows not in source order: {d2s[routed:]}"


# ----------------------------------------------------------------------------- CUDA graphs
def capture_cuda_graph(fn, *, warmup: int = 3):
    """``(graph, out)``: one call of ``fn`` captured in a CUDA graph by the standard recipe.

    ``warmup`` calls run on a side stream first (Triton compiles, the allocator's cache
    fills), then one call is captured with ``torch.cuda.set_sync_debug_mode("error")``, so a
    host sync raises with its own stack instead of invalidating the capture. ``out`` is what
    the captured call returned: its static outputs, rewritten by every replay.

    ``fn`` must return tensors, never an autograd graph (``.detach()`` its outputs): a graph
    that outlives a call keeps its leaves' gradient accumulators, which keep the stream they
    were made on, and a backward captured later would make that stream wait on the capturing
    one — with the default stream, "operation would make the legacy stream depend on a
    capturing blocking stream". Mark the test ``isolated`` (tests/conftest.py): a failed
    capture leaves the process unfit for the tests after it.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return graph, out
