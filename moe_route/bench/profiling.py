"""What the stages learn from ``torch.profiler``: the kernels of one call grouped into named steps,
and the activation memory of a training step.

* :func:`profile_kernels` — ``[(name, µs), ...]`` of what ran on the device during one call, in
  launch order (on the CPU: the operators' self times);
* :func:`attribute` — those, grouped into steps by a table of name patterns;
* :func:`step_memory` — peak memory of one training step beyond what was allocated before it,
  with and without the gradients it returns (the allocation trace of the profiler).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

OTHER = "other"  # the step of kernels no pattern of a table matches


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_kernels(fn, device) -> tuple[object, list[tuple[str, float]]]:
    """``(fn(), [(name, µs), ...])``: what ran during one call of ``fn``, in launch order.

    CUDA: every device activity (kernels, copies, memsets) and its device time. CPU: every
    operator and its self time (the time not spent in the operators it calls), so the list
    sums to the operators' total without counting nested ones twice.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(device)
    cuda = device.type == "cuda"
    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        out = fn()
        _sync(device)
    want = DeviceType.CUDA if cuda else DeviceType.CPU
    events = [e for e in prof.events() if e.device_type == want and (cuda or not e.is_async)]
    events.sort(key=lambda e: e.time_range.start)
    if cuda:
        return out, [(e.name, float(e.time_range.elapsed_us())) for e in events]
    return out, [(e.name, float(e.self_cpu_time_total)) for e in events]


@dataclass(frozen=True)
class Until:
    """A table rule for a kernel that serves a step only in some launch plans, by where its
    launches fall: those before the first launch of a kernel matching ``landmark`` (a regular
    expression) serve ``before``; the others are split among ``steps`` as a plain rule's.

    E.g. the same GEMM kernel computes GEMM2's input gradient ahead of a separate activation
    backward (one plan) and, after it, GEMM1's input gradient (both plans)."""

    landmark: str
    before: str
    steps: tuple[str, ...]


Rule = tuple[str, ...] | Until


def rule_steps(rule: Rule) -> tuple[str, ...]:
    """Every step a table rule can attribute time to."""
    return (rule.before, *rule.steps) if isinstance(rule, Until) else rule


def attribute(
    kernels: list[tuple[str, float]], table: dict[str, Rule]
) -> dict[str, dict[str, float]]:
    """``{step: {kernel name: µs}}`` of one call's ``kernels`` (in launch order).

    ``table`` maps a regular expression (searched in the kernel's name; the first one that
    matches wins) to the steps that kernel serves, in launch order: a kernel launched for two
    steps (the same GEMM kernel for two products) lists both, and its launches in the call are
    split evenly among them, the first share to the first step. An :class:`Until` rule first
    gives the launches before its landmark to its own step. Kernels no pattern matches go to
    :data:`OTHER`.
    """
    rules = [(re.compile(pattern), steps) for pattern, steps in table.items()]
    found: list[list[tuple[int, str, float]]] = [[] for _ in rules]
    out: dict[str, dict[str, float]] = {}

    def add(step: str, name: str, us: float) -> None:
        per_name = out.setdefault(step, {})
        per_name[name] = per_name.get(name, 0.0) + us

    for i, (name, us) in enumerate(kernels):
        for j, (rx, _) in enumerate(rules):
            if rx.search(name):
                found[j].append((i, name, us))
                break
        else:
            add(OTHER, name, us)
    for (_, steps), launches in zip(rules, found, strict=True):
        if isinstance(steps, Until):
            landmark = re.compile(steps.landmark)
            first = next((i for i, (n, _) in enumerate(kernels) if landmark.search(n)), None)
            early = [x for x in launches if first is not None and x[0] < first]
            for _, name, us in early:
                add(steps.before, name, us)
            launches, steps = launches[len(early) :], steps.steps
        for j, (_, name, us) in enumerate(launches):
            add(steps[j * len(steps) // len(launches)], name, us)
    return out


@dataclass
class StepMemory:
    """Bytes of one training step, from the allocations made during it (see :func:`step_memory`)."""

    peak: int  # most bytes allocated at once beyond what was allocated before the step
    activation: int  # the same, not counting the gradients the step returns
    grads: int  # bytes of those gradients


def _walk(events):
    for e in events:
        yield e
        yield from _walk(e.children)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item)


def step_memory(fn, device) -> tuple[object, StepMemory]:
    """``(fn(), StepMemory)`` of one call of ``fn``, a training step that returns its gradients.

    Replays the allocations and frees made on ``device`` during the call (the profiler's
    memory trace, every thread included: the backward runs on autograd's device threads) and
    takes the most bytes held at once (``peak``) and the most held at once when the gradients
    the step returns are not counted from the moment each is allocated (``activation``): what
    the forward saves for the backward, the forward's output and every temporary of both
    passes. Memory allocated before the call (parameters, inputs) is in neither.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(device)
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
        _sync(device)
    events = [
        e.typed[1]
        for e in sorted(
            _walk(prof.profiler.kineto_results.experimental_event_tree()),
            key=lambda e: e.start_time_ns,
        )
        if e.typed[0] == _EventType.Allocation
        and torch.device(e.typed[1].device).type == device.type
    ]
    grad_ptrs = {t.untyped_storage().data_ptr() for t in _tensors(out) if t.numel()}
    last_alloc = {}  # a gradient is the last allocation made at its address
    for i, a in enumerate(events):
        if a.alloc_size > 0 and a.ptr in grad_ptrs:
            last_alloc[a.ptr] = i
    grad_allocs = set(last_alloc.values())
    live: dict[int, int] = {}
    held = grads = peak = activation = 0
    for i, a in enumerate(events):
        if a.alloc_size > 0:
            live[a.ptr] = a.alloc_size
            held += a.alloc_size
            if i in grad_allocs:
                grads += a.alloc_size
        elif a.ptr in live:  # frees of memory allocated before the call are not ours
            held -= live.pop(a.ptr)
        peak = max(peak, held)
        activation = max(activation, held - grads)
    return out, StepMemory(peak=peak, activation=activation, grads=grads)
