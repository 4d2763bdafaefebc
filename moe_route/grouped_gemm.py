"""Grouped GEMM entry points: GEMM1 (with fused activation) and GEMM2 over permuted rows."""

from __future__ import annotations

import torch

from . import _checks, arch, tuning
from ._checks import check_gemm_args, check_interpreter_dtype
from ._dispatch import CallMemo, Op, memo_env, memo_wanted, needs_dispatcher, rows_key, tensor_key
from .activations import Activation, as_activation
from .kernels import torch_impl
from .kernels.triton.grouped_gemm import GemmLaunch, grouped_gemm_triton
from .kernels.triton.moe import grouped_gemm_backward_triton
from .maps import RoutingMaps, check_maps
from .plan import epilogue_for
from .tuning import token_bucket


def _configs(a_like: torch.Tensor, w: torch.Tensor, M: int, gated: bool):
    n_out = w.shape[1] // 2 if gated else w.shape[1]
    bucket = tuning.token_bucket(M)
    return tuning.gemm_configs(a_like.device, a_like.dtype, w.shape[0], bucket, gated, n_out,
                        w.shape[2], arch.env_key())  # fmt: skip


def gemm_tables(
    a: torch.Tensor,
    w: torch.Tensor,
    src_to_dest: torch.Tensor,
    dest_to_src: torch.Tensor,
    expert_for_src: torch.Tensor,
    offsets: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    gate_up_layout: str,
    gather: bool,
    allow_tf32: bool,
    backend: str,
) -> torch.Tensor:
    """``out [T*K, N_out]`` on a resolved ``backend``."""
    if backend == "torch":
        return torch_impl.grouped_gemm_torch(
            a, w, offsets, bias, activation, gate_up_layout, dest_to_src if gather else None
        )
    M = dest_to_src.numel()
    epi = epilogue_for(activation, gate_up_layout)
    out = a.new_empty(M, w.shape[1] // 2 if epi.gated else w.shape[1])
    cfg = _configs(a, w, M, epi.gated).forward
    grouped_gemm_triton(
        a, w, offsets, out, cfg, epilogue=epi, bias=bias,
        dest_to_src=dest_to_src if gather else None, num_rows=M, allow_tf32=allow_tf32,
    )  # fmt: skip
    return out


def _gemm_fake(a, w, src_to_dest, dest_to_src, expert_for_src, offsets, bias, activation, *_):
    return a.new_empty(dest_to_src.numel(), n_out(w, activation))


def _gemm_backward_impl(
    dout: torch.Tensor,
    a: torch.Tensor,
    w: torch.Tensor,
    src_to_dest: torch.Tensor,
    dest_to_src: torch.Tensor,
    expert_for_src: torch.Tensor,
    offsets: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    gate_up_layout: str,
    gather: bool,
    need_da: bool,
    need_dw: bool,
    need_db: bool,
    allow_tf32: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(da, dw, db)`` of :func:`grouped_gemm`; the ones not asked for are empty."""
    if backend == "torch":
        da, dw, db = torch_impl.grouped_gemm_backward_torch(
            dout, a, w, offsets, bias, activation, gate_up_layout, src_to_dest, dest_to_src,
            expert_for_src, gather, need_da=need_da, need_dw=need_dw,
            need_db=need_db and bias is not None,
        )  # fmt: skip
    else:
        epi = epilogue_for(activation, gate_up_layout)
        cfgs = _configs(a, w, dest_to_src.numel(), epi.gated)
        da, dw, db = grouped_gemm_backward_triton(
            dout, a, w, offsets, src_to_dest, dest_to_src, expert_for_src, bias, activation,
            gate_up_layout, epi, gather, need_da, need_dw, need_db, cfgs.forward, cfgs.dx,
            cfgs.weight_grad, allow_tf32,
        )  # fmt: skip
    if bias is not None and db is not None:
        db = db.to(bias.dtype)
    wanted = (need_da, need_dw, need_db and bias is not None)
    return tuple(g if n else a.new_empty(0) for g, n in zip((da, dw, db), wanted, strict=True))


def _gemm_backward_fake(dout, a, w, s2d, d2s, efs, off, bias, act, layout, gather, need_da,
                        need_dw, need_db, *_):  # fmt: skip
    wanted = (need_da, need_dw, need_db and bias is not None)
    like = (a, w, bias if bias is not None else a)
    return tuple(
        torch.empty_like(t) if n else a.new_empty(0) for t, n in zip(like, wanted, strict=True)
    )


_GEMM_BACKWARD = Op("grouped_gemm_backward", _gemm_backward_impl, _gemm_backward_fake)


def _setup_context(ctx, inputs, output):
    a, w, s2d, d2s, efs, offsets, bias, activation, layout, gather, tf32, backend = inputs
    ctx.save_for_backward(a, w, s2d, d2s, efs, offsets, bias)
    ctx.config = (activation, layout, gather, tf32, backend)


def _backward(ctx, dout):
    a, w, s2d, d2s, efs, offsets, bias = ctx.saved_tensors
    activation, layout, gather, tf32, backend = ctx.config
    need = ctx.needs_input_grad
    da, dw, db = _GEMM_BACKWARD(
        dout, a, w, s2d, d2s, efs, offsets, bias, activation, layout, gather, need[0], need[1],
        need[6], tf32, backend,
    )  # fmt: skip
    grads = [da if need[0] else None, dw if need[1] else None] + [None] * 10
    grads[6] = db if need[6] else None
    return tuple(grads)


GEMM = Op("grouped_gemm", gemm_tables, _gemm_fake, setup_context=_setup_context, backward=_backward)


def n_out(w: torch.Tensor, activation: str | Activation) -> int:
    return w.shape[1] // 2 if as_activation(activation).gated else w.shape[1]


def grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    maps: RoutingMaps,
    *,
    bias: torch.Tensor | None = None,
    activation: str | Activation = "identity",
    gate_up_layout: str = "concat",
    gather: bool = False,
    allow_tf32: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """``out[d] = act(a[d] @ w[e].T + bias[e])`` for every permuted row ``d`` of expert ``e``.

    GEMM1 is ``grouped_gemm(x_perm, w1, maps, activation="swiglu")``, GEMM2 is
    ``grouped_gemm(h, w2, maps)``. One launch for all experts, no host synchronisation.

    Args:
        a: ``[T*K, Kd]`` permuted rows; with ``gather=True`` the token rows ``x [T, Kd]``, read
            through ``maps`` (the expand is fused into the GEMM: ``x_perm`` never exists).
        w: ``[E, N, Kd]`` weights, any strided view (e.g. ``[E, Kd, N].transpose(1, 2)``),
            never copied. Gated activations: ``N = 2*I`` rows, gate then up (``"concat"``) or
            alternating (``"interleaved"``).
        maps: :class:`RoutingMaps` for ``E = w.shape[0]`` experts.
        bias: optional ``[E, N]``.
        activation: ``swiglu`` / ``geglu`` / ``geglu_tanh`` (gated) or ``silu`` / ``gelu`` /
            ``gelu_tanh`` / ``relu`` / ``relu2`` / ``identity``, by name or as a
            :class:`moe_route.Activation` with parameters (e.g. the clamped SwiGLU of gpt-oss,
            ``moe_route.activation("swiglu", alpha=1.702, limit=7.0, up_offset=1.0)``).
        allow_tf32: float32 inputs use TF32 tensor cores (else exact float32 products).

    Returns:
        ``[T*K, N_out]`` in ``a.dtype`` (``N_out = I`` for gated activations, else ``N``),
        float32 accumulation, rounded once. Rows of dropped slots are zero.
    """
    key = None
    if memo_wanted():
        key = _call_key(a, w, maps, bias, activation, gate_up_layout, gather, allow_tf32, backend)
        call = _CALLS.get(key)
        if call is not None:
            return call(a, w, maps, bias)
    _checks.check_bool("gather", gather)
    _checks.check_bool("allow_tf32", allow_tf32)
    spec = as_activation(activation)
    E, _ = check_gemm_args("a", a, "w", w, "bias", bias, spec, gate_up_layout)
    if not isinstance(maps, RoutingMaps):
        raise TypeError(f"maps must be a RoutingMaps, got {type(maps).__name__}")
    if maps.num_experts != E:
        raise ValueError(f"maps were built for E={maps.num_experts} experts but w has E={E}")
    if gather:
        check_maps(maps, a.shape[0], a.device, "a")
    elif a.shape[0] != maps.num_expanded_rows:
        raise ValueError(
            f"a must have T*K = {maps.num_expanded_rows} permuted rows (or pass gather=True "
            f"with x [T, Kd]), got {_checks.describe(a)}"
        )
    elif maps.device != a.device:
        raise ValueError(f"maps are on {maps.device} but a is on {a.device}")
    chosen = arch.cached_backend(a.device, backend)
    check_interpreter_dtype("a", a, chosen)
    call = GemmCall(a, w, maps, bias, str(spec), gate_up_layout, gather, allow_tf32, chosen,
                    key is not None)  # fmt: skip
    _CALLS.keep(key, call, (a, w, bias, *maps.tensors()))
    return call(a, w, maps, bias)


class GemmCall:
    """What :func:`grouped_gemm` decided for one call signature (:func:`_call_key`): the
    activation's canonical string, the backend, and where the call needs neither autograd
    nor the custom op's dispatch, the kernel's prepared launch (tiles from the token
    bucket)."""

    __slots__ = ("activation", "allow_tf32", "backend", "gather", "launch", "layout")

    def __init__(self, a, w, maps: RoutingMaps, bias, activation: str, gate_up_layout: str,
                 gather: bool, allow_tf32: bool, backend: str, eager: bool):  # fmt: skip
        self.activation, self.layout, self.gather = activation, gate_up_layout, gather
        self.allow_tf32, self.backend, self.launch = allow_tf32, backend, None
        grads = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (a, w, bias)
        )
        tensors = (a, w, bias, *maps.tensors())
        if eager and not grads and backend == "triton" and not needs_dispatcher(tensors):
            epi = epilogue_for(activation, gate_up_layout)
            cfg = _configs(a, w, maps.num_expanded_rows, epi.gated).forward
            self.launch = GemmLaunch(a, w, None, cfg, epi, bias, gather, None, allow_tf32)

    def __call__(self, a, w, maps: RoutingMaps, bias) -> torch.Tensor:
        launch = self.launch
        if launch is None:
            # The op carries the spec as its canonical string (a constant for torch.library
            # and torch.compile).
            return GEMM(a, w, *maps.tensors(), bias, self.activation, self.layout, self.gather,
                        self.allow_tf32, self.backend)  # fmt: skip
        M = maps.num_tokens * maps.top_k
        out = a.new_empty(M, launch.n_out)
        launch(a, w, maps.expert_first_token_offset, out, bias,
               maps.expanded_dest_row_to_expanded_source_row, M)  # fmt: skip
        return out


#: :func:`grouped_gemm`'s decisions by call signature
_CALLS = CallMemo()


def _call_key(a, w, maps, bias, *options) -> tuple | None:
    """The signature of a :func:`grouped_gemm` call: what its checks and decisions read of
    each tensor (``a`` without its row count: the token bucket of the maps' rows instead, and
    whether ``a``'s rows agree with the maps) and of the maps, the options, grad mode and the
    environment (None for arguments of the wrong kinds: the checks say what is wrong)."""
    try:
        T, K = maps.num_tokens, maps.top_k
        rows = a.shape[0] == (T if options[2] else T * K)  # options[2]: gather
        return (token_bucket(T * K), rows, rows_key(a), tensor_key(w), tensor_key(bias),
                type(maps), K, maps.num_experts, maps.device, *options,
                torch.is_grad_enabled(), memo_env())  # fmt: skip
    except (AttributeError, TypeError, IndexError):
        return None
