"""The benchmark harness and suite on the CPU: roofline arithmetic, CSV/JSON schema, plots, CLI.

The suite itself runs here in its CPU-comparison mode (what ``python -m moe_route bench`` does
on a machine without a GPU), at two tiny sizes and a few milliseconds of timing per
implementation.
"""

import csv
import importlib.util
import io
import json
import math
import os
import re
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from moe_cases import needs_interpreter

from moe_route.__main__ import main as cli_main
from moe_route.bench import (
    backward,
    baselines,
    context,
    harness,
    host,
    profiling,
    report,
    shapes,
    stages,
    suite,
    tables,
    timing,
)
from moe_route.bench.harness import Ceilings, Row, Timing, add_speedups, make_row

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "bench", "data")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _row(stage, shape, impl, us, **extra):
    return make_row(stage, shape, impl, Timing(us * 1e-6, us * 0.9e-6, us * 1.1e-6, 5),
                    Ceilings(1e12, 1e15), 1e6, 1e9, **extra)  # fmt: skip


# --------------------------------------------------------------------------- roofline arithmetic


def test_floor_is_the_slower_of_memory_and_compute():
    c = Ceilings(copy_bytes_per_s=2e12, mm_flops_per_s=500e12)
    assert c.floor_s(4e9) == pytest.approx(2e-3)  # memory-bound: 4 GB at 2 TB/s
    assert c.floor_s(4e9, 5e12) == pytest.approx(1e-2)  # compute-bound: 5 TFLOP at 500 TFLOP/s
    assert c.floor_s(0, 0) == 0


def test_make_row_fraction_of_roofline_and_bandwidth():
    c = Ceilings(copy_bytes_per_s=1e12, mm_flops_per_s=1e15)
    t = Timing(median_s=4e-3, p20_s=3.9e-3, p80_s=4.2e-3, samples=30)
    r = make_row("forward", "m T=8", "moe_route", t, c, bytes_moved=2e9, flops=1e12, x_loop=3.0)
    assert r.floor_us == pytest.approx(2000.0)  # 2 GB / 1 TB/s beats 1 TFLOP / 1 PFLOP/s
    assert r.roofline_fraction == pytest.approx(0.5)
    assert (r.median_us, r.p20_us, r.p80_us) == pytest.approx((4000.0, 3900.0, 4200.0))
    assert r.achieved_gb_s == pytest.approx(500.0)
    assert r.extra == {"x_loop": 3.0}
    noted = make_row("s", "x", "i", Timing(1, 1, 1, 1, note="eager"), c, 1)
    assert noted.extra["timing"] == "eager"


def test_add_speedups_per_stage_and_shape():
    rows = [
        _row("forward", "a T=1", "grouped_mm", 30.0),
        _row("forward", "a T=1", "loop", 300.0),
        _row("forward", "a T=1", "moe_route", 10.0),
        _row("forward", "a T=2", "moe_route", 10.0),  # no baseline at this shape
        _row("maps", "a T=1", "moe_route", 5.0, x_argsort=7.0),  # computed by the stage: kept
        _row("maps", "a T=1", "torch argsort", 50.0),
    ]
    add_speedups(rows)
    assert rows[2].extra == pytest.approx({"x_grouped_mm": 3.0, "x_loop": 30.0})
    assert rows[3].extra == {}
    assert rows[4].extra == {"x_argsort": 7.0}
    assert "x_loop" not in rows[0].extra  # baselines get no speed-up


def test_timers_order_their_percentiles():
    calls = []
    t = harness.time_cpu(lambda: calls.append(1), inner=2, outer=7, warmup=1)
    assert len(calls) == 1 + 2 * 7
    assert t.samples == 7 and t.p20_s <= t.median_s <= t.p80_s
    t = harness.time_auto(lambda: sum(range(100)), "cpu", budget_s=0.01)
    assert t.samples >= 5 and 0 < t.p20_s <= t.median_s <= t.p80_s


def test_interleaved_timing_takes_turns_and_rotates_the_order():
    log = []
    fns = {name: (lambda name=name: log.append(name)) for name in "abc"}
    timed = harness.time_interleaved(fns, "cpu", budget_s=0.01, rounds=3)
    runs = [n for i, n in enumerate(log) if i == 0 or log[i - 1] != n]
    # sizing (each twice, in order), then three rounds, each starting one later
    assert runs == list("abc" + "abc" + "bca" + "cab")
    for name in "abc":
        t, medians = timed[name]
        assert len(medians) == 3 and t.samples >= 3 * 2
        assert t.p20_s <= t.median_s <= t.p80_s
        assert min(medians) <= t.median_s <= max(medians)


# --------------------------------------------------------------------------- CSV / JSON schema


def test_write_results_json_and_csv_schema(tmp_path):
    env = {"gpu": "Test GPU", "capability": "SM90", "torch": "2", "triton": "3",
           "moe_route": "0.1", "timestamp": "2026-01-01T00:00:00+00:00", "copy_TB_s": 1.0,
           "bf16_mm_TFLOP_s": 1000.0}  # fmt: skip
    rows = add_speedups(
        [_row("forward", "m T=8", "loop", 40.0), _row("forward", "m T=8", "moe_route", 10.0,
                                                        rel_err=1e-3)]
    )  # fmt: skip
    paths = harness.write_results(rows, env, str(tmp_path), "r", schema="s/1", failures=[])
    assert [os.path.basename(p) for p in paths] == ["r.json", "r.csv"]
    data = json.loads((tmp_path / "r.json").read_text())
    assert set(data) == {"environment", "schema", "failures", "rows"}
    assert data["environment"] == env
    fields = set(Row.__dataclass_fields__)
    assert all(set(r) == fields for r in data["rows"])
    assert data["rows"][1]["extra"] == {"x_loop": 4.0, "rel_err": 1e-3}
    with open(tmp_path / "r.csv", newline="") as f:
        lines = list(csv.DictReader(f))
    assert list(lines[0])[:6] == list(harness.ENV_COLUMNS)
    assert {"median_us", "p20_us", "p80_us", "roofline_fraction", "x_loop"} <= set(lines[0])
    assert lines[0]["gpu"] == "Test GPU" and lines[0]["x_loop"] == ""
    assert float(lines[1]["x_loop"]) == 4.0 and json.loads(lines[1]["extra"]) == {"rel_err": 1e-3}
    # the saved rows come back unchanged
    back = report.load([str(tmp_path / "r.json")])[0].rows
    assert [(r.impl, r.median_us, r.extra) for r in back] == [
        (r.impl, r.median_us, r.extra) for r in rows
    ]


def test_bench_harness_script_reexports_the_package():
    spec = importlib.util.spec_from_file_location("bench_harness", f"{REPO}/bench/harness.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for name in ("Ceilings", "time_cuda", "make_row", "write_results", "print_table", "Row"):
        assert getattr(mod, name) is getattr(harness, name)


# --------------------------------------------------------------------------- shapes and stages


def test_shape_selection():
    std = shapes.select_shapes()
    assert [s.label for s in std if s.model == "qwen3-30b-a3b"] == [
        "qwen3-30b-a3b T=1", "qwen3-30b-a3b T=8", "qwen3-30b-a3b T=64",
        "qwen3-30b-a3b T=8192", "qwen3-30b-a3b T=32768",
    ]  # fmt: skip
    assert {(s.H, s.I, s.E, s.K) for s in std if s.model == "deepseek-v3"} == {(7168, 2048, 256, 8)}
    quick = shapes.select_shapes(quick=True)
    assert [s.T for s in quick if not s.decode] == [4096, 8192, 4096]
    assert [s.T for s in shapes.select_shapes(["mix", "decode"])] == [1, 8, 64]
    assert [s.T for s in shapes.select_shapes(["deepseek"], tokens=[2, 4])] == [2, 4]
    (c,) = shapes.select_shapes(["prefill"], custom=["16,64,32,4,2"])[-1:]
    assert (c.T, c.H, c.I, c.E, c.K) == (16, 64, 32, 4, 2) and c.label.startswith("custom-")
    with pytest.raises(ValueError, match="llama"):
        shapes.select_shapes(["llama"])
    with pytest.raises(ValueError, match="T,H,I,E,K"):
        shapes.custom_shape("1,2,3")


def test_skewed_routing_shapes():
    """``--skew``: every shape carries it in its label and dims; its routing spreads the experts'
    rows wider than uniform routing, which it leaves bit for bit as it was."""
    plain = shapes.custom_shape("512,64,32,64,8")
    picked = shapes.select_shapes(["deepseek"], tokens=[8], custom=["512,64,32,64,8"], skew=0.5)
    assert [s.skew for s in picked] == [0.5, 0.5]
    skewed = picked[-1]
    assert skewed.label == plain.label + " skew 0.5" and skewed.dims()["skew"] == 0.5
    assert "skew" not in plain.dims()
    with pytest.raises(ValueError, match="--skew -1"):
        shapes.select_shapes(skew=-1.0)
    cpu = torch.device("cpu")

    def counts(shape):
        ids = context.Inputs(shape, cpu, torch.float32).topk_ids
        return torch.bincount(ids.flatten().long(), minlength=shape.E).float()

    again = context.Inputs(plain, cpu, torch.float32).topk_ids
    assert torch.equal(again, context.Inputs(plain, cpu, torch.float32).topk_ids)
    assert counts(skewed).std() > 2 * counts(plain).std()
    assert counts(skewed).sum() == counts(plain).sum() == 512 * 8


def test_stage_selection():
    assert [s.name for s in stages.select_stages(["routing"])] == ["maps", "expand", "finalize"]
    assert [s.name for s in stages.select_stages(["train,maps"])] == ["maps", "train"]
    assert len(stages.select_stages(["all"])) == len(stages.STAGES)
    with pytest.raises(ValueError, match="expected one of"):
        stages.select_stages(["nope"])
    # CuPy (or another backend) is timed beside the default one only where it works
    assert context.available_alt_backends(torch.device("cpu")) == ()
    ctx = context.Context(torch.device("cpu"), Ceilings(1, 1), alt_backends=("cupy",))
    assert context._variants(ctx) == [("moe_route", "auto"), ("moe_route cupy", "cupy")]


def test_host_and_backward_stages_apply_to_their_shapes(capsys):
    std = shapes.select_shapes()
    host_shapes = [s.label for s in std if stages.STAGES["host"].applies(s)]
    assert host_shapes == [s.label for s in std if s.T <= 64]
    assert {(s.H, s.I, s.E, s.K) for s in std if s.label in host_shapes} >= {
        (2048, 1024, 64, 8), (7168, 2048, 256, 8),  # olmoe-1b-7b's and deepseek-v3's decode sizes
    }  # fmt: skip
    assert [s.label for s in std if stages.STAGES["backward"].applies(s)] == [
        "mixtral-8x7b T=4096", "qwen3-30b-a3b T=8192", "deepseek-v3 T=4096",
    ]  # fmt: skip
    smaller = shapes.select_shapes(["mixtral"], tokens=[64, 1024], custom=["512,64,32,4,2"])
    assert [s.label for s in smaller if stages.STAGES["backward"].applies(s)] == [
        "mixtral-8x7b T=1024", "custom-H64-I32-E4-K2 T=512",
    ]  # fmt: skip
    assert cli_main(["bench", "--list", "--device", "cpu", "--tokens", "8", "64"]) == 0
    listed = capsys.readouterr().out
    assert "  host " in listed and "  backward " in listed
    assert "cpu-tiny T=8" in listed and listed.split("cpu-tiny T=64")[1].split()[-1] == "host"


def test_new_token_counts_stay_in_the_bucket_and_are_not_reused():
    key = ("test", object())
    first = host.new_token_counts(shapes.Shape("m", 64, 1, 1, 1, 1), key)
    assert first == [63, 48, 33]  # spread over (32, 64), below T
    again = host.new_token_counts(shapes.Shape("m", 64, 1, 1, 1, 1), key)
    assert len(again) == 3 and not set(again) & set(first) and all(32 < t < 64 for t in again)
    assert host.new_token_counts(shapes.Shape("m", 8, 1, 1, 1, 1), key) == [7, 6, 5]
    assert host.new_token_counts(shapes.Shape("m", 8, 1, 1, 1, 1), key) == []  # bucket used up
    for T in (1, 2, 3, 5):  # nothing else below T in its power-of-two bucket
        assert host.new_token_counts(shapes.Shape("m", T, 1, 1, 1, 1), key) == []


def test_kernels_are_grouped_into_steps_by_name_and_launch_order():
    table = {r"_gemm": ("a", "b"), r"_wgrad": ("w2", "w1"), r"_fin": ("x",)}
    launched = [("_tile", 1.0), ("_gemm_k", 10.0), ("_wgrad_k", 5.0), ("_gemm_k", 20.0),
                ("_fin_k", 2.0), ("_wgrad_k", 7.0), ("memset", 0.5)]  # fmt: skip
    assert profiling.attribute(launched, table) == {
        "a": {"_gemm_k": 10.0}, "b": {"_gemm_k": 20.0}, "w2": {"_wgrad_k": 5.0},
        "w1": {"_wgrad_k": 7.0}, "x": {"_fin_k": 2.0}, "other": {"_tile": 1.0, "memset": 0.5},
    }  # fmt: skip
    # a GEMM launched once per expert (a loop): its launches are split evenly, in order
    loop = [("gemm", float(i)) for i in range(8)]
    assert profiling.attribute(loop, {"gemm": ("dX", "dW")}) == {
        "dX": {"gemm": 6.0}, "dW": {"gemm": 22.0},
    }  # fmt: skip
    # the first pattern that matches wins (a renamed, more specific kernel goes first)
    first = {r"_act_bwd": ("d",), r"_grouped_gemm": ("x",)}
    assert profiling.attribute([("_grouped_gemm_act_bwd", 1.0)], first) == {
        "d": {"_grouped_gemm_act_bwd": 1.0}
    }


def test_until_rule_gives_the_launches_before_its_landmark_to_its_step():
    rule = {r"_act": ("d",), r"_gemm": profiling.Until(r"_act", "g", ("a", "b"))}
    launched = [("_gemm_k", 1.0), ("_gemm_k", 2.0), ("_act_k", 3.0), ("_gemm_k", 4.0),
                ("_gemm_k", 5.0)]  # fmt: skip
    assert profiling.attribute(launched, rule) == {
        "g": {"_gemm_k": 3.0}, "d": {"_act_k": 3.0}, "a": {"_gemm_k": 4.0}, "b": {"_gemm_k": 5.0},
    }  # fmt: skip
    # no launch before the landmark, or no landmark at all: the plain rule's split
    for launched in ([("_act_k", 3.0), ("_gemm_k", 4.0), ("_gemm_k", 5.0)],
                     [("_gemm_k", 4.0), ("_gemm_k", 5.0)]):  # fmt: skip
        steps = profiling.attribute(launched, rule)
        assert (steps["a"], steps["b"]) == ({"_gemm_k": 4.0}, {"_gemm_k": 5.0})
        assert "g" not in steps


@pytest.mark.parametrize("plan", ["fused", "split"])
def test_backward_attribution_of_both_activation_backward_plans(plan):
    """moe_route's backward launch sequence (Hopper, TMA weight gradients) with step 1 fused or
    split: the plain GEMM that precedes the row pass is GEMM2's input gradient, the one after
    it GEMM1's."""
    step1 = [("_gemm_act_bwd_kernel", 600.0)]
    if plan == "split":
        step1 = [("_gemm_persistent_kernel", 370.0), ("_act_bwd_rows_kernel", 200.0)]
    launched = [
        ("_expand_rows_kernel", 5.0), *step1, ("_router_weight_grad_kernel", 3.0),
        ("_expert_weight_grad_tma_kernel", 400.0), ("_gemm_persistent_kernel", 700.0),
        ("_finalize_kernel", 20.0), ("_expand_rows_kernel", 6.0),
        ("_expert_weight_grad_tma_kernel", 800.0),
    ]  # fmt: skip
    steps = profiling.attribute(launched, backward.MOE_ROUTE_KERNELS)
    assert steps[backward.DGEMM2] == dict(step1)
    assert steps[backward.DX1] == {"_gemm_persistent_kernel": 700.0}
    assert steps[backward.ROUTER] == {"_router_weight_grad_kernel": 3.0}
    assert steps[backward.DW2] == {"_expand_rows_kernel": 5.0,
                                   "_expert_weight_grad_tma_kernel": 400.0}  # fmt: skip
    assert steps[backward.DW1] == {"_expand_rows_kernel": 6.0,
                                   "_expert_weight_grad_tma_kernel": 800.0}  # fmt: skip
    assert steps[backward.EXPAND] == {"_finalize_kernel": 20.0}
    assert profiling.OTHER not in steps


def test_every_backward_pattern_names_a_kernel_of_the_package():
    """A renamed kernel must not leave its pattern behind (its time would go to "other")."""
    import pkgutil

    import moe_route.kernels.triton as kernels

    names = set()
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        names |= {n for n in vars(module) if n.endswith("_kernel")}
    for pattern, rule in backward.MOE_ROUTE_KERNELS.items():
        assert any(re.search(pattern, n) for n in names), (pattern, sorted(names))
        assert set(profiling.rule_steps(rule)) <= set(backward.BACKWARD_STEPS)
        if isinstance(rule, profiling.Until):
            assert any(re.search(rule.landmark, n) for n in names), (rule, sorted(names))
    for rule in backward.GROUPED_MM_KERNELS.values():
        assert set(profiling.rule_steps(rule)) <= set(backward.BACKWARD_STEPS)
    covered = {
        s for rule in backward.MOE_ROUTE_KERNELS.values() for s in profiling.rule_steps(rule)
    }
    assert covered == set(backward.BACKWARD_STEPS)


def test_step_memory_leaves_out_the_returned_gradients_from_their_allocation():
    before = torch.empty(10_000, dtype=torch.uint8)

    def step():
        nonlocal before
        grad = torch.empty(2000, dtype=torch.uint8)  # returned: not an activation
        saved = torch.empty(1000, dtype=torch.uint8)
        temp = torch.empty(3000, dtype=torch.uint8)
        del temp
        before = None  # memory allocated before the step and freed in it: not the step's
        del saved
        return (grad, None)

    out, mem = profiling.step_memory(step, "cpu")
    assert out[0].numel() == 2000
    assert (mem.peak, mem.activation, mem.grads) == (6000, 4000, 2000)


def test_host_and_backward_tables():
    def row(stage, shape, impl, us, nbytes=0.0, **extra):
        return make_row(stage, shape, impl, Timing(us * 1e-6, us * 1e-6, us * 1e-6, 3),
                        Ceilings(1e12, 1e15), nbytes, **extra)  # fmt: skip

    rows = [
        row("host", "m T=64", "index_select", 30.0, per_index_select=1.0, eager_us=10.0,
            graph_us=5.0, eager_over_graph=2.0),
        row("host", "m T=64", "fused_moe", 300.0, per_index_select=10.0, eager_us=280.0,
            graph_us=270.0, eager_over_graph=280 / 270, device_bound=False),
        row("host", "m T=64", "fused_moe fwd+bwd", 900.0, per_index_select=30.0,
            eager_us=950.0, graph="capture failed: RuntimeError"),
        row("host", "m T=64", "fused_moe new T", 2000.0, new_T=[63, 48], first_us=[2000.0, 1500.0],
            repeat_us=500.0, first_over_repeat=4.0),
        row("backward", "m T=4096", "moe_route: total", 200.0, 2e8, step="total", of="moe_route"),
        row("backward", "m T=4096", "moe_route: dW1", 40.0, 2e7, step="dW1", of="moe_route",
            of_dense=0.6, kernels={"_expand_rows_kernel": 10.0,
                                   "_expert_weight_grad_tma_kernel": 30.0}),
        row("backward", "m T=4096", "grouped_mm: dW1", 60.0, 2e7, step="dW1", of="grouped_mm"),
        row("backward", "m T=4096", "grouped_mm: other", 5.0, step="other", of="grouped_mm"),
    ]  # fmt: skip
    md = report.markdown([report.Source("x.json", {"gpu": "G"}, rows)])
    assert "| m T=64 | fused_moe | 300 µs | 10.0× | 280 µs | 270 µs | 1.04× |" in md
    assert "| m T=64 | fused_moe fwd+bwd | 900 µs | 30.0× | 950 µs | capture failed | — |" in md
    assert "| m T=64 | 63, 48 | 2.00 ms, 1.50 ms | 500 µs | 4.00× |" in md
    lines = md.split("### backward")[1].splitlines()
    table = [line for line in lines if line.startswith("| m T=4096")]
    assert table == [  # steps in the backward's order, other and total last
        # the GEMM kernels alone: 30 of the step's 40 µs, so 0.6 * 40 / 30 of dense and
        # 0.5 * 40 / 30 of the step's roofline
        "| m T=4096 | dW1 | 40.0 µs (50 %) | 60.0 µs (33 %) | 1.50× "
        "| 30.0 µs (80 % of dense, 67 % roofline) |",
        "| m T=4096 | other | — | 5.0 µs | — | — |",
        "| m T=4096 | total | 200 µs (100 %) | — | — | — |",
    ]
    # they have their own tables, and no place in the roofline and speed-up plots
    src = report.Source("x.json", {"gpu": "G"}, rows)
    assert report.plot_roofline([src], "unused.png") is None
    assert report.plot_speedup([src], "unused.png") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback is what runs without a GPU")
def test_default_output_folder_is_not_the_working_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.chdir(tmp_path)
    rc = suite.main(["--stages", "maps", "--tokens", "8", "--budget", "0.003", "--no-plots"])
    assert rc == 0 and os.listdir(tmp_path) == []
    out = capsys.readouterr().out
    where = out.split("results go to ")[1].split()[0]
    assert os.path.isfile(os.path.join(where, "suite.json"))
    assert os.path.commonpath([where, tempfile.gettempdir()]) == tempfile.gettempdir()


def test_progress_bar_in_a_log():
    out = io.StringIO()
    p = suite.Progress(4, stream=out)
    p.step("first", 1)
    p.step("second", 3)
    p.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and "first" in lines[0] and "0%" in lines[0]
    assert " 25%" in lines[1] and lines[2].startswith("[" + "#" * 24 + "] 100%")


# --------------------------------------------------------------------------- report and plots


def test_label_parsing():
    assert report.parse_label("qwen3-30b-a3b T=8192") == ("qwen3-30b-a3b", {"T": 8192})
    assert report.parse_label("decode T=64 K=8 E=256") == ("decode", {"T": 64, "K": 8, "E": 256})


def test_legacy_h200_results_load_and_render(tmp_path):
    sources = report.load([f"{DATA}/routing_h200.json", f"{DATA}/moe_h200.json"])
    routing, moe = sources
    assert routing.env["gpu"] == "NVIDIA H200"
    keys = [(r.stage, r.shape, r.impl) for s in sources for r in s.rows]
    assert len(keys) == len(set(keys))  # sweep rows and repeats dropped
    assert not any(r.impl.startswith(("tile=", "block=")) for r in routing.rows)
    # bench_moe.py's second "decode T=64" shape had deepseek-v3's dimensions
    assert {r.impl for r in moe.rows if r.shape == "deepseek-v3 T=64"} >= {"moe_route", "loop"}
    table = report.stage_table(moe.rows, "forward")
    assert table.splitlines()[0] == (
        "| shape | moe_route | moe_route fused | grouped_mm | loop | moe_route roofline |"
    )
    assert "| qwen3-30b-a3b T=8192 | 1.46 ms | 2.18 ms (1.49×) | 2.98 ms (2.04×) | 21.3 ms" in table
    md = report.markdown(sources)
    assert "**NVIDIA H200** (SM90)" in md and "### finalize (`routing_h200.json`)" in md


def test_readme_section_is_replaced_between_markers(tmp_path):
    path = tmp_path / "README.md"
    path.write_text(f"# B\n\nintro\n\n{report.BEGIN}\nold table\n{report.END}\n\ntail\n")
    sources = report.load([f"{DATA}/moe_h200.json"])
    report.update_readme(str(path), sources)
    once = path.read_text()
    report.update_readme(str(path), sources)
    assert path.read_text() == once
    assert once.startswith("# B\n\nintro\n\n" + report.BEGIN) and once.endswith(
        report.END + "\ntail\n"
    )
    assert "old table" not in once and "| deepseek-v3 T=4096 | 8.63 ms" in once


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    rows = []
    for T in (1, 8, 64, 4096):
        for impl, us in (("moe_route", 10.0 * T**0.5), ("grouped_mm", 25.0 * T**0.5),
                         ("loop", 400.0)):  # fmt: skip
            rows.append(_row("forward", f"m T={T}", impl, us))
        rows.append(_row("maps", f"m T={T}", "moe_route", 2.0))
        rows.append(_row("maps", f"m T={T}", "torch argsort", 40.0))
    src = report.Source("x.json", {"gpu": "Test GPU", "timestamp": "2026"}, add_speedups(rows))
    plots = report.plot_all([src], str(tmp_path), prefix="t_")
    assert sorted(plots) == ["decode", "roofline", "speedup"]
    for path in plots.values():
        with open(path, "rb") as f:
            assert f.read(8) == PNG_MAGIC
        assert os.path.getsize(path) > 5000


# --------------------------------------------------------------------------- the CLI on a CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback is what runs without a GPU")
def test_cli_without_gpu_runs_the_cpu_comparison(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(host, "_SEEN_T", {})  # token counts a previous run used are taken
    out = tmp_path / "out"
    readme = tmp_path / "README.md"
    readme.write_text(f"# bench\n\n{report.BEGIN}\n{report.END}\n")
    rc = cli_main(["bench", "--tokens", "8", "64", "--budget", "0.003", "--host-calls", "4",
                   "--out", str(out), "--readme", str(readme)])  # fmt: skip
    text = capsys.readouterr()
    assert rc == 0
    assert "no CUDA device here" in text.out and "CPU comparison" in text.out
    assert "100%" in text.err  # the progress bar
    data = json.loads((out / "suite.json").read_text())
    assert data["schema"] == suite.SCHEMA and data["environment"]["device"] == "cpu"
    assert data["failures"] == []
    assert set(data["shapes"]) == {"cpu-tiny T=8", "cpu-tiny T=64"}
    got = {(r["stage"], r["shape"], r["impl"]) for r in data["rows"]}
    for stage in ("maps", "expand", "finalize", "gemm1", "gemm2+fin", "forward"):
        assert (stage, "cpu-tiny T=8", "moe_route") in got
    assert {i for s, sh, i in got if s == "forward"} == {"moe_route", "grouped_mm", "loop"}
    assert {i for s, sh, i in got if s == "train"} == {"moe_route", "grouped_mm", "loop"}
    for r in data["rows"]:
        if r["stage"] == "train":  # peak memory without the gradients: > 0, < what is saved + out
            assert 0 < r["extra"]["activation_MiB"] < 1, r
    # host: every op at both decode sizes, as a multiple of one index_select, with the eager
    # latency; the first calls at new token counts of each bucket
    ops = {"index_select", "build_routing_maps", "expand_rows", "finalize_moe_routing",
           "grouped_gemm GEMM1", "grouped_gemm GEMM2", "fused_moe", "fused_moe fwd+bwd",
           "MoELayer", "fused_moe new T"}  # fmt: skip
    for T in (8, 64):
        hrows = {r["impl"]: r for r in data["rows"] if r["stage"] == "host"
                 and r["shape"] == f"cpu-tiny T={T}"}  # fmt: skip
        assert set(hrows) == ops, T
        assert hrows["index_select"]["extra"]["per_index_select"] == 1.0
        for name, r in hrows.items():
            if name != "fused_moe new T":
                assert r["extra"]["calls"] == 4 and r["extra"]["eager_us"] > 0, r
                e = r["extra"]
                assert e["per_index_select"] > 0, r
                # the ratio is to the yardstick timed next to the row
                assert e["per_index_select"] == pytest.approx(r["median_us"] / e["index_select_us"])
        new_t = hrows["fused_moe new T"]["extra"]
        assert new_t["new_T"] == {8: [7, 6, 5], 64: [63, 48, 33]}[T]
        assert len(new_t["first_us"]) == 3 and new_t["repeat_us"] > 0
        assert len(new_t["first_host_us"]) == 3 and new_t["repeat_host_us"] > 0
        # a call returns before the device has drained
        assert all(h <= s for h, s in zip(new_t["first_host_us"], new_t["first_us"], strict=True))
        assert new_t["host_first_over_repeat"] == pytest.approx(
            max(new_t["first_host_us"]) / new_t["repeat_host_us"]
        )
    # backward: per-step rows of both implementations at the training size (T >= 64 on a CPU)
    brows = [r for r in data["rows"] if r["stage"] == "backward"]
    assert {r["shape"] for r in brows} == {"cpu-tiny T=64"}
    assert {r["extra"]["of"] for r in brows} == {"moe_route", "grouped_mm"}
    for of in ("moe_route", "grouped_mm"):
        steps = {r["extra"]["step"]: r for r in brows if r["extra"]["of"] == of}
        assert "total" in steps
        assert (
            steps["total"]["median_us"]
            >= max(r["median_us"] for k, r in steps.items() if k != "total") * 0.999
        )
    # on the CPU, torch._grouped_mm's operator is the one name the baseline's table matches
    assert {"dGEMM2 + act'", "dW2", "dX GEMM1", "dW1"} <= {
        r["extra"]["step"] for r in brows if r["extra"]["of"] == "grouped_mm"
    }
    for r in data["rows"]:
        assert 0 < r["p20_us"] <= r["median_us"] <= r["p80_us"]
        assert math.isfinite(r["roofline_fraction"])
        if r["impl"] == "moe_route" and "rel_err" in r["extra"]:
            assert r["extra"]["rel_err"] < 1e-4, r
    ours = next(r for r in data["rows"] if r["stage"] == "forward" and r["impl"] == "moe_route")
    assert {"x_grouped_mm", "x_loop"} <= set(ours["extra"])
    for name in ("suite.csv", "suite.md"):
        assert (out / name).stat().st_size > 0, name
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib is not installed" in text.out
    else:
        for name in ("suite_roofline.png", "suite_speedup.png", "suite_decode.png"):
            assert (out / name).read_bytes()[:8] == PNG_MAGIC, name
    text = readme.read_text()
    assert "### forward" in text and "cpu-tiny T=64" in text
    assert "| cpu-tiny T=64 | fused_moe fwd+bwd |" in text and "| cpu-tiny T=8 | 7, 6, 5 |" in text
    assert "### backward" in text and "| cpu-tiny T=64 | total |" in text


def test_a_failing_stage_is_reported_and_the_rest_continue(tmp_path, capsys, monkeypatch):
    def boom(shape, ctx):
        raise RuntimeError("kaput")

    monkeypatch.setitem(stages.STAGES, "boom", stages.Stage("boom", boom, "fails", ("boom",)))
    rc = suite.main(["--device", "cpu", "--stages", "boom", "maps", "--tokens", "8",
                     "--budget", "0.003", "--no-plots", "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    assert "RuntimeError: kaput" in capsys.readouterr().out
    data = json.loads((tmp_path / "suite.json").read_text())
    assert [(f["stage"], f["impl"]) for f in data["failures"]] == [("boom", "*")]
    assert {r["stage"] for r in data["rows"]} == {"maps"}
    strict = suite.main(["--device", "cpu", "--stages", "boom", "--tokens", "8", "--strict",
                         "--no-plots", "--out", str(tmp_path)])  # fmt: skip
    assert strict == 1


def test_render_from_saved_json(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rc = cli_main(["bench", "--render", f"{DATA}/moe_h200.json", "--out", str(tmp_path)])
    assert rc == 0
    assert sorted(os.listdir(tmp_path)) == [
        "results.md", "results_decode.png", "results_roofline.png", "results_speedup.png",
    ]  # fmt: skip
    assert "![decode](results_decode.png)" in (tmp_path / "results.md").read_text()


def test_bench_readme_table_is_generated_from_the_json():
    """bench/README.md's results section is exactly what the renderer makes of its sources."""
    with open(f"{REPO}/bench/README.md") as f:
        text = f.read()
    section = text.split(report.BEGIN, 1)[1].split(report.END, 1)[0]
    sources = [line.split("`")[1] for line in section.splitlines() if line.startswith("- `")]
    assert sources, "no source files named in bench/README.md"
    cwd = os.getcwd()
    try:
        os.chdir(REPO)
        plots = {
            name: os.path.join(REPO, rel)
            for name, rel in (
                (line[2 : line.index("]")], "bench/" + line[line.index("(") + 1 : -1])
                for line in section.splitlines()
                if line.startswith("![")
            )
        }
        expect = report.markdown(report.load(sources), plots, relative_to=f"{REPO}/bench")
    finally:
        os.chdir(cwd)
    assert section.strip("\n") == expect.strip("\n")


def test_runs_split_over_files_render_as_one_table(tmp_path):
    env = {"gpu": "Test GPU", "timestamp": "2026-01-01T00:00:00+00:00"}
    for name, T in (("decode", 8), ("prefill", 4096)):
        rows = [
            _row("forward", f"m T={T}", "moe_route", T),
            _row("forward", f"m T={T}", "loop", 9 * T),
        ]
        harness.write_results(add_speedups(rows), env, str(tmp_path), name)
    md = report.markdown(
        report.load([str(tmp_path / "decode.json"), str(tmp_path / "prefill.json")])
    )
    assert md.count("### forward") == 1 and "### forward (`decode.json`, `prefill.json`)" in md
    assert "| m T=8 | 8.0 µs | 72.0 µs (9.00×) |" in md and "| m T=4096 | 4.10 ms |" in md


@given(st.lists(st.floats(1e-7, 1e-1), min_size=1, max_size=40), st.integers(0, 3))
@settings(max_examples=200, deadline=None)
def test_summary_percentiles_bracket_the_median(samples, repeats):
    """p20 <= median <= p80 exactly (the report draws median - p20 and p80 - median as error
    bars); equal samples, whose interpolated percentiles can land an ulp off, included."""
    t = timing._summarise(samples + [samples[0]] * repeats)
    assert t.p20_s <= t.median_s <= t.p80_s


# --------------------------------------------------------------------------- the quant stage


def _meta(t):
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _scaled_grouped_mm_standin(a, b, scale_a, scale_b, offs=None, bias=None, scale_result=None,
                               out_dtype=None, use_fast_accum=False):  # fmt: skip
    """``torch._scaled_grouped_mm`` on the CPU: its layout checks (the meta function's, those of
    the CUDA kernel), then each group's product in float32. Rows past ``offs[-1]`` stay NaN."""
    torch.ops.aten._scaled_grouped_mm(_meta(a), _meta(b), _meta(scale_a), _meta(scale_b),
                                      offs=_meta(offs), out_dtype=out_dtype)  # fmt: skip
    assert a.shape[-1] % 16 == 0 and b.shape[-2] % 16 == 0 and b.shape[-1] % 16 == 0
    out = torch.full((a.shape[0], b.shape[-1]), float("nan"), dtype=out_dtype)
    start = 0
    for g, end in enumerate(offs.tolist()):
        a_g = a[start:end].float() * scale_a[start:end, None]
        out[start:end] = (a_g @ (b[g].float() * scale_b[g][None, :])).to(out_dtype)
        start = end
    return out


def _quant_case(T=64, H=256, I=128, E=8, K=2):  # noqa: E741
    import moe_route

    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).bfloat16()
    w1 = (torch.randn(E, 2 * I, H, generator=g) * H**-0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) * I**-0.5).bfloat16()
    logits = torch.randn(T, E, generator=g)
    tw, ids = moe_route.reference.topk_routing_reference(logits, K, renormalize=True)
    ref = moe_route.fused_moe(x, w1, w2, tw, ids, backend="torch")
    return x, w1, w2, tw, ids, ref


@pytest.mark.parametrize("align", [1, 16])
def test_scaled_grouped_mm_pipeline_passes_the_operator_checks(align):
    """The ``_scaled_grouped_mm`` baseline hands the operator what its checks want (mat_a
    row-major, mat_b ``[E, K, N]`` column-major, scale_a ``[M]``, scale_b ``[E, N]``, int32
    group ends; groups padded to ``align`` rows) and computes the MoE forward."""
    import moe_route

    x, w1, w2, tw, ids, ref = _quant_case()
    q1, s1 = moe_route.quantize_experts(w1, "fp8_channel")
    q2, s2 = moe_route.quantize_experts(w2, "fp8_channel")
    out = baselines.scaled_grouped_mm_forward(x, q1, s1, q2, s2, tw, ids, align=align,
                                              mm=_scaled_grouped_mm_standin)  # fmt: skip
    assert out.dtype == x.dtype and out.shape == x.shape
    assert context.rel_err(out, ref) < 0.1


def test_transformers_fp8_baseline_takes_moe_route_fp8_weights(monkeypatch):
    """transformers' FP8 grouped_mm experts function on moe_route's ``fp8`` layout (its hub
    kernel replaced by a CPU stand-in of the same signature)."""
    pytest.importorskip("transformers")
    fp8mod = pytest.importorskip("transformers.integrations.finegrained_fp8")
    import moe_route

    def grouped_matmul(x, w, scale, offsets=None, tokens_per_expert=None, block_size=None):
        wd = moe_route.quant.dequantize_fp8_block(w, scale, tuple(block_size))
        out, start = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype), 0
        for g, end in enumerate(offsets.tolist()):
            out[start:end] = (x[start:end].float() @ wd[g].t()).to(x.dtype)
            start = end
        return out

    kernel = type("Kernel", (), {"grouped_matmul": staticmethod(grouped_matmul)})
    monkeypatch.setattr(fp8mod, "load_finegrained_fp8_kernel", lambda: kernel)
    x, w1, w2, tw, ids, ref = _quant_case()
    q1, s1 = moe_route.quantize_experts(w1, "fp8")
    q2, s2 = moe_route.quantize_experts(w2, "fp8")
    out = baselines.transformers_fp8_experts(q1, s1, q2, s2)(x, tw, ids)
    assert out.dtype == x.dtype and context.rel_err(out, ref) < 0.1


def test_triton_kernels_routing_and_weights_compute_the_gpt_oss_forward():
    """What the ``triton_kernels`` baseline hands ``matmul_ogs``, run through the semantics of
    its torch reference (``matmul_ogs_torch``, written out here: the package itself is
    optional): sorted rows grouped by expert in ``counts``, GEMM1 on token
    ``sorted_to_slot // K`` with the SwiGLU on (gate, up) column pairs, GEMM2 scaled by
    ``gammas``, rows summed into their slot's token. That is moe_route's forward with
    gpt-oss's activation (the inputs large enough that the clamp bites)."""
    import moe_route

    g = torch.Generator().manual_seed(0)
    T, H, I, E, K = 48, 64, 32, 8, 3  # noqa: E741
    x = torch.randn(T, H, generator=g) * 8
    w1 = torch.randn(E, 2 * I, H, generator=g) * H**-0.5
    w2 = torch.randn(E, H, I, generator=g) * I**-0.5
    logits = torch.randn(T, E, generator=g)
    tw, ids = moe_route.reference.topk_routing_reference(logits, K, renormalize=True)
    act = baselines.GPT_OSS_ACTIVATION
    ref = moe_route.fused_moe(x, w1, w2, tw, ids, activation=act, backend="torch")
    gate = (x @ w1[:, :I].transpose(1, 2)).flatten()
    assert (gate > baselines.GPT_OSS_LIMIT).any()
    s2s, slot_to_sorted, counts, gammas = baselines.triton_kernels_routing(ids, tw, E)
    assert s2s.dtype == slot_to_sorted.dtype == counts.dtype == torch.int32
    assert torch.equal(slot_to_sorted[s2s.long()], torch.arange(T * K, dtype=torch.int32))
    assert counts.sum() == T * K and gammas.dtype == torch.float32
    w1p, w2k = baselines.gate_up_pairs(w1), w2.transpose(1, 2)
    assert w1p.shape == (E, H, 2 * I) and w1p.stride(-2) == 1
    assert torch.equal(w1p[:, :, 0::2], w1[:, :I].transpose(1, 2))
    out, start = torch.zeros(T, H), 0
    for e, n in enumerate(counts.tolist()):
        slots = s2s[start : start + n].long()
        assert (ids.reshape(-1)[slots] == e).all()
        a = x[slots // K] @ w1p[e]
        h = moe_route.reference.activation_reference(a, act, "interleaved")
        out.index_add_(0, slots // K, (h @ w2k[e]) * gammas[start : start + n, None])
        start += n
    assert context.rel_err(out, ref) < 1e-5
    grouped = baselines.grouped_mm_forward(x, w1.transpose(1, 2), w2k, tw, ids,
                                           activation=act)  # fmt: skip
    assert context.rel_err(grouped, ref) < 1e-5


def test_triton_kernels_rows_only_where_the_package_imports_on_cuda(monkeypatch):
    """No ``triton_kernels`` rows on the CPU, importable or not; on CUDA without the package the
    forward and quant stages list it under ``skipped`` with the reason (nothing allocated)."""
    from moe_route.bench import forward, quant

    monkeypatch.setattr(baselines, "triton_kernels_available", lambda: True)
    ctx = context.Context(torch.device("cpu"), Ceilings(1e10, 1e11), dtype=torch.float32,
                          budget_s=0.002, with_loop=False, backend="reference")  # fmt: skip
    shape = shapes.cpu_shapes([8])[0]
    forward.stage_forward(shape, ctx)
    assert {r.impl for r in ctx.rows} == {"moe_route", "grouped_mm"}
    assert ctx.skipped == [] and ctx.failures == []
    monkeypatch.setattr(baselines, "triton_kernels_available", lambda: False)
    cuda = context.Context(torch.device("cuda"), Ceilings(1e12, 1e15))
    assert forward._triton_kernels_entries(shape, cuda, 1.0, 1.0) == []
    assert quant._triton_kernels(shape, cuda, None, 1.0, 1.0) == {}
    assert [(s["stage"], s["impl"]) for s in cuda.skipped] == [
        ("forward", forward.TRITON_KERNELS), ("quant", quant.TRITON_KERNELS)]  # fmt: skip
    assert all("PYTHONPATH" in s["reason"] for s in cuda.skipped)
    assert cuda.rows == [] and cuda.failures == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback is what runs without a GPU")
def test_quant_stage_on_the_cpu(tmp_path, capsys):
    """The quant stage's CPU comparison: the prefill rows (fp32 reference, the three formats),
    the decode rows against the weight-read floor, host times; the GPU-only baselines listed as
    skipped with their reason, not failed; tables and the plot rendered."""
    rc = suite.main(["--device", "cpu", "--stages", "quant", "--tokens", "8", "256", "--budget",
                     "0.003", "--host-calls", "4", "--out", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0 and "optional baseline(s) skipped" in out
    data = json.loads((tmp_path / "suite.json").read_text())
    assert data["failures"] == []
    assert (
        data["environment"]["fp8_mm_TFLOP_s"] > 0 and "_scaled_mm" in data["environment"]["fp8_mm"]
    )
    rows = {(r["stage"], r["impl"]): r for r in data["rows"]}
    prefill = {i: r for (s, i), r in rows.items() if s == "quant"}
    assert list(prefill) == ["moe_route fp32", "moe_route fp8", "moe_route fp8_channel",
                             "moe_route mxfp4"]  # fmt: skip
    assert all(r["shape"] == "cpu-tiny T=256" for r in prefill.values())
    flops = 6 * 256 * 2 * 64 * 32
    for impl, r in prefill.items():
        e = r["extra"]
        assert r["flops"] == flops and e["tflops"] == pytest.approx(flops / r["median_us"] / 1e6)
        assert e["of_dense"] > 0 and e["rate"] == ("fp8" if "fp8" in impl else "mm")
        if impl != "moe_route fp32":
            assert e["x_fp32"] == pytest.approx(prefill["moe_route fp32"]["median_us"] /
                                                r["median_us"])  # fmt: skip
            assert 0.01 < e["rel_err"] < (0.4 if impl.endswith("mxfp4") else 0.15), r
    wb = {i: r["extra"]["weight_bytes"] for (s, i), r in rows.items() if s == "quant-dec"}
    assert list(wb) == ["moe_route fp32", "moe_route fp8", "moe_route mxfp4"]
    assert wb["moe_route fp32"] > wb["moe_route fp8"] > wb["moe_route mxfp4"]
    for impl in wb:
        r = rows[("quant-dec", impl)]
        assert r["bytes"] == wb[impl] and r["flops"] == 0 and 0 < r["extra"]["touched"] <= 8
        assert r["extra"]["over_floor"] == pytest.approx(r["median_us"] / r["floor_us"])
    host = {i: r for (s, i), r in rows.items() if s == "quant-host"}
    assert list(host) == ["fused_moe fp32", "fused_moe fp8", "fused_moe mxfp4"]
    assert host["fused_moe fp32"]["extra"]["over_ref"] == 1.0
    assert all(r["extra"]["calls"] == 4 and r["median_us"] > 0 for r in host.values())
    skipped = {f["impl"]: f["reason"] for f in data["skipped"]}
    assert set(skipped) == {"torch._scaled_grouped_mm fp8 rowwise", "transformers fp8 grouped_mm"}
    assert "CPU" in skipped["torch._scaled_grouped_mm fp8 rowwise"]
    md = (tmp_path / "suite.md").read_text()
    for stage in ("quant", "quant-dec", "quant-host"):
        assert f"### {stage}\n" in md
    assert "| cpu-tiny T=256 | moe_route fp8 |" in md and "### skipped" in md
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "suite_quant.png").read_bytes()[:8] == PNG_MAGIC


def test_quant_tables_render_gpu_rows():
    """The quant tables on rows as a GPU run writes them: the baselines' rows, the FP8 rate,
    the speed-ups over bf16 and over the baseline of the same format, a host row."""

    def row(stage, impl, us, nbytes=1e9, flops=1e12, **extra):
        return make_row(stage, "m T=4096", impl, Timing(us * 1e-6, us * 1e-6, us * 1e-6, 3),
                        Ceilings(1e12, 1e15), nbytes, flops, **extra)  # fmt: skip

    rows = [
        row("quant", "moe_route bf16", 2000.0, quant="bf16", tflops=500.0, of_dense=0.7,
            rate="mm", peak_mib=2048.0),
        row("quant", "moe_route fp8_channel", 1000.0, quant="fp8_channel", tflops=1000.0,
            of_dense=0.6, rate="fp8", x_bf16=2.0, x_scaled_grouped_mm=1.5, rel_err=0.061),
        row("quant", "torch._scaled_grouped_mm fp8 rowwise", 1500.0, quant="fp8_channel",
            tflops=667.0, of_dense=0.4, rate="fp8", x_bf16=1.33, rel_err=0.07, mismatch=True),
        row("quant-dec", "moe_route fp8", 375.0, 3e8, 0.0, quant="fp8", touched=64,
            weight_bytes=3e8, over_floor=1.25, x_bf16=1.8, rel_err=0.06),
        row("quant-host", "fused_moe fp8", 50.0, 0, 0, quant="fp8", eager_us=120.0,
            graph_us=110.0, over_ref=1.1, path="sorted"),
    ]  # fmt: skip
    env = {"gpu": "G", "fp8_mm_TFLOP_s": 1500.0, "copy_TB_s": 3.0, "bf16_mm_TFLOP_s": 700.0}
    skipped = [{"stage": "quant", "shape": "m T=4096", "impl": "transformers fp8 grouped_mm",
                "reason": "ImportError: no kernels"}]  # fmt: skip
    md = report.markdown([report.Source("x.json", env, rows, skipped=skipped)])
    assert "FP8 matmul 1500 TFLOP/s" in md
    assert ("| m T=4096 | moe_route fp8_channel | 1.00 ms | 1000 TFLOP/s (60 % of FP8 dense) "
            "| 2.00× | 1.50× scaled_grouped_mm | 0.061 | — |") in md  # fmt: skip
    assert "| 0.07 ⚠ mismatch |" in md and "| 2.0 GiB |" in md
    assert (
        "| m T=4096 | moe_route fp8 | 375 µs | 64 | 286 MiB | 300 µs |" in md
        and "| 1.25× | 1.80× |" in md
    )
    assert "| m T=4096 | fused_moe fp8 | sorted | 50.0 µs | 1.10× | 120 µs | 110 µs |" in md
    # rows written before the eager path was recorded: no such column
    unrecorded = row("quant-host", "fused_moe fp8", 50.0, 0, 0, quant="fp8", over_ref=1.1)
    old_table = tables.quant_host_table([unrecorded])
    assert "eager path" not in old_table and "| fused_moe fp8 | 50.0 µs | 1.10× |" in old_table
    assert "- quant / m T=4096 / transformers fp8 grouped_mm: ImportError: no kernels" in md
    src = report.Source("x.json", {"gpu": "G"}, rows)
    assert report.plot_roofline([src], "unused.png") is None  # tables of their own


# --------------------------------------------------------------------------- bench --sweep
# (tests/test_cli.py: the names, --list and the options each takes)

# each sweep's tiny case at one token count: a few seconds of interpreted kernels each
SWEEP_TOKENS = {
    "gemm": "24",
    "wgrad": "24",
    "act": "24",
    "decode": "1",
    "bwd_decode": "1",
    "quant": "1",
}


@needs_interpreter
@pytest.mark.parametrize("name", list(SWEEP_TOKENS))
def test_sweep_runs_its_tiny_case_on_the_cpu(tmp_path, capsys, name):
    """``bench --sweep NAME`` without a GPU: the tiny float16 case through the interpreter, every
    variant run and checked against the tables' config (or fused_moe), the CSV written."""
    rc = cli_main(["bench", "--sweep", name, "--tokens", SWEEP_TOKENS[name],
                   "--out", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "the tiny float16 case through the Triton interpreter" in out
    with open(tmp_path / f"{name}_sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows and {r["model"] for r in rows} == {"tiny"}
    for r in rows:
        assert not r["status"].startswith("FAILED") and r["status"] != "MISMATCH", r
        if r.get("rel_err") and r.get("impl") != "torch._grouped_mm":
            assert float(r["rel_err"]) < 1e-2, r
    if name == "gemm":
        persistent = [r for r in rows if r["kernel"] == "persistent"]
        assert {r["gemm"] for r in rows} == {"gemm1", "gemm1_xperm", "gemm2"}
        assert persistent and all(r["status"] == "ok" for r in persistent), persistent
        assert "return GemmConfig(" in out  # the suggested tuning.py tail
    elif name == "wgrad":
        impls = {r["impl"].split(" ")[0] for r in rows if r["gemm"] == "dW1"}
        assert {"pointer+gather", "plan:", "tma", "pointer"} <= impls, impls
    elif name == "act":
        assert {r["impl"] for r in rows} >= {"plan, gathered", "plan, permuted",
                                            "epilogue bytes, copied"}  # fmt: skip
    elif name == "decode":
        assert [r["status"] for r in rows][:2] == ["baseline", "current"]
    elif name == "bwd_decode":
        assert {r["gemm"] for r in rows} == {"dX", "act_bwd"}
    elif name == "quant":
        assert {r["format"] for r in rows} == {"fp8", "mxfp4"}
        for fmt in ("fp8", "mxfp4"):  # the tables' tiles first, then the tiny grid's
            statuses = [r["status"] for r in rows if r["format"] == fmt]
            assert statuses[0] == "current" and statuses[1:] and set(statuses[1:]) == {"ok"}
            # then the decode path's tiles (eager calls of this size take it), the tables' first
            decode = [
                r["config"] for r in rows if r["format"] == fmt and "decode path" in r["config"]
            ]
            assert len(decode) > 1 and decode[0].endswith("(eager calls)"), decode


@needs_interpreter
def test_quant_sweep_prefill_tiles_on_the_cpu(tmp_path, capsys):
    """``--sweep quant --prefill``: MXFP4 only, GEMM1's tiles beside the tables' GEMM2, then
    GEMM2's beside the tables' GEMM1, all agreeing; decode sizes are refused there."""
    rc = cli_main(["bench", "--sweep", "quant", "--prefill", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    with open(tmp_path / "quant_sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["format"] for r in rows} == {"mxfp4"} and {r["T"] for r in rows} == {"64"}
    assert [r["status"] for r in rows] == ["current"] + ["ok"] * (len(rows) - 1)
    pairs = [r["config"].split(" gemm2 ") for r in rows]
    g1, g2 = pairs[0]
    assert any(a == g1 and b != g2 for a, b in pairs) and any(a != g1 and b == g2 for a, b in pairs)
    assert cli_main(["bench", "--sweep", "quant", "--prefill", "--tokens", "1"]) == 2
    assert "more than 16 rows per expert" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what runs without a GPU")
@pytest.mark.parametrize("name", list(SWEEP_TOKENS))
def test_sweep_without_gpu_or_interpreter_refuses(monkeypatch, capsys, name):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert cli_main(["bench", "--sweep", name]) == 2
    out = capsys.readouterr().out
    assert f"bench --sweep {name}: needs a CUDA device" in out and "TRITON_INTERPRET=1" in out
    assert cli_main(["bench", "--sweep", name, "--device", "cuda"]) == 2
    assert "no CUDA device is visible" in capsys.readouterr().out
