"""Train a small mixture-of-experts language model with moe_route.MoELayer.

The model: token + position embeddings → ``--layers`` blocks of
``[RMSNorm → causal self-attention → + residual → RMSNorm → MoELayer → + residual]`` →
RMSNorm → LM head. The task is synthetic and fully learnable: every sequence starts with two
random tokens and continues with ``x[t+1] = (A·x[t] + B·x[t-1]) mod V``, so the model has to
attend to the previous token and the MoE blocks have to learn a ``V × V`` table. The loss is
measured on the predictable positions only; it starts near ``ln V`` and must fall below half
of its initial value, or the script exits with status 1.

    python examples/train_moe_lm.py                          # CPU: reference backend, < 1 min
    python examples/train_moe_lm.py --device cuda            # GPU: Triton kernels, bf16
    python examples/train_moe_lm.py --router sigmoid_grouped --capacity-factor 1.25
    TRITON_INTERPRET=1 python examples/train_moe_lm.py --backend triton --steps 20 --batch 4

On a GPU the model runs in bf16 with float32 master weights for AdamW (bf16 weights would
swallow small updates); the experts run moe_route's Triton kernels forward and backward. On
the CPU the default backend is the pure-PyTorch reference; ``--backend triton`` interprets the
Triton kernels (``TRITON_INTERPRET=1`` must be set before Python starts; very slow).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import moe_route


# ----------------------------------------------------------------------------- data
def make_batch(batch, seq_len, vocab, *, a=3, b=5, generator=None, device="cpu"):
    """``[batch, seq_len]`` int64 sequences: ``x[t+1] = (a x[t] + b x[t-1]) mod vocab``."""
    x = torch.empty(batch, seq_len, dtype=torch.int64)
    x[:, :2] = torch.randint(0, vocab, (batch, 2), generator=generator)
    for t in range(2, seq_len):
        x[:, t] = (a * x[:, t - 1] + b * x[:, t - 2]) % vocab
    return x.to(device)


# ----------------------------------------------------------------------------- model
class CausalSelfAttention(nn.Module):
    def __init__(self, dim, heads, **fk):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False, **fk)
        self.proj = nn.Linear(dim, dim, bias=False, **fk)

    def forward(self, x):
        B, L, D = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, D // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.proj(y.transpose(1, 2).reshape(B, L, D))


class Block(nn.Module):
    def __init__(self, dim, heads, moe_kwargs, **fk):
        super().__init__()
        self.norm1 = nn.RMSNorm(dim, **fk)
        self.attn = CausalSelfAttention(dim, heads, **fk)
        self.norm2 = nn.RMSNorm(dim, **fk)
        self.moe = moe_route.MoELayer(**moe_kwargs, **fk)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        moe = self.moe(self.norm2(x))
        return x + moe.output, moe.aux_loss, moe.tokens_per_expert


class MoELM(nn.Module):
    def __init__(self, vocab, seq_len, dim, layers, heads, moe_kwargs, **fk):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim, **fk)
        self.pos = nn.Embedding(seq_len, dim, **fk)
        self.blocks = nn.ModuleList(Block(dim, heads, moe_kwargs, **fk) for _ in range(layers))
        self.norm = nn.RMSNorm(dim, **fk)
        self.head = nn.Linear(dim, vocab, bias=False, **fk)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos.weight[: tokens.shape[1]]
        aux = torch.zeros((), device=tokens.device)
        loads = []
        for block in self.blocks:
            x, block_aux, load = block(x)
            aux = aux + block_aux
            loads.append(load)
        return self.head(self.norm(x)), aux, loads


def lm_loss(logits, tokens):
    """Cross-entropy of the predictable positions: targets ``x[2:]`` from positions ``1..L-2``."""
    pred = logits[:, 1:-1].float()
    return F.cross_entropy(pred.reshape(-1, pred.shape[-1]), tokens[:, 2:].reshape(-1))


# ----------------------------------------------------------------------------- progress bar
class ProgressBar:
    """One self-overwriting line: ``[#####-----] step/total loss x.xxxx  n.n it/s  eta``."""

    def __init__(self, total, width=30, stream=sys.stdout):
        self.total, self.width, self.stream = total, width, stream
        self.start = time.perf_counter()
        self.interactive = stream.isatty()
        self.last_line = -1.0

    def update(self, step, loss):
        elapsed = time.perf_counter() - self.start
        done = self.width * step // self.total
        bar = "#" * done + "-" * (self.width - done)
        rate = step / elapsed if elapsed > 0 else 0.0
        eta = (self.total - step) / rate if rate > 0 else 0.0
        line = f"[{bar}] {step:>{len(str(self.total))}}/{self.total} loss {loss:.4f}  "
        line += f"{rate:.1f} it/s  eta {eta:.0f}s"
        if self.interactive:
            self.stream.write("\r" + line)
        elif elapsed - self.last_line >= 5.0 or step == self.total:  # logs: a line every 5 s
            self.stream.write(line + "\n")
            self.last_line = elapsed
        self.stream.flush()

    def close(self):
        if self.interactive:
            self.stream.write("\n")
            self.stream.flush()


# ----------------------------------------------------------------------------- training
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="default: cuda if available, else cpu")  # fmt: skip
    p.add_argument("--backend", default=None, choices=["auto", "triton", "cupy", "reference"],
                   help="moe_route backend (default: reference on cpu, auto on cuda)")  # fmt: skip
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on cuda, float32 on cpu")  # fmt: skip
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--vocab", type=int, default=16)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=64)
    p.add_argument("--router", choices=["softmax", "sigmoid_grouped"], default="softmax")
    p.add_argument("--capacity-factor", type=float, default=None)
    p.add_argument("--shared-experts", type=int, default=0)
    p.add_argument("--aux-loss-coef", type=float, default=0.01)
    p.add_argument("--z-loss-coef", type=float, default=1e-3)
    p.add_argument("--bias-update-rate", type=float, default=1e-3,
                   help="expert-bias step of the aux-loss-free sigmoid_grouped router")  # fmt: skip
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads (default 1: the matrices are tiny, more threads mostly "
                   "synchronise; restored on return)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def train(args):
    """Train; returns ``{"initial": loss, "final": loss, "seconds": wall time, ...}``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _train(args)
    finally:
        torch.set_num_threads(threads)


def _train(args):
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    backend = args.backend or ("auto" if device.type == "cuda" else "reference")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    torch.manual_seed(args.seed)
    moe_kwargs = dict(
        hidden_size=args.dim, intermediate_size=args.intermediate, num_experts=args.experts,
        top_k=args.top_k, router=args.router, aux_loss_coef=args.aux_loss_coef,
        z_loss_coef=args.z_loss_coef, capacity_factor=args.capacity_factor,
        num_shared_experts=args.shared_experts, backend=backend,
    )  # fmt: skip
    if args.router == "sigmoid_grouped":
        moe_kwargs.update(aux_loss_coef=0.0, n_group=min(4, args.experts), topk_group=None)
    model = MoELM(args.vocab, args.seq_len, args.dim, args.layers, args.heads, moe_kwargs,
                  device=device, dtype=dtype)  # fmt: skip
    params = [p for p in model.parameters() if p.requires_grad]
    # float32 master weights when the model is in a low precision dtype
    master = [p.detach().float().clone() for p in params] if dtype != torch.float32 else params
    opt = torch.optim.AdamW(master, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / args.steps))
    )
    forward = torch.compile(model) if args.compile else model

    gen = torch.Generator().manual_seed(args.seed + 1)
    eval_tokens = make_batch(4 * args.batch, args.seq_len, args.vocab, generator=gen, device=device)

    @torch.no_grad()
    def evaluate():
        return lm_loss(forward(eval_tokens)[0], eval_tokens).item()

    initial = evaluate()
    sync_every = max(1, args.steps // 50)  # read the loss (a host sync) only now and then
    bar = None if args.quiet else ProgressBar(args.steps)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        tokens = make_batch(args.batch, args.seq_len, args.vocab, generator=gen, device=device)
        logits, aux, loads = forward(tokens)
        loss = lm_loss(logits, tokens)
        (loss + aux).backward()
        if master is not params:
            for m, p in zip(master, params, strict=True):
                m.grad = p.grad.float()
                p.grad = None
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            if master is not params:
                for m, p in zip(master, params, strict=True):
                    p.copy_(m)
            if args.router == "sigmoid_grouped":
                for block, load in zip(model.blocks, loads, strict=True):
                    block.moe.update_expert_bias(load, args.bias_update_rate)
        if bar is not None and (step % sync_every == 0 or step == args.steps):
            bar.update(step, loss.item())
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - start
    return {"initial": initial, "final": evaluate(), "seconds": seconds, "device": str(device),
            "backend": backend, "dtype": str(dtype).replace("torch.", "")}  # fmt: skip


def main(argv=None) -> int:
    """Run :func:`train`, print the losses; 0 if the loss fell below half its initial value."""
    args = parse_args(argv)
    r = train(args)
    print(f"device {r['device']}, moe_route backend {r['backend']}, {r['dtype']}, "
          f"{args.steps} steps in {r['seconds']:.1f} s")  # fmt: skip
    print(f"initial loss {r['initial']:.4f} (ln V = {math.log(args.vocab):.4f})")
    print(f"final loss   {r['final']:.4f}")
    if r["final"] <= r["initial"] / 2:
        print("ok: the loss fell by more than half")
        return 0
    print(f"FAILED: the loss did not fall below half of {r['initial']:.4f}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
