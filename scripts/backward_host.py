"""Where the host time of an eager ``fused_moe`` forward + backward goes (GPU), qwen3-30b-a3b's
MoE sizes at ``--tokens`` (default 1). In alternating rounds (one process, so that the host's
drift hits both alike): the whole step (``torch.autograd.grad`` of the four inputs) and the
forward alone on the prepared route (``PreparedExperts``: the launch sequences' prepared
launches, autograd through ``_Experts``) and on the op's route (``run_experts`` through the
custom op's autograd: every eager call's route before), autograd's own cost around a
do-nothing Function with the same leaves, the backward launch sequence with its prepared
launches and preparing them per call, and inside a trivial Function's backward; then the
step's two halves, and inside the forward and the backward launch sequences each launcher's
host µs and, within those, the thin launches' and the TMA descriptors' (the rest is
allocation and glue). Host µs per call over bursts of 8 calls (synchronised between bursts,
so the launch queue never fills).

    PYTHONPATH=. python scripts/backward_host.py [--tokens 1 8 64] [--rounds 8]
    PYTHONPATH=. python scripts/backward_host.py --ab [--rounds 8] [--tokens 1 4096]
    PYTHONPATH=. python scripts/backward_host.py --cprofile [--tokens 4096]

``--ab``: the step and the forward alone, timed in alternating rounds with the launch path
before the descriptor cache (Triton's ``TensorDescriptor`` built and validated per call,
encoded per launch: emulated by patching the launchers' descriptor constructors and dropping
the thin launch's expander) and as it is.
"""

import argparse
import time
from collections import defaultdict

import torch
import triton.backends.nvidia.driver as nv_driver

import moe_route
import moe_route.kernels.triton.grouped_gemm as gg
import moe_route.kernels.triton.moe as launch_seq
import moe_route.kernels.triton.weight_grad as wg
from moe_route import moe as moe_mod
from moe_route import reference as R
from moe_route.bench.harness import time_host
from moe_route.kernels.triton import ThinKernel

H, inter, E, K = 2048, 768, 128, 8


def burst(fn, n=8, loops=60) -> float:
    return time_host(fn, "cuda", calls=n, repeats=loops, warmup=3).median_s * 1e6


class _Trivial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, a, b, tw):
        ctx.save_for_backward(x, a, b, tw)
        return x.new_empty(x.shape)

    @staticmethod
    def backward(ctx, dout):
        return tuple(torch.empty_like(t) for t in ctx.saved_tensors)


def in_backward_step(fn):
    """A step whose only backward work is ``fn()``, run by autograd's engine (one leaf)."""
    leaf = torch.zeros(1, device="cuda", requires_grad=True)

    class Runs(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a.clone()

        @staticmethod
        def backward(ctx, grad):
            fn()
            return grad

    return lambda: torch.autograd.grad(Runs.apply(leaf), leaf, torch.ones_like(leaf))


class Timers:
    """Host seconds spent in wrapped functions, by name (nested wrappers both count)."""

    def __init__(self):
        self.total = defaultdict(float)
        self.calls = defaultdict(int)
        self._undo = []

    def wrap(self, owner, name, label=None):
        fn = getattr(owner, name)
        label = label or name
        total, calls = self.total, self.calls

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                total[label] += time.perf_counter() - t0
                calls[label] += 1

        setattr(owner, name, timed)
        self._undo.append((owner, name, fn))

    def undo(self):
        for owner, name, fn in reversed(self._undo):
            setattr(owner, name, fn)
        self._undo.clear()

    def report(self, per, title):
        print(f"  {title} (host us per call, inside the wrappers):")
        for label, s in sorted(self.total.items(), key=lambda kv: -kv[1]):
            print(f"    {s / per * 1e6:8.1f} us  {self.calls[label] / per:4.1f}x  {label}")


#: the launch sequences' prepared launches (timed around their calls)
LAUNCHERS = ("GemmLaunch", "ActBackwardLaunch", "RowPassLaunch", "RouterGradLaunch",
             "WeightGradLaunch", "FinalizeLaunch", "ExpandLaunch", "WeightGradOperand")  # fmt: skip


class Case:
    """fused_moe at qwen3-30b-a3b's MoE sizes and ``T`` tokens, every input requiring grad:
    ``fwd()`` the forward, ``step()`` forward + ``torch.autograd.grad`` of the four inputs."""

    def __init__(self, T):
        dev, dt = "cuda", torch.bfloat16
        w1 = (torch.randn(E, 2 * inter, H, device=dev, dtype=dt) * 0.02).requires_grad_()
        w2 = (torch.randn(E, H, inter, device=dev, dtype=dt) * 0.02).requires_grad_()
        x = torch.randn(T, H, device=dev, dtype=dt, requires_grad=True)
        tw, ids = R.topk_routing_reference(torch.randn(T, E, device=dev), K, renormalize=True)
        self.inputs = (x, w1, w2, tw.requires_grad_(), ids)
        self.leaves = [x, w1, w2, tw]
        self.dout = torch.randn(T, H, device=dev, dtype=dt)

    def fwd(self):
        return moe_route.fused_moe(*self.inputs)

    def step(self):
        return torch.autograd.grad(self.fwd(), self.leaves, self.dout)

    def launch_sequence(self):
        """``(args, kwargs)`` of ``moe_backward_triton`` as a step called it (``dz`` into a
        new tensor, so that repeated calls leave ``z`` as it is)."""
        real = launch_seq.moe_backward_triton
        seen = {}

        def capture(*a, **k):
            seen["a"], seen["k"] = a, dict(k, dz_out=None)
            return real(*a, **k)

        moe_mod.moe_backward_triton = capture
        try:
            self.step()
        finally:
            moe_mod.moe_backward_triton = real
        return seen["a"], seen["k"]


def routes(case):
    """``use(route)``: switch ``fused_moe``'s memoised calls of ``case`` between the prepared
    route (``"prepared"``: ``PreparedExperts``) and the op's (``"op"``: ``run_experts``
    through the custom op's autograd, the route of every eager call before the prepared
    launch sequences)."""
    case.step()
    calls = [c for c in moe_mod._CALLS.calls.values() if c.experts is not None]
    prepared = {id(c): c.experts for c in calls}

    def use(route):
        for c in calls:
            c.experts = prepared[id(c)] if route == "prepared" else None

    return use


def run(T, rounds):
    case = Case(T)
    leaves, dout, fwd, step = case.leaves, case.dout, case.fwd, case.step

    def floor():
        return torch.autograd.grad(_Trivial.apply(*leaves), leaves, dout)

    use = routes(case)
    for _ in range(5):
        step()
    real = launch_seq.moe_backward_triton
    a, k = case.launch_sequence()

    def seq():  # with the prepared launches
        return real(*a, **k)

    def fresh():  # preparing its launches
        return real(*a, **dict(k, launches=None))

    idx = torch.arange(T, device="cuda")
    pieces = {
        "index_select": lambda: dout.index_select(0, idx),
        "autograd floor (do-nothing Function)": floor,
        "backward launch sequence, prepared (main thread)": seq,
        "backward launch sequence, prepared per call": fresh,
        "backward launch sequence, in a Function's backward": in_backward_step(seq),
    }
    samples = defaultdict(list)
    for r in range(rounds):
        for route in ("op", "prepared") if r % 2 == 0 else ("prepared", "op"):
            use(route)
            for _ in range(3):
                step()
            samples[f"fwd + bwd (autograd.grad), {route} route"].append(burst(step, loops=20))
            samples[f"forward, grad-requiring inputs, {route} route"].append(burst(fwd, loops=20))
        for name, fn in pieces.items():
            samples[name].append(burst(fn, loops=20))
    use("prepared")
    print(f"T={T}: host us per call, median of {rounds} alternating rounds")
    for name, v in samples.items():
        print(f"  {sorted(v)[len(v) // 2]:8.1f} us  {name}")
    # the step's two halves, the backward timed inside autograd's engine
    timers = Timers()
    timers.wrap(moe_mod, "_triton_backward", "backward launch sequence (in autograd)")
    timers.wrap(moe_mod._Experts, "backward", "Function.backward (in autograd)")
    moe_mod._Experts.backward = staticmethod(moe_mod._Experts.backward)
    n = 400
    for i in range(n):
        t0 = time.perf_counter()
        out = fwd()
        t1 = time.perf_counter()
        torch.autograd.grad(out, leaves, dout)
        t2 = time.perf_counter()
        timers.total["step: forward"] += t1 - t0
        timers.total["step: autograd.grad"] += t2 - t1
        timers.calls["step: forward"] += 1
        timers.calls["step: autograd.grad"] += 1
        del out
        if i % 8 == 7:
            torch.cuda.synchronize()
    timers.undo()
    timers.report(n, "the step (prepared route)")
    for title, fn in (("forward", fwd), ("moe_backward_triton (prepared)", seq)):
        timers = Timers()
        for name in LAUNCHERS:
            timers.wrap(getattr(launch_seq, name), "__call__", name)
        timers.wrap(launch_seq, "grouped_gemm_finalize_triton")
        timers.wrap(ThinKernel, "launch", "ThinKernel.launch")
        # TMA descriptors: built by the launchers, encoded by Triton's launch wrapper
        for name in ("_a_descriptor", "_w_descriptor", "_gate_up_descriptor",
                     "_store_descriptors"):  # fmt: skip
            timers.wrap(gg, name, f"grouped_gemm.{name}")
        timers.wrap(wg, "bounded_rows_descriptor", "weight_grad: bounded_rows_descriptor")
        timers.wrap(wg, "tma_operands_ok", "weight_grad: tma_operands_ok")
        timers.wrap(nv_driver, "make_tensordesc_arg", "triton: make_tensordesc_arg")
        timers.wrap(moe_mod, "moe_forward_triton")
        n = 400
        for i in range(n):
            fn()
            if i % 8 == 7:
                torch.cuda.synchronize()
        timers.undo()
        timers.report(n, title)


def legacy_descriptors(on: bool) -> None:
    """Switch the launch path to Triton's descriptors (``on``) or back; every thin kernel
    forgets its compiled variants' launchers, so the next launch rebuilds them (a cache
    lookup in Triton, no compile)."""
    import moe_route.kernels.triton as kt
    from moe_route.kernels.triton import tma

    if not hasattr(legacy_descriptors, "saved"):
        legacy_descriptors.saved = {
            (m, n): getattr(m, n)
            for m, names in ((gg, ("descriptor", "bounded_rows_descriptor", "Descriptor")),
                             (wg, ("descriptor", "bounded_rows_descriptor")),
                             (kt, ("_descriptor_expander",)))
            for n in names
        }  # fmt: skip
    saved = legacy_descriptors.saved
    for (m, n), fn in saved.items():
        setattr(m, n, fn)
    if on:
        for (m, n), fn in saved.items():
            if n == "_descriptor_expander":
                setattr(m, n, lambda launch, n_args: (launch, None))
            elif n == "Descriptor":
                setattr(m, n, lambda *a: tma.Descriptor(*a).triton())
            else:
                setattr(m, n, lambda *a, _fn=fn, **k: _fn(*a, **k).triton())
    for kernel in kt.KERNELS:
        kernel.forget()


def ab(T, rounds):
    case = Case(T)
    fwd, step, dout = case.fwd, case.step, case.dout
    idx = torch.arange(T, device="cuda")

    from moe_route.kernels.triton import tma

    built = [0]
    init = tma.Descriptor.__init__

    def counting(self, *a):
        built[0] += 1
        init(self, *a)

    tma.Descriptor.__init__ = counting
    step()
    fwd()
    tma.Descriptor.__init__ = init
    print(f"T={T}: {built[0]} TMA descriptors built per forward + step")
    samples = defaultdict(list)
    for r in range(rounds):
        for mode in ("before", "after") if r % 2 == 0 else ("after", "before"):
            legacy_descriptors(mode == "before")
            for _ in range(3):
                step()
            samples[("step", mode)].append(burst(step, loops=20))
            samples[("forward", mode)].append(burst(fwd, loops=20))
        samples[("index_select", "-")].append(burst(lambda: dout.index_select(0, idx), loops=20))
    legacy_descriptors(False)
    med = {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
    print(f"T={T}: host us per call, median of {rounds} alternating rounds "
          f"(index_select {med[('index_select', '-')]:.1f} us)")  # fmt: skip
    for what in ("step", "forward"):
        b, a = med[(what, "before")], med[(what, "after")]
        print(f"  {what:8s} before {b:7.1f}  after {a:7.1f}  ({b / a:.2f}x)")


def profile_calls(T, calls=400, top=25):
    """cProfile of ``calls`` forward and backward launch sequences at ``T`` (main thread):
    the functions by own time."""
    import cProfile
    import pstats

    case = Case(T)
    for _ in range(3):
        case.step()
    args, kwargs = case.launch_sequence()

    def backward():
        return launch_seq.moe_backward_triton(*args, **kwargs)

    for title, fn in (("forward (fused_moe, grad-requiring inputs)", case.fwd),
                      ("moe_backward_triton", backward)):  # fmt: skip
        prof = cProfile.Profile()
        for i in range(calls):
            prof.enable()
            fn()
            prof.disable()
            if i % 8 == 7:
                torch.cuda.synchronize()
        print(f"T={T}, {title}: per call, by own time")
        stats = pstats.Stats(prof).sort_stats("tottime")
        width = max(len(pstats.func_std_string(f)) for f in stats.fcn_list[:top])
        for f in stats.fcn_list[:top]:
            _, nc, tt, ct, _ = stats.stats[f]
            print(
                f"  {tt / calls * 1e6:7.1f} us own {ct / calls * 1e6:8.1f} us cum "
                f"{nc / calls:5.1f}x  {pstats.func_std_string(f)[: max(width, 40)]}"
            )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1])
    ap.add_argument("--ab", action="store_true")
    ap.add_argument("--cprofile", action="store_true", help="cProfile the launch sequences")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    for T in args.tokens:
        if args.cprofile:
            profile_calls(T)
        elif args.ab:
            ab(T, args.rounds)
        else:
            run(T, args.rounds)


if __name__ == "__main__":
    main()
