"""The ``backward`` stage: the device time of each step of the MoE backward, and its roofline.

Steps (``BACKWARD_STEPS``): GEMM2's input gradient with the activation's backward, the
router-weight gradient, ``dW2``, GEMM1's input gradient, the expand's backward (the ``K``
copies of each token's gradient summed into ``dx``) and ``dW1``.

Each implementation's backward (``torch.autograd.grad`` of its forward's output) runs a few
times under ``torch.profiler`` (CUDA activities; the forward runs outside it); its device
kernels are grouped into the steps by the tables below, by kernel name. The stage calls no
internal launcher, so when kernels are renamed or split only the tables change. Kernels that
no pattern matches form an ``other`` row, and ``total`` is every kernel of the call. On the CPU
the same runs with the operators' self times instead of kernels (nothing matches there but
``torch._grouped_mm``'s operator: the CPU rows check the plumbing, not the attribution).

A row per (implementation, step): ``impl`` is ``"<implementation>: <step>"``, ``median_us`` the
step's device time per backward (p20 / p80 over the profiled calls), ``bytes`` / ``flops`` the
step's own (each input read once, each output written once; GEMMs ``2·rows·in·out``), so
``roofline_fraction`` is the step's; ``extra``: ``step``, ``of`` (the implementation),
``kernels`` (µs per kernel name), ``of_dense`` for the GEMM steps, and on moe_route's rows
``x_grouped_mm`` (the baseline's time for the step over moe_route's).
"""

from __future__ import annotations

import statistics

import torch

import moe_route

from . import baselines as B
from .context import Context
from .harness import make_row
from .profiling import OTHER, Rule, Until, attribute, profile_kernels
from .shapes import MODELS, Shape
from .timing import _summarise

STAGE = "backward"
DGEMM2, ROUTER, DW2, DX1, EXPAND, DW1 = (
    "dGEMM2 + act'", "router-weight grad", "dW2", "dX GEMM1", "expand backward", "dW1",
)  # fmt: skip
BACKWARD_STEPS = (DGEMM2, ROUTER, DW2, DX1, EXPAND, DW1)
TOTAL = "total"

# Kernel name (a regular expression, searched; the first key that matches wins) -> the steps it
# serves, in launch order: a kernel launched for several steps in one backward has its
# launches split evenly among them, in this order (an ``Until`` rule: its launches before a
# landmark kernel serve one step first). Update when kernels are renamed or split.
MOE_ROUTE_KERNELS: dict[str, Rule] = {
    # fused: dz = act'(z)·w·(dout @ W2), w·act(z), partial <g, h> in the GEMM's epilogue;
    # split: the same from g (the plain GEMM's, below) in a pass over the rows
    r"_gemm_act_bwd|_act_bwd_rows": (DGEMM2,),
    # the split's g = dout @ W2 runs before the row pass, dx_perm = dz @ W1 after step 1
    r"_gemm_kernel|_gemm_persistent": Until(r"_gemm_act_bwd|_act_bwd_rows", DGEMM2, (DX1,)),
    r"_expand_rows": (DW2, DW1),  # dout and x permuted for the TMA weight-gradient kernel
    r"_router_weight_grad": (ROUTER,),
    r"_expert_weight_grad": (DW2, DW1),
    r"_finalize": (EXPAND,),  # dx[t] = sum over k of dx_perm
}
#: moe_route's GEMM kernels among them (the rest move or reduce memory): the report gives a
#: GEMM step's own GEMM kernels' rate against the dense matmul rate beside the step's.
MOE_ROUTE_GEMMS = r"_gemm_kernel|_gemm_persistent|_gemm_act_bwd|_expert_weight_grad"
# torch._grouped_mm autograd (baselines.grouped_mm_forward), best effort: its backward runs
# index_add_'s backward (gather dout), the router weight's mul backward (dout·w; (dout·y).sum),
# the index backward of the weights (sort + accumulate), GEMM2's backward (input, then weight
# gradient), SwiGLU's (mul, silu, cat), GEMM1's, then the index backward of x[token].
GROUPED_MM_KERNELS: dict[str, Rule] = {
    r"GroupProblemShape|grouped|[Gg]emm|GEMM|nvjet|xmma|cutlass": (DGEMM2, DW2, DX1, DW1),
    r"indexSelect|index_select": (DGEMM2,),
    r"MulFunctor": (DGEMM2, ROUTER, DGEMM2, DGEMM2),
    r"silu|[Cc]atArray": (DGEMM2,),
    r"reduce_kernel": (ROUTER,),
    r"indexing_backward|index_put|[Rr]adix|[Ss]ort": (ROUTER, EXPAND),
}
TABLES = {"moe_route": MOE_ROUTE_KERNELS, "grouped_mm": GROUPED_MM_KERNELS}


def applies(shape: Shape) -> bool:
    """Prefill sizes but the models' larger standard ones (32768, 16384): by default the training
    shapes (each model's first prefill size); ``--tokens`` and ``--custom`` pick others. On the
    CPU, T >= 64."""
    if shape.model == "cpu-tiny":
        return shape.T >= 64
    model = MODELS.get(shape.model)
    return not shape.decode and (model is None or shape.T not in model["prefill"][1:])


def step_costs(shape: Shape, touched: int, es: int) -> dict[str, tuple[float, float]]:
    """``{step: (bytes, flops)}`` of the backward of a gated (``2I``) MoE, ``touched`` experts."""
    T, H, I, K = shape.T, shape.H, shape.I, shape.K  # noqa: E741
    M = T * K
    w2 = touched * H * I * es  # bytes of the touched experts' W2 (W1 is twice that)
    return {
        # read dout, W2, z, the weights; write w·act(z) (for dW2) and dz
        DGEMM2: (T * H * es + w2 + 2 * M * I * es + 4 * M + M * I * es + 2 * M * I * es,
                 2 * M * H * I),
        ROUTER: (8 * M, 0.0),  # the weights' gradient, from per-row dot products
        DW2: (T * H * es + M * I * es + w2, 2 * M * H * I),  # read dout, w·act(z); write dW2
        DX1: (2 * M * I * es + 2 * w2 + M * H * es, 4 * M * H * I),  # read dz, W1; write rows
        EXPAND: (M * H * es + T * H * es + 8 * M, 0.0),  # read M rows and maps, write dx
        DW1: (2 * M * I * es + T * H * es + 2 * w2, 4 * M * H * I),  # read dz, x; write dW1
    }  # fmt: skip


def stage_backward(shape: Shape, ctx: Context) -> None:
    inp = ctx.inputs(shape)
    leaves = [t.detach().requires_grad_() for t in (inp.x, inp.w1, inp.w2, inp.topk_weights)]
    x, w1, w2, tw = leaves
    ids = inp.topk_ids
    dout = inp.randn(shape.T, shape.H)
    forwards = {
        "moe_route": lambda: moe_route.fused_moe(x, w1, w2, tw, ids, backend=ctx.backend),
        "grouped_mm": lambda: B.grouped_mm_forward(
            x, w1.transpose(1, 2), w2.transpose(1, 2), tw, ids
        ),
    }
    costs = step_costs(shape, inp.touched, inp.x.element_size())
    calls = 3 if ctx.cuda else 1
    per_impl: dict[str, dict[str, list[float]]] = {}
    for impl, fwd in forwards.items():
        try:
            per_impl[impl] = _profile(fwd, TABLES[impl], leaves, dout, ctx, calls)
            if not max(per_impl[impl][TOTAL]):
                raise RuntimeError("the profiler recorded no device activity (no CUPTI?)")
        except Exception as exc:
            per_impl.pop(impl, None)
            ctx.fail(STAGE, shape, impl, exc)
    for impl, steps in per_impl.items():
        for step, samples in steps.items():
            if step == "_kernels" or not max(samples):
                continue
            nbytes, flops = costs.get(step, (0.0, 0.0))
            if step == TOTAL:
                nbytes, flops = (sum(c[i] for c in costs.values()) for i in (0, 1))
            timing = _summarise([us * 1e-6 for us in samples])
            extra = {"step": step, "of": impl}
            if step != TOTAL:
                extra["kernels"] = steps["_kernels"].get(step, {})
            if flops:
                extra["of_dense"] = flops / timing.median_s / ctx.ceilings.mm_flops_per_s
            base = per_impl.get("grouped_mm", {}).get(step)
            if impl != "grouped_mm" and base and max(base):
                extra["x_grouped_mm"] = statistics.median(base) * 1e-6 / timing.median_s
            label = f"{impl}: {step}"
            ctx.rows.append(
                make_row(STAGE, shape.label, label, timing, ctx.ceilings, nbytes, flops, **extra)
            )


def _profile(fwd, table: dict, leaves, dout, ctx: Context, calls: int) -> dict:
    """``{step: [µs per call]}`` (``total`` included) and ``"_kernels"``: ``{step: {kernel name:
    mean µs per call}}``, over ``calls`` profiled backward calls (after a warm-up on CUDA);
    ``table`` groups the kernels into steps (:func:`.profiling.attribute`)."""
    if ctx.cuda:  # compile the kernels, fill the allocator's cache
        torch.autograd.grad(fwd(), leaves, dout, allow_unused=True)
    names = (*BACKWARD_STEPS, OTHER)
    samples: dict[str, list[float]] = {s: [] for s in (*names, TOTAL)}
    kernels: dict[str, dict[str, float]] = {}
    for _ in range(calls):
        out = fwd()
        grads, launched = profile_kernels(
            lambda out=out: torch.autograd.grad(out, leaves, dout, allow_unused=True), ctx.device
        )
        del out, grads
        steps = attribute(launched, table)
        for step in names:
            samples[step].append(sum(steps.get(step, {}).values()))
        samples[TOTAL].append(sum(us for _, us in launched))
        for step, per_name in steps.items():
            into = kernels.setdefault(step, {})
            for name, us in per_name.items():
                into[name[:120]] = into.get(name[:120], 0.0) + us / calls
    return {**samples, "_kernels": kernels}
