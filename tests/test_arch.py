"""Run-time choice of backend and finalize path: per device, lazy, with env overrides.

Environment variables are read on every call, so ``monkeypatch`` changes the answer at once.
``MOE_ROUTE_ARCH`` answers ``compute_capability`` for CUDA devices without touching CUDA, which
lets the SM-dependent branches run on a CPU-only machine.
"""

import pytest
import torch

import moe_route
from moe_route import arch


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def no_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


# ----------------------------------------------------------------------------- backend
@pytest.mark.parametrize("value,enabled", [("1", True), ("true", True), ("0", False), ("", False)])
def test_triton_interpreter_enabled(monkeypatch, value, enabled):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert arch.triton_interpreter_enabled() is enabled


def test_cpu_without_interpreter_is_torch(no_interpreter):
    choice = arch.backend_for("cpu")
    assert choice.value == "torch"
    assert "without TRITON_INTERPRET=1" in choice.why


def test_cpu_without_interpreter_env_unset(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert arch.backend_for(torch.device("cpu")).value == "torch"


def test_cpu_with_interpreter_is_triton(interpreter):
    choice = arch.backend_for(torch.device("cpu"))
    assert choice.value == "triton"
    assert "interpreter" in choice.why


def test_explicit_triton_on_cpu_needs_interpreter(no_interpreter):
    with pytest.raises(ValueError, match=r"backend='triton' but the tensors are on cpu"):
        arch.backend_for("cpu", "triton")


def test_explicit_torch_everywhere(interpreter):
    for device in ("cpu", "cuda:0", "meta"):
        choice = arch.backend_for(device, "torch")
        assert (choice.value, choice.why) == ("torch", "backend='torch'")


def test_reference_is_an_alias_of_torch(interpreter):
    """``"reference"``, the torch backend's former name, is still accepted everywhere."""
    assert arch.check_backend_name("reference") == "reference"
    for device in ("cpu", "cuda:0", "meta"):
        choice = arch.backend_for(device, "reference")
        assert (choice.value, choice.why) == ("torch", "backend='reference'")
    assert arch.cached_backend(torch.device("cpu"), "reference") == "torch"
    # And through a public function: the same computation, the same bits.
    g = torch.Generator().manual_seed(0)
    x, w1, w2 = (torch.randn(*s, generator=g) for s in ((5, 8), (3, 12, 8), (3, 8, 6)))
    ids = torch.tensor([[0, 2], [1, -1], [2, 1], [0, 1], [-1, -1]])
    tw = torch.rand(5, 2, generator=g)
    outs = [moe_route.fused_moe(x, w1, w2, tw, ids, backend=b) for b in ("reference", "torch")]
    assert torch.equal(outs[0], outs[1])


def test_cuda_is_triton_without_touching_cuda():
    # No CUDA call is made for this answer, so it holds on a CPU-only machine too.
    choice = arch.backend_for("cuda:0")
    assert (choice.value, choice.why) == ("triton", "CUDA device")


@pytest.mark.parametrize("value", ["torch", " Torch ", "TORCH", "reference", " Reference "])
def test_env_backend_torch(monkeypatch, interpreter, value):
    monkeypatch.setenv("MOE_ROUTE_BACKEND", value)
    for device in ("cpu", "cuda"):
        choice = arch.backend_for(device)
        assert choice.value == "torch"
        assert choice.why == "MOE_ROUTE_BACKEND=torch"


@pytest.mark.parametrize("value", ["auto", "", "  "])
def test_env_backend_auto(monkeypatch, interpreter, value):
    monkeypatch.setenv("MOE_ROUTE_BACKEND", value)
    assert arch.backend_for("cpu").value == "triton"


def test_env_backend_triton_on_cpu_needs_interpreter(monkeypatch, no_interpreter):
    monkeypatch.setenv("MOE_ROUTE_BACKEND", "triton")
    with pytest.raises(ValueError, match=r"MOE_ROUTE_BACKEND=triton but the tensors are on cpu"):
        arch.backend_for("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert arch.backend_for("cpu").value == "triton"


def test_env_backend_only_overrides_auto(monkeypatch, interpreter):
    monkeypatch.setenv("MOE_ROUTE_BACKEND", "torch")
    assert arch.backend_for("cpu", "triton").value == "triton"
    monkeypatch.setenv("MOE_ROUTE_BACKEND", "triton")
    assert arch.backend_for("cpu", "torch").value == "torch"
    assert arch.backend_for("cpu", "reference").value == "torch"


@pytest.mark.parametrize("value", ["cuda", "triton,reference", "1"])
def test_env_backend_invalid(monkeypatch, value):
    monkeypatch.setenv("MOE_ROUTE_BACKEND", value)
    with pytest.raises(ValueError, match=rf"environment variable MOE_ROUTE_BACKEND={value!r}"):
        arch.backend_for("cpu")


@pytest.mark.parametrize("requested", ["cuda", "Triton", "", None])
def test_backend_argument_invalid(requested):
    with pytest.raises(ValueError, match=rf"backend={requested!r}: expected 'auto' or one of"):
        arch.backend_for("cpu", requested)


def test_backend_invalid_argument_wins_over_env(monkeypatch):
    monkeypatch.setenv("MOE_ROUTE_BACKEND", "reference")
    with pytest.raises(ValueError, match=r"backend='gpu'"):
        arch.backend_for("cpu", "gpu")


# ----------------------------------------------------------------------------- capability
def test_compute_capability_cpu_is_none_even_when_forced(monkeypatch):
    monkeypatch.setenv("MOE_ROUTE_ARCH", "90")
    assert arch.compute_capability("cpu") is None
    assert arch.compute_capability(torch.device("meta")) is None


@pytest.mark.parametrize("forced,expected", [("80", 80), ("90", 90), ("100", 100)])
def test_compute_capability_forced(monkeypatch, forced, expected):
    monkeypatch.setenv("MOE_ROUTE_ARCH", forced)
    assert arch.compute_capability("cuda:0") == expected
    assert arch.compute_capability(torch.device("cuda", 3)) == expected  # per device, no query


# ----------------------------------------------------------------------------- finalize path
# Both "standalone" and "fused" (the ordered epilogue) are deterministic; "auto" takes the fused
# epilogue on SM90+ only where it measured faster (arch.FUSED_FINALIZE_WINS), whatever
# `deterministic` says; float atomics ("fused_atomic") only for an explicit "fused" with
# deterministic=False.
def test_finalize_cpu_standalone():
    choice = arch.finalize_path_for("cpu")
    assert (choice.value, choice.why) == (
        "standalone",
        "cpu is below SM90: standalone finalize kernel",
    )
    assert arch.finalize_path_for("cpu", deterministic=False).value == "standalone"


@pytest.mark.parametrize(
    "device,cc",
    [("cuda:0", "89"), ("cuda:0", "80"), ("cpu", "90")],  # MOE_ROUTE_ARCH: CUDA devices only
)
@pytest.mark.parametrize("fused_wins", [True, False])
@pytest.mark.parametrize("deterministic", [True, False])
def test_finalize_auto_below_sm90(monkeypatch, device, cc, fused_wins, deterministic):
    monkeypatch.setattr(arch, "FUSED_FINALIZE_WINS", fused_wins)
    monkeypatch.setenv("MOE_ROUTE_ARCH", cc)
    choice = arch.finalize_path_for(device, deterministic=deterministic)
    assert choice.value == "standalone" and "below SM90" in choice.why, choice


@pytest.mark.parametrize("cc", ["90", "100"])
@pytest.mark.parametrize("deterministic", [True, False])
def test_finalize_auto_sm90(monkeypatch, cc, deterministic):
    # The ordered fused epilogue where it measured faster; never the atomic one.
    monkeypatch.setenv("MOE_ROUTE_ARCH", cc)
    monkeypatch.setattr(arch, "FUSED_FINALIZE_WINS", True)
    choice = arch.finalize_path_for("cuda:0", deterministic=deterministic)
    assert choice.value == "fused" and "ordered" in choice.why, choice
    monkeypatch.setattr(arch, "FUSED_FINALIZE_WINS", False)
    choice = arch.finalize_path_for("cuda:0", deterministic=deterministic)
    assert choice.value == "standalone" and "slower" in choice.why, choice


def test_finalize_explicit_standalone(monkeypatch):
    monkeypatch.setenv("MOE_ROUTE_ARCH", "90")
    for device in ("cpu", "cuda:0"):
        for det in (True, False):
            choice = arch.finalize_path_for(device, "standalone", deterministic=det)
            assert (choice.value, choice.why) == ("standalone", "finalize='standalone'")


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_finalize_explicit_fused(monkeypatch, device):
    # On request it is taken on any device (no SM check for an explicit ask): ordered when
    # deterministic, atomic only when the caller gives determinism up.
    monkeypatch.setenv("MOE_ROUTE_ARCH", "80")
    choice = arch.finalize_path_for(device, "fused")
    assert choice.value == "fused" and "deterministic" in choice.why, choice
    choice = arch.finalize_path_for(device, "fused", deterministic=False)
    assert choice.value == "fused_atomic" and "atomics" in choice.why, choice
    monkeypatch.setenv("MOE_ROUTE_FINALIZE", "fused")
    assert arch.finalize_path_for(device).value == "fused"
    choice = arch.finalize_path_for(device, "standalone", deterministic=False)
    assert choice.value == "fused_atomic" and "MOE_ROUTE_FINALIZE=fused" in choice.why


def test_finalize_env_overrides_request(monkeypatch):
    monkeypatch.setenv("MOE_ROUTE_FINALIZE", "standalone")
    choice = arch.finalize_path_for("cpu", "fused")
    assert (choice.value, choice.why) == ("standalone", "MOE_ROUTE_FINALIZE=standalone")
    monkeypatch.setenv("MOE_ROUTE_FINALIZE", "auto")
    monkeypatch.setenv("MOE_ROUTE_ARCH", "90")
    monkeypatch.setattr(arch, "FUSED_FINALIZE_WINS", True)
    assert arch.finalize_path_for("cuda:0", deterministic=False).value == "fused"


@pytest.mark.parametrize("value", ["epilogue", "yes", "standalone,fused"])
def test_finalize_env_invalid(monkeypatch, value):
    monkeypatch.setenv("MOE_ROUTE_FINALIZE", value)
    with pytest.raises(ValueError, match=rf"environment variable MOE_ROUTE_FINALIZE={value!r}"):
        arch.finalize_path_for("cpu")


@pytest.mark.parametrize("requested", ["epilogue", "Fused", ""])
def test_finalize_argument_invalid(requested):
    with pytest.raises(ValueError, match=rf"finalize={requested!r}: expected 'auto', 'fused'"):
        arch.finalize_path_for("cpu", requested)


# ----------------------------------------------------------------------------- describe
def test_describe_cpu(interpreter):
    info = arch.describe("cpu")
    assert info["device"] == "cpu (cpu)"
    assert info["compute capability"] == "-"
    assert info["backend"].startswith("triton  [") and "TRITON_INTERPRET=1" in info["backend"]
    assert info["finalize path"].startswith("standalone  [cpu is below SM90")
    assert all(isinstance(v, str) for v in info.values())


def test_describe_follows_env(monkeypatch, no_interpreter):
    assert arch.describe("cpu")["backend"].startswith("torch  [")
    monkeypatch.setenv("MOE_ROUTE_BACKEND", "torch")
    assert arch.describe("cpu")["backend"] == "torch  [MOE_ROUTE_BACKEND=torch]"
    monkeypatch.setenv("MOE_ROUTE_FINALIZE", "bogus")
    with pytest.raises(ValueError, match="MOE_ROUTE_FINALIZE='bogus'"):
        arch.describe("cpu")
