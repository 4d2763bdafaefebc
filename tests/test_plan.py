"""The per-call plan of ``fused_moe``: one cached decision per call shape that never serves a
stale answer, errors before any launch, and the warm-up that compiles every bucket.

CPU: the Triton kernels run under the interpreter (fp32/fp16 only, see moe_cases)."""

from __future__ import annotations

import pytest
import torch
from moe_cases import TOL, assert_matches, moe_case, moe_expected, needs_interpreter, run_moe

import moe_route
from moe_route import _dispatch
from moe_route import moe as moe_mod
from moe_route.kernels import triton as kt
from moe_route.tuning import token_bucket, token_buckets

pytestmark = needs_interpreter

T, K, E, H, INTER = 5, 2, 4, 32, 16


def plan_of(case, **kw):
    x, w1, w2 = case["x"], case["w1"], case["w2"]
    args = dict(activation="swiglu", gate_up_layout="concat", finalize="auto",
                deterministic=True, gather=None, allow_tf32=False, backend="triton")  # fmt: skip
    args.update(kw)
    return moe_route.plan.moe_plan(x, w1, w2, K, args["activation"], args["gate_up_layout"],
                            args["finalize"], args["deterministic"], args["gather"],
                            args["allow_tf32"], args["backend"])  # fmt: skip


@pytest.fixture
def launches(monkeypatch):
    """Names of the kernels launched (the launches still run)."""
    seen = []
    real = kt.ThinKernel.launch

    def spy(self, key, grid, args, constexprs):
        seen.append(self.fn.__name__ if hasattr(self.fn, "__name__") else repr(self.fn))
        return real(self, key, grid, args, constexprs)

    monkeypatch.setattr(kt.ThinKernel, "launch", spy)
    return seen


def test_plan_is_shared_inside_a_bucket_and_not_across():
    small, same_bucket, next_bucket = (moe_case(t, K, E, H, INTER) for t in (5, 8, 9))
    assert token_bucket(5) == token_bucket(8) != token_bucket(9)
    assert plan_of(small) is plan_of(same_bucket)
    assert plan_of(small) is not plan_of(next_bucket)


def test_plan_follows_dtype_flags_and_activation():
    f32 = moe_case(T, K, E, H, INTER)
    f16 = moe_case(T, K, E, H, INTER, dtype=torch.float16)
    p32, p16 = plan_of(f32), plan_of(f16)
    assert p32 is not p16
    assert p32.configs.gemm1.block_k != p16.configs.gemm1.block_k  # fp32 tiles are narrower
    assert plan_of(f32, finalize="standalone").path == "standalone"
    assert plan_of(f32, finalize="fused").path == "fused"
    assert plan_of(f32, finalize="fused", deterministic=False).path == "fused_atomic"
    assert plan_of(f32, gather=False).gather is False
    assert plan_of(f32, gather=True).gather is True
    assert plan_of(f32, allow_tf32=True).configs.allow_tf32
    geglu = plan_of(f32, activation="geglu").configs.epilogue
    assert geglu != plan_of(f32).configs.epilogue and geglu.gated


def test_plan_follows_environment_overrides(monkeypatch):
    case = moe_case(T, K, E, H, INTER)
    assert plan_of(case).path == "standalone"  # the CPU is below SM90
    monkeypatch.setenv("MOE_ROUTE_FINALIZE", "fused")
    assert plan_of(case).path == "fused"
    monkeypatch.setenv("MOE_ROUTE_BACKEND", "torch")
    assert plan_of(case, backend="auto").backend == "torch"
    monkeypatch.delenv("MOE_ROUTE_BACKEND")
    monkeypatch.delenv("MOE_ROUTE_FINALIZE")
    assert plan_of(case).path == "standalone"
    assert plan_of(case, backend="auto").backend == "triton"


def test_comm_sms_leaves_sms_to_the_communication_kernels(monkeypatch):
    """MOE_ROUTE_COMM_SMS: the persistent kernels spread over that many SMs fewer (at least
    one), and the plans' key changes with it."""
    from moe_route.kernels.triton import gemm_mainloop

    monkeypatch.setattr(gemm_mainloop, "_cuda_sms", lambda index: 132)
    monkeypatch.setattr(gemm_mainloop, "cuda_index", lambda device: 0)
    gpu = torch.device("cuda", 0)
    key = moe_route.arch.env_key()
    assert gemm_mainloop.num_sms(gpu) == 132
    monkeypatch.setenv("MOE_ROUTE_COMM_SMS", "20")
    assert gemm_mainloop.num_sms(gpu) == 112
    assert moe_route.arch.env_key() != key
    monkeypatch.setenv("MOE_ROUTE_COMM_SMS", "500")
    assert gemm_mainloop.num_sms(gpu) == 1
    monkeypatch.setenv("MOE_ROUTE_COMM_SMS", "-4")
    with pytest.raises(ValueError, match=r"MOE_ROUTE_COMM_SMS='-4': expected an integer >= 0"):
        gemm_mainloop.num_sms(gpu)


@pytest.mark.parametrize("finalize", ["standalone", "fused"])
def test_env_override_after_a_cached_call_runs_the_right_kernels(monkeypatch, launches, finalize):
    case = moe_case(T, K, E, H, INTER)
    ref = moe_expected(case)
    run_moe(case, finalize="standalone", backend="triton")  # caches the standalone plan
    launches.clear()
    monkeypatch.setenv("MOE_ROUTE_FINALIZE", finalize)
    out = run_moe(case, finalize="standalone", backend="triton")
    assert_matches(out, ref, TOL[torch.float32])
    fused = "_gemm_finalize_kernel" in launches
    assert fused == (finalize == "fused"), launches


def test_bad_arguments_raise_before_any_launch(launches):
    case = moe_case(T, K, E, H, INTER)
    bad_w2 = dict(case, w2=case["w2"][:, :, :-1])
    bad_ids = dict(case, topk_ids=case["topk_ids"].to(torch.float32))
    for bad, err in ((bad_w2, ValueError), (bad_ids, TypeError)):
        with pytest.raises(err):
            run_moe(bad, backend="triton")
    with pytest.raises(ValueError, match="finalize"):
        run_moe(case, backend="triton", finalize="sideways")
    with pytest.raises(ValueError, match="backend"):
        run_moe(case, backend="gpu")
    assert launches == []


def test_token_buckets():
    assert token_buckets(1) == [1]
    assert token_buckets(5) == [1, 2, 4, 8]
    assert token_buckets(8) == [1, 2, 4, 8]
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="max_tokens"):
            token_buckets(bad)


def test_warmup_runs_every_bucket_without_touching_grads_or_rng():
    case = moe_case(T, K, E, H, INTER)
    w1 = case["w1"].clone().requires_grad_()
    w2 = case["w2"].clone().requires_grad_()
    state = torch.get_rng_state()
    assert moe_route.warmup(w1, w2, K, 6, backward=True, backend="triton") == [1, 2, 4, 8]
    assert w1.grad is None and w2.grad is None
    assert torch.equal(state, torch.get_rng_state())
    with pytest.raises(ValueError, match="top_k"):
        moe_route.warmup(w1, w2, E + 1, 4)
    with pytest.raises(TypeError, match="backward must be a bool, got str 'False'"):
        moe_route.warmup(w1, w2, K, 4, backward="False")
    layer = moe_route.MoELayer(H, INTER, E, K, backend="triton")
    with pytest.raises(TypeError, match="backward must be a bool, got int 0"):
        layer.warmup(4, backward=0)


@pytest.mark.parametrize("max_tokens", [2**40, 2**30 + 1])
def test_warmup_past_the_int32_maps_raises_before_any_launch(launches, max_tokens):
    case = moe_case(T, K, E, H, INTER)
    match = rf"max_tokens={max_tokens}: .* than the int32 routing maps .* max_tokens <= {2**29}"
    with pytest.raises(ValueError, match=match):
        moe_route.warmup(case["w1"], case["w2"], K, max_tokens)
    layer = moe_route.MoELayer(H, INTER, E, K, backend="triton")
    with pytest.raises(ValueError, match=match):
        layer.warmup(max_tokens)
    assert launches == []


def test_warmup_past_the_free_memory_raises_before_any_launch(monkeypatch, launches):
    """Where the device reports its free memory (a GPU), the largest bucket's activations
    must fit it (here a CPU pretending to have 1 MiB free)."""
    from moe_route import tuning

    monkeypatch.setattr(tuning, "free_memory", lambda device: 2**20)
    case = moe_case(T, K, E, H, INTER)
    match = r"max_tokens=5000: the warm-up of its bucket T=8192 needs about .* GiB free"
    with pytest.raises(ValueError, match=match):
        moe_route.warmup(case["w1"], case["w2"], K, 5000)
    layer = moe_route.MoELayer(H, INTER, E, K, backend="triton")
    with pytest.raises(ValueError, match=match):
        layer.warmup(5000, backward=True)
    assert launches == []
    assert moe_route.warmup(case["w1"], case["w2"], K, 2) == [1, 2]  # small enough


def test_layer_warmup(launches):
    layer = moe_route.MoELayer(H, INTER, E, K, aux_loss_coef=0.01, backend="triton")
    assert layer.warmup(3, backward=True) == [1, 2, 4]
    assert all(p.grad is None for p in layer.parameters())
    assert "_gemm_act_bwd_kernel" in launches  # the backward ran


# --------------------------------------------------------------------------- the call memo
def _count_checks(monkeypatch):
    """How many times fused_moe validated its arguments (check_gemm_args runs once per check)."""
    seen = []
    real = moe_mod.check_gemm_args
    monkeypatch.setattr(moe_mod, "check_gemm_args", lambda *a: seen.append(1) or real(*a))
    return seen


@pytest.mark.parametrize("tokens", [1, T], ids=["decode path", "sorted path"])
def test_repeated_call_skips_the_checks_and_gives_the_same_bits(monkeypatch, tokens):
    case = moe_case(tokens, K, E, H, INTER)
    moe_route.plan.clear_plans()
    checks = _count_checks(monkeypatch)
    first = run_moe(case, backend="triton")
    second = run_moe(case, backend="triton")
    assert checks == [1]
    assert torch.equal(first, second)
    assert_matches(second, moe_expected(case), TOL[torch.float32])


def test_new_token_count_in_a_seen_bucket_is_not_checked_again(monkeypatch):
    """The memo keys on the token bucket: a new T in it is neither checked nor decided again,
    and gives the right output; rows that disagree still raise."""
    moe_route.plan.clear_plans()
    checks = _count_checks(monkeypatch)
    run_moe(moe_case(5, K, E, H, INTER), backend="triton")
    for t in (6, 7, 8):
        case = moe_case(t, K, E, H, INTER, seed=t)
        assert_matches(run_moe(case, backend="triton"), moe_expected(case), TOL[torch.float32])
    assert checks == [1]
    run_moe(moe_case(9, K, E, H, INTER), backend="triton")  # the next bucket
    assert checks == [1, 1]
    case = moe_case(6, K, E, H, INTER)
    for short in ("topk_weights", "topk_ids"):
        with pytest.raises(ValueError, match="rows like x"):
            run_moe(dict(case, **{short: case[short][:5]}), backend="triton")


@pytest.mark.parametrize("tokens", [1, T], ids=["decode path", "sorted path"])
def test_call_memo_serves_no_stale_decision(monkeypatch, launches, tokens):
    """After a memoised call, calls that differ in any one thing the checks or decisions read
    get their own answer: another dtype, strides, shape, grad mode, requires_grad, ids that
    are out of range (values: checked on every CPU call), an environment override."""
    case = moe_case(tokens, K, E, H, INTER)
    ref = moe_expected(case)
    moe_route.plan.clear_plans()
    run_moe(case, backend="triton")
    run_moe(case, backend="triton")
    # another dtype
    half = {k: (v.half() if v is not None and v.is_floating_point() and k != "topk_weights"
                else v) for k, v in case.items()}  # fmt: skip
    out = run_moe(half, backend="triton")
    assert out.dtype == torch.float16
    assert_matches(out, ref, TOL[torch.float16])
    # the same shapes through other strides (a transposed copy seen as [E, 2I, H])
    w1_t = case["w1"].transpose(1, 2).contiguous().transpose(1, 2)
    assert w1_t.stride() != case["w1"].stride()
    assert_matches(run_moe(dict(case, w1=w1_t), backend="triton"), ref, TOL[torch.float32])
    # a wrong shape still raises, naming the argument
    with pytest.raises(ValueError, match="w2"):
        run_moe(dict(case, w2=case["w2"][:, :, :-1]), backend="triton")
    # an id out of range raises on every CPU call, memoised or not
    bad = case["topk_ids"].clone()
    bad[0, 0] = E
    for _ in range(2):
        with pytest.raises(ValueError, match="out of range"):
            run_moe(dict(case, topk_ids=bad), backend="triton")
    # a gradient wanted: the autograd path, with the gradient of x
    x = case["x"].clone().requires_grad_()
    out = run_moe(dict(case, x=x), backend="triton")
    assert out.grad_fn is not None
    (dx,) = torch.autograd.grad(out.sum(), x)
    assert dx.shape == x.shape and torch.isfinite(dx).all()
    with torch.no_grad():
        assert run_moe(dict(case, x=x), backend="triton").grad_fn is None
    # an environment override: the torch backend launches no kernel
    monkeypatch.setenv("MOE_ROUTE_BACKEND", "torch")
    launches.clear()
    assert_matches(run_moe(case), ref, TOL[torch.float32])
    assert launches == []


def test_call_memo_is_bounded(monkeypatch):
    monkeypatch.setattr(_dispatch, "MAX_CALLS", 2)
    moe_route.plan.clear_plans()
    for tokens in (1, 2, 3, 4):
        run_moe(moe_case(tokens, K, E, H, INTER), backend="triton")
        assert 1 <= len(moe_mod._CALLS) <= 2


def test_call_memo_steps_aside_under_a_dispatch_mode(monkeypatch):
    """A memoised signature, then the same call under a torch dispatch mode (what opcheck,
    make_fx and fake tensors run under): the memo is not used, the call is checked and goes
    through the custom op, and gives the same result."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    case = moe_case(1, K, E, H, INTER)
    moe_route.plan.clear_plans()
    checks = _count_checks(monkeypatch)
    first = run_moe(case, backend="triton")
    with Passthrough():
        again = run_moe(case, backend="triton")
    assert checks == [1, 1]
    assert torch.equal(first, again)
