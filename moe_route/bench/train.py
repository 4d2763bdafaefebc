"""The ``train`` stage: forward + backward, peak and activation memory, saved activations.

Against the ``_grouped_mm`` pipeline under autograd and the per-expert loop. The per-step
device times of the backward are the ``backward`` stage's (:mod:`.backward`).
"""

from __future__ import annotations

import torch

import moe_route

from . import baselines as B
from .context import Context, Entry, _tol, _weight_bytes, rel_err
from .forward import forward_cost
from .profiling import step_memory
from .shapes import Shape


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
