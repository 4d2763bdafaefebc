"""MoELayer: a trainable mixture-of-experts block (router + experts + shared expert).

The layer owns the parameters and the routing policy; the expert computation is one
:func:`moe_route.fused_moe` call (forward and backward), with the shared expert's output fed
in as finalize's per-token ``bias``, so it is added inside the same reduction (no extra pass
over ``[T, H]``). See :class:`MoELayer` for the parameter layout.

This module holds the parameters, the constructor's checks and the forward; the bases of
:class:`MoELayer` hold the rest: :mod:`moe_route.layer_router` (gate logits, top-k routing,
losses, capacity, expert bias), :mod:`moe_route.layer_call` (the decisions kept per call
signature) and :mod:`moe_route.layer_weights` (loading and quantising the experts).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from . import _checks
from ._checks import GEMM_DTYPES
from .activations import Activation, as_activation
from .arch import check_backend_name
from .decode import DECODE
from .layer_call import LayerCallMemo
from .layer_call import _LayerCall as _LayerCall  # (re-exported: callers patch it here)
from .layer_router import LayerRouter
from .layer_weights import ExpertWeights
from .moe import fused_moe
from .parallel import expert_parallel
from .parallel.state import full_state_dict, slice_full_experts
from .reference import GATE_UP_LAYOUTS, activation_reference
from .routing import ROUTERS, check_groups, expert_capacity, tokens_per_expert
from .tuning import warmup_buckets

FINALIZE_CHOICES = ("auto", "fused", "standalone")
# A quantised layer's expert buffers (MoELayer.quantize_experts).
_QUANT_BUFFERS = ("w1", "w1_scale_inv", "w2", "w2_scale_inv")
# What every rank of an expert-parallel group must agree on (checked at construction).
_EP_CONFIG = (
    "hidden_size", "intermediate_size", "num_experts", "top_k", "router", "renormalize",
    "n_group", "topk_group", "routed_scaling_factor", "router_dtype", "aux_loss_coef",
    "z_loss_coef", "capacity_factor", "num_shared_experts", "shared_intermediate_size",
    "activation", "gate_up_layout",
)  # fmt: skip


class MoEOutput(NamedTuple):
    """What :meth:`MoELayer.forward` returns (a tuple: ``out, aux, *_ = layer(x)`` works)."""

    #: ``[..., H]`` in ``x.dtype``: routed experts + shared expert.
    output: torch.Tensor
    #: float32 scalar (float64 for a float64 router): ``aux_loss_coef · load_balancing_loss +
    #: z_loss_coef · z_loss``, to add to the training loss (zero when both coefficients are 0).
    #: With an ``ep_group``: the value over every rank's tokens, on every rank. A switched-off
    #: loss is a zero the layer returns again on later calls: add it, do not write into it.
    aux_loss: torch.Tensor
    #: ``[T, E]`` router logits in ``router_dtype`` (``T`` = tokens of ``x`` flattened).
    router_logits: torch.Tensor
    #: ``[E]`` int64: slots each expert computed (after capacity drops); feed it (summed over
    #: steps or ranks if you like) to :meth:`MoELayer.update_expert_bias`. With an
    #: ``ep_group``: already summed over the group's ranks (the same on every rank).
    tokens_per_expert: torch.Tensor
    #: ``[T, K]`` int32 expert ids as run (``-1`` = dropped by the capacity).
    topk_ids: torch.Tensor
    #: ``[T, K]`` float32 router weights (float64 for a float64 router).
    topk_weights: torch.Tensor
    #: Unscaled load-balancing loss (before capacity); zero unless ``aux_loss_coef > 0``.
    load_balancing_loss: torch.Tensor
    #: Unscaled router z-loss; zero unless ``z_loss_coef > 0``.
    z_loss: torch.Tensor


class MoELayer(ExpertWeights, LayerRouter, LayerCallMemo, nn.Module):
    """Mixture-of-experts block: ``y_t = Σ_k w[t,k] · expert_{e[t,k]}(x_t) + shared(x_t)``.

    Args:
        hidden_size: ``H``. intermediate_size: ``I``, width of one expert.
        num_experts: ``E``. top_k: ``K``, experts per token (``1 <= K <= E``).
        router: ``"softmax"`` (Mixtral, Qwen2/3-MoE) or ``"sigmoid_grouped"`` (DeepSeek-V3); see
            :mod:`moe_route.routing`.
        renormalize: renormalise the ``K`` weights to sum 1 (Mixtral: True; Qwen3:
            ``norm_topk_prob``; DeepSeek-V3: True).
        n_group, topk_group: group-limited routing (``sigmoid_grouped`` only; ``n_group``
            must divide ``E``). routed_scaling_factor: multiplies the router weights.
        router_dtype: dtype of the router matmul and logits. The default ``"auto"`` is
            float32 promoted with the layer's dtype, read at each call: float32 for 16-bit
            and float32 layers, float64 for a float64 one (never below the layer's
            precision). ``None``: the input's dtype; a dtype: that dtype. Scores are float32
            (float64 for float64 logits).
        aux_loss_coef: weight of the Switch/Mixtral load-balancing loss in ``aux_loss``.
        z_loss_coef: weight of the router z-loss in ``aux_loss``.
        capacity_factor: ``None`` (no limit) or a finite ``c > 0``: each expert keeps at most
            ``ceil(c · T · K / E)`` slots, earliest tokens first; the others are dropped (their
            token gets the other slots and the shared expert only). ``c >= E`` drops nothing
            (see :func:`moe_route.expert_capacity`).
        num_shared_experts, shared_intermediate_size: a dense shared expert of width
            ``num_shared_experts · shared_intermediate_size`` (default ``I``) added to every
            token (DeepSeek / Qwen2-MoE), same activation and gate/up layout, no biases.
        shared_expert_gate: scale the shared expert by ``sigmoid(x @ shared_gate.weight.T)``
            (Qwen2-MoE).
        activation, gate_up_layout: as :func:`moe_route.fused_moe` (``swiglu``, ``geglu``,
            ``geglu_tanh``, ``silu``, ``gelu``, ``gelu_tanh``, ``relu``, ``relu2``,
            ``identity``, or an :class:`moe_route.Activation` with parameters, e.g. gpt-oss's
            clamped SwiGLU; ``concat`` or ``interleaved``). The shared expert uses the same
            activation. ``layer.activation`` holds its canonical string.
        bias: per-expert biases ``b1``, ``b2``.
        finalize, deterministic, backend: passed to :func:`moe_route.fused_moe` (``backend``
            also builds the capacity's routing maps).
        ep_group: a ``torch.distributed`` process group of ``W`` ranks (``W`` divides ``E``)
            to shard the experts over (expert parallelism): this rank holds experts
            ``[rank·E/W, (rank+1)·E/W)``, so ``w1``, ``w2``, ``b1``, ``b2`` have ``E/W`` rows;
            the router, ``expert_bias`` and the shared expert are replicated. Every rank of the
            group must construct the layer alike (the constructor checks that, collectively)
            and call it on its own tokens; see :mod:`moe_route.parallel`. ``None``: one process.
        ep_capacity: with ``ep_group``, how each rank's tokens travel (each token once per
            rank holding any of its experts). ``None``: blocks of ``T`` tokens per pair of
            ranks, which every token fits, without a host sync (CUDA graphs, ``fullgraph``
            compile); every rank must pass the same ``T``. An int ``C``: blocks of ``C``
            tokens, a bound every rank shares (any ``T``; the tokens beyond ``C`` for a rank
            lose their slots there). ``"exact"``: the routed tokens only, any ``T``, one host
            sync per forward (see :mod:`moe_route.parallel.expert_parallel`).
        ep_chunks: with ``ep_group``, split the local batch into this many chunks whose
            all-to-alls overlap the experts of the others (``ep_capacity`` is then per chunk).
        device, dtype: of the parameters (``dtype`` one of fp32 / bf16 / fp16 / fp64).

    Parameter layout (``N1 = 2I`` for gated activations, else ``I``; ``S`` the shared width):

    ===========================  ==============  =============================================
    name                         shape           meaning
    ===========================  ==============  =============================================
    ``gate.weight``              ``[E, H]``      router: ``logits = x @ gate.weight.T``
    ``w1``                       ``[E, N1, H]``  expert ``e``'s first linear map, rows ``[gate;
                                                 up]`` (``concat``) or alternating (``interleaved``)
    ``w2``                       ``[E, H, I]``   expert ``e``'s down projection
    ``b1`` / ``b2`` (bias=True)  ``[E, N1]`` /   biases; ``b2`` is scaled by the router weight
                                 ``[E, H]``
    ``shared_w1``                ``[N1(S), H]``  shared expert, same row layout as ``w1[e]``
    ``shared_w2``                ``[H, S]``      shared expert's down projection
    ``shared_gate.weight``       ``[1, H]``      shared expert gate (``shared_expert_gate``)
    ``expert_bias`` (buffer)     ``[E]`` fp32    DeepSeek aux-loss-free bias (``sigmoid_grouped``)
    ===========================  ==============  =============================================

    Expert ``e`` is ``x ↦ w2[e] @ act(w1[e] @ x + b1[e]) + b2[e]``, i.e. ``nn.Linear`` weights
    stacked along dim 0: :meth:`load_experts_` copies per-expert ``gate_proj`` / ``up_proj`` /
    ``down_proj`` (or Mixtral's ``w1`` / ``w3`` / ``w2``) modules in.

    ``forward(x [..., H])`` returns a :class:`MoEOutput`; nothing in it synchronises with the
    host, so it runs under ``torch.compile(fullgraph=True)`` and CUDA-graph capture, and with
    ``deterministic=True`` it gives the same bits on every run, backward included. With an
    ``ep_group`` the expert tensors hold this rank's ``E/W`` experts (rows ``[rank·E/W,
    (rank+1)·E/W)`` of the table's); only the exact exchange (``ep_capacity="exact"``) reads
    its split sizes on the host, once per forward.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        router: str = "softmax",
        renormalize: bool = True,
        n_group: int | None = None,
        topk_group: int | None = None,
        routed_scaling_factor: float = 1.0,
        router_dtype: torch.dtype | str | None = "auto",
        aux_loss_coef: float = 0.0,
        z_loss_coef: float = 0.0,
        capacity_factor: float | None = None,
        num_shared_experts: int = 0,
        shared_intermediate_size: int | None = None,
        shared_expert_gate: bool = False,
        activation: str | Activation = "swiglu",
        gate_up_layout: str = "concat",
        bias: bool = False,
        finalize: str = "auto",
        deterministic: bool = True,
        backend: str = "auto",
        ep_group: object = None,
        ep_capacity: int | str | None = None,
        ep_chunks: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        H = _checks.positive_int("hidden_size", hidden_size)
        inter = _checks.positive_int("intermediate_size", intermediate_size)
        E = _checks.positive_int("num_experts", num_experts)
        K = _checks.positive_int("top_k", top_k)
        if K > E:
            raise ValueError(f"top_k={K} > num_experts={E}: a token cannot pick more experts")
        if router not in ROUTERS:
            raise ValueError(f"router={router!r}: expected one of {ROUTERS}")
        if router == "sigmoid_grouped":
            n_group, topk_group = check_groups(E, K, 1 if n_group is None else n_group, topk_group)
        elif n_group is not None or topk_group is not None:
            raise ValueError(
                f"n_group={n_group}, topk_group={topk_group}: group-limited routing needs "
                "router='sigmoid_grouped'"
            )
        if isinstance(routed_scaling_factor, bool) or not isinstance(
            routed_scaling_factor, (int, float)
        ):
            raise TypeError(
                f"routed_scaling_factor must be a number, got {type(routed_scaling_factor)}"
            )
        if not 0 < routed_scaling_factor < math.inf:
            raise ValueError(f"routed_scaling_factor={routed_scaling_factor}: expected > 0")
        if router_dtype not in (None, "auto", *_checks.FLOAT_DTYPES):
            raise ValueError(
                f"router_dtype={router_dtype!r}: expected 'auto', None or one of "
                f"{_checks.FLOAT_DTYPES}"
            )
        for name, flag in (("renormalize", renormalize), ("bias", bias),
                           ("shared_expert_gate", shared_expert_gate),
                           ("deterministic", deterministic)):  # fmt: skip
            _checks.check_bool(name, flag)
        aux_loss_coef = _checks.nonneg_float("aux_loss_coef", aux_loss_coef)
        z_loss_coef = _checks.nonneg_float("z_loss_coef", z_loss_coef)
        if capacity_factor is not None:
            expert_capacity(capacity_factor, 1, K, E)  # validates the factor
        n_shared = _checks.positive_int("num_shared_experts", num_shared_experts, minimum=0)
        if shared_intermediate_size is not None:
            _checks.positive_int("shared_intermediate_size", shared_intermediate_size)
        if shared_expert_gate and not n_shared:
            raise ValueError("shared_expert_gate=True needs num_shared_experts >= 1")
        spec = as_activation(activation)  # raises, naming the argument
        gated = spec.gated
        if gate_up_layout not in GATE_UP_LAYOUTS:
            raise ValueError(
                f"gate_up_layout={gate_up_layout!r}: expected one of {GATE_UP_LAYOUTS}"
            )
        if finalize not in FINALIZE_CHOICES:
            raise ValueError(f"finalize={finalize!r}: expected one of {FINALIZE_CHOICES}")
        check_backend_name(backend)  # the torch backend's former name "reference" included
        if dtype is not None and dtype not in GEMM_DTYPES:
            raise ValueError(f"dtype={dtype}: expected one of {GEMM_DTYPES}")
        if ep_group is None and (ep_capacity is not None or ep_chunks != 1):
            raise ValueError(
                f"ep_capacity={ep_capacity!r}, ep_chunks={ep_chunks!r}: these need an ep_group "
                "(expert parallelism)"
            )

        self.hidden_size, self.intermediate_size, self.num_experts, self.top_k = H, inter, E, K
        self.router = router
        self.renormalize = bool(renormalize)
        self.n_group, self.topk_group = n_group, topk_group
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.router_dtype = router_dtype
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.capacity_factor = None if capacity_factor is None else float(capacity_factor)
        self.num_shared_experts = n_shared
        self.shared_intermediate_size = (shared_intermediate_size or inter) if n_shared else None
        self._activation, self.gate_up_layout = spec, gate_up_layout
        self.finalize, self.deterministic, self.backend = finalize, bool(deterministic), backend

        #: :class:`moe_route.parallel.ExpertParallel` (group, rank, local experts) or None.
        self.ep = None
        if ep_group is not None:
            config = {name: getattr(self, name) for name in _EP_CONFIG}
            config["bias"], config["dtype"] = bool(bias), dtype or torch.get_default_dtype()
            config["shared_expert_gate"] = bool(shared_expert_gate)
            self.ep = expert_parallel.setup(ep_group, E, ep_capacity, ep_chunks, config)
            self._register_load_state_dict_pre_hook(slice_full_experts, with_module=True)
        E_here = E if self.ep is None else self.ep.num_local_experts

        fk = dict(device=device, dtype=dtype)
        n1 = 2 * inter if gated else inter
        self.gate = nn.Linear(H, E, bias=False, **fk)
        self.w1 = nn.Parameter(torch.empty(E_here, n1, H, **fk))
        self.w2 = nn.Parameter(torch.empty(E_here, H, inter, **fk))
        self.b1 = nn.Parameter(torch.empty(E_here, n1, **fk)) if bias else None
        self.b2 = nn.Parameter(torch.empty(E_here, H, **fk)) if bias else None
        if n_shared:
            S = n_shared * self.shared_intermediate_size
            s1 = 2 * S if gated else S
            self.shared_w1 = nn.Parameter(torch.empty(s1, H, **fk))
            self.shared_w2 = nn.Parameter(torch.empty(H, S, **fk))
        else:
            self.shared_w1 = self.shared_w2 = None
        self.shared_gate = nn.Linear(H, 1, bias=False, **fk) if shared_expert_gate else None
        bias_buf = torch.zeros(E, device=device) if router == "sigmoid_grouped" else None
        self.register_buffer("expert_bias", bias_buf)
        self._zeros: dict = {}  # see _zero_loss
        self._calls: dict = {}  # see _eager_call
        self.reset_parameters()

    # ------------------------------------------------------------------ parameters
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise as the per-expert ``nn.Linear`` modules a model would otherwise hold.

        Every weight of fan-in ``n`` is drawn from ``U(-1/√n, 1/√n)`` (``nn.Linear``'s
        default: ``gate.weight``, ``w1``, ``shared_w1``, ``shared_gate.weight`` with
        ``n = H``; ``w2`` with ``n = I``; ``shared_w2`` with ``n = S``); the biases ``b1``,
        ``b2`` and ``expert_bias`` start at zero. Models with their own scheme (e.g.
        ``normal(0, 0.02)``) re-initialise the parameters after construction.
        """

        def uniform(p: torch.Tensor | None, fan_in: int) -> None:
            if p is not None:
                bound = 1.0 / math.sqrt(fan_in)
                p.uniform_(-bound, bound)

        uniform(self.gate.weight, self.hidden_size)
        uniform(self.w1, self.hidden_size)
        uniform(self.w2, self.intermediate_size)
        for p in (self.b1, self.b2, self.expert_bias):
            if p is not None:
                p.zero_()
        uniform(self.shared_w1, self.hidden_size)
        if self.shared_w2 is not None:
            uniform(self.shared_w2, self.shared_w2.shape[1])
        if self.shared_gate is not None:
            uniform(self.shared_gate.weight, self.hidden_size)

    def _apply(self, fn, recurse=True):
        # ``layer.to(torch.bfloat16)`` would round the expert bias, whose updates are ~1e-3:
        # keep it float32 (on whatever device ``fn`` moved it to).
        before = self.expert_bias
        # quantised experts' codes and scales move, never change dtype
        codes = {n: self._buffers[n] for n in _QUANT_BUFFERS} if self.quant is not None else {}
        super()._apply(fn, recurse)
        after = self.expert_bias
        if before is not None and after is not None and after.dtype != torch.float32:
            self._buffers["expert_bias"] = before.to(device=after.device, dtype=torch.float32)
        for name, t in codes.items():
            moved = self._buffers[name]
            if moved.dtype != t.dtype:
                self._buffers[name] = t.to(device=moved.device)
        return self

    @property
    def activation(self) -> str:
        """The activation's canonical string (``str`` of its :class:`moe_route.Activation`)."""
        return str(self._activation)

    def extra_repr(self) -> str:
        parts = [
            f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}",
            f"num_experts={self.num_experts}, top_k={self.top_k}, router={self.router!r}",
            f"renormalize={self.renormalize}",
        ]
        if self.router == "sigmoid_grouped":
            parts.append(f"n_group={self.n_group}, topk_group={self.topk_group}")
        if self.routed_scaling_factor != 1.0:
            parts.append(f"routed_scaling_factor={self.routed_scaling_factor}")
        parts.append(f"router_dtype={self.router_dtype!r}")
        if self.aux_loss_coef or self.z_loss_coef:
            parts.append(f"aux_loss_coef={self.aux_loss_coef}, z_loss_coef={self.z_loss_coef}")
        if self.capacity_factor is not None:
            parts.append(f"capacity_factor={self.capacity_factor}")
        if self.num_shared_experts:
            parts.append(
                f"num_shared_experts={self.num_shared_experts}, "
                f"shared_intermediate_size={self.shared_intermediate_size}, "
                f"shared_expert_gate={self.shared_gate is not None}"
            )
        parts.append(f"activation={self.activation!r}, gate_up_layout={self.gate_up_layout!r}")
        parts.append(f"bias={self.b1 is not None}")
        if self.quant is not None:
            parts.append(f"quant={str(self.quant)!r}")
        parts.append(
            f"finalize={self.finalize!r}, deterministic={self.deterministic}, "
            f"backend={self.backend!r}"
        )
        if self.ep is not None:
            parts.append(
                f"ep_size={self.ep.size}, ep_rank={self.ep.rank}, "
                f"local_experts=[{self.ep.first_expert}, "
                f"{self.ep.first_expert + self.ep.num_local_experts}), "
                f"ep_capacity={self.ep.capacity}, ep_chunks={self.ep.chunks}"
            )
        return ", ".join(parts)

    @property
    def ep_group(self):
        """The expert-parallel process group, or None (one process)."""
        return None if self.ep is None else self.ep.group

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The state dict of this layer built without ``ep_group``: the full ``[E, ...]``
        expert tensors, gathered on every rank (a collective). Plain ``state_dict()`` when
        the layer is not expert-parallel. ``load_state_dict`` takes either form."""
        return full_state_dict(self)

    # ------------------------------------------------------------------ forward
    def shared_expert(self, x: torch.Tensor) -> torch.Tensor | None:
        """``[T, H]`` output of the shared expert (gated if asked), or None without one."""
        if self.shared_w1 is None:
            return None
        h = activation_reference(F.linear(x, self.shared_w1), self._activation, self.gate_up_layout)
        out = F.linear(h, self.shared_w2)
        if self.shared_gate is not None:
            out = torch.sigmoid(self.shared_gate(x)) * out
        return out

    def forward(self, x: torch.Tensor) -> MoEOutput:
        """Route, run the experts, add the shared expert.

        Args:
            x: ``[..., H]`` in the layer's dtype, on its device.

        Returns:
            :class:`MoEOutput` (``output`` has ``x``'s shape; per-token tensors are flattened
            to ``T = x.numel() // H`` rows).
        """
        if self.quant is not None:
            return self._forward_quantized(x)
        H = self.hidden_size
        # each parameter read once (nn.Module.__getattr__ per read)
        w1, w2, b1, b2 = self.w1, self.w2, self.b1, self.b2
        _checks.check_layer_input(x, H, w1.dtype)
        flat = x.dim() == 2  # (a reshape and a view cost ~3 us of host time each)
        x2 = x if flat else x.reshape(-1, H)
        if self.ep is not None:
            out, *rest = expert_parallel.forward(self, x2)
            return MoEOutput(out.view(x.shape), *rest)
        T, E = x2.shape[0], self.num_experts
        gate_w = self.gate.weight
        call = self._eager_call(x2, w1, w2, b1, b2, gate_w)
        # CUDA-graph capture is asked per call (on CUDA, eager)
        capturing = call.ask_capture and torch._C._cuda_isCurrentStreamCapturing()
        fused = None
        if call.router is not None and not capturing:  # eager inference: one router launch
            fused = call.router(x2, gate_w)
        if fused is None:
            logits = self.router_logits(x2)
            weights, ids = self.route(logits)
        else:
            logits, weights, ids = fused
            if self.routed_scaling_factor != 1.0:
                weights = weights * self.routed_scaling_factor

        lb, z, aux, ids = self._losses_and_capacity(logits, ids, T)

        # The router made the ids and the parameters are the layer's own (shapes fixed at
        # construction, load_state_dict checks them): none of fused_moe's argument checks,
        # one plan, and the counts come with the experts' launches (the maps' offsets, or the
        # decode path's second kernel): one op instead of eight.
        act, layout = self.activation, self.gate_up_layout
        shared = self.shared_expert(x2)
        decode = None if capturing else call.decode_launch(x2, w1, w2, weights, ids, b1, b2, shared)
        if decode is not None:
            counts = ids.new_empty(E, dtype=torch.int64)
            out = decode(x2, w1, w2, weights, ids, b1, b2, shared, counts)
        elif call.decode_by_op and not capturing:
            out, counts = DECODE(x2, w1, w2, weights, ids, b1, b2, shared, act, layout, True)
        else:
            maps_call, program, direct = call.sorted_path(x2, w1, w2, weights, ids, b1, b2, shared,
                                                          act, layout)  # fmt: skip
            maps = maps_call(ids)
            out = program(x2, w1, w2, weights, maps.tensors(), b1, b2, shared, direct=direct)
            counts = maps.tokens_per_expert()
        return MoEOutput(
            output=out if flat else out.view(x.shape),
            aux_loss=aux,
            router_logits=logits,
            tokens_per_expert=counts,
            topk_ids=ids,
            topk_weights=weights,
            load_balancing_loss=lb,
            z_loss=z,
        )

    def warmup(self, max_tokens: int, *, backward: bool = False) -> list[int]:
        """Compile every kernel this layer launches for up to ``max_tokens`` tokens per call
        (one forward per token bucket on random tokens, and a backward when ``backward``:
        gradients computed and dropped, nothing accumulates into ``.grad``, the global RNG
        untouched); see :func:`moe_route.warmup`. An expert-parallel layer runs collectives:
        call it on every rank. Returns the buckets warmed. ``max_tokens`` has the bounds of
        :func:`moe_route.warmup` (``ValueError`` before anything runs)."""
        _checks.check_bool("backward", backward)
        buckets = warmup_buckets(max_tokens, self.top_k, self.w1, self.w2, backward)
        p = self.w1
        gen = torch.Generator(device=p.device).manual_seed(0)
        for T in buckets:
            x = torch.randn(T, self.hidden_size, device=p.device, dtype=p.dtype, generator=gen)
            if not backward:
                with torch.no_grad():
                    self(x)
                continue
            with torch.enable_grad():
                x.requires_grad_()
                out = self(x)
                inputs = [x, *(q for q in self.parameters() if q.requires_grad)]
                dout = torch.randn(x.shape, device=p.device, dtype=p.dtype, generator=gen)
                outs, grads = [out.output], [dout]
                if out.aux_loss.requires_grad:
                    outs.append(out.aux_loss)
                    grads.append(torch.ones_like(out.aux_loss))
                torch.autograd.grad(outs, inputs, grads, allow_unused=True)
        if p.device.type == "cuda":
            torch.cuda.synchronize(p.device)
        return buckets

    def _forward_quantized(self, x: torch.Tensor) -> MoEOutput:
        """:meth:`forward` on quantised experts: the same routing, losses and capacity, the
        experts by :func:`moe_route.fused_moe` on the codes and scales."""
        H = self.hidden_size
        _checks.check_layer_input(
            x, H, self.gate.weight.dtype
        )  # (the experts hold codes, not the dtype)
        x2 = x.reshape(-1, H)
        T = x2.shape[0]
        logits = self.router_logits(x2)
        weights, ids = self.route(logits)
        lb, z, aux, ids = self._losses_and_capacity(logits, ids, T)
        out = fused_moe(
            x2, self.w1, self.w2, weights, ids, activation=self._activation,
            gate_up_layout=self.gate_up_layout, b1=self.b1, b2=self.b2,
            bias=self.shared_expert(x2), deterministic=self.deterministic, backend=self.backend,
            quant=self.quant, w1_scale=self.w1_scale_inv, w2_scale=self.w2_scale_inv,
        )  # fmt: skip
        counts = tokens_per_expert(ids, self.num_experts)
        return MoEOutput(out.view(x.shape), aux, logits, counts, ids, weights, lb, z)
