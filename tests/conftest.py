"""Test configuration: Triton interpreter on CPU-only machines, hermetic env, hypothesis profile.

``TRITON_INTERPRET`` must be in the environment before ``triton`` (and therefore the kernel
modules of ``moe_route``) are imported, so it is set here, at the very top, before anything
else imports them. On a machine with a CUDA device it is left alone: the kernels compile and
the same tests run on the GPU (see ``helpers.DEVICE``).

Known gaps of the triton 3.5.1 interpreter that matter here: float32 -> bfloat16 conversion
truncates instead of rounding to nearest (bf16 results may sit one ulp from torch's rounding;
``helpers`` sizes the bf16 tolerance for that), and ``tl.dot`` on bf16 is wrong (none of the
routing kernels use it). It is also slow: a 2048-key ``tl.sort`` takes seconds, so the CPU
tests keep sizes small and force the multi-tile routing path with ``tile=16``/``32``.
"""

import importlib
import os
import pkgutil
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

# On a GPU every thin launch checks that its launch key picked the variant Triton would
# (moe_route.kernels.triton.CHECK_LAUNCHES); read at import, so set before it.
os.environ.setdefault("MOE_ROUTE_CHECK_LAUNCHES", "1")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The flag is read when a kernel is decorated (``@triton.jit`` picks the interpreted
    # function then), so no kernel module may have been imported before this line.
    assert "moe_route" not in sys.modules, "conftest must run before moe_route is imported"
    # Import triton now, while the flag is set: triton.language's own @jit helpers (tl.cumsum,
    # tl.sort, ...) are decorated at import. If triton were first imported later inside a test
    # that sets TRITON_INTERPRET=0 (tests/test_arch.py does, and moe_route imports triton
    # lazily), every later interpreted kernel would fail with "Cannot call @triton.jit'd
    # outside of the scope of a kernel".
    import triton  # noqa: F401


import interpreter_patch

# The interpreter's per-call re-walk of triton.language, done once per module instead
# (tests/interpreter_patch.py says why the kernels run the same either way).
interpreter_patch.apply_if_interpreting()

import moe_route.kernels.triton  # noqa: E402

# Decorate every kernel module of moe_route now too, for the same reason (importing moe_route
# imports the ones the ops launch; this also covers any imported only on demand).
for _mod in pkgutil.iter_modules(moe_route.kernels.triton.__path__):
    importlib.import_module(f"moe_route.kernels.triton.{_mod.name}")

# Under pytest-xdist the workers already share the cores: torch's intra-op threads (one per
# core by default) would put several threads of each worker on every core, and their
# OpenMP pools spin while they wait. Each worker takes its share of the cores instead
# (one thread each when there are as many workers as cores).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _workers > 0:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (_cores or 1) // _workers))

# The interpreter is slow (a 2048-key sort takes seconds): no per-example deadline, modest
# example counts (each test states its own max_examples), no health check for slow data.
settings.register_profile(
    "moe_route",
    deadline=None,
    max_examples=30,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "moe_route"))


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """Work stealing where ``-n`` was given without a ``--dist`` mode (pytest-xdist's default
    is ``load``).

    The tests take from milliseconds to tens of seconds, and the slow ones sit late in the
    collection order (tests/test_training.py's prepared route: 4 x 10 s): ``load`` sends each
    worker its chunks ahead, so on two cores one worker sat idle for the last half minute
    while the other ran them. Work stealing hands each worker a contiguous half and moves
    tests not yet started to whichever runs dry, so a worker waits at most for the other's
    current test. Which worker runs a test changes, not what any test does.
    """
    given = [*config.invocation_params.args, *os.environ.get("PYTEST_ADDOPTS", "").split(),
             *config.getini("addopts")]  # fmt: skip
    chosen = any(a == "-d" or a.startswith(("--dist", "--maxschedchunk")) for a in given)
    if config.getvalue("dist") != "load" or chosen:
        return None
    from xdist.scheduler import WorkStealingScheduling

    return WorkStealingScheduling(config, log)


def pytest_configure(config):
    # triton 3.5.1's interpreter converts 1-element arrays to scalars, which numpy >= 1.25
    # deprecates; it is the interpreter's warning, not ours.
    config.addinivalue_line(
        "filterwarnings",
        "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning",
    )
    # Emitted by torch's own modules while torch.compile / opcheck import them.
    config.addinivalue_line(
        "filterwarnings", "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"
    )


_ENV_KNOBS = ("MOE_ROUTE_BACKEND", "MOE_ROUTE_FINALIZE", "MOE_ROUTE_ARCH", "MOE_ROUTE_CHECK_IDS",
              "MOE_ROUTE_PERSISTENT", "MOE_ROUTE_COMM_SMS")  # fmt: skip


@pytest.fixture(autouse=True)
def _hermetic_env(monkeypatch):
    """Every test starts from the default choices, whatever the caller's shell exports."""
    for name in _ENV_KNOBS:
        monkeypatch.delenv(name, raising=False)


# ----------------------------------------------------------------------------- isolated tests
#: Set in the child process that runs an ``isolated`` test (see ``pytest_pyfunc_call``).
ISOLATED_CHILD = "MOE_ROUTE_ISOLATED_CHILD"


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Run a test marked ``isolated`` in a fresh Python process (a pytest child on that test).

    For CUDA-graph captures: a capture that fails leaves process-wide state behind that no
    public API restores — the capture stream stays current (``torch.cuda.graph`` does not exit
    its stream context when ``capture_end`` raises), the caching allocator keeps the aborted
    capture's pool registered, the generators keep its capture state while the graph object
    lives (pytest keeps the failed test's frames), and an error inside the capture may be
    sticky — and on an H100 that failed the three tests after it. A child process takes all
    of that with it; it costs a few seconds (importing torch, loading the already compiled
    Triton kernels from the cache).
    """
    if pyfuncitem.get_closest_marker("isolated") is None or os.environ.get(ISOLATED_CHILD):
        return None
    root = str(pyfuncitem.config.rootpath)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short",
           "-m", "isolated", pyfuncitem.nodeid]  # fmt: skip
    env = {**os.environ, ISOLATED_CHILD: "1"}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    if proc.returncode == 0 and " passed" in summary and "skipped" not in summary:
        return True
    if proc.returncode == 0 and "skipped" in summary:
        pytest.skip(f"skipped in its child process:\n{proc.stdout[-2000:]}")
    pytest.fail(
        f"{pyfuncitem.nodeid} in a child process: exit code {proc.returncode}\n"
        f"{proc.stdout[-8000:]}\n{proc.stderr[-3000:]}",
        pytrace=False,
    )
