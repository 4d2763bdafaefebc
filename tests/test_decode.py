"""The decode path of fused_moe (moe_route/kernels/triton/decode.py: two launches, no routing
maps) on the CPU through the interpreter, against the float64 reference and against the sorted
path (maps → GEMM1 → GEMM2 → finalize) on the same inputs: activations and layouts, biases,
dropped slots (NaN router weights, never read), K = E, zero tokens, strided weights. Also which
calls take it (eager, no gradient wanted, few slots), opcheck of its op, and that it launches
neither the maps nor the sorted GEMMs. The CPU runs are float32 / float16 (the interpreter's bf16
``tl.dot`` is wrong); bf16 runs on CUDA (tests/test_gpu_decode.py).
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from moe_cases import ACT_IDS, ACT_LAYOUTS, TOL, assert_matches, make_ids, needs_interpreter
from moe_cases import moe_case as make_moe
from moe_cases import moe_expected as expected
from moe_cases import run_moe as run

import moe_route
from moe_route import tuning
from moe_route.kernels.triton.decode import DecodeLaunch, _scratch
from moe_route.kernels.triton.routing_maps import MapsLaunch

moe_module = importlib.import_module("moe_route.moe")

pytestmark = needs_interpreter


@pytest.fixture
def sorted_path(monkeypatch):
    """Run fused_moe with the decode path turned off (every plan rebuilt)."""

    def turn_off():
        monkeypatch.setattr(tuning, "decode_config", lambda *a, **k: None)
        moe_route.plan.clear_plans()

    yield turn_off
    moe_route.plan.clear_plans()


@pytest.fixture(params=[False, True], ids=["per_token", "per_slot"])
def split(request, monkeypatch):
    """The second launch per token (the tables' tiles of large experts) or per slot, the last
    slot to arrive summing the token's terms (of small ones)."""
    tiles = tuning.decode_tiles

    def chosen(*a):
        return dataclasses.replace(tiles(*a), split=request.param)

    monkeypatch.setattr(tuning, "decode_tiles", chosen)
    moe_route.plan.clear_plans()
    return request.param


class Launches:
    """Counts the decode path's runs (a prepared DecodeLaunch called, whether by fused_moe's
    memo, the layer or the op) and the maps the Triton kernels built (a MapsLaunch called,
    whether by build_routing_maps's memo or the op), as they run: a signature's compile-ahead
    pass on a GPU (which calls each once more, and launches nothing) is turned off."""

    def __init__(self, monkeypatch):
        monkeypatch.setenv("MOE_ROUTE_COMPILE_AHEAD", "0")
        self.decode = self.maps = 0
        real_decode = DecodeLaunch.__call__
        real_maps = MapsLaunch.__call__

        def decode(*a, **k):
            self.decode += 1
            return real_decode(*a, **k)

        def maps(*a, **k):
            self.maps += 1
            return real_maps(*a, **k)

        monkeypatch.setattr(DecodeLaunch, "__call__", decode)
        monkeypatch.setattr(MapsLaunch, "__call__", maps)


def _both(case, sorted_path, **kw):
    moe_route.plan.clear_plans()
    fast = run(case, **kw)
    sorted_path()
    slow = run(case, **kw)
    return fast, slow


@pytest.mark.parametrize(("activation", "layout"), ACT_LAYOUTS, ids=ACT_IDS)
def test_activations_match_reference_and_sorted_path(monkeypatch, sorted_path, activation,
                                                      layout):  # fmt: skip
    case = make_moe(1, 4, 6, 40, 24, activation=activation, b1=True, b2=True, bias="TH",
                    drop=0.25, seed=3)  # fmt: skip
    spy = Launches(monkeypatch)
    fast, slow = _both(case, sorted_path, activation=activation, layout=layout)
    assert spy.decode == 1 and spy.maps == 1  # the decode call built no maps
    want = expected(case, activation=activation, layout=layout)
    assert_matches(fast, want, TOL[torch.float32])
    assert_matches(fast, slow, TOL[torch.float32], what="decode vs sorted")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("T", "K", "E", "bias"),
    [(1, 2, 2, None), (2, 8, 16, "H"), (1, 8, 8, "TH"), (4, 4, 64, None)],
    ids=["K=E=2", "T=2 K=8", "K=E=8", "T=4"],
)  # fmt: skip
def test_sizes_and_dtypes(sorted_path, split, dtype, T, K, E, bias):
    # odd H and I: no tile divides them
    case = make_moe(T, K, E, 37, 19, dtype=dtype, b2=True, bias=bias, drop=0.2, seed=T + K)
    fast, slow = _both(case, sorted_path)
    assert not fast.isnan().any()
    assert_matches(fast, expected(case), TOL[dtype])
    assert_matches(fast, slow, TOL[dtype], what="decode vs sorted")


def test_every_slot_dropped_and_zero_tokens():
    moe_route.plan.clear_plans()
    ids = torch.full((1, 4), -1, dtype=torch.int32)
    case = make_moe(1, 4, 8, 16, 8, ids=ids, bias="H", seed=1)
    out = run(case)
    assert torch.equal(out, case["bias"].expand(1, 16).to(out.dtype))  # the bias alone
    empty = run(make_moe(0, 4, 8, 16, 8, seed=2))
    assert empty.shape == (0, 16)


@pytest.mark.parametrize(("H", "inter"), [(32, 16), (40, 24)], ids=["even", "odd"])
def test_strided_weights_and_tokens(sorted_path, H, inter):
    """n-contiguous (transposed) weights, also at sizes no tile divides (masked rows)."""
    case = make_moe(2, 2, 5, H, inter, b1=True, seed=4)
    case["w1"] = case["w1"].transpose(1, 2).contiguous().transpose(1, 2)  # k-major W1
    case["w2"] = case["w2"][:, :, :].transpose(1, 2).contiguous().transpose(1, 2)
    case["x"] = torch.cat([case["x"], case["x"]], dim=1)[:, ::2]  # column stride 2
    fast, slow = _both(case, sorted_path)
    assert_matches(fast, expected(case), TOL[torch.float32])
    assert_matches(fast, slow, TOL[torch.float32], what="decode vs sorted")


def test_which_calls_take_it(monkeypatch):
    """No gradient wanted and T*K <= min(16, E), or <= min(64, E/2) with small experts: the
    decode path; otherwise the sorted one."""
    moe_route.plan.clear_plans()
    spy = Launches(monkeypatch)
    small = make_moe(2, 4, 8, 16, 8, seed=5)
    run(small)
    assert (spy.decode, spy.maps) == (1, 0)
    run(make_moe(9, 4, 64, 16, 8, seed=6))  # 36 slots (bucket 16: 64) over 64 experts
    run(make_moe(2, 4, 4, 16, 8, seed=7))  # 8 slots over 4 experts
    assert (spy.decode, spy.maps) == (1, 2)
    grad = dict(small, x=small["x"].clone().requires_grad_(True))
    run(grad).sum().backward()  # training: the sorted path, which saves z
    assert (spy.decode, spy.maps) == (1, 3)
    with torch.no_grad():
        run(grad)
    assert (spy.decode, spy.maps) == (2, 3)
    run(make_moe(8, 4, 64, 16, 8, seed=6))  # 32 slots over 64 small experts
    assert (spy.decode, spy.maps) == (3, 3)


MIB = 1 << 20


@pytest.mark.parametrize(
    ("name", "K", "E", "expert_bytes", "largest_T"),
    [
        ("qwen3-30b-a3b", 8, 128, 9 * MIB, 8),
        ("olmoe-1b-7b", 8, 64, 12 * MIB, 4),
        ("deepseek-v3", 8, 256, 84 * MIB, 2),
        ("mixtral-8x7b", 2, 8, 336 * MIB, 4),
        ("16 MiB experts", 8, 128, 16 * MIB, 8),
        ("just over 16 MiB", 8, 128, 16 * MIB + 2, 2),
    ],
)  # fmt: skip
def test_decode_config_slots(name, K, E, expert_bytes, largest_T):
    """The largest token bucket the decode path takes (docs/decisions.md, "Decode path
    threshold", has the measurements behind each boundary)."""
    buckets = (1, 2, 4, 8, 16, 32)
    taken = [T for T in buckets if tuning.decode_config(T, K, E, expert_bytes, torch.bfloat16)]
    assert taken == [T for T in buckets if largest_T >= T]
    assert tuning.decode_config(1, K, E, expert_bytes, torch.float64) is None


def test_most_slots(monkeypatch, sorted_path, split):
    """64 slots (the most the path takes): several slots per expert, one expert with 9 of
    them, dropped slots; the layer's counts from the second kernel's first program."""
    moe_route.plan.clear_plans()
    T, K, E = 8, 8, 128
    ids = make_ids(T, K, E, drop=0.1, seed=16)
    ids[ids == 7] = -1
    ids[:, 0] = 7  # expert 7 in every token, and again in one
    ids[3, 5] = 7
    case = make_moe(T, K, E, 24, 16, ids=ids, b1=True, bias="TH", seed=16)
    spy = Launches(monkeypatch)
    fast, slow = _both(case, sorted_path)
    assert (spy.decode, spy.maps) == (1, 1)
    assert_matches(fast, expected(case), TOL[torch.float32])
    assert_matches(fast, slow, TOL[torch.float32], what="decode vs sorted")
    op = torch.ops.moe_route.moe_decode.default
    args = (case["x"], case["w1"], case["w2"], case["topk_weights"], ids, None, None, None)
    _, counts = op(*args, "swiglu", "concat", True)
    assert torch.equal(counts, moe_route.tokens_per_expert(ids, E))
    assert int(counts[7]) == 9
    more = torch.cat([ids, ids[:1]])  # 72 slots: more than the counts cover
    x9 = torch.cat([case["x"], case["x"][:1]])
    with pytest.raises(ValueError, match=r"at most 64 slots.*9\*8"):
        op(x9, *args[1:3], torch.cat([args[3], args[3][:1]]), more, *args[5:], "swiglu",
           "concat", True)  # fmt: skip


def test_deterministic_bitwise():
    moe_route.plan.clear_plans()
    case = make_moe(2, 4, 8, 24, 12, b1=True, b2=True, bias="TH", seed=8)
    first = run(case)
    for _ in range(2):
        assert torch.equal(run(case), first)


def test_opcheck():
    case = make_moe(2, 4, 8, 16, 8, b1=True, b2=True, bias="H", seed=9)
    args = (case["x"], case["w1"], case["w2"], case["topk_weights"], case["topk_ids"], case["b1"],
            case["b2"], case["bias"], "swiglu", "concat")  # fmt: skip
    for want_counts in (False, True):
        torch.library.opcheck(torch.ops.moe_route.moe_decode.default, (*args, want_counts))


def test_compile_keeps_the_sorted_path(sorted_path):
    """Under torch.compile (where host time is not paid per call) the sorted path runs: the
    compiled call gives the sorted path's eager bits."""
    torch._dynamo.reset()
    moe_route.plan.clear_plans()
    case = make_moe(1, 4, 8, 16, 8, b2=True, seed=10)
    ids = make_ids(1, 4, 8, drop=0.0, seed=10)
    case["topk_ids"] = ids
    case["topk_weights"] = torch.rand(1, 4)

    def f(x, w1, w2, tw):
        return moe_route.fused_moe(x, w1, w2, tw, ids, b2=case["b2"], backend="triton")

    args = (case["x"], case["w1"], case["w2"], case["topk_weights"])
    got = torch.compile(f, fullgraph=True)(*args)
    sorted_path()
    assert torch.equal(got, f(*args))


# --------------------------------------------------------------------------- MoELayer
@pytest.mark.parametrize(
    "kw",
    [{}, {"capacity_factor": 0.5}, {"num_shared_experts": 1, "shared_expert_gate": True}],
    ids=["plain", "capacity-drops", "shared-expert"],
)
def test_layer_inference_takes_it_with_counts(monkeypatch, sorted_path, kw):
    """An inference MoELayer at a decode size runs the decode path (no maps) and returns the
    sorted path's output and the exact slots per expert, dropped slots not counted."""
    moe_route.plan.clear_plans()
    torch.manual_seed(11)
    layer = moe_route.MoELayer(32, 24, 8, 4, dtype=torch.float32, backend="triton", **kw).eval()
    x = torch.randn(2, 32)
    spy = Launches(monkeypatch)
    with torch.no_grad():
        fast = layer(x)
        # capacity drops rank the slots through maps of their own, before the experts
        assert spy.decode == 1 and spy.maps == (1 if "capacity_factor" in kw else 0)
        sorted_path()
        slow = layer(x)
    assert torch.equal(fast.topk_ids, slow.topk_ids)
    assert torch.equal(fast.tokens_per_expert, moe_route.tokens_per_expert(fast.topk_ids, 8))
    assert torch.equal(fast.tokens_per_expert, slow.tokens_per_expert)
    assert fast.tokens_per_expert.dtype == torch.int64
    if "capacity_factor" in kw:
        assert int(fast.tokens_per_expert.sum()) < 8  # some slots dropped
    assert_matches(fast.output, slow.output, TOL[torch.float32], what="decode vs sorted")


def test_layer_training_and_zero_tokens(monkeypatch):
    """With a gradient wanted the layer keeps the sorted path; zero tokens count nothing."""
    moe_route.plan.clear_plans()
    layer = moe_route.MoELayer(32, 24, 8, 2, dtype=torch.float32, backend="triton")
    spy = Launches(monkeypatch)
    layer(torch.randn(3, 32)).output.sum().backward()
    assert spy.decode == 0 and spy.maps == 1
    with torch.no_grad():
        empty = layer(torch.randn(0, 32))
    assert spy.decode == 1
    assert empty.output.shape == (0, 32)
    assert torch.equal(empty.tokens_per_expert, torch.zeros(8, dtype=torch.int64))


def test_ids_past_the_experts_read_nothing():
    """Unchecked ids past the experts (a GPU caller skips the value check) act as dropped
    slots, as in the sorted path's kernels: never an out-of-bounds weight read."""
    torch.manual_seed(14)
    T, H, inter, E, K = 2, 16, 8, 8, 4
    x, w1, w2 = torch.randn(T, H), torch.randn(E, 2 * inter, H), torch.randn(E, H, inter)
    tw, b2 = torch.rand(T, K), torch.randn(E, H)
    ids = torch.randint(0, E, (T, K), dtype=torch.int32)
    bad, dropped = ids.clone(), ids.clone()
    bad[0, 1], bad[1, 2] = E + 3, 1000
    dropped[0, 1], dropped[1, 2] = -1, -1
    op = torch.ops.moe_route.moe_decode.default
    got = op(x, w1, w2, tw, bad, None, b2, None, "swiglu", "concat", True)
    want = op(x, w1, w2, tw, dropped, None, b2, None, "swiglu", "concat", True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert int(got[1].sum()) == T * K - 2


def test_zero_intermediate_size_adds_b2(sorted_path):
    """I = 0: no GEMM1 launch; each routed slot still adds its weight times ``b2[e]``."""
    case = make_moe(2, 4, 8, 16, 4, b2=True, seed=15)
    case["w1"], case["w2"] = case["w1"][:, :0], case["w2"][..., :0]
    fast, slow = _both(case, sorted_path)
    assert fast.abs().max() > 0
    assert torch.equal(fast, slow)


@settings(max_examples=60, deadline=None)
@given(
    split=st.booleans(),
    T=st.integers(1, 9),
    K=st.integers(1, 8),
    n_inter=st.integers(0, 300),
    H=st.integers(1, 300),
    tiles=st.integers(1, 40),
    h_dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
    terms_dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_scratch_layout(split, T, K, n_inter, H, tiles, h_dtype, terms_dtype):
    """A call's one scratch allocation: ``h``, then (per slot) the terms from a 16-byte
    boundary past ``h``'s end and the counters past the terms', all inside the buffer; the
    counters zeroed where no first launch runs to zero them (``I = 0``)."""
    slots = T * K
    h, terms_at, arrived_at, arrivals = _scratch(split, T, slots, n_inter, H, tiles, h_dtype,
                                                 terms_dtype, "cpu")  # fmt: skip
    assert h.dtype == h_dtype and h.dim() == 1
    if not split:
        assert (h.numel(), terms_at, arrived_at, arrivals) == (slots * n_inter, 0, 0, 0)
        return
    nbytes = h.numel() * h_dtype.itemsize
    terms_start = terms_at * terms_dtype.itemsize
    assert terms_start % 16 == 0 and terms_start >= slots * n_inter * h_dtype.itemsize
    assert arrived_at * 4 >= terms_start + slots * H * terms_dtype.itemsize
    assert arrivals == T * tiles and arrived_at * 4 + 4 * arrivals <= nbytes
    if n_inter == 0:
        counters = h.view(torch.uint8)[arrived_at * 4 :].view(torch.int32)[:arrivals]
        assert torch.equal(counters, torch.zeros_like(counters))
