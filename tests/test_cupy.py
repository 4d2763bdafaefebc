"""The CuPy backend on a machine without CuPy or without a GPU (CI): optional dependency, the
error that says how to install it, backend choice, the ``info`` listing, the CuPy-array interop
plumbing (through a stand-in ``cupy`` module) and the launchers' layout decisions.

The kernels themselves run in ``tests/test_gpu_cupy.py``.
"""

import importlib
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from helpers import randn, random_topk_ids, random_weights

import moe_route
from moe_route import _interop, arch
from moe_route.kernels.cupy import expand as cupy_expand
from moe_route.kernels.cupy import finalize as cupy_finalize
from moe_route.kernels.cupy import routing_maps as cupy_maps

INSTALL = r"pip install 'moe_route\[cupy-cuda\d+\]' \(or pip install cupy-cuda\d+x"


@pytest.fixture
def no_cupy(monkeypatch):
    """CuPy absent: ``import cupy`` raises ImportError, as on a machine without it."""
    monkeypatch.setitem(sys.modules, "cupy", None)
    arch._cupy_usable.cache_clear()
    yield
    arch._cupy_usable.cache_clear()


# ----------------------------------------------------------------------------- optional dependency
def test_import_and_other_backends_work_without_cupy():
    # A fresh interpreter in which CuPy cannot be imported runs every non-CuPy path, and
    # nothing moe_route does imports CuPy behind the caller's back.
    script = textwrap.dedent(
        """
        import sys
        sys.modules["cupy"] = None  # import cupy -> ImportError
        import torch, moe_route
        ids = torch.tensor([[0, 1], [0, 2], [1, 2]])
        x, w = torch.randn(3, 8), torch.rand(3, 2)
        for backend in ("torch", "reference", "triton", "auto"):
            maps = moe_route.build_routing_maps(ids, 3, backend=backend)
            assert maps.expanded_source_row_to_expanded_dest_row.tolist() == [0, 1, 3, 2, 4, 5]
            y = moe_route.expand_rows(x, maps, backend=backend)
            out = moe_route.finalize_moe_routing(y, w, maps, backend=backend)
            assert torch.allclose(out, x * w.sum(1, keepdim=True))
        info = moe_route.arch.describe("cpu")
        assert info["  cupy"].startswith("no"), info
        assert sys.modules["cupy"] is None
        print("ok")
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("MOE_ROUTE_BACKEND", None)
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_backend_cupy_without_cupy_says_how_to_install(no_cupy):
    with pytest.raises(
        ImportError, match=rf"backend='cupy': the CuPy backend needs CuPy.*{INSTALL}"
    ):
        arch.backend_for("cuda:0", "cupy")


def test_env_backend_cupy_without_cupy(monkeypatch, no_cupy):
    monkeypatch.setenv("MOE_ROUTE_BACKEND", "cupy")
    with pytest.raises(ImportError, match=rf"MOE_ROUTE_BACKEND=cupy: .*{INSTALL}"):
        arch.backend_for("cuda")
    assert "cupy" in arch.describe("cpu")["backend"]  # info still prints, with the reason


def test_public_functions_raise_before_running_without_cupy(no_cupy):
    """CPU tensors: the device is what is wrong whether CuPy is installed or not, so the error
    names it and the backends that would run (the install hint is for CUDA devices, above)."""
    ids = random_topk_ids(5, 2, 4)
    maps = moe_route.build_routing_maps(ids, 4)
    x, w = randn(5, 8), random_weights(5, 2)
    y = moe_route.expand_rows(x, maps)
    calls = [
        lambda: moe_route.build_routing_maps(ids, 4, backend="cupy"),
        lambda: moe_route.expand_rows(x, maps, backend="cupy"),
        lambda: moe_route.finalize_moe_routing(y, w, maps, backend="cupy"),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"backend='cupy' but the tensors are on cpu: .*torch"):
            call()


@pytest.mark.parametrize("cuda,wheel", [("12.8", "cupy-cuda12x"), ("13.0", "cupy-cuda13x")])
def test_install_hint_names_the_wheel_for_torchs_cuda(monkeypatch, cuda, wheel):
    monkeypatch.setattr(torch.version, "cuda", cuda)
    hint = arch.cupy_install_hint()
    assert wheel in hint and f"moe_route[cupy-cuda{cuda.split('.')[0]}]" in hint


def test_extras_in_setup_cfg_match_the_hint():
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(os.path.dirname(__file__), "..", "setup.cfg"))
    extras = cfg["options.extras_require"]
    assert extras["cupy-cuda12"].split()[0].startswith("cupy-cuda12x")
    assert extras["cupy-cuda13"].split()[0].startswith("cupy-cuda13x")
    assert "cupy" in extras
    assert "*.cu" in cfg["options.package_data"]["moe_route.kernels.cupy"]


# ----------------------------------------------------------------------------- choice
@pytest.fixture
def fake_cupy(monkeypatch):
    """A stand-in ``cupy`` module: importable, converts through DLPack like CuPy does."""
    module = types.ModuleType("cupy")
    module.__version__ = "0.fake"
    module.from_dlpack = lambda obj: FakeCupyArray(torch.from_dlpack(obj))
    monkeypatch.setitem(sys.modules, "cupy", module)
    arch._cupy_usable.cache_clear()
    yield module
    arch._cupy_usable.cache_clear()


class FakeCupyArray:
    """Quacks like ``cupy.ndarray`` for DLPack: wraps a torch tensor's memory."""

    __module__ = "cupy._core.core"

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def __dlpack__(self, **kwargs):
        return self.tensor.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()


def test_backend_cupy_needs_a_cuda_device(fake_cupy):
    with pytest.raises(ValueError, match=r"backend='cupy' but the tensors are on cpu: .*CUDA"):
        arch.backend_for("cpu", "cupy")
    assert arch.backend_for("cuda:0", "cupy") == arch.Choice("cupy", "backend='cupy'")


def test_auto_keeps_triton_on_cuda(fake_cupy):
    assert arch.backend_for("cuda:0").value == "triton"
    assert arch.backend_for("cuda:0", op="expand_rows", slots=1 << 20).value == "triton"


@pytest.mark.parametrize(
    "slots,chosen", [(8, "triton"), (2048, "triton"), (2049, "triton"), (131071, "triton"),
                     (131072, "cupy"), (1 << 24, "cupy")],
)  # fmt: skip
def test_auto_routing_maps_pick_cupy_where_it_measured_faster(fake_cupy, slots, chosen):
    """Large maps only: below, CuPy's launch costs the host more than its kernels save."""
    choice = arch.backend_for("cuda:0", op="routing_maps", slots=slots)
    assert choice.value == chosen
    assert arch.backend_for("cpu", op="routing_maps", slots=slots).value != "cupy"


def test_auto_routing_maps_without_cupy_or_when_forced(monkeypatch, no_cupy):
    assert arch.backend_for("cuda:0", op="routing_maps", slots=1 << 20).value == "triton"
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    arch._cupy_usable.cache_clear()
    monkeypatch.setenv("MOE_ROUTE_BACKEND", "triton")
    assert arch.backend_for("cuda:0", op="routing_maps", slots=1 << 20).value == "triton"
    assert arch.backend_for("cuda:0", "triton", op="routing_maps", slots=8).value == "triton"


@pytest.fixture
def h100_limits(monkeypatch, fake_cupy):
    """A CUDA device as the expert limits see it on an H100 (227 KiB of opt-in shared memory):
    CuPy maps hold E <= 29048 at K = 8, Triton E <= 32759. Fresh caches of maps backends."""
    import importlib

    from moe_route.kernels.triton import routing_maps as triton_maps

    maps_module = importlib.import_module("moe_route.maps")
    monkeypatch.setattr(cupy_maps._nvrtc, "max_shared_memory", lambda device: 227 * 1024)
    monkeypatch.setattr(triton_maps, "shared_memory_optin", lambda index: 227 * 1024)
    monkeypatch.setenv("MOE_ROUTE_ARCH", "90")
    maps_module._bucket_maps_backend.cache_clear()
    yield maps_module
    maps_module._bucket_maps_backend.cache_clear()


@pytest.mark.parametrize(("E", "chosen"), [(256, "cupy"), (29048, "cupy"), (29049, "triton"),
                                           (32759, "triton")])  # fmt: skip
def test_auto_maps_fall_back_to_triton_past_the_cupy_expert_limit(h100_limits, E, chosen):
    """ "auto" picks the CuPy maps at 131072 slots (measured faster), but only for as many experts
    as their kernels hold; past that Triton's, for build_routing_maps and fused_moe's plan."""
    device, T = torch.device("cuda", 0), arch.CUPY_MAPS_MIN_LARGE_SLOTS // 8
    assert h100_limits._cached_maps_backend(device, "auto", T, 8, E) == chosen
    plan = importlib.import_module("moe_route.plan")._plan.__wrapped__(
        device, torch.bfloat16, (E, 64, 32), (E, 32, 32), E, 8, T, "swiglu", "concat",
        "standalone", True, False, "auto", arch.env_key(),
    )  # fmt: skip
    assert plan.maps_backend == chosen


def test_maps_past_every_kernel_limit_or_explicit_cupy_raise(h100_limits, monkeypatch):
    device = torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"num_experts=32760 with K=8: the Triton .* E <= 32759"):
        h100_limits._cached_maps_backend(device, "auto", 1 << 14, 8, 32760)
    for how in ("argument", "env"):
        if how == "env":
            monkeypatch.setenv("MOE_ROUTE_BACKEND", "cupy")
        with pytest.raises(ValueError, match=r"num_experts=29049 with K=8: the CuPy .* E <= 29048"):
            h100_limits._cached_maps_backend(device, "cupy" if how == "argument" else "auto",
                                             1 << 14, 8, 29049)  # fmt: skip


def test_env_backend_cupy(monkeypatch, fake_cupy):
    monkeypatch.setenv("MOE_ROUTE_BACKEND", "CuPy")
    assert arch.backend_for("cuda:0") == arch.Choice("cupy", "MOE_ROUTE_BACKEND=cupy")
    assert arch.backend_for("cuda:0", "triton").value == "triton"  # an explicit argument wins


def test_availability_listing(no_cupy):
    found = arch.backend_availability("cpu")
    assert list(found) == list(arch.BACKENDS)
    assert found["torch"].value == "yes"
    assert found["cupy"] == arch.Choice("no", "needs a CUDA device")
    cuda = arch.backend_availability("cuda:0")["cupy"]  # no CUDA call before CuPy is found
    assert cuda.value == "no" and "not installed" in cuda.why and "pip install" in cuda.why
    info = arch.describe("cpu")
    assert info["  cupy"].startswith("no") and info["  torch"].startswith("yes")


# ----------------------------------------------------------------------------- interop
def test_is_cupy():
    assert _interop.is_cupy(FakeCupyArray(torch.zeros(1)))
    assert not _interop.is_cupy(torch.zeros(1))
    assert not _interop.is_cupy(None)


def test_cupy_arrays_in_cupy_arrays_out_without_copies(fake_cupy):
    T, K, E, H = 7, 2, 4, 16
    ids = random_topk_ids(T, K, E, drop_prob=0.2, seed=3)
    x, w, bias = randn(T, H, seed=1), random_weights(T, K, seed=2), randn(H, seed=3)
    maps = moe_route.build_routing_maps(FakeCupyArray(ids), E)
    assert isinstance(maps, moe_route.RoutingMaps)
    want = moe_route.build_routing_maps(ids, E)
    assert torch.equal(maps.expanded_source_row_to_expanded_dest_row,
                       want.expanded_source_row_to_expanded_dest_row)  # fmt: skip

    x_in = FakeCupyArray(x)
    assert _interop.as_torch(x_in).data_ptr() == x.data_ptr()  # a view, not a copy
    y = moe_route.expand_rows(x_in, maps)
    assert isinstance(y, FakeCupyArray)
    assert torch.equal(y.tensor, moe_route.expand_rows(x, maps))

    out = moe_route.finalize_moe_routing(y, w, maps, FakeCupyArray(bias))
    assert isinstance(out, FakeCupyArray)
    assert torch.equal(out.tensor, moe_route.finalize_moe_routing(y.tensor, w, maps, bias))
    # One CuPy argument is enough to get CuPy back; all-torch calls stay torch.
    assert isinstance(moe_route.finalize_moe_routing(y.tensor, FakeCupyArray(w), maps),
                      FakeCupyArray)  # fmt: skip
    assert isinstance(moe_route.finalize_moe_routing(y.tensor, w, maps), torch.Tensor)


def test_cupy_array_checks_name_the_argument(fake_cupy):
    maps = moe_route.build_routing_maps(random_topk_ids(4, 2, 3), 3)
    with pytest.raises(TypeError, match=r"x must have dtype in .*got shape \(4, 8\), dtype "
                                        r"torch.int64"):  # fmt: skip
        moe_route.expand_rows(FakeCupyArray(torch.zeros(4, 8, dtype=torch.int64)), maps)


# ----------------------------------------------------------------------------- launcher layout
def test_rows_aligned():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert cupy_expand.rows_aligned(x, 16)
    assert not cupy_expand.rows_aligned(x[:, 1:33], 16)  # starts 2 bytes in
    assert not cupy_expand.rows_aligned(x[:, :12], 16)  # rows of 24 bytes
    assert not cupy_expand.rows_aligned(x.t().contiguous().t(), 16)  # column-major
    assert cupy_expand.rows_aligned(torch.zeros(4, 72, dtype=torch.bfloat16)[:, :64], 16)


def test_finalize_vector_width():
    y = torch.zeros(8, 64, dtype=torch.bfloat16)
    out = torch.zeros(4, 64, dtype=torch.bfloat16)
    width = cupy_finalize._vector_width
    assert width(y, None, out) == 8
    assert width(y.float(), None, out.float()) == 4
    assert width(y.double(), None, out.double()) == 2
    assert width(y, torch.zeros(64, dtype=torch.float32), out) == 8  # 32-byte bias units
    assert width(y, torch.zeros(4, 64), out) == 8
    assert width(y, torch.zeros(65)[1:], out) == 1  # bias rows 4 bytes off
    assert width(y, torch.zeros(4, 64).t().contiguous().t(), out) == 1
    assert width(y[:, :13], None, out[:, :13]) == 1
    assert width(y.t().contiguous().t(), None, out) == 1


def test_routing_maps_warps_fit_shared_memory(monkeypatch):
    tile, one = cupy_maps.TILE_WARPS, cupy_maps.ONE_TILE_WARPS
    assert cupy_maps._warps(264, tile) == 8  # deepseek: E=256, K=8
    assert cupy_maps._warps(264, one) == 32  # one block places 2048 slots
    assert cupy_maps._warps(4008, one) == 2  # 4 * 4008 * 3 bytes fit in 48 KiB
    assert cupy_maps._warps(20008, tile) == 1  # opts in to 160 KB
    cpu = torch.device("cpu")  # the limit only asks the device for its shared memory
    monkeypatch.setattr(cupy_maps._nvrtc, "max_shared_memory", lambda device: 227 * 1024)
    assert cupy_maps.max_num_experts(8, cpu) == 227 * 1024 // 8 - 8 == 29048
    cupy_maps.check_num_experts_supported(29048, 8, cpu)
    with pytest.raises(ValueError, match=r"num_experts=29049 with K=8: .* E <= 29048; use backe"):
        cupy_maps.check_num_experts_supported(29049, 8, cpu)


def test_maps_backend_cache_is_keyed_on_the_token_bucket(h100_limits):
    """T = 8192 and 8193 share a bit length but not a bucket (8192 / 16384 tokens: 65536 /
    131072 slots at K = 8): a cache keyed on the bit length served 8193 the choice of 8192."""
    device = torch.device("cuda", 0)
    assert h100_limits._cached_maps_backend(device, "auto", 8192, 8, 256) == "triton"
    assert h100_limits._cached_maps_backend(device, "auto", 8193, 8, 256) == "cupy"
