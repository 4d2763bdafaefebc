"""torch.compile and torch.library registration of the routing ops, and which eager calls take
the custom op's dispatch instead of the kernels directly.

The ops are ``torch.library.custom_op``s with fake implementations, so Dynamo traces the public
functions into one graph (``fullgraph=True``) and Inductor calls the ops as opaque kernels.
"""

import pytest
import torch
from helpers import DEVICE, randn, random_topk_ids, random_weights, requires_triton

import moe_route

E = 5


def _chain(x, topk_ids, topk_weights, bias, backend="reference"):
    maps = moe_route.build_routing_maps(topk_ids, E, backend=backend, check_ids=False)
    x_perm = moe_route.expand_rows(x, maps, backend=backend)
    out = moe_route.finalize_moe_routing(x_perm, topk_weights, maps, bias, backend=backend)
    return out, x_perm, maps.expert_first_token_offset


def _inputs(T, K=2, H=13, seed=0):
    return (
        randn(T, H, seed=seed),
        random_topk_ids(T, K, E, drop_prob=0.25, seed=seed),
        random_weights(T, K, seed=seed),
        randn(T, H, seed=seed + 1),
    )


def test_compile_fullgraph_reference_chain():
    torch._dynamo.reset()
    compiled = torch.compile(_chain, fullgraph=True, dynamic=True)
    # Two batch sizes through one dynamic-shape graph: the fake impls must give symbolic sizes.
    for T in (7, 11):
        inputs = _inputs(T, seed=T)
        got = compiled(*inputs)
        want = _chain(*inputs)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and g.dtype == w.dtype
            assert torch.equal(g, w), "compiled result differs from eager"


def test_compile_fullgraph_default_check_ids_on_cpu():
    # Regression: the default CPU id value check is a data-dependent branch (bool(tensor.any()))
    # that fullgraph cannot trace, so it is skipped under compile.
    torch._dynamo.reset()

    def build(topk_ids):
        return moe_route.build_routing_maps(topk_ids, E, backend="reference").expert_for_source_row

    ids = random_topk_ids(7, 2, E)
    assert torch.equal(torch.compile(build, fullgraph=True)(ids), build(ids))


# ----------------------------------------------------------------------------- opcheck
def _arg_pool(backend, bias_kind="H", requires_grad=False, T=7, K=2, H=13):
    """Every argument the ops take, by schema name (robust to argument reordering)."""
    device = DEVICE if backend == "triton" else torch.device("cpu")
    ids = random_topk_ids(T, K, E, drop_prob=0.3, seed=3, device=device)
    maps = moe_route.build_routing_maps(ids, E, backend="reference")
    x, _, w, bias_th = (t.to(device) for t in _inputs(T, K, H, seed=3))
    y = randn(T * K, H, seed=4, device=device)
    bias = {None: None, "H": randn(H, seed=5, device=device), "TH": bias_th}[bias_kind]
    floats = [x, y, w] + ([] if bias is None else [bias])
    for t in floats:
        t.requires_grad_(requires_grad)
    return {
        "topk_ids": ids,
        "num_experts": E,
        "backend": backend,
        "x": x,
        "y_perm": y,
        "dout": randn(T, H, seed=6, device=device),
        "need_dy": True,
        "need_dw": True,
        "topk_weights": w,
        "bias": bias,
        "src_to_dest": maps.expanded_source_row_to_expanded_dest_row,
        "dest_to_src": maps.expanded_dest_row_to_expanded_source_row,
        "expert_for_src": maps.expert_for_source_row,
        "offsets": maps.expert_first_token_offset,
    }


def _args_for(op, pool):
    names = [a.name for a in op._schema.arguments]
    missing = [n for n in names if n not in pool]
    assert not missing, f"{op}: test does not know how to build arguments {missing}"
    return tuple(pool[n] for n in names)


OPS = ["routing_maps", "expand_rows", "finalize_moe_routing", "finalize_moe_routing_backward"]
OPCHECK_BACKENDS = ["torch", pytest.param("triton", marks=requires_triton)]


@pytest.mark.parametrize("backend", OPCHECK_BACKENDS)
@pytest.mark.parametrize("name", OPS)
def test_opcheck(name, backend):
    op = getattr(torch.ops.moe_route, name).default
    torch.library.opcheck(op, _args_for(op, _arg_pool(backend)))


@pytest.mark.parametrize("bias_kind", [None, "TH"])
def test_opcheck_finalize_bias_variants(bias_kind):
    op = torch.ops.moe_route.finalize_moe_routing.default
    torch.library.opcheck(op, _args_for(op, _arg_pool("torch", bias_kind)))


def test_opcheck_empty_batch():
    for name in OPS:
        op = getattr(torch.ops.moe_route, name).default
        torch.library.opcheck(op, _args_for(op, _arg_pool("torch", T=0)))


@pytest.mark.parametrize("backend", OPCHECK_BACKENDS)
@pytest.mark.parametrize("name", ["expand_rows", "finalize_moe_routing"])
def test_opcheck_with_grad_inputs(name, backend):
    """Registered autograd: opcheck differentiates the op (test_aot_dispatch_dynamic)."""
    op = getattr(torch.ops.moe_route, name).default
    torch.library.opcheck(op, _args_for(op, _arg_pool(backend, requires_grad=True)))


@pytest.mark.parametrize("backend", OPCHECK_BACKENDS)
@pytest.mark.parametrize("bias_kind", [None, "H", "TH"])
def test_expand_finalize_gradients(backend, bias_kind):
    """Backward of expand and finalize against autograd through the float64 reference."""
    pool = _arg_pool(backend, bias_kind=bias_kind, requires_grad=True)
    maps = moe_route.build_routing_maps(pool["topk_ids"], E, backend="reference")
    x, y, w, bias = pool["x"], pool["y_perm"], pool["topk_weights"], pool["bias"]
    leaves = [t for t in (x, y, w, bias) if t is not None]
    g = torch.Generator().manual_seed(8)
    d_perm = torch.randn(y.shape, generator=g).to(y.device)
    d_out = torch.randn(x.shape, generator=g).to(x.device)

    def loss(x, y, w, bias, backend):
        x_perm = moe_route.expand_rows(x, maps, backend=backend)
        out = moe_route.finalize_moe_routing(y, w, maps, bias, backend=backend)
        return (x_perm * d_perm).sum() + (out * d_out).sum()

    got = torch.autograd.grad(loss(x, y, w, bias, backend), leaves)
    ref_leaves = [t.detach().cpu().double().requires_grad_(True) for t in leaves]
    rx, ry, rw, *rb = ref_leaves
    maps_cpu = moe_route.build_routing_maps(pool["topk_ids"].cpu(), E, backend="reference")
    ref_out = moe_route.reference.finalize_moe_routing_reference(
        ry, rw, maps_cpu.expanded_source_row_to_expanded_dest_row,
        maps_cpu.expert_for_source_row, rb[0] if rb else None,
    )  # fmt: skip
    ref_perm = moe_route.reference.expand_rows_reference(
        rx, maps_cpu.expanded_dest_row_to_expanded_source_row, maps_cpu.expert_first_token_offset
    )
    ref_loss = (ref_perm * d_perm.cpu().double()).sum() + (ref_out * d_out.cpu().double()).sum()
    want = torch.autograd.grad(ref_loss, ref_leaves)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.cpu().double(), b, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- eager dispatch
# In eager mode the public functions call the kernels directly (moe_route._dispatch), except
# where those cannot run on the tensors as they are: there the custom op's dispatch goes first.
@requires_triton
def test_tensor_subclass_inputs_go_through_the_dispatcher():
    """A functional collective's lazily waited result (a wrapper subclass without storage, what
    the expert-parallel layer hands to fused_moe) gives the plain tensors' bits."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    T, K, H, inter = 7, 2, 8, 6
    x, ids, tw, _ = (t.to(DEVICE) for t in _inputs(T, K, H))
    w1 = randn(E, 2 * inter, H, seed=5, device=DEVICE)
    w2 = randn(E, H, inter, seed=6, device=DEVICE)
    want = moe_route.fused_moe(x, w1, w2, tw, ids, backend="triton")
    got = moe_route.fused_moe(AsyncCollectiveTensor(x), w1, w2, tw, ids, backend="triton")
    assert torch.equal(got, want)
    maps = moe_route.build_routing_maps(ids, E, backend="triton")
    sub_maps = moe_route.build_routing_maps(AsyncCollectiveTensor(ids), E, backend="triton")
    for a, b in zip(sub_maps.tensors(), maps.tensors(), strict=True):
        assert torch.equal(a, b)
    got = moe_route.expand_rows(AsyncCollectiveTensor(x), maps, backend="triton")
    assert torch.equal(got, moe_route.expand_rows(x, maps, backend="triton"))


@requires_triton
def test_fake_tensor_mode_gets_the_fake_implementations():
    """Under a dispatch mode (here fake tensors) no kernel sees the tensors."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    T, K, H = 7, 2, 13
    x, ids, tw, bias = (t.to(DEVICE) for t in _inputs(T, K, H))
    with FakeTensorMode() as mode:
        fx, fids, ftw, fbias = map(mode.from_tensor, (x, ids, tw, bias))
        out, x_perm, offsets = _chain(fx, fids, ftw, fbias, backend="triton")
    assert all(isinstance(t, FakeTensor) for t in (out, x_perm, offsets))
    assert (out.shape, x_perm.shape, offsets.shape) == ((T, H), (T * K, H), (E + 1,))


# ----------------------------------------------------------------------------- backend names
OP_OBJECTS = {  # module, attribute of the Op behind each torch.ops.moe_route op
    "routing_maps": ("maps", "_ROUTING_MAPS"),
    "expand_rows": ("permute", "EXPAND"),
    "finalize_moe_routing": ("finalize", "FINALIZE"),
    "finalize_moe_routing_backward": ("finalize", "_FINALIZE_BACKWARD"),
    "grouped_gemm": ("grouped_gemm", "GEMM"),
    "grouped_gemm_backward": ("grouped_gemm", "_GEMM_BACKWARD"),
    "moe_experts": ("experts", "MOE"),
    "moe_experts_backward": ("experts", "_MOE_BACKWARD"),
}


def _every_op_pool():
    """Arguments of every op for one small float32 CPU case, by schema name."""
    T, K, E_, H, inter = 5, 2, 3, 8, 4
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([[0, 2], [1, -1], [2, 1], [0, 1], [-1, -1]])
    s2d, d2s, efs, off = moe_route.build_routing_maps(ids, E_, backend="torch").tensors()
    x, w1, w2 = (torch.randn(*s, generator=g) for s in ((T, H), (E_, 2 * inter, H), (E_, H, inter)))
    tw = torch.rand(T, K, generator=g)
    pool = dict(
        topk_ids=ids, num_experts=E_, x=x, a=x, w=w1, w1=w1, w2=w2, topk_weights=tw,
        y_perm=torch.randn(T * K, H, generator=g), src_to_dest=s2d, dest_to_src=d2s,
        expert_for_src=efs, offsets=off, bias=None, b1=None, b2=None, activation="swiglu",
        gate_up_layout="concat", path="standalone", gather=True, allow_tf32=False, store_z=True,
        need_dy=True, need_dw=True, need_da=True, need_db=False, need_dx=True, need_dw1=True,
        need_dw2=True, need_dtopk=True, consume_z=False,
    )  # fmt: skip
    maps = (s2d, d2s, efs, off)
    pool["z"] = torch.ops.moe_route.moe_experts(x, w1, w2, tw, None, None, None, *maps, "swiglu",
                                                "concat", "standalone", True, False, "torch",
                                                True)[1]  # fmt: skip
    douts = {"grouped_gemm_backward": torch.randn(T * K, inter, generator=g)}
    return pool, douts, torch.randn(T, H, generator=g)


@pytest.mark.parametrize("entry", ["custom_op", "Op"])
@pytest.mark.parametrize("name", list(OP_OBJECTS))
def test_every_op_entry_resolves_backend_names(monkeypatch, name, entry):
    """``"reference"`` (the torch backend's alias) and ``"auto"`` mean to an op what they mean
    to the public functions, on both entry points: the torch backend runs (not Triton, which
    the interpreter would also run here) and gives the bits of ``backend="torch"``; an unknown
    name raises instead of falling through to a backend."""
    import importlib

    module, attr = OP_OBJECTS[name]
    op_object = getattr(importlib.import_module(f"moe_route.{module}"), attr)
    op = getattr(torch.ops.moe_route, name).default
    pool, douts, dout = _every_op_pool()
    pool["dout"] = douts.get(name, dout)
    names = [a.name for a in op._schema.arguments]
    call = op if entry == "custom_op" else op_object

    def run(backend):
        out = call(*(backend if n == "backend" else pool[n] for n in names))
        return out if isinstance(out, tuple) else (out,)

    torch_impl = importlib.import_module("moe_route.kernels.torch_impl")
    ran = []
    for fn_name in [n for n in dir(torch_impl) if n.endswith("_torch")]:
        fn = getattr(torch_impl, fn_name)
        monkeypatch.setattr(
            torch_impl, fn_name, lambda *a, _f=fn, **k: ran.append(1) or _f(*a, **k)
        )
    want = run("torch")
    assert ran, "the torch backend did not run for backend='torch'"
    monkeypatch.setenv("MOE_ROUTE_BACKEND", "torch")  # what "auto" resolves to on this device
    for alias in ("reference", "auto"):
        ran.clear()
        got = run(alias)
        assert ran, f"backend={alias!r} did not run the torch backend"
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), f"backend={alias!r} gave other bits than 'torch'"
    with pytest.raises(ValueError, match=r"backend='cuda': expected 'auto' or one of"):
        run("cuda")


# ----------------------------------------------------------------------------- programs
@requires_triton
def test_compiled_fused_moe_runs_the_eager_calls_program(monkeypatch):
    """Compiled code calls the experts' custom op, whose implementation looks up the call
    signature's program: after an eager call of that signature, compiled calls (T of the same
    token bucket) plan nothing and prepare no launch again, and give the eager bits."""
    from moe_route.kernels.triton.grouped_gemm import GemmLaunch

    moe_route.plan.clear_plans()
    H, inter, K = 16, 8, 2
    w1 = randn(E, 2 * inter, H, seed=1, device=DEVICE) * 0.2
    w2 = randn(E, H, inter, seed=2, device=DEVICE) * 0.2

    def run(x, ids, weights):
        return moe_route.fused_moe(x, w1, w2, weights, ids, backend="triton", allow_tf32=False)

    cases = [(randn(T, H, seed=T, device=DEVICE),
              random_topk_ids(T, K, E, drop_prob=0.2, seed=T).to(DEVICE),
              random_weights(T, K, seed=T, device=DEVICE)) for T in (11, 13, 11)]  # fmt: skip
    want = [run(*case) for case in cases]  # eager: the programs and their launches
    made = {"plan_for": 0, "GemmLaunch": 0}

    def counting(name, real):
        def counted(*args, **kwargs):
            if not torch.compiler.is_compiling():  # a (re)trace makes its own, none kept
                made[name] += 1
            return real(*args, **kwargs)

        return counted

    monkeypatch.setattr(moe_route.experts, "plan_for",
                        counting("plan_for", moe_route.experts.plan_for))  # fmt: skip
    monkeypatch.setattr(GemmLaunch, "__init__", counting("GemmLaunch", GemmLaunch.__init__))
    torch._dynamo.reset()
    compiled = torch.compile(run, fullgraph=True)
    try:
        for case, expected in zip(cases, want, strict=True):
            assert torch.equal(compiled(*case), expected)
        assert made == {"plan_for": 0, "GemmLaunch": 0}, made
    finally:
        moe_route.plan.clear_plans()
        torch._dynamo.reset()
