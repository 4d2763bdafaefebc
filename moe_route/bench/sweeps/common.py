"""What the tuning sweeps share: :class:`Sweep` (device and dtype, the shapes ``--shapes`` /
``--tokens`` select, routing and random operands, timing, the ceilings, the CSV's rows), the
tiny CPU shape, relative errors."""

from __future__ import annotations

import math
import time

import torch

import moe_route
from moe_route import arch
from moe_route.plan import moe_plan
from moe_route.reference import topk_routing_reference

from ..harness import Ceilings
from ..shapes import Shape
from ..timing import time_cuda

#: The tiny shape of the CPU runs (interpreted kernels, float16).
TINY = {"H": 32, "I": 32, "E": 4, "K": 2}


def tiny_shapes(tokens) -> list[Shape]:
    return [Shape("tiny", T, TINY["H"], TINY["I"], TINY["E"], TINY["K"]) for T in tokens]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` (float32 norms: outputs reach 1e9 elements), inf if ``out``
    holds a non-finite value (an element left unwritten stays NaN)."""
    if not torch.isfinite(out).all():
        return math.inf
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def short_error(exc: Exception, width: int = 120) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:width]}"


class Sweep:
    """What every sweep shares: device and dtype, the shapes ``--shapes`` / ``--tokens``
    select, routing and random operands, timing, the ceilings, the rows of the CSV."""

    name = ""
    help = ""
    #: the options (argparse dests) it reads beyond --device, --out, --name, --seed, --list
    takes: tuple[str, ...] = ("shapes", "tokens")
    #: do_bench's defaults for this sweep (``--rep-ms`` overrides the repetition time)
    rep_ms, warmup = 100, 25

    def __init__(self, args, device: torch.device):
        self.args = args
        self.device = device
        self.cpu = device.type != "cuda"
        self.dtype = torch.float16 if self.cpu else torch.bfloat16
        self.cc = arch.compute_capability(device)
        self.rows: list[dict] = []
        self._ceilings = None

    # ------------------------------------------------------------------ what it runs
    def candidate_shapes(self) -> list[Shape]:
        raise NotImplementedError

    def shapes(self) -> list[Shape]:
        """:meth:`candidate_shapes` kept where their label (``"model T=..."``) contains a word
        of ``--shapes``; a word that keeps none is an error."""
        shapes = self.candidate_shapes()
        words = self.args.shapes or []
        for word in words:
            if not any(word in s.label for s in shapes):
                labels = sorted({s.label for s in shapes}, key=lambda s: (len(s), s))
                raise ValueError(f"--shapes {word!r} matches none of {labels}")
        return [s for s in shapes if not words or any(w in s.label for w in words)]

    def describe(self) -> list[str]:
        """What it sweeps, for ``--list``."""
        return []

    def start(self) -> None:
        """The header line(s), before the first shape."""

    def run_shape(self, shape: Shape) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """Summary lines after the last shape."""

    def status(self) -> int:
        return 1 if any(r.get("status") == "MISMATCH" for r in self.rows) else 0

    # ------------------------------------------------------------------ shared tools
    @property
    def ceilings(self) -> Ceilings:
        if self._ceilings is None:
            self._ceilings = Ceilings.measure(self.device)
        return self._ceilings

    def device_name(self) -> str:
        if self.cpu:
            return "cpu (TRITON_INTERPRET=1)"
        return torch.cuda.get_device_name(self.device)

    def time_ms(self, fn, rep_ms: int | None = None) -> float:
        """Milliseconds of one call of ``fn``: ``do_bench``'s median on a GPU; on the CPU (the
        interpreter) one wall-clock call."""
        if self.cpu:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        import triton.testing

        rep = rep_ms or self.args.rep_ms or self.rep_ms
        return triton.testing.do_bench(fn, warmup=self.warmup, rep=rep, return_mode="median")

    def time_calls_us(self, fns) -> float:
        """Microseconds per call of the calls ``fns`` (e.g. one per routing): a CUDA graph of
        them all (median of 20 replays); on the CPU (the interpreter) one wall-clock pass."""
        if self.cpu:
            start = time.perf_counter()
            for f in fns:
                f()
            return (time.perf_counter() - start) * 1e6 / len(fns)

        def all_calls():
            for f in fns:
                f()

        median_s = time_cuda(all_calls, use_graph=True, inner=1, outer=20, warmup=1).median_s
        return median_s * 1e6 / len(fns)

    def rand(self, *shape, scale: float = 1.0, generator=None) -> torch.Tensor:
        t = torch.randn(*shape, device=self.device, dtype=self.dtype, generator=generator)
        return t.mul_(scale) if scale != 1.0 else t

    def routing(self, shape: Shape, seed: int | None = None):
        """``(topk_weights, topk_ids, maps)`` of a softmax top-k over random logits."""
        g = torch.Generator(device=self.device).manual_seed(
            self.args.seed if seed is None else seed
        )
        logits = torch.randn(shape.T, shape.E, device=self.device, generator=g)
        weights, ids = topk_routing_reference(logits, shape.K)
        return weights.to(self.dtype), ids, moe_route.build_routing_maps(ids, shape.E)

    def plan_configs(self, x, w1, w2, K):
        """The plan's tiles of a swiglu ``fused_moe`` call on these operands (training, the
        gathered GEMM1, standalone finalize)."""
        plan = moe_plan(x, w1, w2, K, activation="swiglu", gate_up_layout="concat",
                        finalize="standalone", deterministic=True, gather=True,
                        allow_tf32=False, backend="auto")  # fmt: skip
        return plan.configs

    def record(self, shape: Shape, **fields) -> dict:
        row = {"model": shape.model, "T": shape.T, "H": shape.H, "I": shape.I, "E": shape.E,
               "K": shape.K, **fields}  # fmt: skip
        self.rows.append(row)
        return row

    def release(self) -> None:
        if not self.cpu:
            torch.cuda.empty_cache()
