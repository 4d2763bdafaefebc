"""What a stage gets to work with: the inputs of a shape, and the context that times and checks.

A stage is a function ``run(shape, ctx)`` that times moe_route next to the PyTorch baselines
of :mod:`moe_route.bench.baselines` through ``ctx.measure`` (one :class:`~.harness.Row` per
implementation). Each implementation is timed and checked on its own: one that fails (not
implemented, out of memory, wrong result) is recorded in ``ctx.failures`` and the others still
run.

Byte counts read each input once and write each output once; FLOPs count the expert GEMMs
(``2·rows·in·out`` each). A forward pass with a gated activation is ``6·T·K·H·I`` FLOPs, a
training step (forward + backward) three times that.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch

import moe_route

from . import baselines as B
from .harness import Ceilings, Row, make_row
from .shapes import Shape
from .timing import time_auto, time_interleaved

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
        (:func:`.timing.time_interleaved`, :data:`ROUNDS` rounds): their ratios then do not
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


def _weight_bytes(shape: Shape, inp: Inputs) -> int:
    """Bytes of the touched experts' W1 and W2 (what one forward must read at least)."""
    return inp.touched * 3 * shape.I * shape.H * inp.x.element_size()
