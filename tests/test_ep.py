"""Expert parallelism on the CPU: MoELayer(ep_group=...) over gloo, W = 2 and 4 processes.

One spawned job per world size runs every scenario of ``tests/ep_worker.py`` (spawning costs
seconds per group), twice each; the tests here compare what each rank saw with the
single-process layer (float64, reference backend) applied to the rank-major concatenation of
all ranks' tokens: outputs, the aux losses, ids and weights, global tokens per expert, input
gradients, each rank's slice of the expert-weight gradients and the replicated parameters'
gradients summed over ranks. Then bitwise determinism across the two runs, the state-dict
round trips, and the errors (the collective ones from the job, the local ones here with a
process group that cannot exchange).
"""

from __future__ import annotations

import csv
import functools
import importlib.util
import os
import pathlib

import ep_worker
import filelock
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import moe_route

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="needs torch.distributed with the gloo backend",
)

EPS = torch.finfo(torch.float64).eps
TOL = dict(rtol=64 * EPS, atol=64 * EPS)  # float64: only the order of a few sums differs
# float32 Triton kernels against the float64 oracle: sums of a few dozen float32 roundings
TOL32 = dict(rtol=128 * torch.finfo(torch.float32).eps, atol=128 * torch.finfo(torch.float32).eps)
EXPERT = ("w1", "w2", "b1", "b2")
EXACT = ("tokens_per_expert", "topk_ids")  # integers: equal
MATCHED = [n for n in ep_worker.SCENARIOS if n != "fixed-truncated"]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"W{w}")
def job(request, tmp_path_factory):
    """``(W, [rank results])`` of one spawned gloo job running every scenario."""
    W = request.param
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Under pytest-xdist both workers get tests of this module, and each would spawn the
        # job: the first to ask runs it into the run's shared temporary directory (the
        # workers' common parent, new for each run) while the other waits on the lock, then
        # both read its files.
        outdir = tmp_path_factory.getbasetemp().parent / f"ep_w{W}"
        outdir.mkdir(exist_ok=True)
    else:
        outdir = tmp_path_factory.mktemp(f"ep_w{W}")
    with filelock.FileLock(str(outdir / "job.lock")):
        if not (outdir / "done").exists():
            names = list(ep_worker.SCENARIOS)
            args = (W, ep_worker.free_port(), str(outdir), names)
            mp.spawn(ep_worker.worker, args=args, nprocs=W)
            (outdir / "done").touch()
    return W, [torch.load(outdir / f"rank{r}.pt", weights_only=False) for r in range(W)]


@functools.cache
def single_process(name: str, world: int, ids_override: tuple | None = None) -> dict:
    """The single-process layer on the concatenated batch: its outputs and gradients."""
    layer = ep_worker.full_layer(name, world)
    xs, douts = ep_worker.inputs(name, world)
    x = torch.cat(xs).requires_grad_(True)
    if ids_override is None:
        out = layer(x)
    else:  # the layer with the given slots dropped: its maps come from the overriding ids
        import moe_route.layer as layer_module
        from moe_route.maps import maps_op

        real = layer_module._LayerCall.sorted_path
        ids = torch.tensor(ids_override, dtype=torch.int32).view(-1, ep_worker.K)

        def overriding(call, x, w1, *rest):
            _, program, direct = real(call, x, w1, *rest)
            maps = lambda _ids: maps_op(ids, w1.shape[0], call.plan.maps_backend)
            return maps, program, direct

        layer_module._LayerCall.sorted_path = overriding
        try:
            out = layer(x)
        finally:
            layer_module._LayerCall.sorted_path = real
        out = out._replace(
            topk_ids=ids, tokens_per_expert=moe_route.tokens_per_expert(ids, ep_worker.E)
        )
    ((out.output * torch.cat(douts)).sum() + out.aux_loss).backward()
    rec = {f: getattr(out, f).detach() for f in out._fields}
    rec["x.grad"] = x.grad
    rec.update({f"{n}.grad": p.grad for n, p in layer.named_parameters()})
    rec["state"] = layer.state_dict()
    return rec


def _check_against(ref: dict, ranks: list[dict], tol: dict = TOL) -> None:
    per_rank = ("output", "router_logits", "topk_ids", "topk_weights", "x.grad")
    for field, want in ref.items():
        if field == "state" or want is None:
            continue
        got = [r[field] for r in ranks]
        base = field.removesuffix(".grad")
        if field in per_rank or (field.endswith(".grad") and base in EXPERT):
            got = torch.cat(got)  # the rank's rows of the batch, or its slice of the experts
        elif field.endswith(".grad"):  # replicated: the ranks' shares sum to the whole
            got = torch.stack(got).sum(0)
        else:  # global values, the same on every rank
            for r, g in enumerate(got[1:], 1):
                assert torch.equal(g, got[0]), f"{field}: rank {r} differs from rank 0"
            got = got[0]
        if field in EXACT:
            assert torch.equal(got, want), f"{field}: {got.tolist()} != {want.tolist()}"
        else:
            got = got.to(want.dtype)
            torch.testing.assert_close(got, want, **tol, msg=lambda m, f=field: f"{f}: {m}")


@pytest.mark.parametrize("name", MATCHED)
def test_matches_single_process_on_concatenated_batch(job, name):
    W, results = job
    if ep_worker.tokens(name, W) is None:
        pytest.skip(f"{name} runs in the W=2 job only (the Triton interpreter takes seconds)")
    ranks = [r[name]["runs"][0] for r in results]
    ref = single_process(name, W)
    _check_against(ref, ranks, TOL32 if name in ep_worker.TRITON else TOL)
    if name == "deepseek":  # the last rank's experts got nothing: it received no rows
        assert (ref["tokens_per_expert"][-ep_worker.E // W :] == 0).all()
    if name == "zero-tokens":
        assert 0 in ep_worker.tokens(name, W)


def test_fixed_capacity_drops_rows_beyond_the_capacity(job):
    """ep_capacity=2: each rank sends its first 2 tokens (token order) to each destination;
    the slots of the others there are dropped, and the result is the single-process layer with
    those slots dropped."""
    W, results = job
    name = "fixed-truncated"
    ranks = [r[name]["runs"][0] for r in results]
    ids = torch.cat([r["topk_ids"] for r in ranks])
    free = single_process(name, W)["topk_ids"]  # the router's choice, nothing dropped
    assert ((ids == free) | (ids == -1)).all()
    El = ep_worker.E // W
    for r, rank in enumerate(ranks):  # at most 2 tokens of each rank for each destination
        kept = rank["topk_ids"]
        goes = ((kept.unsqueeze(-1) // El == torch.arange(W)) & (kept >= 0).unsqueeze(-1)).any(1)
        assert goes.sum(0).max() <= 2, f"rank {r}"
        # the first tokens in token order: a token dropped for a destination that is routed
        # there (in the router's choice) comes after 2 that travel
        wanted = free[sum(len(q["topk_ids"]) for q in ranks[:r]) :][: len(kept)]
        wants = (wanted.unsqueeze(-1) // El == torch.arange(W)) & (wanted >= 0).unsqueeze(-1)
        wants = wants.any(1)
        for d in range(W):
            lost = (wants[:, d] & ~goes[:, d]).nonzero()
            if lost.numel():
                assert goes[: int(lost[0]), d].sum() == 2, f"rank {r} -> {d}"
    assert (ids == -1).sum() > 0  # the scenario does drop
    ref = single_process(name, W, ids_override=tuple(ids.flatten().tolist()))
    _check_against(ref, ranks)


@pytest.mark.parametrize("name", list(ep_worker.SCENARIOS))
def test_two_runs_give_the_same_bits(job, name):
    W, results = job
    if ep_worker.tokens(name, W) is None:
        pytest.skip(f"{name} runs in the W=2 job only (the Triton interpreter takes seconds)")
    for r, res in enumerate(results):
        first, second = res[name]["runs"]
        for field, t in first.items():
            if t is not None:
                assert torch.equal(t, second[field]), f"rank {r}: {field} differs"


@pytest.mark.parametrize("name", ["softmax-capacity", "deepseek"])
def test_state_dict_round_trips(job, name):
    """load_state_dict(full) keeps the slice, full_state_dict() gathers it back on every
    rank, and the per-rank state_dict() loads into another expert-parallel layer."""
    W, results = job
    full = single_process(name, W)["state"]
    El = ep_worker.E // W
    for r, res in enumerate(results):
        gathered, mine = res[name]["full_state"], res[name]["rank_state"]
        reloaded = res[name]["reloaded_state"]
        assert gathered.keys() == full.keys() == mine.keys() == reloaded.keys()
        for key, want in full.items():
            assert torch.equal(gathered[key], want), f"rank {r}: full {key}"
            expect = want[r * El : (r + 1) * El] if key in EXPERT else want
            assert torch.equal(mine[key], expect), f"rank {r}: {key}"
            assert torch.equal(reloaded[key], mine[key]), f"rank {r}: reloaded {key}"


def test_from_experts_keeps_the_rank_slice(job):
    W, results = job
    for r, res in enumerate(results):
        full_w1, full_w2, mine_w1, mine_w2 = res["from_experts"]
        El = ep_worker.E // W
        assert torch.equal(mine_w1, full_w1[r * El : (r + 1) * El])
        assert torch.equal(mine_w2, full_w2[r * El : (r + 1) * El])


def test_fixed_capacity_compiles_fullgraph(job):
    """No graph break (no host sync) in the fixed-capacity forward; the compiled forward and
    its AOT-autograd backward give what eager gives."""
    W, results = job
    if W != 2:
        pytest.skip("compiled in the W=2 job only (it costs seconds per rank)")
    for res in results:
        for got, want in zip(res["compiled"]["compiled"], res["compiled"]["eager"], strict=True):
            torch.testing.assert_close(got, want, **TOL)


def test_collective_errors_name_the_argument(job):
    W, results = job
    for r, res in enumerate(results):
        msgs = res["errors"]
        other = 1 if r == 0 else 0
        inter = ep_worker.INTER + (r == 1)
        assert f"intermediate_size differs between ranks (rank {r}: {inter}" in msgs["mismatch"]
        if r in (0, 1):
            assert f"rank {other}: {ep_worker.INTER + (other == 1)}" in msgs["mismatch"]
        assert "capacity_factor differs" in msgs["mismatch-float"]
        divide = f"ep_group has {W} ranks, which does not divide num_experts={2 * W - 1}"
        assert divide in msgs["divide"]
        assert "ep_capacity=0: expected None" in msgs["capacity"]
        assert "ep_chunks=0: expected an int >= 1" in msgs["chunks"]


# ----------------------------------------------------------------------------- local errors
class _NoAllToAll(dist.ProcessGroup):
    """A process group with no backend behind it: it can do no collective at all."""

    def getBackendName(self):
        return "none"


def test_group_that_cannot_exchange_is_refused():
    with pytest.raises(ValueError, match=r"ep_group \(backend .*\) cannot run all_to_all_single"):
        moe_route.MoELayer(16, 8, 4, 2, ep_group=_NoAllToAll(0, 2))


def test_more_experts_than_float32_ids_hold_is_refused():
    """Checked before the configuration's exchange (every rank has the same E): no hang."""
    from moe_route.parallel import expert_parallel

    E = expert_parallel.MAX_EXPERTS + 2
    with pytest.raises(ValueError, match=rf"num_experts={E} with ep_group: .* float32"):
        expert_parallel.setup(_NoAllToAll(0, 2), E, None, 1, {})


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(ep_group="world"), "ep_group must be a torch.distributed ProcessGroup"),
        (dict(ep_capacity=4), "ep_capacity=4, ep_chunks=1: these need an ep_group"),
        (dict(ep_chunks=2), "ep_capacity=None, ep_chunks=2: these need an ep_group"),
    ],
)  # fmt: skip
def test_bad_ep_arguments_name_the_argument(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        moe_route.MoELayer(16, 8, 4, 2, **kw)


# ----------------------------------------------------------------------------- benchmark
def test_bench_ep_smoke_on_cpu(tmp_path, monkeypatch, capsys):
    """bench/bench_ep.py at W=1 over gloo, tiny shape: every implementation runs, the
    grouped_mm baseline agrees with moe_route (the script checks it) and the CSV is written."""
    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "bench_ep.py"
    spec = importlib.util.spec_from_file_location("bench_ep", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    for key, value in {**env, "MASTER_PORT": str(ep_worker.free_port())}.items():
        monkeypatch.setenv(key, value)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only contend (as in the spawned workers)
    try:
        bench.main(["--smoke", "--backend", "reference", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    with open(tmp_path / "ep_w1.csv") as f:
        rows = list(csv.DictReader(f))
    impls = ["moe_route", "moe_route-exact", "moe_route-chunks2", "grouped_mm", "single"]
    assert [r["impl"] for r in rows] == impls
    for r in rows:
        assert float(r["fwd_ms"]) > 0
        assert float(r["fwd_bwd_ms"]) > 0 or r["impl"] == "grouped_mm"  # CPU: forward only
        # W=1: the layer sends T rows of H float32 and T of 2K metadata (float32), and gets T
        # rows back; the grouped_mm baseline T*K rows each way; the single layer nothing
        T, H, K = (int(r[k]) for k in ("tokens_per_rank", "H", "K"))
        sent = {"grouped_mm": 2 * T * K * H * 4, "single": 0}.get(
            r["impl"], T * (2 * H + 2 * K) * 4
        )
        assert float(r["mb_sent_fwd"]) == pytest.approx(sent / 1e6), r["impl"]
    assert "moe_route-chunks2" in capsys.readouterr().out
    assert not dist.is_initialized()
