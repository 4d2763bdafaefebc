"""Routers, auxiliary losses and capacity (moe_route.routing) against the plain-loop oracles of
moe_route.reference and against values worked out by hand.

Ids are compared exactly, weights to float32 rounding (the routers score in float32, the
oracles in Python float64); random logits have no near-ties at these sizes.
"""

from __future__ import annotations

import math

import pytest
import torch

import moe_route
from moe_route import reference


def _logits(T, E, *, seed=0, scale=2.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, E, generator=g, dtype=torch.float64) * scale).to(dtype)


def _assert_router_equal(got, want):
    (w, ids), (w_ref, ids_ref) = got, want
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids, ids_ref), (ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=2e-6, atol=1e-7)


# ----------------------------------------------------------------------------- routers
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(("T", "E", "k"), [(37, 8, 2), (5, 16, 8), (3, 4, 4), (1, 1, 1)])
def test_softmax_topk_matches_loop(T, E, k, renormalize):
    logits = _logits(T, E, seed=T + E)
    got = moe_route.softmax_topk(logits, k, renormalize)
    _assert_router_equal(got, reference.softmax_topk_reference(logits, k, renormalize))
    # the vectorised oracle that predates this module agrees as well
    _, ids_old = reference.topk_routing_reference(logits, k, renormalize=renormalize)
    assert torch.equal(got[1], ids_old)
    if renormalize:
        torch.testing.assert_close(got[0].sum(-1), torch.ones(T))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_softmax_topk_scores_low_precision_logits_in_float32(dtype):
    logits = _logits(20, 8, seed=3, dtype=dtype)
    w, ids = moe_route.softmax_topk(logits, 2, False)
    _assert_router_equal((w, ids), reference.softmax_topk_reference(logits.float(), 2, False))


SIGMOID_CASES = {
    "no-groups": dict(E=8, k=2, n_group=1, topk_group=None),
    "deepseek-like": dict(E=16, k=4, n_group=4, topk_group=2),
    "group-of-one": dict(E=6, k=2, n_group=6, topk_group=3),
    "one-group-kept": dict(E=12, k=3, n_group=3, topk_group=1),
}


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "expert-bias"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("case", SIGMOID_CASES.values(), ids=SIGMOID_CASES.keys())
def test_sigmoid_grouped_topk_matches_loop(case, renormalize, with_bias):
    E, k = case["E"], case["k"]
    logits = _logits(41, E, seed=E + k)
    # a bias of the size of the scores' spread: it changes many choices
    bias = _logits(1, E, seed=99, scale=0.3)[0] if with_bias else None
    kw = dict(n_group=case["n_group"], topk_group=case["topk_group"], expert_bias=bias,
              routed_scaling_factor=2.5, renormalize=renormalize)  # fmt: skip
    got = moe_route.sigmoid_grouped_topk(logits, k, **kw)
    _assert_router_equal(got, reference.sigmoid_grouped_topk_reference(logits, k, **kw))
    if with_bias:  # the bias steers the choice but never enters the weights
        unbiased = moe_route.sigmoid_grouped_topk(logits, k, **{**kw, "expert_bias": None})
        assert not torch.equal(got[1], unbiased[1])
        scores = torch.sigmoid(logits).gather(1, got[1].long())
        if renormalize:
            scores = scores / scores.sum(-1, keepdim=True)
        torch.testing.assert_close(got[0], 2.5 * scores)


def test_sigmoid_grouped_topk_keeps_only_chosen_groups():
    # 4 groups of 2; group scores (top-2 sums): g0 low, g1 high, g2 highest, g3 low
    logits = torch.tensor([[-3.0, -3.0, 1.0, 0.5, 2.0, 2.0, -1.0, 3.0]])
    w, ids = moe_route.sigmoid_grouped_topk(logits, 3, n_group=4, topk_group=2)
    # expert 7 is the best single expert but its group (g3: 3.0 and -1.0) loses to g1, g2;
    # experts 4 and 5 tie: the lower id comes first (torch.topk put 5 first on the CPU)
    assert ids.tolist() == [[4, 5, 2]]
    s = torch.sigmoid(logits[0, [4, 5, 2]])
    torch.testing.assert_close(w[0], s / s.sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_go_to_the_lower_expert_id(dtype):
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0, 3.0, 3.0, 2.0]] * 3, dtype=dtype)
    for _, ids in (moe_route.softmax_topk(logits, 4), moe_route.sigmoid_grouped_topk(logits, 4)):
        assert ids.tolist() == [[1, 2, 3, 5]] * 3
    # groups {1,3} {3,3} {0,3} {3,2}: g1 and g3 kept, then experts 2, 3 (tie), 6 (tie with 3)
    _, ids = moe_route.sigmoid_grouped_topk(logits, 3, n_group=4, topk_group=2)
    assert ids.tolist() == [[2, 3, 6]] * 3
    want = reference.sigmoid_grouped_topk_reference(logits.float(), 3, n_group=4, topk_group=2)
    assert torch.equal(ids, want[1])


def test_routers_differentiable_in_logits():
    logits = _logits(6, 8, seed=5, dtype=torch.float64).requires_grad_(True)
    for router in (
        lambda lg: moe_route.softmax_topk(lg, 3, True)[0],
        lambda lg: moe_route.softmax_topk(lg, 3, False)[0],
        lambda lg: moe_route.sigmoid_grouped_topk(
            lg, 3, n_group=4, topk_group=2, expert_bias=torch.linspace(-0.1, 0.1, 8),
            routed_scaling_factor=1.5,
        )[0],
    ):  # fmt: skip
        assert router(logits).dtype == torch.float64
        assert torch.autograd.gradcheck(router, (logits,))


# ----------------------------------------------------------------------------- aux losses
def test_load_balancing_loss_by_hand():
    # T=2, E=2, K=1: both tokens pick expert 0. f = [1, 0], P = [0.625, 0.375]
    probs = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    ids = torch.tensor([[0], [0]])
    loss = moe_route.load_balancing_loss(probs, ids, 2)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss, torch.tensor(2 * (1 * 0.625 + 0 * 0.375)))
    # T=4, E=4, K=2 with a dropped slot: counts [2, 3, 1, 1] → f = [.5, .75, .25, .25]
    probs = torch.tensor(
        [[0.4, 0.3, 0.2, 0.1], [0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]]
    )
    ids = torch.tensor([[0, 1], [1, 2], [3, 1], [0, -1]], dtype=torch.int32)
    P = [1.45 / 4, 1.25 / 4, 0.75 / 4, 0.55 / 4]
    want = 4 * (0.5 * P[0] + 0.75 * P[1] + 0.25 * P[2] + 0.25 * P[3])
    torch.testing.assert_close(moe_route.load_balancing_loss(probs, ids, 4), torch.tensor(want))
    assert math.isclose(reference.load_balancing_loss_reference(probs, ids, 4), want, rel_tol=1e-6)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_load_balancing_loss_uniform_routing_is_k(k):
    E, T = 8, 16
    probs = torch.full((T, E), 1.0 / E)
    ids = (torch.arange(T).unsqueeze(1) * k + torch.arange(k)) % E  # every expert T*k/E times
    torch.testing.assert_close(moe_route.load_balancing_loss(probs, ids, E), torch.tensor(float(k)))


def test_load_balancing_loss_matches_loop_and_transformers_formula():
    logits = _logits(33, 8, seed=11)
    probs = torch.softmax(logits, -1)
    _, ids = moe_route.softmax_topk(logits, 2)
    got = moe_route.load_balancing_loss(probs, ids, 8)
    assert math.isclose(got.item(), reference.load_balancing_loss_reference(probs, ids, 8),
                        rel_tol=1e-6)  # fmt: skip
    # transformers' load_balancing_loss_func (one layer, no attention mask), written out
    mask = torch.nn.functional.one_hot(ids.long(), 8).float()  # [T, K, E]
    hf = (mask.mean(0) * probs.mean(0).unsqueeze(0)).sum() * 8
    torch.testing.assert_close(got, hf)
    # gradient flows to the probabilities only
    p = probs.clone().requires_grad_(True)
    moe_route.load_balancing_loss(p, ids, 8).backward()
    f = moe_route.tokens_per_expert(ids, 8).float() / 33
    torch.testing.assert_close(p.grad, (8 * f / 33).expand(33, 8))


def test_router_z_loss_by_hand():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])  # lse = ln 2, ln 4
    want = (math.log(2) ** 2 + math.log(4) ** 2) / 2
    torch.testing.assert_close(moe_route.router_z_loss(logits), torch.tensor(want))
    logits = _logits(9, 5, seed=2, scale=4.0)
    assert math.isclose(
        moe_route.router_z_loss(logits).item(), reference.router_z_loss_reference(logits),
        rel_tol=1e-6,
    )  # fmt: skip
    assert moe_route.router_z_loss(logits.bfloat16()).dtype == torch.float32


def test_losses_of_zero_tokens_are_zero():
    assert moe_route.load_balancing_loss(torch.zeros(0, 4), torch.zeros(0, 2).long(), 4) == 0
    assert moe_route.router_z_loss(torch.zeros(0, 4)) == 0


# ----------------------------------------------------------------------------- capacity
def test_expert_capacity():
    assert moe_route.expert_capacity(1.0, 10, 2, 4) == 5
    assert moe_route.expert_capacity(1.25, 10, 2, 4) == 7  # ceil(6.25)
    assert moe_route.expert_capacity(0.01, 10, 2, 4) == 1
    assert moe_route.expert_capacity(2.0, 0, 2, 4) == 0
    with pytest.raises(ValueError, match="capacity_factor"):
        moe_route.expert_capacity(0.0, 10, 2, 4)
    with pytest.raises(ValueError, match="capacity_factor"):
        moe_route.expert_capacity(float("nan"), 10, 2, 4)


def test_expert_capacity_is_capped_at_every_slot():
    """A factor ``>= E`` keeps every slot (``T·K``): no overflow, however large the factor."""
    assert moe_route.expert_capacity(1e308, 8, 2, 4) == 16
    assert moe_route.expert_capacity(10**400, 8, 2, 4) == 16
    assert moe_route.expert_capacity(4.0, 8, 2, 4) == 16
    assert moe_route.expert_capacity(3.99, 8, 2, 4) == 16  # ceil(15.96)
    assert moe_route.expert_capacity(1e308, 0, 2, 4) == 0
    with pytest.raises(ValueError, match=r"capacity_factor=inf: expected a finite number > 0"):
        moe_route.expert_capacity(float("inf"), 8, 2, 4)


@pytest.mark.parametrize(
    ("args", "exc", "match"),
    [
        ((1.0, -8, 2, 4), ValueError, r"num_tokens=-8: expected an int >= 0"),
        ((1.0, 8.0, 2, 4), TypeError, r"num_tokens must be an int, got float 8.0"),
        ((1.0, True, 2, 4), TypeError, r"num_tokens must be an int, got bool"),
        ((1.0, 8, 0, 4), ValueError, r"top_k=0: expected an int >= 1"),
        ((1.0, 8, 2, 0), ValueError, r"num_experts must be >= 1, got 0"),
        ((1.0, 8, 2, 4.0), TypeError, r"num_experts must be an int, got float"),
    ],
)
def test_expert_capacity_checks_the_sizes(args, exc, match):
    with pytest.raises(exc, match=match):
        moe_route.expert_capacity(*args)


@pytest.mark.parametrize("capacity", [2**31, 2**63, 2**64 + 1, 10**30])
def test_apply_capacity_past_every_slot_drops_nothing(capacity):
    ids = torch.tensor([[0, 1], [1, 0], [0, -1]])
    assert torch.equal(moe_route.apply_capacity(ids, 2, capacity), ids)
    assert torch.equal(moe_route.apply_capacity(ids.int(), 2, capacity, backend="torch"), ids.int())


def test_apply_capacity_checks_its_capacity():
    ids = torch.zeros(4, 2, dtype=torch.long)
    with pytest.raises(TypeError, match=r"capacity must be an int, got float 2.0"):
        moe_route.apply_capacity(ids, 8, 2.0)
    with pytest.raises(TypeError, match=r"capacity must be an int, got bool"):
        moe_route.apply_capacity(ids, 8, True)


def test_apply_capacity_by_hand():
    # expert 0 picked by tokens 0, 1, 2 (slot 0) and token 3 (slot 1); capacity 2
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [2, 0]])
    got = moe_route.apply_capacity(ids, 3, 2)
    assert got.tolist() == [[0, 1], [0, 2], [-1, 1], [2, -1]]
    assert got.dtype == ids.dtype
    # earliest *token* wins, even over an earlier slot: token 0 slot 1 beats token 1 slot 0
    ids = torch.tensor([[1, 0], [0, 1]], dtype=torch.int32)
    assert moe_route.apply_capacity(ids, 2, 1).tolist() == [[1, 0], [-1, -1]]


@pytest.mark.parametrize("capacity", [0, 1, 3, 7, 100])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_apply_capacity_matches_loop(capacity, dtype):
    g = torch.Generator().manual_seed(capacity)
    T, K, E = 29, 3, 6
    # skewed routing (experts 0 and 1 popular), distinct per token, some slots dropped
    ids = torch.rand(T, E, generator=g).argsort(1)[:, :K]
    ids = torch.where(torch.rand(T, K, generator=g) < 0.4, ids % 2, ids)
    ids = _distinct_rows(ids, E).masked_fill(torch.rand(T, K, generator=g) < 0.1, -1).to(dtype)
    got = moe_route.apply_capacity(ids, E, capacity, backend="reference")
    assert torch.equal(got, reference.apply_capacity_reference(ids, E, capacity))
    counts = moe_route.tokens_per_expert(got, E)
    assert int(counts.max()) <= capacity


def _distinct_rows(ids, E):
    """Make each row's ids distinct (as top-k gives) by bumping repeats to a free expert."""
    out = ids.clone()
    for row in out:
        seen = set()
        for j, e in enumerate(row.tolist()):
            while e in seen:
                e = (e + 1) % E
            seen.add(e)
            row[j] = e
    return out


def test_tokens_per_expert():
    ids = torch.tensor([[0, 3], [3, -1], [2, 3]])
    assert moe_route.tokens_per_expert(ids, 4).tolist() == [1, 0, 1, 3]
    assert moe_route.tokens_per_expert(ids, 4).dtype == torch.int64


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("renormalize", ["False", "no", 0, None])
def test_routers_take_a_real_bool_renormalize(renormalize):
    logits = torch.randn(4, 8)
    match = rf"renormalize must be a bool, got {type(renormalize).__name__}"
    with pytest.raises(TypeError, match=match):
        moe_route.softmax_topk(logits, 2, renormalize)
    with pytest.raises(TypeError, match=match):
        moe_route.sigmoid_grouped_topk(logits, 2, renormalize=renormalize)


def test_router_errors_name_the_argument():
    logits = torch.randn(4, 8)
    with pytest.raises(ValueError, match="k=9"):
        moe_route.softmax_topk(logits, 9)
    with pytest.raises(ValueError, match="logits must have 2 dimensions"):
        moe_route.softmax_topk(logits[0], 1)
    with pytest.raises(ValueError, match="n_group=3 does not divide num_experts=8"):
        moe_route.sigmoid_grouped_topk(logits, 2, n_group=3)
    with pytest.raises(ValueError, match="topk_group=5"):
        moe_route.sigmoid_grouped_topk(logits, 2, n_group=4, topk_group=5)
    with pytest.raises(ValueError, match="k=5 experts per token but topk_group=2"):
        moe_route.sigmoid_grouped_topk(logits, 5, n_group=4, topk_group=2)
    with pytest.raises(ValueError, match="expert_bias must be"):
        moe_route.sigmoid_grouped_topk(logits, 2, expert_bias=torch.zeros(7))
    with pytest.raises(ValueError, match="capacity=-1"):
        moe_route.apply_capacity(torch.zeros(4, 2, dtype=torch.long), 8, -1)
    with pytest.raises(ValueError, match="num_experts = 3"):
        moe_route.load_balancing_loss(torch.rand(4, 8), torch.zeros(4, 2).long(), 3)
