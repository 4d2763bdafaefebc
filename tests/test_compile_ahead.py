"""The compile-ahead pass's machinery on any machine (its GPU run: test_gpu_compile_ahead.py):
the executor that runs each compile in a forked child and then in the parent, and the pass's
tolerance of failures, which it leaves to the real call."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from moe_route import experts
from moe_route.kernels import triton as kt

needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


@needs_fork
def test_forked_compiles_run_in_a_child_then_here(tmp_path):
    marks = tmp_path / "pids"

    def compile_once(value):
        with open(marks, "a") as f:
            f.write(f"{os.getpid()}\n")
        return value * 2

    futures = [kt._ForkedCompiles().submit(compile_once, v) for v in (1, 2, 3)]
    assert [f.result(timeout=60) for f in futures] == [2, 4, 6]
    pids = [int(p) for p in marks.read_text().split()]
    assert pids.count(os.getpid()) == 3  # the parent's run of each (a cache hit on a GPU)
    assert len(set(pids) - {os.getpid()}) == 3  # one child each


@needs_fork
def test_a_failing_compile_fails_in_the_parent_too():
    def broken():
        raise RuntimeError("no such kernel")

    future = kt._ForkedCompiles().submit(broken)
    with pytest.raises(RuntimeError, match="no such kernel"):
        future.result(timeout=60)


def test_compiling_ahead_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(kt.COMPILE_AHEAD_ENV, "0")
    assert kt.compiling_ahead() is None


def test_the_pass_leaves_failures_to_the_real_call(monkeypatch):
    ran = []

    def call(x):
        ran.append(x)
        raise ValueError("a bug in the pass")

    monkeypatch.setattr(experts, "INTERPRETING", False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(experts, "compiling_ahead", contextlib.nullcontext)
    experts.compile_ahead(call, 7)  # does not raise
    assert ran == [7]
