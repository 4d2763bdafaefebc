"""fused_moe on the CPU (Triton kernels through the interpreter, and the reference backend)
against ``moe_route.reference.moe_forward_reference`` evaluated in float64 on the same inputs.

Every finalize path runs here: ``"standalone"`` (GEMM2 writes permuted rows, a finalize kernel
reduces them), ``"fused"`` (GEMM2's epilogue: the last row of a token to arrive reduces the
token in k order, the standalone kernel's arithmetic) and ``"fused_atomic"`` (the epilogue
scales and atomically adds into a float32 output). The interpreter runs one program at a time,
so the concurrency of the last two is tested on the GPU. Router weights of dropped slots are
NaN throughout: the contract says they are never read.

bfloat16: ``tl.dot`` with bf16 operands returns garbage under the triton 3.5.1 interpreter, so
bf16 runs with ``backend="reference"`` here and through the kernels in tests/test_gpu_moe.py.

Tolerances as in tests/test_grouped_gemm.py (relative Frobenius error: fp32 1e-5, fp16 2e-3,
bf16 1e-2, plus a wide elementwise guard); the two finalize paths agree in float32 to
``(K + 2) * eps32 * (|bias| + sum_k |w| |y|)`` per element.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from moe_cases import (
    ACT_IDS,
    ACT_LAYOUTS,
    BF16_INTERPRETER,
    BIASES,
    PATHS,
    TOL,
    assert_matches,
    assert_paths_agree,
    finalize_scale,
    make_ids,
    needs_interpreter,
    rand,
)
from moe_cases import moe_case as make_moe
from moe_cases import moe_expected as expected
from moe_cases import run_moe as run

import moe_route
from moe_route import arch
from moe_route.kernels.triton.routing_maps import MapsLaunch
from moe_route.reference import routing_maps_reference

moe_module = importlib.import_module("moe_route.moe")
launches = importlib.import_module("moe_route.kernels.triton.moe")
torch_impl = importlib.import_module("moe_route.kernels.torch_impl")


# ----------------------------------------------------------------------------- helpers
class Spy:
    """Counts the launches of fused_moe's forward by kind: the finalize paths (the standalone
    finalize kernel, GEMM2 with the finalize in its epilogue), the plain grouped GEMMs, the
    expand, the routing maps (Triton) and the torch backend's forward. It counts the calls
    that run: a signature's compile-ahead pass on a GPU (which calls each once more, and
    launches nothing) is turned off."""

    def __init__(self, monkeypatch, *, forbid=False):
        monkeypatch.setenv("MOE_ROUTE_COMPILE_AHEAD", "0")
        self.calls = {"standalone": 0, "fused": 0, "grouped_gemm": 0, "expand": 0,
                      "routing_maps": 0, "torch": 0}  # fmt: skip
        for attr, key, module in (
            ("__call__", "standalone", launches.FinalizeLaunch),
            ("grouped_gemm_finalize_triton", "fused", launches),
            ("__call__", "grouped_gemm", launches.GemmLaunch),
            ("__call__", "expand", launches.ExpandLaunch),
            ("__call__", "routing_maps", MapsLaunch),
            ("moe_forward_torch", "torch", torch_impl),
        ):
            monkeypatch.setattr(module, attr, self._wrap(getattr(module, attr), key, forbid))

    def _wrap(self, fn, key, forbid):
        def wrapped(*args, **kwargs):
            if forbid:
                raise AssertionError(f"{key} ran although the arguments are invalid")
            self.calls[key] += 1
            return fn(*args, **kwargs)

        return wrapped


# ----------------------------------------------------------------------------- vs the oracle
# Every GEMM1 epilogue once, each with one of the finalize paths in turn (the activation is
# GEMM1's, the path GEMM2's and finalize's: the full product runs no other kernel variant).
ACT_PATHS = [(act, lay, list(PATHS)[i % len(PATHS)]) for i, (act, lay) in enumerate(ACT_LAYOUTS)]
ACT_PATH_IDS = [f"{name}-{case[2]}" for name, case in zip(ACT_IDS, ACT_PATHS, strict=True)]


@needs_interpreter
@pytest.mark.parametrize(("activation", "layout", "path"), ACT_PATHS, ids=ACT_PATH_IDS)
def test_activations_both_paths(activation, layout, path):
    """fp32, T = 23, K = 2, E = 4, H = 27, I = 13, b1 + b2 + bias [H], 20 % slots dropped."""
    case = make_moe(23, 2, 4, 27, 13, activation=activation, b1=True, b2=True, bias="H", seed=1)
    out = run(case, activation=activation, layout=layout, **PATHS[path])
    ref = expected(case, activation=activation, layout=layout)
    assert out.dtype == torch.float32 and out.shape == (23, 27)
    assert_matches(out, ref, TOL[torch.float32])


# Every bias form with every finalize path; GEMM1 gathers in every other case, so that each
# bias form and each path runs with both GEMM1 inputs (gathered x, expanded rows).
BIAS_CASES = [(biases, (i + j) % 2 == 0, path) for i, biases in enumerate(BIASES)
              for j, path in enumerate(PATHS)]  # fmt: skip
BIAS_IDS = [f"{b}-{'gather' if g else 'expand'}-{p}" for b, g, p in BIAS_CASES]


@needs_interpreter
@pytest.mark.parametrize(("biases", "gather", "path"), BIAS_CASES, ids=BIAS_IDS)
def test_biases_and_gather(biases, gather, path):
    case = make_moe(19, 3, 5, 21, 11, seed=2, **BIASES[biases])
    out = run(case, gather=gather, **PATHS[path])
    assert_matches(out, expected(case), TOL[torch.float32])


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("activation", "layout"), [("swiglu", "interleaved"), ("gelu", "concat")])
def test_paths_agree(dtype, activation, layout):
    """The three finalize paths: all close to the float64 oracle; the ordered fused epilogue
    gives the standalone path's bits (same GEMM2 rows, same sum order); the atomic one agrees
    in float32 to the rounding of a K-term sum (in float16 within the fp16 tolerance, since it
    does not round GEMM2's rows to fp16)."""
    K = 3
    case = make_moe(31, K, 6, 27, 19, activation=activation, dtype=dtype, b1=True, b2=True,
                    bias="TH", seed=3)  # fmt: skip
    kw = dict(activation=activation, layout=layout)
    outs = {path: run(case, **kw, **args) for path, args in PATHS.items()}
    ref = expected(case, **kw)
    for path, out in outs.items():
        assert out.dtype == dtype
        assert_matches(out, ref, TOL[dtype], what=path)
    standalone, atomic = outs["standalone"], outs["fused_atomic"]
    assert torch.equal(outs["fused"], standalone), "ordered fused finalize != standalone bits"
    if dtype == torch.float32:
        assert_paths_agree(standalone, atomic, finalize_scale(case, **kw), K)
    else:
        assert_matches(atomic, standalone.double(), TOL[dtype], what="atomic vs standalone")


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_backend(dtype, path):
    """backend="reference" (the CPU fallback; the only bf16 path testable on the CPU)."""
    case = make_moe(29, 2, 4, 40, 24, dtype=dtype, b1=True, b2=True, bias="TH", seed=4)
    out = run(case, backend="reference", **PATHS[path])
    assert out.dtype == dtype
    assert_matches(out, expected(case), TOL[dtype])


@needs_interpreter
@pytest.mark.skip(reason=BF16_INTERPRETER)
def test_bf16_kernels():  # pragma: no cover - documents the gap; see tests/test_gpu_moe.py
    case = make_moe(9, 2, 3, 16, 8, dtype=torch.bfloat16, seed=5)
    assert_matches(run(case), expected(case), TOL[torch.bfloat16])


@needs_interpreter
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("T", [1, 2])
def test_few_tokens(T, path):
    case = make_moe(T, 2, 3, 27, 13, b2=True, bias="H", drop=0, seed=6)
    assert_matches(run(case, **PATHS[path]), expected(case), TOL[torch.float32])


@pytest.mark.parametrize("path", list(PATHS))
def test_zero_tokens(path):
    case = make_moe(0, 2, 3, 8, 4, bias="H", seed=7)
    out = run(case, **PATHS[path])
    assert out.shape == (0, 8) and out.dtype == torch.float32


@needs_interpreter
def test_allow_tf32():
    case = make_moe(7, 2, 3, 27, 13, b1=True, seed=8)
    assert_matches(run(case, allow_tf32=True), expected(case), 2e-3)


# ----------------------------------------------------------------------------- dropped slots
@needs_interpreter
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("bias", [None, "H", "TH"])
def test_dropped_slots(bias, path):
    """Tokens with every slot dropped get exactly ``bias[t]`` (or zeros); partly dropped tokens
    sum their routed slots only (the NaN router weights of dropped slots are never read)."""
    T, K, E = 17, 3, 5
    ids = make_ids(T, K, E, drop=0.3, seed=9)
    ids[::4] = -1  # tokens 0, 4, 8, 12, 16: all slots dropped
    ids[1, 1:] = -1  # token 1: one routed slot
    case = make_moe(T, K, E, 21, 11, b1=True, b2=True, bias=bias, ids=ids, seed=9)
    out = run(case, **PATHS[path])
    dead = (ids < 0).all(dim=1)
    want = torch.zeros(int(dead.sum()), 21)
    if bias == "H":
        want = case["bias"].expand(T, -1)[dead]
    elif bias == "TH":
        want = case["bias"][dead]
    assert torch.equal(out[dead], want), f"fully dropped tokens: {out[dead]} != {want}"
    assert_matches(out[~dead], expected(case)[~dead], TOL[torch.float32])


@needs_interpreter
@pytest.mark.parametrize("path", list(PATHS))
def test_every_slot_dropped(path):
    case = make_moe(6, 2, 3, 10, 5, b2=True, bias="TH", ids=torch.full((6, 2), -1), seed=10)
    assert torch.equal(run(case, **PATHS[path]), case["bias"])
    case["bias"] = None
    assert torch.equal(run(case, **PATHS[path]), torch.zeros(6, 10))


# ----------------------------------------------------------------------------- path choice
@needs_interpreter
@pytest.mark.parametrize("deterministic", [True, False])
def test_auto_is_standalone_on_cpu(monkeypatch, deterministic):
    choice = arch.finalize_path_for(torch.device("cpu"), "auto", deterministic)
    assert choice.value == "standalone", choice
    spy = Spy(monkeypatch)
    case = make_moe(9, 2, 3, 12, 6, seed=12)
    out = run(case, finalize="auto", deterministic=deterministic)
    assert spy.calls["standalone"] == 1 and spy.calls["fused"] == 0, spy.calls
    assert_matches(out, expected(case), TOL[torch.float32])


@needs_interpreter
@pytest.mark.parametrize(
    ("env", "kwargs", "taken"),
    [
        ("fused", dict(finalize="standalone", deterministic=False), "fused"),
        ("fused", dict(finalize="standalone"), "fused"),
        ("fused", dict(finalize="auto", deterministic=False), "fused"),
        ("standalone", dict(finalize="fused", deterministic=False), "standalone"),
        ("standalone", dict(finalize="fused", deterministic=True), "standalone"),
        ("auto", dict(finalize="fused", deterministic=False), "fused"),
        ("AUTO", dict(finalize="standalone", deterministic=False), "standalone"),
    ],
)
def test_finalize_env_override(monkeypatch, env, kwargs, taken):
    monkeypatch.setenv("MOE_ROUTE_FINALIZE", env)
    spy = Spy(monkeypatch)
    case = make_moe(9, 2, 3, 12, 6, b2=True, bias="H", seed=13)
    out = run(case, **kwargs)
    other = "standalone" if taken == "fused" else "fused"
    assert spy.calls[taken] == 1 and spy.calls[other] == 0, spy.calls
    # GEMM1, and GEMM2 unless the fused epilogue runs it; the maps once.
    assert spy.calls["grouped_gemm"] == (1 if taken == "fused" else 2), spy.calls
    assert spy.calls["routing_maps"] == 1, spy.calls
    assert_matches(out, expected(case), TOL[torch.float32])


@pytest.mark.parametrize(
    ("env", "kwargs", "match"),
    [
        ("epilogue", dict(), r"MOE_ROUTE_FINALIZE='epilogue'"),
        ("auto", dict(finalize="atomic"), r"finalize='atomic'"),
    ],
)
def test_finalize_env_errors(monkeypatch, env, kwargs, match):
    monkeypatch.setenv("MOE_ROUTE_FINALIZE", env)
    case = make_moe(5, 2, 3, 8, 4, seed=14)
    Spy(monkeypatch, forbid=True)
    with pytest.raises(ValueError, match=match):
        run(case, **kwargs)


# ----------------------------------------------------------------------------- ordered epilogue
# Each tile shape without and with the final bias (the kernel's FINAL_BIAS variants); a bias
# [H] and a bias [T, H] differ only in a stride, so the shapes take them in turn.
ORDERED_TILES = {"64x32": (64, 32, 16, 1, 4, 1), "32x16": (32, 16, 16, 2, 4, 1),
                 "16x64": (16, 64, 8, 1, 4, 1)}  # fmt: skip
ORDERED_CASES = [("64x32", None), ("64x32", "H"), ("32x16", None), ("32x16", "TH"),
                 ("16x64", None), ("16x64", "H")]  # fmt: skip


@needs_interpreter
@pytest.mark.parametrize(("tiles", "bias"), ORDERED_CASES,
                         ids=[f"{b}-{t}" for t, b in ORDERED_CASES])  # fmt: skip
def test_ordered_epilogue_tiles(tiles, bias):
    """The ordered fused finalize under forced tiles, against GEMM2 with the same tiles plus the
    standalone finalize kernel, bit for bit. The interpreter runs programs in order, so the tiles
    of the last expert find every one of their tokens complete: whole tiles of last-arriving
    rows, several reduction groups (RED_ROWS) per tile and a partial last group; tokens with
    every slot dropped get exactly the bias."""
    from moe_route.kernels.triton.finalize import finalize_triton
    from moe_route.kernels.triton.gemm_finalize import grouped_gemm_finalize_triton
    from moe_route.kernels.triton.gemm_mainloop import GemmConfig
    from moe_route.kernels.triton.grouped_gemm import grouped_gemm_triton

    T, K, E, H, inter = 125, 2, 3, 40, 24  # the last expert: 70 rows (a whole 64-row tile)
    case = make_moe(T, K, E, H, inter, b2=True, bias=bias, drop=0.1, seed=31)
    ids = case["topk_ids"]
    ids[::11] = -1
    s2d, d2s, efs, off = routing_maps_reference(ids, E)
    tw = case["topk_weights"]
    h = rand(T * K, inter, seed=32)
    cfg = GemmConfig(*ORDERED_TILES[tiles])
    y = torch.full((T * K, H), float("nan"))
    grouped_gemm_triton(h, case["w2"], off, y, cfg, bias=case["b2"])
    want = torch.full((T, H), float("nan"))
    finalize_triton(y, tw, s2d, efs, case["bias"], want)
    out = torch.full((T, H), float("nan"))
    grouped_gemm_finalize_triton(h, case["w2"], off, s2d, d2s, efs, tw, out, cfg, ordered=True,
                                 b2=case["b2"], bias=case["bias"])  # fmt: skip
    assert torch.equal(out, want)
    dead = (ids < 0).all(dim=1)
    assert dead.any()
    fill = torch.zeros(H) if bias is None else case["bias"].expand(T, H)[dead]
    assert torch.equal(out[dead], torch.broadcast_to(fill, out[dead].shape))


# ----------------------------------------------------------------------------- determinism
@needs_interpreter
@pytest.mark.parametrize("finalize", ["standalone", "fused"])  # "auto" is standalone on the CPU
def test_deterministic_bitwise(finalize):
    case = make_moe(21, 3, 5, 20, 12, b1=True, b2=True, bias="TH", seed=15)
    first = run(case, finalize=finalize, deterministic=True)
    again = run(case, finalize=finalize, deterministic=True)  # a second call: its plan cached
    assert torch.equal(again, first), "deterministic=True gave different bits"


# ----------------------------------------------------------------------------- validation
def _bad(**changes):
    def make():
        case = make_moe(6, 2, 3, 8, 4, b1=True, b2=True, bias="H", drop=0, seed=16)
        for key, fn in changes.items():
            case[key] = fn(case)
        return case

    return make


BAD_INPUTS = [
    ("w2_shape", _bad(w2=lambda c: c["w2"][:, :, :-1]), ValueError, r"w2 must be \[E, H, I\]"),
    ("w2_experts", _bad(w2=lambda c: c["w2"][:-1]), ValueError, r"w2 must be \[E, H, I\]"),
    ("w2_ndim", _bad(w2=lambda c: c["w2"][0]), ValueError, r"w2 must have 3 dim"),
    ("w2_dtype", _bad(w2=lambda c: c["w2"].half()), TypeError, r"w2.*dtype"),
    ("w1_dtype", _bad(w1=lambda c: c["w1"].half()), TypeError, r"w1.*dtype"),
    ("x_ndim", _bad(x=lambda c: c["x"][None]), ValueError, r"\bx must have 2 dim"),
    ("w1_hidden", _bad(w1=lambda c: c["w1"][..., :-1]), ValueError, r"w1 \[E, N, K\]"),
    ("w1_odd_gated", _bad(w1=lambda c: c["w1"][:, :-1], b1=lambda c: c["b1"][:, :-1]),
     ValueError, r"w1 .*even"),
    ("b1_shape", _bad(b1=lambda c: c["b1"][:, :-1]), ValueError, r"b1 must be \[E, N\]"),
    ("b2_shape", _bad(b2=lambda c: c["b2"][:, :-1]), ValueError, r"b2 must be \[E, H\]"),
    ("bias_shape", _bad(bias=lambda c: torch.zeros(9)), ValueError, r"bias must be \[H\]"),
    ("bias_TH_shape", _bad(bias=lambda c: torch.zeros(5, 8)), ValueError, r"bias must be"),
    ("bias_3d", _bad(bias=lambda c: torch.zeros(1, 6, 8)), ValueError, r"bias must be"),
    ("weights_vs_ids", _bad(topk_weights=lambda c: c["topk_weights"][:, :1]), ValueError,
     r"topk_weights .* must match topk_ids"),
    ("ids_vs_x", _bad(topk_ids=lambda c: c["topk_ids"][:-1],
                      topk_weights=lambda c: c["topk_weights"][:-1]), ValueError, r"T = 6"),
    ("weights_ndim", _bad(topk_weights=lambda c: c["topk_weights"].reshape(-1)), ValueError,
     r"topk_weights must have 2 dim"),
    ("weights_int", _bad(topk_weights=lambda c: c["topk_weights"].long()), TypeError,
     r"topk_weights.*dtype"),
    ("ids_float", _bad(topk_ids=lambda c: c["topk_ids"].float()), TypeError, r"topk_ids"),
    ("ids_out_of_range", _bad(topk_ids=lambda c: c["topk_ids"] + 3), ValueError,
     r"topk_ids\[.*out of range"),
]  # fmt: skip


@pytest.mark.parametrize(("make", "exc", "match"), [c[1:] for c in BAD_INPUTS],
                         ids=[c[0] for c in BAD_INPUTS])  # fmt: skip
def test_bad_inputs_raise_before_launch(monkeypatch, make, exc, match):
    case = make()
    Spy(monkeypatch, forbid=True)
    with pytest.raises(exc, match=match):
        run(case)


@pytest.mark.parametrize("kwargs", [dict(finalize="epilogue"), dict(backend="cuda"),
                                    dict(activation="tanh"), dict(layout="split")])  # fmt: skip
def test_bad_options_raise_before_launch(monkeypatch, kwargs):
    case = make_moe(6, 2, 3, 8, 4, seed=17)
    Spy(monkeypatch, forbid=True)
    with pytest.raises(ValueError, match=next(iter(kwargs)).replace("layout", "gate_up_layout")):
        run(case, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(deterministic="no"), r"deterministic must be a bool, got str 'no'"),
        (dict(deterministic=0), r"deterministic must be a bool, got int 0"),
        (dict(allow_tf32="False"), r"allow_tf32 must be a bool, got str 'False'"),
        (dict(gather=1), r"gather must be a bool or None, got int 1"),
    ],
)
def test_boolean_options_must_be_bools(monkeypatch, kwargs, match):
    """``"no"`` and ``"False"`` are truthy: a flag that is not a bool is a TypeError, before
    anything runs."""
    case = make_moe(6, 2, 3, 8, 4, seed=17)
    Spy(monkeypatch, forbid=True)
    with pytest.raises(TypeError, match=match):
        run(case, **kwargs)


@pytest.mark.parametrize("path", list(PATHS))
def test_b2_float64_rejected_before_launch(monkeypatch, path):
    """b2 takes the GEMM dtypes on both finalize paths, checked before anything runs (it was
    once accepted by the fused path and rejected by standalone GEMM2 after GEMM1 had run)."""
    case = make_moe(6, 2, 3, 8, 4, b2=True, seed=18)
    case["b2"] = case["b2"].double()
    Spy(monkeypatch, forbid=True)
    with pytest.raises(TypeError, match=r"\bb2\b.*dtype"):
        run(case, **PATHS[path])


# ----------------------------------------------------------------------------- torch.compile
def _compile_case():
    return make_moe(11, 2, 4, 16, 8, b1=True, b2=True, bias="TH", seed=19)


def test_compile_fullgraph_cpu():
    """The whole of fused_moe under fullgraph=True on CPU tensors: the eager-only id value
    check (a data-dependent branch) must step aside while compiling."""
    case = _compile_case()

    def f(x, w1, w2, tw, ids, b1, b2, bias):
        return moe_route.fused_moe(x, w1, w2, tw, ids, b1=b1, b2=b2, bias=bias,
                                   backend="reference")  # fmt: skip

    args = [case[k] for k in ("x", "w1", "w2", "topk_weights", "topk_ids", "b1", "b2", "bias")]
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    torch.testing.assert_close(compiled(*args), f(*args), rtol=0, atol=0)


def test_compile_fullgraph_cpu_chain():
    """What fused_moe does after building the maps, compiled with fullgraph=True on the CPU
    (reference backend): every op is a custom op with a fake implementation, no graph break."""
    case = _compile_case()
    E = case["w1"].shape[0]
    maps = moe_route.build_routing_maps(case["topk_ids"], E, backend="reference")

    def chain(x, w1, w2, tw, b1, b2, bias):
        h = moe_route.grouped_gemm(x, w1, maps, bias=b1, activation="swiglu", gather=True,
                                   backend="reference")  # fmt: skip
        y = moe_route.grouped_gemm(h, w2, maps, bias=b2, backend="reference")
        return moe_route.finalize_moe_routing(y, tw, maps, bias, backend="reference")

    args = [case[k] for k in ("x", "w1", "w2", "topk_weights", "b1", "b2", "bias")]
    torch._dynamo.reset()
    out = torch.compile(chain, fullgraph=True)(*args)
    torch.testing.assert_close(out, chain(*args), rtol=0, atol=0)
    eager = moe_route.fused_moe(
        case["x"], case["w1"], case["w2"], case["topk_weights"], case["topk_ids"],
        b1=case["b1"], b2=case["b2"], bias=case["bias"], backend="reference",
    )  # fmt: skip
    torch.testing.assert_close(out, eager, rtol=0, atol=0)


def test_compile_with_graph_breaks_cpu():
    case = _compile_case()
    args = [case[k] for k in ("x", "w1", "w2", "topk_weights", "topk_ids")]
    kw = dict(b1=case["b1"], b2=case["b2"], bias=case["bias"], backend="reference")
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: moe_route.fused_moe(*a, **kw), backend="aot_eager")
    torch.testing.assert_close(compiled(*args), moe_route.fused_moe(*args, **kw), rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("path", ["fused", "fused_atomic"])
def test_opcheck_fused_finalize_op(backend, path):
    """The MoE op with the finalize in GEMM2's epilogue (inference: no ``z``)."""
    case = make_moe(7, 2, 3, 8, 4, b1=True, b2=True, bias="TH", seed=20)
    tables = routing_maps_reference(case["topk_ids"], 3)
    floats = [case[n].nan_to_num(0.0) for n in ("x", "w1", "w2", "topk_weights", "b1", "b2",
                                                 "bias")]  # fmt: skip
    args = (*floats, *tables, "swiglu", "concat", path, True, False, backend, False)
    torch.library.opcheck(moe_route.experts.MOE.op, args)


# ----------------------------------------------------------------------------- random routings
@needs_interpreter
@settings(max_examples=6, deadline=None)
@given(
    T=st.integers(1, 16),
    K=st.integers(1, 3),
    E=st.integers(3, 6),
    drop=st.sampled_from([0.0, 0.3, 1.0]),
    act_layout=st.sampled_from(ACT_LAYOUTS),
    path=st.sampled_from(list(PATHS)),
    bias=st.sampled_from([None, "H", "TH"]),
    seed=st.integers(0, 2**16),
)
def test_random_routings(T, K, E, drop, act_layout, path, bias, seed):
    activation, layout = act_layout
    case = make_moe(T, K, E, 12, 7, activation=activation, b1=True, b2=True, bias=bias,
                    drop=drop, seed=seed)  # fmt: skip
    out = run(case, activation=activation, layout=layout, **PATHS[path])
    ref = expected(case, activation=activation, layout=layout)
    if ref.norm() == 0:
        assert torch.equal(out, torch.zeros_like(out))
    else:
        assert_matches(out, ref, TOL[torch.float32], floor=0.1 * out.numel() ** 0.5)


def test_meta_tensors_give_meta_outputs():
    """Shape inference and meta-device initialisation (torchtitan, FSDP2): meta inputs run
    the ops' fake implementations, forward and backward, and return meta tensors of the right
    shapes; nothing reads a value."""
    T, H, n_inter, E, K = 5, 16, 8, 4, 2
    meta = dict(device="meta")
    x = torch.empty(T, H, **meta, requires_grad=True)
    w1 = torch.empty(E, 2 * n_inter, H, **meta, requires_grad=True)
    w2 = torch.empty(E, H, n_inter, **meta)
    tw = torch.empty(T, K, **meta)
    ids = torch.empty(T, K, dtype=torch.int32, **meta)
    out = moe_route.fused_moe(x, w1, w2, tw, ids)
    assert out.device.type == "meta" and out.shape == (T, H)
    dx, dw1 = torch.autograd.grad(out.sum(), (x, w1))
    assert (dx.shape, dw1.shape) == (x.shape, w1.shape) and dx.device.type == "meta"
    with torch.device("meta"):
        layer = moe_route.MoELayer(H, n_inter, E, K)
    y = layer(torch.empty(T, H, **meta))
    assert y.output.device.type == "meta" and y.output.shape == (T, H)
    y.output.sum().backward()
    assert layer.w1.grad.shape == layer.w1.shape
    # then materialised, as FSDP2 / torchtitan do, it runs for real
    layer = layer.to_empty(device="cpu")
    layer.reset_parameters()
    assert torch.isfinite(layer(torch.randn(T, H)).output).all()
