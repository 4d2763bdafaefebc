"""The stages of the benchmark suite, the standard shapes, and what a stage gets to work with.

A stage is a function ``run(shape, ctx)`` that times moe_route next to the PyTorch baselines
of :mod:`moe_route.bench.baselines` through ``ctx.measure`` (one :class:`~.harness.Row` per
implementation). Stages are registered in :data:`STAGES` (:func:`register_stage` adds one); the
suite runs every selected stage on every selected shape it applies to. Each implementation is
timed and checked on its own: one that fails (not implemented, out of memory, wrong result)
is recorded in ``ctx.failures`` and the others still run.

Byte counts read each input once and write each output once; FLOPs count the expert GEMMs
(``2·rows·in·out`` each). A forward pass with a gated activation is ``6·T·K·H·I`` FLOPs, a
training step (forward + backward) three times that.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch

import moe_route

from . import baselines as B
from .backward import applies as backward_applies
from .backward import stage_backward
from .harness import Ceilings, Row, make_row, time_auto, time_interleaved
from .host import stage_host
from .profiling import step_memory
from .quant import ROWS as QUANT_ROWS
from .quant import stage_quant

# --------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Shape:
    """One problem size: ``T`` tokens, hidden ``H``, intermediate ``I``, ``E`` experts, top ``K``.

    ``model`` names the dimensions (a model of :data:`MODELS`, ``cpu-tiny`` or ``custom-...``).
    ``skew``: the router logits get a per-expert offset drawn with this standard deviation, so
    the experts' rows spread unevenly, as a trained router's do (0: uniform random routing).
    """

    model: str
    T: int
    H: int
    I: int  # noqa: E741 - the design's name
    E: int
    K: int
    skew: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.model} T={self.T}" + (f" skew {self.skew:g}" if self.skew else "")

    @property
    def decode(self) -> bool:
        """Decode-sized (latency-bound) batches: at most 128 tokens."""
        return self.T <= 128

    def dims(self) -> dict:
        return {
            "model": self.model,
            "T": self.T,
            "H": self.H,
            "I": self.I,
            "E": self.E,
            "K": self.K,
            **({"skew": self.skew} if self.skew else {}),
        }


# DESIGN.md "Measuring": model dimensions, the prefill token counts, and the decode ones.
# olmoe-1b-7b (decode only): the small decode configuration of the host-time measurements.
MODELS = {
    "mixtral-8x7b": {"H": 4096, "I": 14336, "E": 8, "K": 2, "prefill": (4096, 32768)},
    "qwen3-30b-a3b": {"H": 2048, "I": 768, "E": 128, "K": 8, "prefill": (8192, 32768)},
    "olmoe-1b-7b": {"H": 2048, "I": 1024, "E": 64, "K": 8, "prefill": ()},
    "deepseek-v3": {"H": 7168, "I": 2048, "E": 256, "K": 8, "prefill": (4096, 16384)},
}
DECODE_T = (1, 8, 64)
# --quick: the first prefill size of each model, and decode latency on qwen3's dimensions.
QUICK_DECODE_MODELS = ("qwen3-30b-a3b",)
# The CPU comparison (no GPU): tiny sizes, every stage, float32.
CPU_MODEL = {"H": 64, "I": 32, "E": 8, "K": 2}
CPU_T = (1, 8, 64, 256)


def model_shape(model: str, T: int) -> Shape:
    m = MODELS[model]
    return Shape(model, T, m["H"], m["I"], m["E"], m["K"])


#: The training shapes by short name (each model at its first prefill size), as the tuning
#: scripts under scripts/ take them with ``--shapes``.
TRAINING_SHAPES = {
    name: model_shape(model, MODELS[model]["prefill"][0])
    for name, model in (("mixtral", "mixtral-8x7b"), ("qwen3", "qwen3-30b-a3b"),
                        ("deepseek", "deepseek-v3"))
}  # fmt: skip


def standard_shapes(quick: bool = False) -> list[Shape]:
    """Decode sizes first (seconds), then prefill sizes (the larger ones take longer)."""
    shapes = []
    for model in MODELS:
        if not quick or model in QUICK_DECODE_MODELS:
            shapes += [model_shape(model, T) for T in DECODE_T]
    for model, m in MODELS.items():
        shapes += [model_shape(model, T) for T in (m["prefill"][:1] if quick else m["prefill"])]
    return shapes


def cpu_shapes(tokens=None) -> list[Shape]:
    c = CPU_MODEL
    return [Shape("cpu-tiny", T, c["H"], c["I"], c["E"], c["K"]) for T in tokens or CPU_T]


def custom_shape(spec: str) -> Shape:
    """``"T,H,I,E,K"`` (e.g. ``"4096,4096,1024,32,4"``) as a :class:`Shape`."""
    try:
        T, H, I, E, K = (int(v) for v in spec.replace("x", ",").split(","))  # noqa: E741
    except ValueError:
        raise ValueError(f"--custom {spec!r}: expected T,H,I,E,K (five integers)") from None
    if min(T, H, I, E, K) < 1 or K > E:
        raise ValueError(f"--custom {spec!r}: sizes must be >= 1 and K <= E")
    return Shape(f"custom-H{H}-I{I}-E{E}-K{K}", T, H, I, E, K)


def select_shapes(
    words=None, tokens=None, custom=(), quick: bool = False, cpu: bool = False, skew: float = 0.0
) -> list[Shape]:
    """The standard shapes filtered by ``words``, with ``tokens`` replacing the T values.

    ``words``: model names or prefixes (``qwen3``), ``decode``, ``prefill``; models are OR-ed,
    the regime filters AND-ed with them. ``tokens``: T values for every selected model.
    ``custom``: extra ``"T,H,I,E,K"`` shapes, always kept. ``skew``: :attr:`Shape.skew` of
    every shape.
    """
    if skew < 0:
        raise ValueError(f"--skew {skew}: a standard deviation, expected >= 0")
    words = [w.lower() for w in words or []]
    regimes = {w for w in words if w in ("decode", "prefill")}
    model_words = [w for w in words if w not in regimes]
    if cpu:
        shapes = cpu_shapes(tokens)
    else:
        models = [m for m in MODELS if not model_words or any(m.startswith(w) for w in model_words)]
        unknown = [w for w in model_words if not any(m.startswith(w) for m in MODELS)]
        if unknown:
            raise ValueError(
                f"--shapes {unknown}: not a model of {list(MODELS)}, nor decode/prefill"
            )
        if tokens:
            shapes = [model_shape(m, T) for m in models for T in tokens]
        else:
            shapes = [s for s in standard_shapes(quick) if s.model in models]
    if regimes == {"decode"}:
        shapes = [s for s in shapes if s.decode]
    elif regimes == {"prefill"}:
        shapes = [s for s in shapes if not s.decode]
    shapes += [custom_shape(c) for c in custom]
    return [replace(s, skew=skew) for s in shapes] if skew else shapes


# --------------------------------------------------------------------------- inputs


class Inputs:
    """The tensors of one shape, made on first use and shared by the stages run on it."""

    def __init__(
        self, shape: Shape, device: torch.device, dtype: torch.dtype, seed=0, backend="auto"
    ):
        self.shape, self.device, self.dtype, self.backend = shape, device, dtype, backend
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def randn(self, *size, scale: float = 1.0) -> torch.Tensor:
        t = torch.randn(*size, device=self.device, dtype=self.dtype, generator=self.gen)
        return t.mul_(scale) if scale != 1.0 else t

    @cached_property
    def x(self):
        return self.randn(self.shape.T, self.shape.H)

    @cached_property
    def w1(self):  # [E, 2I, H], gate rows then up rows
        s = self.shape
        return self.randn(s.E, 2 * s.I, s.H, scale=s.H**-0.5)

    @cached_property
    def w2(self):  # [E, H, I]
        s = self.shape
        return self.randn(s.E, s.H, s.I, scale=s.I**-0.5)

    @cached_property
    def routing(self):  # (topk_weights [T, K] float32, topk_ids [T, K] int32): softmax top-k
        s = self.shape
        logits = torch.randn(s.T, s.E, device=self.device, generator=self.gen)
        if s.skew:
            logits += s.skew * torch.randn(s.E, device=self.device, generator=self.gen)
        return moe_route.reference.topk_routing_reference(logits, s.K, renormalize=True)

    @property
    def topk_weights(self):
        return self.routing[0]

    @property
    def topk_ids(self):
        return self.routing[1]

    @cached_property
    def maps(self):
        return moe_route.build_routing_maps(self.topk_ids, self.shape.E, backend=self.backend)

    @cached_property
    def touched(self) -> int:
        """Experts with at least one token: their weights are what a forward must read."""
        return int(torch.unique(self.topk_ids).numel())

    @cached_property
    def grouped_mm_route(self):
        return B.grouped_mm_route(self.topk_ids, self.shape.E)


# --------------------------------------------------------------------------- context


#: rounds of :meth:`Context.measure_together`
ROUNDS = 3


@dataclass
class Entry:
    """One implementation for :meth:`Context.measure_together` (the arguments of
    :meth:`Context.measure`)."""

    impl: str
    fn: Callable
    nbytes: float
    flops: float = 0.0
    memory: bool = False
    check: Callable | None = None
    tol: float = 0.0
    extra: dict = field(default_factory=dict)


@dataclass
class Context:
    """What a stage works with: device, ceilings, settings, and where rows and failures go."""

    device: torch.device
    ceilings: Ceilings
    dtype: torch.dtype = torch.bfloat16
    budget_s: float = 1.0  # measurement time per implementation
    with_loop: bool = True
    loop_max_tokens: int = 8192  # the per-expert loop syncs per expert: slow past this
    backend: str = "auto"  # moe_route's backend= ("reference" for the CPU comparison)
    # Other backends of the memory-bound stages to time too (e.g. "cupy" where it works).
    alt_backends: tuple[str, ...] = ()
    seed: int = 0
    host_calls: int = 300  # calls per host-time loop (the host stage)
    rows: list[Row] = field(default_factory=list)
    failures: list[dict] = field(default_factory=list)
    # Optional baselines this torch / device / install cannot run (not failures: the reason)
    skipped: list[dict] = field(default_factory=list)
    _inputs: Inputs | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def inputs(self, shape: Shape) -> Inputs:
        if self._inputs is None or self._inputs.shape != shape:
            self.release()
            self._inputs = Inputs(shape, self.device, self.dtype, self.seed, self.backend)
        return self._inputs

    def release(self) -> None:
        self._inputs = None
        if self.cuda:
            torch.cuda.empty_cache()

    def loop_allowed(self, shape: Shape) -> bool:
        return self.with_loop and self.loop_max_tokens >= shape.T

    def fail(self, stage: str, shape: Shape, impl: str, exc: BaseException) -> None:
        tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
        self.failures.append(
            {
                "stage": stage,
                "shape": shape.label,
                "impl": impl,
                "error": f"{type(exc).__name__}: {exc}"[:500],
                "traceback": "".join(tb[-3:])[-2000:],
            }
        )
        if self.cuda:
            try:  # after a sticky CUDA error this raises too; the next steps will say so
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception:
                pass

    def skip(self, stage: str, shape: Shape, impl: str, reason: str) -> None:
        """Record that ``impl`` was not measured here, and why (an optional baseline that this
        torch, device or install does not offer: not a failure)."""
        self.skipped.append(
            {"stage": stage, "shape": shape.label, "impl": impl, "reason": reason[:500]}
        )

    def peak_mib(self, fn) -> float:
        """Memory one call of ``fn`` allocates beyond what is live before it, in MiB."""
        if not self.cuda:
            return float("nan")
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        del out
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    def measure(
        self,
        stage: str,
        shape: Shape,
        impl: str,
        fn: Callable,
        nbytes: float,
        flops: float = 0.0,
        *,
        graph: bool = True,
        memory: bool = False,
        check: Callable | None = None,
        tol: float = 0.0,
        budget_s: float | None = None,
        **extra,
    ) -> Row | None:
        """Check, then time ``fn`` and append its row; on any error record a failure instead.

        ``check(out) -> error`` compares one output with the baseline's; an error above ``tol``
        is recorded as a failure (the row is still kept, with ``extra["mismatch"]``).
        """
        try:
            self._prepare(stage, shape, impl, fn, extra, memory, check, tol)
            t = time_auto(fn, self.device, use_graph=graph, budget_s=budget_s or self.budget_s)
        except Exception as exc:
            self.fail(stage, shape, impl, exc)
            return None
        row = make_row(stage, shape.label, impl, t, self.ceilings, nbytes, flops, **extra)
        self.rows.append(row)
        return row

    def measure_together(
        self, stage: str, shape: Shape, entries: list[Entry], *, graph: bool = True
    ) -> dict[str, Row]:
        """:meth:`measure` for implementations of one computation, timed in turns
        (:func:`.harness.time_interleaved`, :data:`ROUNDS` rounds): their ratios then do not
        carry the clock drift between one timing and the next. Each row's
        ``extra["round_us"]`` holds its median per round. Rows in ``entries`` order; an entry
        that fails its check or its first call is recorded as a failure and left out."""
        ready = {}
        for e in entries:
            try:
                self._prepare(stage, shape, e.impl, e.fn, e.extra, e.memory, e.check, e.tol)
            except Exception as exc:
                self.fail(stage, shape, e.impl, exc)
                continue
            ready[e.impl] = e
        if not ready:
            return {}
        fns = {impl: e.fn for impl, e in ready.items()}
        try:
            timed = time_interleaved(fns, self.device, use_graph=graph, budget_s=self.budget_s,
                                     rounds=ROUNDS)  # fmt: skip
        except Exception as exc:
            for impl in ready:
                self.fail(stage, shape, impl, exc)
            return {}
        rows = {}
        for impl, e in ready.items():
            t, medians = timed[impl]
            extra = {**e.extra, "round_us": [m * 1e6 for m in medians]}
            rows[impl] = make_row(stage, shape.label, impl, t, self.ceilings, e.nbytes, e.flops,
                                  **extra)  # fmt: skip
            self.rows.append(rows[impl])
        return rows

    def _prepare(self, stage, shape, impl, fn, extra: dict, memory: bool, check, tol) -> None:
        """The first call (compiles; checked against the baseline where ``check`` is given)
        and, with ``memory``, the peak memory of another, into ``extra``."""
        out = fn()
        if check is not None:
            err = float(check(out))
            extra["rel_err"] = err
            if not err <= tol:
                extra["mismatch"] = True
                self.fail(stage, shape, impl, AssertionError(f"error {err:.3g} > {tol:g}"))
        del out
        if memory and self.cuda:
            extra["peak_mib"] = self.peak_mib(fn)

    def attempt(self, stage: str, shape: Shape, impl: str, fn: Callable):
        """``fn()``, or ``None`` with a failure recorded."""
        try:
            return fn()
        except Exception as exc:
            self.fail(stage, shape, impl, exc)
            return None


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _tol(ctx: Context) -> float:
    return 2e-2 if ctx.dtype in (torch.bfloat16, torch.float16) else 1e-4


def _exact(ref):
    def check(out):
        outs = out if isinstance(out, (tuple, list)) else (out,)
        refs = ref if isinstance(ref, (tuple, list)) else (ref,)
        return 0.0 if all(torch.equal(a, b) for a, b in zip(outs, refs, strict=True)) else 1.0

    return check


def _variants(ctx: Context) -> list[tuple[str, str]]:
    """(impl, backend) pairs of the memory-bound stages: moe_route, then "moe_route cupy", ..."""
    return [("moe_route", ctx.backend)] + [(f"moe_route {b}", b) for b in ctx.alt_backends]


def available_alt_backends(device: torch.device) -> tuple[str, ...]:
    """Backends besides the default that work on ``device`` (CuPy, where installed)."""
    if device.type != "cuda":
        return ()
    probe = getattr(moe_route.arch, "backend_availability", None)
    if probe is None:
        return ()
    try:
        found = probe(device)
    except Exception:
        return ()
    return tuple(b for b in ("cupy",) if b in found and found[b].value == "yes")


def _maps_tuple(m):
    return (
        m.expanded_source_row_to_expanded_dest_row,
        m.expanded_dest_row_to_expanded_source_row,
        m.expert_for_source_row,
        m.expert_first_token_offset,
    )


# --------------------------------------------------------------------------- stages


def stage_maps(shape: Shape, ctx: Context) -> None:
    """Routing maps from top-k ids, against the ``argsort`` pipeline."""
    inp = ctx.inputs(shape)
    ids, E, N = inp.topk_ids, shape.E, shape.T * shape.K
    nbytes = N * 4 + 3 * N * 4 + (E + 1) * 8  # read the ids, write three maps and the offsets
    ref = B.argsort_maps(ids, E)
    ctx.measure("maps", shape, "torch argsort", lambda: B.argsort_maps(ids, E), nbytes)
    for impl, backend in _variants(ctx):
        ctx.measure(
            "maps", shape, impl,
            lambda b=backend: moe_route.build_routing_maps(ids, E, backend=b), nbytes,
            check=lambda m: _exact(ref)(_maps_tuple(m)),
        )  # fmt: skip


def stage_expand(shape: Shape, ctx: Context) -> None:
    """Expand rows (permute ``x`` into expert order), against ``index_select``."""
    inp = ctx.inputs(shape)
    x, maps = inp.x, inp.maps
    T, N, es = shape.T, shape.T * shape.K, x.element_size()
    d2s = maps.expanded_dest_row_to_expanded_source_row
    nbytes = T * shape.H * es + N * shape.H * es + N * 4  # read x once, write N rows, one map
    ref = B.torch_expand(x, d2s)
    ctx.measure("expand", shape, "torch gather", lambda: B.torch_expand(x, d2s), nbytes)
    for impl, backend in _variants(ctx):
        ctx.measure(
            "expand", shape, impl, lambda b=backend: moe_route.expand_rows(x, maps, backend=b),
            nbytes, check=_exact(ref),
        )  # fmt: skip


def stage_finalize(shape: Shape, ctx: Context) -> None:
    """finalizeMoeRouting (gather, weight, K-way sum, bias), against gather + weighted sum."""
    inp = ctx.inputs(shape)
    maps, w = inp.maps, inp.topk_weights
    T, H, N = shape.T, shape.H, shape.T * shape.K
    y = inp.randn(N, H)
    bias = inp.randn(H)
    es = y.element_size()
    s2d = maps.expanded_source_row_to_expanded_dest_row
    # Read N permuted rows, the weights and two maps, write T rows; the [H] bias is noise.
    nbytes = N * H * es + T * H * es + N * 12 + H * es
    ref = B.torch_finalize(y, w, s2d, bias)
    ctx.measure(
        "finalize", shape, "torch gather+sum", lambda: B.torch_finalize(y, w, s2d, bias), nbytes
    )
    for impl, backend in _variants(ctx):
        ctx.measure(
            "finalize", shape, impl,
            lambda b=backend: moe_route.finalize_moe_routing(y, w, maps, bias, backend=b), nbytes,
            check=lambda out: rel_err(out, ref), tol=_tol(ctx),
        )  # fmt: skip


def _weight_bytes(shape: Shape, inp: Inputs) -> int:
    """Bytes of the touched experts' W1 and W2 (what one forward must read at least)."""
    return inp.touched * 3 * shape.I * shape.H * inp.x.element_size()


def stage_gemm(shape: Shape, ctx: Context) -> None:
    """GEMM1 (gathering, SwiGLU fused) and GEMM2 + finalize, against ``torch._grouped_mm``."""
    inp = ctx.inputs(shape)
    x, w1, w2, tw, maps = inp.x, inp.w1, inp.w2, inp.topk_weights, inp.maps
    T, H, I, M, es = shape.T, shape.H, shape.I, shape.T * shape.K, x.element_size()  # noqa: E741
    wb = _weight_bytes(shape, inp)
    order, token, offs = inp.grouped_mm_route
    w1t, w2t = w1.transpose(1, 2), w2.transpose(1, 2)

    g1_flops = 4 * M * H * I
    g1_bytes = T * H * es + wb * 2 // 3 + M * I * es
    ref_h = ctx.attempt(
        "gemm1", shape, "grouped_mm", lambda: B.grouped_mm_gemm1(x, w1t, token, offs)
    )
    if ref_h is not None:
        ctx.measure(
            "gemm1", shape, "grouped_mm", lambda: B.grouped_mm_gemm1(x, w1t, token, offs),
            g1_bytes, g1_flops,
        )  # fmt: skip

    def gemm1():
        return moe_route.grouped_gemm(
            x, w1, maps, activation="swiglu", gather=True, backend=ctx.backend
        )

    row = ctx.measure(
        "gemm1", shape, "moe_route", gemm1, g1_bytes, g1_flops,
        check=None if ref_h is None else (lambda h: rel_err(h, ref_h)), tol=_tol(ctx),
    )  # fmt: skip
    if row is not None:
        row.extra["tflops"] = g1_flops / (row.median_us * 1e-6) / 1e12
        row.extra["of_dense"] = g1_flops / (row.median_us * 1e-6) / ctx.ceilings.mm_flops_per_s
    ref_h = None  # free it before GEMM2
    h = ctx.attempt("gemm2+fin", shape, "moe_route", gemm1)
    if h is None:
        return

    g2_flops = 2 * M * H * I
    g2_bytes = M * I * es + wb // 3 + T * H * es
    ref = ctx.attempt(
        "gemm2+fin", shape, "grouped_mm",
        lambda: B.grouped_mm_gemm2_finalize(h, w2t, tw, order, token, offs, T),
    )  # fmt: skip
    if ref is not None:
        ctx.measure(
            "gemm2+fin", shape, "grouped_mm",
            lambda: B.grouped_mm_gemm2_finalize(h, w2t, tw, order, token, offs, T),
            g2_bytes, g2_flops,
        )  # fmt: skip
    check = None if ref is None else (lambda out: rel_err(out, ref))

    def standalone():
        y = moe_route.grouped_gemm(h, w2, maps, backend=ctx.backend)
        return moe_route.finalize_moe_routing(y, tw, maps, backend=ctx.backend)

    ctx.measure(
        "gemm2+fin", shape, "moe_route", standalone, g2_bytes, g2_flops, check=check, tol=_tol(ctx)
    )
    if not ctx.cuda:
        return
    # The epilogue-fused finalize, ordered (deterministic, the default) and atomic: the launch
    # fused_moe makes, with the tiles its plan takes for GEMM2 at this token bucket.
    from .. import arch, tuning
    from ..kernels.triton.gemm_finalize import grouped_gemm_finalize_triton

    rows_per_expert = tuning.token_bucket(T) * shape.K / shape.E
    cfg = tuning.gemm_config(rows_per_expert, False, h.dtype, arch.compute_capability(h.device))
    s2d, d2s, efs, expert_offsets = maps.tensors()

    def fused(ordered):
        if ordered:
            out = h.new_empty(T, H)
        else:  # float32 accumulator, as fused_moe's atomic path
            out = torch.zeros(T, H, dtype=torch.float32, device=h.device)
        grouped_gemm_finalize_triton(h, w2, expert_offsets, s2d, d2s, efs, tw, out, cfg,
                                     ordered=ordered)  # fmt: skip
        return out if ordered else out.to(h.dtype)

    for impl, ordered in (("moe_route fused", True), ("moe_route fused atomic", False)):
        ctx.measure(
            "gemm2+fin", shape, impl, lambda o=ordered: fused(o), g2_bytes, g2_flops,
            check=check, tol=_tol(ctx),
        )  # fmt: skip


def forward_cost(shape: Shape, inp: Inputs) -> tuple[int, int]:
    """(bytes, flops) of one MoE forward: x in, out, the touched experts' weights, the routing."""
    es = inp.x.element_size()
    nbytes = 2 * shape.T * shape.H * es + _weight_bytes(shape, inp) + shape.T * shape.K * 8
    return nbytes, 6 * shape.T * shape.K * shape.H * shape.I


def stage_forward(shape: Shape, ctx: Context) -> None:
    """The whole forward, routing maps → output, against the two PyTorch pipelines."""
    inp = ctx.inputs(shape)
    x, w1, w2, tw, ids = inp.x, inp.w1, inp.w2, inp.topk_weights, inp.topk_ids
    nbytes, flops = forward_cost(shape, inp)
    w1t, w2t = w1.transpose(1, 2), w2.transpose(1, 2)

    def grouped_mm():
        return B.grouped_mm_forward(x, w1t, w2t, tw, ids)

    def loop():
        return B.loop_forward(x, w1, w2, tw, ids)

    ref = ctx.attempt("forward", shape, "grouped_mm", grouped_mm)
    if ctx.loop_allowed(shape):
        if ref is None:
            ref = ctx.attempt("forward", shape, "loop", loop)
        ctx.measure("forward", shape, "loop", loop, nbytes, flops, graph=False, memory=True)
    check = None if ref is None else (lambda out: rel_err(out, ref))
    entries = [] if ref is None else [Entry("grouped_mm", grouped_mm, nbytes, flops, memory=True)]
    variants = [("moe_route", {})]
    if ctx.cuda:  # both finalize paths, whichever "auto" picks
        variants.append(("moe_route standalone", {"finalize": "standalone"}))
        variants.append(("moe_route fused", {"finalize": "fused"}))
    for impl, kw in variants:
        entries.append(Entry(
            impl, lambda kw=kw: moe_route.fused_moe(x, w1, w2, tw, ids, backend=ctx.backend, **kw),
            nbytes, flops, memory=True, check=check, tol=_tol(ctx),
        ))  # fmt: skip
    # grouped_mm and moe_route timed in turns (the floors are their ratios)
    ctx.measure_together("forward", shape, entries)


def saved_bytes(fn, inputs) -> int:
    """Bytes the autograd graph of ``fn()`` saves for the backward, beyond ``inputs``' storage.

    (The method of ``bench/bench_train.py``: ``saved_tensors_hooks`` see every saved tensor.)
    """
    seen = {t.untyped_storage().data_ptr() for t in inputs}
    total = 0

    def pack(t):
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return total


def stage_train(shape: Shape, ctx: Context) -> None:
    """Forward + backward (w.r.t. x, w1, w2, topk_weights), peak memory, saved activations.

    ``extra``: ``peak_mib`` (CUDA), the most memory allocated at once during forward + backward
    beyond what was allocated before; ``activation_MiB``, the same without the gradients the
    step returns (dx, dw1, dw2, d topk_weights), each left out from the moment it is allocated:
    what the forward saves, its output and the temporaries of both passes
    (:func:`.profiling.step_memory`); ``grads_MiB``, those gradients (``peak_mib - grads_MiB``
    would undercount an implementation whose peak comes before its last gradient is
    allocated); ``saved_bytes_per_token``, what autograd saves for the backward beyond the
    inputs' storage, per token.

    Baselines: the ``_grouped_mm`` pipeline under autograd, and the per-expert loop with one
    weight tensor per expert (as an ``nn.ModuleList`` of experts has: indexing one ``[E, ...]``
    parameter per expert would make autograd add ``E`` full-size gradients).
    """
    inp = ctx.inputs(shape)
    x = inp.x.detach().requires_grad_()
    w1 = inp.w1.detach().requires_grad_()
    w2 = inp.w2.detach().requires_grad_()
    tw = inp.topk_weights.detach().requires_grad_()
    ids = inp.topk_ids
    dout = inp.randn(shape.T, shape.H)
    leaves = (x, w1, w2, tw)
    fwd_bytes, fwd_flops = forward_cost(shape, inp)
    # Backward reads the weights again and writes their gradients; dout in, dx out.
    es = inp.x.element_size()
    nbytes = fwd_bytes + 2 * _weight_bytes(shape, inp) + 2 * shape.T * shape.H * es
    flops = 3 * fwd_flops  # dX and dW each cost what the forward does

    def grouped_mm_fwd():
        return B.grouped_mm_forward(x, w1.transpose(1, 2), w2.transpose(1, 2), tw, ids)

    def ours_fwd():
        out = moe_route.fused_moe(x, w1, w2, tw, ids, backend=ctx.backend)
        if out.grad_fn is None:
            raise NotImplementedError("fused_moe returned no autograd graph (no training yet)")
        return out

    w1s = [w.detach().requires_grad_() for w in inp.w1]
    w2s = [w.detach().requires_grad_() for w in inp.w2]

    def loop_fwd():
        return B.loop_forward(x, w1s, w2s, tw, ids)

    def step(fwd, wrt=leaves):
        return lambda: torch.autograd.grad(fwd(), wrt, dout, allow_unused=True)

    loop_wrt = (x, tw, *w1s, *w2s)

    def loop_grads():  # the loop's gradients in the [E, ...] layout of the others
        g = step(loop_fwd, loop_wrt)()
        E = shape.E

        def stack(grads, ws):
            pairs = zip(grads, ws, strict=True)
            return torch.stack([torch.zeros_like(w) if d is None else d for d, w in pairs])

        return g[0], stack(g[2 : 2 + E], w1s), stack(g[2 + E :], w2s), g[1]

    def sample(grads):
        # The weight gradients of the first experts only: a full copy of the reference's would
        # hold another set of weights in memory (22 GB at deepseek-v3) while moe_route runs.
        n = min(shape.E, 8)
        return grads[0], grads[1][:n].clone(), grads[2][:n].clone(), grads[3]

    impls = [("grouped_mm", grouped_mm_fwd, leaves)]
    if ctx.loop_allowed(shape):
        impls.append(("loop", loop_fwd, loop_wrt))
    ref = ctx.attempt("train", shape, "grouped_mm", lambda: sample(step(grouped_mm_fwd)()))
    if ref is None and ctx.loop_allowed(shape):
        ref = ctx.attempt("train", shape, "loop", lambda: sample(loop_grads()))
    errs: dict[str, float] = {}

    def check(grads):
        names = ("dx", "dw1", "dw2", "dtw")
        got = sample(grads)
        del grads
        errs.update({n: rel_err(g, r) for n, g, r in zip(names, got, ref, strict=True)})
        return max(errs.values())

    impls.append(("moe_route", ours_fwd, leaves))
    rows, entries = {}, []
    for impl, fwd, wrt in impls:
        if impl == "loop":  # timed on its own; grouped_mm and moe_route in turns (the floors
            # are their ratios)
            rows[impl] = ctx.measure("train", shape, impl, step(fwd, wrt), nbytes, flops,
                                     graph=False, memory=True)  # fmt: skip
            continue
        ours = impl == "moe_route" and ref is not None
        entries.append(Entry(impl, step(fwd, wrt), nbytes, flops, memory=True,
                             check=check if ours else None, tol=2.5 * _tol(ctx)))  # fmt: skip
    rows.update(ctx.measure_together("train", shape, entries, graph=False))
    for impl, fwd, wrt in impls:
        is_ours = impl == "moe_route"
        row = rows.get(impl)
        if row is None:
            continue
        saved = ctx.attempt(
            "train", shape, impl, lambda fwd=fwd, wrt=wrt: saved_bytes(fwd, (*wrt, ids, dout))
        )
        if saved is not None:
            row.extra["saved_bytes_per_token"] = saved / shape.T
        one_step = step(fwd, wrt)
        mem = ctx.attempt("train", shape, impl, lambda fn=one_step: step_memory(fn, ctx.device)[1])
        if mem is not None:
            row.extra["activation_MiB"] = mem.activation / 2**20
            row.extra["grads_MiB"] = mem.grads / 2**20
        if is_ours:
            row.extra.update({f"rel_err_{k}": v for k, v in errs.items()})


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Stage:
    name: str  # what --stages selects
    run: Callable[[Shape, Context], None]
    help: str
    rows: tuple[str, ...]  # the stage names its rows carry (gemm writes gemm1 and gemm2+fin)
    applies: Callable[[Shape], bool] = lambda shape: True
    cost: float = 1.0  # relative time, for the progress bar's estimate
    fp8_rate: bool = False  # needs the dense FP8 matmul rate among the ceilings


STAGES: dict[str, Stage] = {}
GROUPS = {"routing": ("maps", "expand", "finalize"), "all": ()}


def register_stage(stage: Stage) -> Stage:
    """Add (or replace) a stage of the suite; it runs in registration order."""
    STAGES[stage.name] = stage
    return stage


for _stage in (
    Stage("maps", stage_maps, "routing maps vs argsort", ("maps",), cost=0.5),
    Stage("expand", stage_expand, "expand rows vs index_select", ("expand",), cost=0.5),
    Stage("finalize", stage_finalize, "finalize vs gather + weighted sum", ("finalize",), cost=0.5),
    Stage(
        "gemm", stage_gemm, "GEMM1+SwiGLU and GEMM2+finalize vs _grouped_mm",
        ("gemm1", "gemm2+fin"), cost=2.0,
    ),
    Stage(
        "forward", stage_forward, "fused_moe vs the _grouped_mm pipeline vs the per-expert loop",
        ("forward",), cost=3.0,
    ),
    Stage(
        "train", stage_train,
        "forward+backward, peak and activation memory, saved activations; same baselines",
        ("train",), applies=lambda s: not s.decode or (s.model == "cpu-tiny" and s.T >= 64),
        cost=4.0,
    ),
    Stage(
        "backward", stage_backward,
        "device time and roofline of each backward step (profiler) vs _grouped_mm autograd",
        ("backward",), applies=backward_applies, cost=3.0,
    ),
    Stage(
        "quant", stage_quant,
        "quantised experts (FP8 block / per channel, MXFP4) vs bf16, torch._scaled_grouped_mm, "
        "transformers FP8; decode vs the weight-read floor; host time",
        QUANT_ROWS, cost=3.0, fp8_rate=True,
    ),
    Stage(
        "host", stage_host,
        "host time per call of each op (÷ one index_select), eager vs CUDA-graph latency, "
        "first call at a new T", ("host",), applies=lambda s: s.decode, cost=3.0,
    ),
):  # fmt: skip
    register_stage(_stage)


def select_stages(words=None) -> list[Stage]:
    """Stage objects for names and groups (``routing``, ``all``), in registration order."""
    if not words:
        return list(STAGES.values())
    names: set[str] = set()
    for w in words:
        for part in w.split(","):
            part = part.strip()
            if part == "all":
                names |= set(STAGES)
            elif part in GROUPS:
                names |= set(GROUPS[part])
            elif part in STAGES:
                names.add(part)
            elif part:
                raise ValueError(f"--stages {part!r}: expected one of {[*STAGES, *GROUPS]}")
    return [s for s in STAGES.values() if s.name in names]
