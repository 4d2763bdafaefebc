"""The floor of fused_moe's call memo (GPU): fused_moe at T=1 (decode path) as it is, against
a hand-written path that does only what a memo hit must do per call (the signature of the
inputs, one dict lookup, the mode checks, two allocations, two packed C launches), next to one
``index_select``. Host µs per call in bursts of 8 calls (synchronised between bursts).

    PYTHONPATH=. python scripts/memo_probe.py
"""

import torch
from backward_host import burst  # scripts/, the running script's folder

import moe_route
from moe_route import reference as R
from moe_route._dispatch import tensor_key
from moe_route.kernels.triton import decode as decode_mod

H, INTER, E, K = 2048, 768, 128, 8


def main():
    torch.set_grad_enabled(False)
    w1 = torch.randn(E, 2 * INTER, H, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, H, INTER, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    tw, ids = R.topk_routing_reference(torch.randn(1, E, device="cuda"), K, renormalize=True)
    ref = moe_route.fused_moe(x, w1, w2, tw, ids)
    up, down = decode_mod._UP, decode_mod._DOWN
    ((_, (upack, uvars)),) = up._entries.items()
    ((_, (dpack, dvars)),) = down._entries.items()
    seen = {}
    for name, kernel in (("u", up), ("d", down)):
        real = kernel.launch

        def spy(key, grid, args, cx, name=name, real=real):
            seen[name] = (grid, args)
            return real(key, grid, args, cx)

        kernel.launch = spy
    moe_route.fused_moe(x, w1, w2, tw, ids)
    del up.launch, down.launch
    ugrid, uargs = seen["u"]
    dgrid, dargs = seen["d"]
    dev = torch.cuda.current_device()
    memo = {}
    stream_of = torch._C._cuda_getCurrentRawStream
    capturing = torch._C._cuda_isCurrentStreamCapturing

    def sig(x, w1, w2, tw, ids, activation="swiglu", backend="auto"):
        return (
            tensor_key(x),
            tensor_key(w1),
            tensor_key(w2),
            tensor_key(tw),
            tensor_key(ids),
            None,
            None,
            None,
            activation,
            "concat",
            "auto",
            True,
            None,
            False,
            backend,
            torch.is_grad_enabled(),
        )

    def memo_floor(x, w1, w2, tw, ids):
        s = sig(x, w1, w2, tw, ids)
        call = memo.get(s)
        if call is None:
            call = memo[s] = True
        if torch.compiler.is_compiling() or capturing():
            raise RuntimeError
        T = x.shape[0]
        h = x.new_empty(T * K, INTER)
        out = x.new_empty(T, H)
        a = list(uargs)
        a[0], a[1], a[3], a[4] = x, w1, ids, h
        packed, al = upack(tuple(a))
        stream = stream_of(dev)
        uvars[(dev, al)](ugrid[0], ugrid[1], 1, stream, packed)
        b = list(dargs)
        b[0], b[1], b[3], b[4], b[6] = h, w2, ids, tw, out
        packed, al = dpack(tuple(b))
        dvars[(dev, al)](dgrid[0], dgrid[1], 1, stream, packed)
        return out

    got = memo_floor(x, w1, w2, tw, ids)
    torch.cuda.synchronize()
    print("memo floor output equal:", torch.equal(got, ref))
    idx = torch.zeros(8, device="cuda", dtype=torch.long)
    for r in range(3):
        rows = {
            "index_select": burst(lambda: torch.index_select(x, 0, idx), loops=250),
            "fused_moe T=1": burst(lambda: moe_route.fused_moe(x, w1, w2, tw, ids), loops=250),
            "memo floor": burst(lambda: memo_floor(x, w1, w2, tw, ids), loops=250),
            "signature only": burst(lambda: sig(x, w1, w2, tw, ids), loops=250),
        }
        print(f"round {r}: " + ", ".join(f"{k} {v:.1f} us" for k, v in rows.items()))


if __name__ == "__main__":
    main()
