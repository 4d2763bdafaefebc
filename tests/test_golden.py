"""The golden example of DESIGN.md (T=3, K=2, E=3), plus two hand-derived variants, on every
backend, and the whole chain on it against ``moe_forward_reference``."""

import pytest
import torch
from helpers import DEVICE, TRITON_OK, assert_finalize_close, check_routing_invariants, maps_tables

import moe_route
from moe_route.reference import grouped_gemm_reference, moe_forward_reference

BACKENDS = [
    "reference",
    pytest.param(
        "triton", marks=pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")
    ),
]

# (ids, E, src_to_dest, dest_to_src, expert_for_source_row, expert_first_token_offset)
GOLDEN = {
    # DESIGN.md / the reference walkthrough, verbatim.
    "design": (
        [[0, 1], [0, 2], [1, 2]],
        3,
        [0, 1, 3, 2, 4, 5],
        [0, 1, 3, 2, 4, 5],
        [0, 0, 1, 1, 2, 2],
        [0, 2, 4, 6],
    ),
    # Drops and an empty expert. Source rows s = k*T + t hold experts [0, 2, -1 | -1, 0, -1]:
    # expert 0 gets t0 (s0), t1 (s4); expert 1 nothing; expert 2 gets t1 (s1); then the
    # dropped rows s2, s3, s5 in source order.
    "drops": (
        [[0, -1], [2, 0], [-1, -1]],
        3,
        [0, 2, 3, 4, 1, 5],
        [0, 4, 1, 2, 3, 5],
        [0, 2, -1, -1, 0, -1],
        [0, 2, 2, 3],
    ),
    # A token picking the same expert twice: inside expert 1, t0 k0 (s0), t0 k1 (s2), t1 k1 (s3).
    "repeat": (
        [[1, 1], [0, 1]],
        2,
        [1, 0, 2, 3],
        [1, 0, 2, 3],
        [1, 0, 1, 1],
        [0, 1, 4],
    ),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(GOLDEN))
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_golden_maps(backend, case, id_dtype):
    ids_list, E, s2d, d2s, efs, off = GOLDEN[case]
    ids = torch.tensor(ids_list, dtype=id_dtype, device=DEVICE)
    maps = moe_route.build_routing_maps(ids, E, backend=backend)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    expected = (
        torch.tensor(s2d, **i32),
        torch.tensor(d2s, **i32),
        torch.tensor(efs, **i32),
        torch.tensor(off, dtype=torch.int64, device=DEVICE),
    )
    for name, got, want in zip(
        ("src_to_dest", "dest_to_src", "expert_for_source_row", "offsets"),
        maps_tables(maps),
        expected,
        strict=True,
    ):
        assert got.dtype == want.dtype, name
        assert torch.equal(got, want), f"{name}: {got.tolist()} != {want.tolist()}"
    assert (maps.num_tokens, maps.top_k, maps.num_experts) == (len(ids_list), len(ids_list[0]), E)
    assert maps.num_expanded_rows == ids.numel()
    assert torch.equal(maps.tokens_per_expert(), torch.diff(expected[3]))
    check_routing_invariants(maps_tables(maps), ids, E)


@pytest.mark.parametrize("backend", BACKENDS)
def test_golden_expand_and_finalize_by_hand(backend):
    ids = torch.tensor(GOLDEN["design"][0], device=DEVICE)
    maps = moe_route.build_routing_maps(ids, 3, backend=backend)
    x = torch.tensor([[1.0, 2.0], [10.0, 20.0], [100.0, 200.0]], device=DEVICE)
    x_perm = moe_route.expand_rows(x, maps, backend=backend)
    # dest_to_src = [0, 1, 3, 2, 4, 5] -> tokens s mod 3 = [0, 1, 0, 2, 1, 2]
    assert torch.equal(x_perm, x[[0, 1, 0, 2, 1, 2]])

    y_perm = torch.arange(12, dtype=torch.float32, device=DEVICE).reshape(6, 2) + 1
    w = torch.tensor([[0.5, 0.25], [2.0, 4.0], [1.0, 8.0]], device=DEVICE)
    bias = torch.tensor([1000.0, 3000.0], device=DEVICE)
    out = moe_route.finalize_moe_routing(y_perm, w, maps, bias, backend=backend)
    # out[t] = bias + w[t,0] * y[dest(t)] + w[t,1] * y[dest(3 + t)], dest = [0, 1, 3, 2, 4, 5]
    want = torch.stack(
        [
            bias + 0.5 * y_perm[0] + 0.25 * y_perm[2],
            bias + 2.0 * y_perm[1] + 4.0 * y_perm[4],
            bias + 1.0 * y_perm[3] + 8.0 * y_perm[5],
        ]
    )
    assert torch.equal(out, want), (out, want)  # small integers and dyadic weights: exact


def _chain_inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    T, K, E, H, inter = 3, 2, 3, 12, 5

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).to(DEVICE)

    return dict(
        x=r(T, H),
        w1=r(E, 2 * inter, H),
        w2=r(E, H, inter),
        b1=r(E, 2 * inter),
        b2=r(E, H),
        bias=r(H),
        topk_weights=torch.softmax(r(T, K), dim=-1),
        topk_ids=torch.tensor(GOLDEN["design"][0], device=DEVICE),
    )


def _chain(backend, x, w1, w2, b1, b2, bias, topk_weights, topk_ids):
    maps = moe_route.build_routing_maps(topk_ids, w1.shape[0], backend=backend)
    x_perm = moe_route.expand_rows(x, maps, backend=backend)
    offsets = maps.expert_first_token_offset
    h = grouped_gemm_reference(x_perm, w1, offsets, b1, activation="swiglu")
    y = grouped_gemm_reference(h, w2, offsets, b2)
    return moe_route.finalize_moe_routing(y, topk_weights, maps, bias, backend=backend), y, maps


@pytest.mark.parametrize("backend", BACKENDS)
def test_golden_full_chain(backend):
    inp = _chain_inputs(torch.float32)
    out, y, maps = _chain(backend, **inp)
    ref = moe_forward_reference(
        inp["x"],
        inp["w1"],
        inp["w2"],
        inp["topk_weights"],
        inp["topk_ids"],
        activation="swiglu",
        b1=inp["b1"],
        b2=inp["b2"],
        bias=inp["bias"],
    )
    if backend == "reference":
        # Same oracle, same float32 operations in the same order: the same bits.
        assert torch.equal(out, ref)
    # Either backend: within float32 rounding of the exact (float64) finalize of the same y.
    assert_finalize_close(out, y, inp["topk_weights"], maps, inp["bias"], name="chain")
    # And the chain agrees with the float64 oracle run on the same (float32) inputs.
    ref64 = moe_forward_reference(
        *(inp[k].double() for k in ("x", "w1", "w2", "topk_weights")),
        inp["topk_ids"],
        activation="swiglu",
        b1=inp["b1"].double(),
        b2=inp["b2"].double(),
        bias=inp["bias"].double(),
    )
    torch.testing.assert_close(out.double(), ref64, rtol=1e-5, atol=1e-5)
