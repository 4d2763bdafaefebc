"""tests/interpreter_patch.py changes how fast the interpreter runs, not what it checks: the
integer-overflow check it skips is one the interpreter's ``device_assert`` drops unread, so an
overflowing int32 product runs through (wrapped) with the interpreter's own check as with the
patch; with the options' ``debug`` on, both report it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from moe_cases import needs_interpreter


@triton.jit
def _int32_product_kernel(a_ptr, b_ptr, out_ptr):
    offs = tl.arange(0, 4)
    tl.store(out_ptr + offs, tl.load(a_ptr + offs) * tl.load(b_ptr + offs))


def _run():
    a = torch.tensor([3, 1 << 20, -(1 << 20), 7], dtype=torch.int32)
    b = torch.tensor([5, 4099, 4099, -2], dtype=torch.int32)  # two products overflow
    out = torch.zeros(4, dtype=torch.int32)
    _int32_product_kernel[(1,)](a, b, out)
    return out


@needs_interpreter
@pytest.mark.parametrize("check", ["patched", "interpreter's own"])
@pytest.mark.parametrize("debug", [False, True], ids=["default options", "debug"])
def test_overflow_check_skipped_only_where_it_went_unread(monkeypatch, check, debug):
    from triton.language.semantic import TritonSemantic
    from triton.runtime import interpreter

    sanitize = TritonSemantic.binary_op_sanitize_overflow_impl
    assert getattr(sanitize, "_moe_route_unread", False), "conftest applied no patch"
    if check == "interpreter's own":
        monkeypatch.setattr(TritonSemantic, "binary_op_sanitize_overflow_impl",
                            sanitize._moe_route_real)  # fmt: skip
        assert not getattr(TritonSemantic.binary_op_sanitize_overflow_impl, "_moe_route_unread",
                           False)  # fmt: skip
    builder = interpreter.interpreter_builder
    assert builder.options.debug is False  # what the interpreter runs with
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, debug=debug))
    if debug:
        with pytest.raises(Exception, match="int32 overflow detected for operation mul"):
            _run()
    else:
        exact = torch.tensor([3, 1 << 20, -(1 << 20), 7]) * torch.tensor([5, 4099, 4099, -2])
        assert exact.abs().max() > 2**31  # the int64 products, two beyond int32
        assert torch.equal(_run(), exact.to(torch.int32))  # wrapped to 32 bits, as on a GPU
