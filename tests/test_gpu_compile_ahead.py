"""A call signature's first run on a GPU compiles its kernels ahead, side by side in forked
child processes (``moe_route.kernels.triton.compiling_ahead``): in a fresh process on an empty
Triton cache, the forward and backward give the same bits as when each kernel compiles at its
first launch, and the children did the compiling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# fused_moe forward + backward at odd sizes (dropped slots included), the output and every
# gradient hashed; the compiles handed to child processes counted.
SCRIPT = r"""
import hashlib, json, torch, moe_route
from moe_route.kernels import triton as kt

forked = []
real_submit = kt._ForkedCompiles.submit
def submit(self, fn, *args, **kwargs):
    forked.append(1)
    return real_submit(self, fn, *args, **kwargs)
kt._ForkedCompiles.submit = submit

g = torch.Generator(device="cuda").manual_seed(0)
T, H, I, E, K = 301, 264, 200, 16, 4
dt = torch.bfloat16
x = torch.randn(T, H, device="cuda", dtype=dt, generator=g).requires_grad_()
w1 = (torch.randn(E, 2 * I, H, device="cuda", dtype=dt, generator=g) * 0.05).requires_grad_()
w2 = (torch.randn(E, H, I, device="cuda", dtype=dt, generator=g) * 0.05).requires_grad_()
weights, ids = moe_route.softmax_topk(torch.randn(T, E, device="cuda", generator=g), K)
ids[::7, 1] = -1
out = moe_route.fused_moe(x, w1, w2, weights, ids)
out.float().square().sum().backward()
digest = hashlib.sha256()
for t in (out, x.grad, w1.grad, w2.grad):
    digest.update(t.detach().contiguous().view(torch.int16).cpu().numpy().tobytes())
print(json.dumps({"hash": digest.hexdigest(), "forked": len(forked)}))
"""


def _fresh_process(ahead: bool) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache,
                   MOE_ROUTE_COMPILE_AHEAD="1" if ahead else "0")  # fmt: skip
        done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                              text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_compile_ahead_gives_the_same_bits():
    ahead, serial = _fresh_process(True), _fresh_process(False)
    assert serial["forked"] == 0
    # the forward's maps, two GEMMs and finalize at least; the backward's kernels
    assert ahead["forked"] >= 6, ahead
    assert ahead["hash"] == serial["hash"]
