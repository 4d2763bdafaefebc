"""Structure of the package: the walk of a ``fused_moe`` call's ``x`` through moe_route.

**The walk.** One eager ``fused_moe(x, w1, w2, topk_weights, topk_ids)`` call on the CPU with
``x.requires_grad`` (fp32, ``T=5, H=32, I=16, E=4, K=2``, swiglu), and its backward
(``out.backward(dout)``), run under ``sys.settrace``: on ``backend="torch"`` and on
``backend="triton"`` (the kernels under ``TRITON_INTERPRET=1``), each both as the FIRST call
of its signature (after ``moe_route.plan.clear_plans()``) and as a repeated, memoised call
(one untraced call of the signature first, the traced one with a fresh ``x`` of the same
signature). Before any traced call the process has run one untraced call (and backward) of
another shape on both backends, so that lazy imports and per-process state are behind it:
a "first call" is the signature's first, not the process's. Recorded:

* a *call event*: a Python ``call`` event whose code lives in a file of the moe_route package
  (module bodies run by an import, ``<module>``, left out; the resumption of a generator is
  no new call). Its *caller* is the nearest frame below it on the Python stack whose code
  lives in moe_route (frames of torch, triton or the test in between are skipped; none: the
  call comes from outside, e.g. the autograd engine calling a backward).
* *frames holding x*: the call events whose frame's arguments (named parameters, the items
  of ``*args``, the values of ``**kwargs``) include the very tensor object ``x`` (identity,
  ``is``): a view, an expanded copy, a detached alias or a container holding ``x`` does not
  count.
* **modules entered**: the number of distinct moe_route modules among the frames holding x.
* **climbs back up a layer**: among ALL call events (not only those holding x), the calls
  whose callee's module is of a higher layer than its caller's. Layers, from DESIGN.md's
  "Layers", highest first: 4 public API (the package ``__init__``, ``__main__``, routing, maps,
  permute, grouped_gemm, finalize, moe, quant, activations, layer, layer_call, layer_router,
  layer_weights, and the callers above them: parallel/*, integrations/*, bench/*) > 3 plan
  (plan, arch, tuning) > 2 op (experts, decode, _dispatch, router_ops: DESIGN.md puts "the routers'
  ops in moe_route/router_ops.py" in the op layer) > 1 launch sequence
  (kernels/triton/moe.py) > 0 launcher / kernel / torch backend (every other module of
  kernels/: triton/*, torch_impl/*, cupy/*, the ``kernels`` package). Utility modules,
  excluded from climbs (a call into one or out of one is never a climb): _checks, _env,
  _interop, reference (the oracles: DESIGN.md lets the torch backend and the launch sequence
  use them).
* **returns to a module already left**: the frames holding x, in call order, grouped into
  visits (a run of consecutive such frames in one module); a visit to a module that an
  earlier visit entered and then left is a return. Returns = visits - modules entered.

Targets (the project's): at most 7 modules entered, the utility modules (argument checks,
environment) not counted, and at most 4 climbs, for each of the four traces. ``pytest -s``
prints each measurement (and the frames holding x); so does
``python tests/test_structure.py``.

The import-graph check (no cycle among moe_route's modules) is ``tests/test_import_cycles.py``;
the CLI prints its result too.
"""

from __future__ import annotations

import dis
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from test_import_cycles import module_name

PUBLIC, PLAN, OP, SEQUENCE, LAUNCHER = 4, 3, 2, 1, 0
LAYER_NAMES = {PUBLIC: "public API", PLAN: "plan", OP: "op", SEQUENCE: "launch sequence",
               LAUNCHER: "launcher/kernel", None: "utility"}  # fmt: skip
_PUBLIC = {"routing", "maps", "permute", "grouped_gemm", "finalize", "moe", "quant", "activations",
           "layer", "layer_call", "layer_router", "layer_weights", "__main__"}  # fmt: skip
_PLAN = {"plan", "arch", "tuning"}
_OP = {"experts", "decode", "_dispatch", "router_ops"}
_UTILITY = {"_checks", "_env", "_interop", "reference"}

MODULES_TARGET = 7
CLIMBS_TARGET = 4

_CO_VARARGS, _CO_VARKEYWORDS = 0x04, 0x08
_CO_RESUMABLE = 0x20 | 0x80 | 0x200  # generator, coroutine, async generator


def layer_of(module: str) -> int | None:
    """The layer of a moe_route module (dotted name), None for a utility module."""
    parts = module.split(".")
    assert parts[0] == "moe_route", module
    if len(parts) == 1 or parts[1] in ("parallel", "integrations", "bench"):
        return PUBLIC
    top = parts[1]
    if top == "kernels":
        return SEQUENCE if parts[1:] == ["kernels", "triton", "moe"] else LAUNCHER
    for names, layer in ((_PUBLIC, PUBLIC), (_PLAN, PLAN), (_OP, OP), (_UTILITY, None)):
        if top in names:
            return layer
    raise AssertionError(f"{module}: no layer assigned (add it to tests/test_structure.py)")


def package_dir() -> Path:
    import moe_route

    return Path(moe_route.__file__).resolve().parent


# ----------------------------------------------------------------------------- the walk
@dataclass
class Walk:
    """The moe_route call events of one traced call (see the module doc)."""

    label: str
    #: (caller module or None, callee module, callee function, frame holds x), in call order
    events: list = field(default_factory=list)

    @property
    def x_frames(self) -> list[tuple[str, str]]:
        return [(mod, fn) for _, mod, fn, holds in self.events if holds]

    @property
    def modules_entered(self) -> int:
        return len({mod for mod, _ in self.x_frames})

    @property
    def layered_modules_entered(self) -> int:
        """Modules entered less the utility ones (printed, not a target)."""
        return len({mod for mod, _ in self.x_frames if layer_of(mod) is not None})

    @property
    def visits(self) -> list[str]:
        runs: list[str] = []
        for mod, _ in self.x_frames:
            if not runs or runs[-1] != mod:
                runs.append(mod)
        return runs

    @property
    def returns(self) -> int:
        return len(self.visits) - self.modules_entered

    @property
    def climb_list(self) -> list[tuple[str, str, str]]:
        out = []
        for caller, mod, fn, _ in self.events:
            if caller is None:
                continue
            lo, hi = layer_of(caller[0]), layer_of(mod)
            if lo is not None and hi is not None and hi > lo:
                out.append((f"{caller[0]}.{caller[1]}", f"{mod}.{fn}", f"{lo}->{hi}"))
        return out

    @property
    def climbs(self) -> int:
        return len(self.climb_list)

    def report(self) -> str:
        lines = [
            f"== {self.label}: modules entered {self.layered_modules_entered} without utility "
            f"ones (target <= {MODULES_TARGET}; {self.modules_entered} with them), climbs "
            f"{self.climbs} (target <= {CLIMBS_TARGET}), returns {self.returns}; "
            f"{len(self.events)} moe_route call events, {len(self.x_frames)} holding x",
            "  frames holding x:",
        ]
        lines += [f"    {short(mod)}.{fn}  [{LAYER_NAMES[layer_of(mod)]}]"
                  for mod, fn in self.x_frames]  # fmt: skip
        lines.append("  visits: " + " -> ".join(short(m) for m in self.visits))
        lines.append("  climbs:")
        for (src, dst, how), n in Counter(self.climb_list).items():
            lines.append(f"    {short(src)} -> {short(dst)}  (layer {how}) x{n}")
        return "\n".join(lines)


def _qualname(code) -> str:
    return getattr(code, "co_qualname", code.co_name)  # co_qualname: Python 3.11+


def short(name: str) -> str:
    return name.removeprefix("moe_route.")


def _holds(frame, x) -> bool:
    code = frame.f_code
    n = code.co_argcount + code.co_kwonlyargcount
    names = code.co_varnames
    loc = frame.f_locals
    if any(loc.get(name) is x for name in names[:n]):
        return True
    if code.co_flags & _CO_VARARGS:
        if any(a is x for a in loc.get(names[n], ())):
            return True
        n += 1
    if code.co_flags & _CO_VARKEYWORDS:
        return any(v is x for v in loc.get(names[n], {}).values())
    return False


def trace(label: str, fn, x) -> Walk:
    """Run ``fn()`` under ``sys.settrace`` and record its moe_route call events."""
    root = package_dir()
    prefix = str(root) + "/"
    modules: dict[str, str | None] = {}

    def module_of(filename: str) -> str | None:
        mod = modules.get(filename, 0)
        if mod == 0:
            path = Path(filename)
            inside = filename.startswith(prefix) or (
                path.is_absolute() and path.resolve().is_relative_to(root)
            )
            mod = modules[filename] = module_name(path, root) if inside else None
        return mod

    walk = Walk(label)

    def tracer(frame, event, arg):
        code = frame.f_code
        mod = module_of(code.co_filename)
        if mod is None or code.co_name == "<module>":
            return None
        if code.co_flags & _CO_RESUMABLE and frame.f_lasti >= 0 and _resumed(frame):
            return None
        caller = frame.f_back
        while caller is not None and module_of(caller.f_code.co_filename) is None:
            caller = caller.f_back
        who = None
        if caller is not None:
            who = (module_of(caller.f_code.co_filename), _qualname(caller.f_code))
        walk.events.append((who, mod, _qualname(code), _holds(frame, x)))
        return None

    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(old)
    return walk


_FIRST_OFFSET: dict = {}


def _resumed(frame) -> bool:
    """A generator's frame entered again, not its first call: past its first instruction
    (``RESUME`` from Python 3.11 on; before, a first call has ``f_lasti == -1``)."""
    code = frame.f_code
    first = _FIRST_OFFSET.get(code)
    if first is None:
        ops = dis.get_instructions(code)
        first = _FIRST_OFFSET[code] = next((i.offset for i in ops if i.opname == "RESUME"), 0)
    return frame.f_lasti > first


SIZES = {"T": 5, "H": 32, "I": 16, "E": 4, "K": 2}


def _inputs(T, H, I, E, K, seed=0):  # noqa: E741  (DESIGN.md's names)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).requires_grad_()
    w1 = torch.randn(E, 2 * I, H, generator=gen) / H**0.5
    w2 = torch.randn(E, H, I, generator=gen) / I**0.5
    logits = torch.randn(T, E, generator=gen)
    topk_weights, ids = torch.softmax(logits, -1).topk(K, -1)
    dout = torch.randn(T, H, generator=gen)
    return x, w1, w2, topk_weights, ids.to(torch.int32), dout


def _call(backend, x, w1, w2, topk_weights, ids, dout):
    from moe_route import fused_moe

    out = fused_moe(x, w1, w2, topk_weights, ids, backend=backend)
    out.backward(dout)


_WARMED = False


def _warm_process():
    """One untraced call and backward of another shape on each backend: the imports and the
    per-process state behind the traced calls."""
    global _WARMED
    if not _WARMED:
        for backend in ("torch", "triton"):
            x, *rest = _inputs(**{**SIZES, "H": 16, "T": 3}, seed=1)
            _call(backend, x, *rest)
        _WARMED = True


def walk_of(backend: str, memoised: bool) -> Walk:
    """The traced walk of one ``fused_moe`` call and its backward (see the module doc)."""
    from moe_route.plan import clear_plans

    _warm_process()
    clear_plans()
    if memoised:
        _call(backend, *_inputs(**SIZES, seed=2))
    x, *rest = _inputs(**SIZES, seed=3)
    label = f"backend={backend}, {'memoised call' if memoised else 'first call'}"
    walk = trace(label, lambda: _call(backend, x, *rest), x)
    assert x.grad is not None and x.grad.shape == x.shape
    return walk


def _triton_ok() -> bool:
    from moe_route import arch

    return torch.cuda.is_available() or arch.triton_interpreter_enabled()


@pytest.mark.parametrize("memoised", [False, True], ids=["first", "memoised"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_walk_of_x(backend, memoised):
    if backend == "triton" and not _triton_ok():
        pytest.skip("Triton kernels need a CUDA device or TRITON_INTERPRET=1")
    walk = walk_of(backend, memoised)
    print("\n" + walk.report())
    assert walk.x_frames, "no moe_route frame received x"
    assert walk.layered_modules_entered <= MODULES_TARGET, walk.report()
    assert walk.climbs <= CLIMBS_TARGET, walk.report()


def test_every_module_has_a_layer():
    """Each module of the package is placed (a new one must be given its layer above)."""
    from test_import_cycles import import_graph

    for module in import_graph():
        layer_of(module)


# ----------------------------------------------------------------------------- CLI
def main() -> int:
    """``python tests/test_structure.py``: print the four walks and the import-graph check."""
    # This checkout's moe_route (not another one installed), in the suite's environment
    # (conftest: the Triton interpreter on a machine without a GPU).
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import conftest  # noqa: F401

    ok = True
    for backend in ("torch", "triton"):
        if backend == "triton" and not _triton_ok():
            print("backend=triton: skipped (no CUDA device, TRITON_INTERPRET unset)")
            continue
        for memoised in (False, True):
            walk = walk_of(backend, memoised)
            print(walk.report(), end="\n\n")
            ok &= walk.layered_modules_entered <= MODULES_TARGET and walk.climbs <= CLIMBS_TARGET
    from test_import_cycles import find_cycle, import_graph

    graph = import_graph()
    cycle = find_cycle(graph)
    edges = sum(map(len, graph.values()))
    print(f"import graph: {len(graph)} modules, {edges} edges, "
          + ("no cycle" if cycle is None else "cycle: " + " -> ".join(cycle)))  # fmt: skip
    return 0 if ok and cycle is None else 1


if __name__ == "__main__":
    sys.exit(main())
