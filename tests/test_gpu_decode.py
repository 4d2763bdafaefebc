"""fused_moe's decode path (moe_route/kernels/triton/decode.py) on a CUDA device: against the
float64 reference and the sorted path (maps → GEMM1 → GEMM2 → finalize) on the same inputs, in
bf16 / fp16 / fp32, at odd and model sizes, with dropped slots, K = E and strided weights;
bitwise determinism over 20 runs, no host sync; CUDA-graph capture and
``torch.compile(fullgraph=True)`` keep the sorted path (the decode path is for eager calls).

Tolerances: the dtype's (moe_cases.TOL) against float64. Against the sorted path the same
tolerance: both round ``h`` and ``y`` to the dtype, but sum the products in other orders.
"""

from __future__ import annotations

import functools
import importlib

import moe_cases
import pytest
import torch
from helpers import capture_cuda_graph
from moe_cases import ARG_ORDER, TOL, assert_matches, moe_expected, run_moe

import moe_route
from moe_route import tuning
from moe_route.kernels.triton.decode import DecodeLaunch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

moe_module = importlib.import_module("moe_route.moe")
CUDA = "cuda"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DTYPE_IDS = ["bf16", "fp16", "fp32"]


def rand(*shape, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=CUDA) * scale).to(dtype)


moe_case = functools.partial(moe_cases.moe_case, dtype=torch.bfloat16, device=CUDA, rand=rand)


def _sorted(case, monkeypatch, **kw):
    """The same call with the decode path turned off."""
    with monkeypatch.context() as m:
        m.setattr(tuning, "decode_config", lambda *a, **k: None)
        moe_route.plan.clear_plans()
        out = run_moe(case, **kw)
    moe_route.plan.clear_plans()
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    ("T", "K", "E", "H", "inter"),
    [(1, 8, 64, 2048, 1024), (2, 8, 128, 2048, 768), (8, 8, 128, 2048, 768),
     (4, 8, 64, 2048, 1024), (1, 8, 32, 7168, 2048), (1, 2, 8, 4096, 1792), (3, 5, 64, 200, 136),
     (1, 4, 4, 72, 40)],
    ids=["qwen-ish T=1", "qwen3 T=2", "qwen3 T=8", "olmoe T=4", "deepseek-ish T=1",
         "mixtral-ish T=1", "odd", "K=E"],
)  # fmt: skip
def test_matches_reference_and_sorted_path(monkeypatch, dtype, T, K, E, H, inter):
    case = moe_case(T, K, E, H, inter, dtype=dtype, b1=True, b2=True, bias="TH", drop=0.2,
                    seed=T + E)  # fmt: skip
    expert_bytes = 3 * H * inter * dtype.itemsize
    if tuning.decode_config(tuning.token_bucket(T), K, E, expert_bytes, dtype) is None:
        pytest.skip("experts over 16 MiB in this dtype take the sorted path from 17 slots")
    moe_route.plan.clear_plans()
    monkeypatch.setenv("MOE_ROUTE_COMPILE_AHEAD", "0")  # count only the calls that run
    calls = []
    real = DecodeLaunch.__call__
    monkeypatch.setattr(DecodeLaunch, "__call__", lambda *a: calls.append(1) or real(*a))
    fast = run_moe(case)
    assert calls == [1]  # (20 slots at "odd": over 16, but at most E/2 of small experts)
    assert not fast.isnan().any()
    assert_matches(fast, moe_expected(case), TOL[dtype], device=CUDA)
    assert_matches(fast, _sorted(case, monkeypatch), TOL[dtype], what="decode vs sorted")


@pytest.mark.parametrize(("activation", "layout"), moe_cases.ACT_LAYOUTS, ids=moe_cases.ACT_IDS)
def test_activations(activation, layout):
    case = moe_case(2, 4, 16, 256, 96, activation=activation, b1=True, seed=3)
    out = run_moe(case, activation=activation, layout=layout)
    want = moe_expected(case, activation=activation, layout=layout)
    assert_matches(out, want, TOL[torch.bfloat16], device=CUDA)


@pytest.mark.parametrize(("H", "inter"), [(256, 128), (200, 72)], ids=["even", "odd"])
def test_strided_weights_and_every_slot_dropped(H, inter):
    """n-contiguous (transposed) weights, also at sizes no tile divides (masked rows)."""
    case = moe_case(2, 4, 16, H, inter, b2=True, bias="H", seed=4)
    case["w1"] = case["w1"].transpose(1, 2).contiguous().transpose(1, 2)
    case["w2"] = case["w2"].transpose(1, 2).contiguous().transpose(1, 2)
    assert_matches(run_moe(case), moe_expected(case), TOL[torch.bfloat16], device=CUDA)
    case["topk_ids"] = torch.full_like(case["topk_ids"], -1)
    out = run_moe(case)
    assert torch.equal(out, case["bias"].expand(out.shape))


def test_deterministic_20_runs():
    case = moe_case(2, 8, 64, 2048, 768, b1=True, b2=True, bias="TH", seed=5)
    first = run_moe(case)
    for _ in range(19):
        assert torch.equal(run_moe(case), first)


def test_no_host_sync():
    case = moe_case(1, 8, 64, 512, 256, seed=6)
    run_moe(case)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_moe(case)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.isolated  # a failed capture would break the tests after it (tests/conftest.py)
def test_cuda_graph_captures_the_sorted_path(monkeypatch):
    """A captured call runs the sorted path (device time is what a graph pays): its replays
    on new tokens and routing give the sorted path's eager bits."""
    T, K, E, H, inter = 2, 4, 16, 256, 128
    static = moe_case(T, K, E, H, inter, b2=True, bias="TH", seed=7)
    graph, static_out = capture_cuda_graph(lambda: run_moe(static), warmup=2)
    for seed in (8, 9):
        fresh = moe_case(T, K, E, H, inter, b2=True, bias="TH", drop=0.3, seed=seed)
        for key, value in fresh.items():
            if value is not None:
                static[key].copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, _sorted(fresh, monkeypatch))
        assert_matches(static_out, run_moe(fresh), TOL[torch.bfloat16], what="vs decode")


def test_compile_keeps_the_sorted_path(monkeypatch):
    def layer(x, w1, w2, tw, ids, b2):
        return moe_route.fused_moe(x, w1, w2, tw, ids, b2=b2)

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    for seed in (10, 11):
        case = moe_case(1, 8, 64, 256, 128, b2=True, seed=seed)
        args = [case[k] for k in (*ARG_ORDER, "b2")]
        assert torch.equal(compiled(*args), _sorted(case, monkeypatch))


@pytest.mark.parametrize("T", [1, 2, 8])
def test_layer_inference(monkeypatch, T):
    """An inference MoELayer at qwen3's sizes takes the decode path: the sorted path's output
    (to the dtype's tolerance), the exact slots per expert, no host sync, the same bits twice."""
    torch.manual_seed(12)
    layer = moe_route.MoELayer(2048, 768, 128, 8, device=CUDA, dtype=torch.bfloat16,
                               num_shared_experts=1).eval()  # fmt: skip
    x = rand(T, 2048, dtype=torch.bfloat16, seed=13)
    monkeypatch.setenv("MOE_ROUTE_COMPILE_AHEAD", "0")  # count only the calls that run
    calls = []
    real = DecodeLaunch.__call__
    monkeypatch.setattr(DecodeLaunch, "__call__", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        moe_route.plan.clear_plans()
        fast = layer(x)
        assert calls == [1]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            again = layer(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        with monkeypatch.context() as m:
            m.setattr(tuning, "decode_config", lambda *a, **k: None)
            moe_route.plan.clear_plans()
            slow = layer(x)
        moe_route.plan.clear_plans()
    assert torch.equal(again.output, fast.output)
    assert torch.equal(fast.tokens_per_expert, moe_route.tokens_per_expert(fast.topk_ids, 128))
    assert torch.equal(fast.tokens_per_expert, slow.tokens_per_expert)
    assert_matches(fast.output, slow.output, TOL[torch.bfloat16], what="decode vs sorted")
