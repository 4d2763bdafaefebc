"""The thin launch (moe_route.kernels.triton.ThinKernel) on stand-ins for Triton's objects: the
first launch of a key goes through Triton and is remembered, later ones call the compiled
kernel's C launcher with the tensors' addresses, a new alignment or a profiler hook goes back
through Triton. On a GPU, every thin launch of the GPU tests is also checked against Triton's
own choice of variant (``MOE_ROUTE_CHECK_LAUNCHES``, set in conftest.py)."""

from __future__ import annotations

import pytest
import torch

from moe_route.kernels import triton as kt


class FakeLauncher:
    """What ``compiled.run`` is (a ``CudaLauncher``): the C ``launch`` and its attributes."""

    def __init__(self, scratch=0):
        self.global_scratch_size = scratch
        self.profile_scratch_size = 0
        self.launch_cooperative_grid = False
        self.launch_pdl = False
        self.c_calls, self.py_calls = [], []
        self.launch = lambda *a: self.c_calls.append(a)

    def __call__(self, *a):
        self.py_calls.append(a)


class FakeCompiled:
    def __init__(self, scratch=0):
        self.run = FakeLauncher(scratch)
        self.function, self.packed_metadata = 1234, ("meta",)


class FakeJit:
    """A ``@triton.jit`` function: ``fn[grid](*args, **constexprs)`` launches and returns the
    compiled kernel (one per call here, so a test sees which launch compiled)."""

    def __init__(self, scratch=0):
        self.params = [type("P", (), {"name": n, "is_constexpr": c})()
                       for n, c in (("x", False), ("n", False), ("BLOCK", True))]  # fmt: skip
        self.triton_launches, self.compiled, self.scratch = [], [], scratch

    def __getitem__(self, grid):
        def launch(*args, **cx):
            self.triton_launches.append((grid, args, cx))
            self.compiled.append(FakeCompiled(self.scratch))
            return self.compiled[-1]

        return launch


@pytest.fixture
def thin(monkeypatch):
    monkeypatch.setattr(kt, "INTERPRETING", False)
    monkeypatch.setattr(kt, "CHECK_LAUNCHES", False)
    monkeypatch.setattr(kt, "_current_device", lambda: 0)
    monkeypatch.setattr(kt, "_current_stream", lambda device: 77)
    fn = FakeJit()
    kernel = kt.ThinKernel(fn)
    yield fn, kernel
    kt.KERNELS.remove(kernel)


def test_packer_replaces_tensors_by_addresses_and_reports_their_alignment():
    t = torch.zeros(64, dtype=torch.float16)
    odd = t[1:]  # 2 bytes past an aligned address
    pack = kt._packer((t, 5, odd, None, 2.5))
    args, alignment = pack((t, 5, odd, None, 2.5))
    assert args == (t.data_ptr(), 5, odd.data_ptr(), None, 2.5)
    assert alignment == (t.data_ptr() % 16, odd.data_ptr() % 16)
    assert alignment[1] == (alignment[0] + 2) % 16


def test_second_launch_calls_the_c_launcher_with_addresses(thin):
    fn, kernel = thin
    x = torch.zeros(32)
    cx = {"BLOCK": 16, "num_warps": 4}
    kernel.launch(("key",), (3,), (x, 7), lambda: dict(cx))
    assert len(fn.triton_launches) == 1 and fn.triton_launches[0][2] == cx
    compiled = fn.compiled[0]
    kernel.launch(("key",), (3,), (x, 8), lambda: pytest.fail("constexprs built again"))
    assert len(fn.triton_launches) == 1  # no second Triton launch
    (call,) = compiled.run.c_calls
    # grid, stream, function, cooperative, pdl, two scratch buffers, metadata, launch
    # metadata, two hooks, then the arguments with the address, then the constexpr values
    assert call == (3, 1, 1, 77, 1234, False, False, None, None, ("meta",), None, None, None,
                    x.data_ptr(), 8, 16)  # fmt: skip
    assert kt.launch_keys() >= 1


def test_new_alignment_or_key_goes_through_triton_again(thin):
    fn, kernel = thin
    base = torch.zeros(64, dtype=torch.float16)
    aligned = base[8:]  # 16 bytes in
    shifted = base[1:]
    constexprs = lambda: {"BLOCK": 16}
    kernel.launch(("k",), (1,), (aligned, 1), constexprs)
    kernel.launch(("k",), (1,), (shifted, 1), constexprs)  # another alignment: Triton's path
    kernel.launch(("other",), (1,), (aligned, 1), constexprs)  # another key
    assert len(fn.triton_launches) == 3
    kernel.launch(("k",), (1,), (shifted, 1), constexprs)  # remembered now
    kernel.launch(("k",), (1,), (aligned, 1), constexprs)
    assert len(fn.triton_launches) == 3
    assert len(fn.compiled[1].run.c_calls) == 1 and len(fn.compiled[0].run.c_calls) == 1


def test_scratch_memory_or_profiler_hooks_take_the_wrappers(thin, monkeypatch):
    _, kernel = thin
    fn = FakeJit(scratch=128)  # needs scratch: Triton's Python wrapper allocates it
    kernel.fn = fn
    x = torch.zeros(4)
    kernel.launch(("s",), (2,), (x, 3), lambda: {"BLOCK": 8})
    kernel.launch(("s",), (2,), (x, 3), lambda: {"BLOCK": 8})
    run = fn.compiled[0].run
    assert not run.c_calls and len(run.py_calls) == 1
    assert run.py_calls[0][:9] == (2, 1, 1, 77, 1234, ("meta",), None, None, None)
    monkeypatch.setattr(kt, "_hooks_set", lambda: True)  # a profiler hooks launches
    kernel.launch(("s",), (2,), (x, 3), lambda: {"BLOCK": 8})
    assert len(fn.triton_launches) == 2


class FakeDescJit(FakeJit):
    """A kernel ``(x, desc, n, BLOCK)`` whose compiled variants launch through Triton's own
    descriptor wrapper (``wrap_handle_tensordesc``) around a recording C launcher."""

    def __init__(self):
        super().__init__()
        self.params.insert(1, type("P", (), {"name": "desc", "is_constexpr": False})())
        self.meta = {"swizzle": 3, "elem_size": 2, "elem_type": 1, "block_size": [8, 16],
                     "fp4_padded": False}  # fmt: skip

    def __getitem__(self, grid):
        from triton.backends.nvidia.driver import wrap_handle_tensordesc

        def launch(*args, **cx):
            self.triton_launches.append((grid, args, cx))
            compiled = FakeCompiled()
            signature = {0: "*fp16", 1: "tensordesc<fp16[8, 16]>", 2: "i32", 3: "constexpr"}
            compiled.run.launch = wrap_handle_tensordesc(compiled.run.launch, signature,
                                                         [self.meta])  # fmt: skip
            self.compiled.append(compiled)
            return compiled

        return launch


@pytest.fixture
def encodings(monkeypatch):
    """Triton's descriptor encoding replaced by a recording stand-in (the real one asks the
    driver for a CUtensorMap)."""
    import triton.backends.nvidia.driver as driver

    calls = []

    def encode(desc, meta):
        calls.append(desc.base.data_ptr())
        return [("tensormap", desc.base.data_ptr(), meta["swizzle"]), *desc.shape, *desc.strides]

    monkeypatch.setattr(driver, "make_tensordesc_arg", encode)
    return calls


def test_descriptors_go_to_triton_as_tensor_descriptors_then_encoded_once(thin, encodings):
    """A :class:`Descriptor` reaches Triton's launch as Triton's ``TensorDescriptor``; later
    thin launches hand the C launcher what Triton's wrapper would, from an encoding made once
    per (address, shape, strides)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from moe_route.kernels.triton.tma import Descriptor, descriptor

    fn, kernel = thin
    kernel.fn = fn = FakeDescJit()
    x, w = torch.zeros(32, dtype=torch.float16), torch.zeros(64, 32, dtype=torch.float16)
    cx = lambda: {"BLOCK": 16}
    kernel.launch(("d",), (2,), (x, descriptor(w, (8, 16)), 5), cx)
    seen = fn.triton_launches[0][1][1]
    assert type(seen) is TensorDescriptor
    assert (list(seen.shape), list(seen.strides), list(seen.block_shape)) == (
        [64, 32], [32, 1], [8, 16],
    )  # fmt: skip
    compiled = fn.compiled[0]
    assert kernel.variant(("d",), 0, (x.data_ptr() % 16,)).expands_descriptors
    for n in (6, 7):
        kernel.launch(("d",), (2,), (x, descriptor(w, (8, 16)), n), cx)
    assert len(fn.triton_launches) == 1 and encodings == [w.data_ptr()]
    # what Triton's own wrapper hands the C launcher for the same call
    from triton.backends.nvidia.driver import wrap_handle_tensordesc

    got = []
    signature = {0: "*fp16", 1: "tensordesc<fp16[8, 16]>", 2: "i32", 3: "constexpr"}
    inner = wrap_handle_tensordesc(lambda *a: got.append(a), signature, [fn.meta])
    base = compiled.run.c_calls[-1][:13]
    inner(*base, x.data_ptr(), descriptor(w, (8, 16)), 7, 16)
    assert compiled.run.c_calls[-1] == got[0]
    assert got[0][13:] == (x.data_ptr(), ("tensormap", w.data_ptr(), 3), 64, 32, 32, 1, 7, 16)
    encodings.clear()
    # another tensor (address), or the same seen with other strides: encoded anew
    w2 = torch.zeros(64, 32, dtype=torch.float16)
    kernel.launch(("d",), (2,), (x, descriptor(w2, (8, 16)), 8), cx)
    kernel.launch(("d",), (2,), (x, Descriptor(w, (32, 32), (32, 1), (8, 16)), 9), cx)
    assert encodings == [w2.data_ptr(), w.data_ptr()]
    # Triton's own TensorDescriptor (lists inside) takes the same cache
    kernel.launch(("d",), (2,), (x, TensorDescriptor.from_tensor(w2, [8, 16]), 10), cx)
    assert encodings == [w2.data_ptr(), w.data_ptr()]
    assert len(fn.triton_launches) == 1


def test_launch_key_parts_hash_once_and_compare_by_fields():
    """The configs and epilogues in launch keys keep their hash (computed at first use) and
    still compare, hash and pickle by their fields: equal configs hash alike, a replaced
    field gives another key, and a copy from another process would hash the same."""
    import dataclasses
    import pickle

    from moe_route.kernels.triton.act_backward import RowPassConfig
    from moe_route.kernels.triton.decode import DecodeConfig
    from moe_route.kernels.triton.gemm_mainloop import GemmConfig, GemmEpilogue
    from moe_route.kernels.triton.weight_grad import WeightGradConfig

    made = [
        lambda: GemmConfig(128, 256, 64, 8, 8, 3, True, persistent=1, tma_store=True),
        lambda: GemmEpilogue(act=1, gated=True, alpha=1.702, limit=7.0, up_offset=1.0),
        lambda: WeightGradConfig(64, 128, 256, 8, 3, True, 1, flat=True),
        lambda: RowPassConfig(),
        lambda: DecodeConfig(up_n=64, up_k=256, down_n=32, down_k=256, num_warps=4, num_stages=3),
    ]
    for make in made:
        a, b = make(), make()
        fields = tuple(getattr(a, f.name) for f in dataclasses.fields(a))
        assert a == b and a is not b
        assert hash(a) == hash(b) == hash(fields)
        assert hash(a) == hash(a)  # the kept value
        first = dataclasses.fields(a)[0]
        other = dataclasses.replace(a, **{first.name: getattr(a, first.name) + 1})
        assert other != a and hash(other) != hash(a)
        copy = pickle.loads(pickle.dumps(a))
        assert copy == a and hash(copy) == hash(a)
        assert {a: 1}[b] == 1
        assert "_hash" not in repr(a)
        with pytest.raises(dataclasses.FrozenInstanceError):
            a.__setattr__(first.name, 0)
