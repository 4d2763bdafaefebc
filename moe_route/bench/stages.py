"""The stages of the benchmark suite: the registry the command line selects from.

A stage is a function ``run(shape, ctx)`` (:mod:`.context`) that times moe_route next to the
PyTorch baselines on one :class:`~.shapes.Shape`. Stages are registered in :data:`STAGES`
(:func:`register_stage` adds one); the suite runs every selected stage on every selected
shape it applies to. Each stage lives in its own module: :mod:`.routing` (maps, expand,
finalize), :mod:`.gemm`, :mod:`.forward`, :mod:`.train`, :mod:`.backward`, :mod:`.quant`,
:mod:`.host`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .backward import applies as backward_applies
from .backward import stage_backward
from .context import Context
from .forward import stage_forward
from .gemm import stage_gemm
from .host import stage_host
from .quant import ROWS as QUANT_ROWS
from .quant import stage_quant
from .routing import stage_expand, stage_finalize, stage_maps
from .shapes import Shape
from .train import stage_train


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
