"""MoELayer: a trainable mixture-of-experts block (router + experts + shared expert).

The layer owns the parameters and the routing policy; the expert computation is one
:func:`moe_route.fused_moe` call (forward and backward), with the shared expert's output fed
in as finalize's per-token ``bias``, so it is added inside the same reduction (no extra pass
over ``[T, H]``). See :class:`MoELayer` for the parameter layout.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from . import _checks
from ._dispatch import MAX_CALLS, memo_env, needs_dispatcher, tensor_key
from .activations import Activation, as_activation
from .arch import check_backend_name
from .experts import DECODE, PreparedExperts, decode_planned, run_experts
from .grouped_gemm import GEMM_DTYPES, check_interpreter_dtype
from .kernels.triton.decode import DecodeLaunch
from .layer_weights import ExpertWeights
from .maps import MapsCall
from .moe import fused_moe
from .parallel import expert_parallel
from .parallel.state import full_state_dict, slice_full_experts
from .plan import moe_plan
from .reference import GATE_UP_LAYOUTS, activation_reference
from .routing import (
    ROUTERS,
    apply_capacity,
    check_groups,
    expert_capacity,
    fused_router,
    load_balancing_loss,
    route_sigmoid_grouped,
    route_softmax,
    router_z_loss,
    tokens_per_expert,
)
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


class _LayerCall:
    """What an eager :meth:`MoELayer.forward` decided for one call signature (the layer keeps
    it, :meth:`MoELayer._eager_call`): the plan, the router's prepared launch where the one
    launch serves, and the decode path's, prepared at the first call that takes it (from the
    router's outputs, whose layout the signature fixes; checked on each use). Keeps no tensor.

    Those decisions and launch keys were ~40 % of an inference layer call's host time
    (docs/decisions.md, "Call memos").
    """

    __slots__ = ("_decode", "_decode_meta", "_sorted", "_sorted_meta", "ask_capture",
                 "decode_by_op", "eager", "plan", "router")  # fmt: skip

    def __init__(self, plan, router, ask_capture: bool, eager: bool):
        self.plan, self.router, self.ask_capture, self.eager = plan, router, ask_capture, eager
        self._decode = self._decode_meta = self._sorted = self._sorted_meta = None
        #: the decode path, through its custom op (tensors needing the dispatcher)
        self.decode_by_op = False

    def sorted_path(self, x, w1, w2, weights, ids, b1, b2, shared, activation: str,
                    layout: str):  # fmt: skip
        """The sorted path's ``(maps, experts)`` callables for this call: the maps' prepared
        launch (:class:`~moe_route.maps.MapsCall`) and, in eager mode on plain tensors and the
        Triton backend, the experts' prepared launch sequences
        (:class:`~moe_route.experts.PreparedExperts`, else None:
        :func:`~moe_route.experts.run_experts` through the op). Prepared at the first call
        from the router's outputs and the shared expert's, whose layouts the signature fixes
        (checked on each use)."""
        meta = (weights.dtype, weights.stride(), ids.dtype, ids.stride(),
                None if shared is None else (shared.dtype, shared.stride()))  # fmt: skip
        if meta != self._sorted_meta:
            plan, E = self.plan, w1.shape[0]
            experts = None
            args = (x, w1, w2, weights, ids, b1, b2, shared)
            if self.eager and plan.backend == "triton" and not needs_dispatcher(args):
                experts = PreparedExperts(plan, activation, layout, False)
            self._sorted = (MapsCall(ids, E, plan.maps_backend, False, self.eager), experts)
            self._sorted_meta = meta
        return self._sorted

    def decode_launch(self, x, w1, w2, weights, ids, b1, b2, shared):
        """The decode path's :class:`DecodeLaunch` (with counts) for this call, or None where
        the call takes another path: the sorted path (gradients, compile, no decode plan), or
        the decode op (:attr:`decode_by_op`, set here). CUDA-graph capture aside (the caller
        asks it per call)."""
        meta = (weights.dtype, weights.stride(), weights.requires_grad, ids.dtype, ids.stride(),
                None if shared is None else (shared.stride(), shared.requires_grad))  # fmt: skip
        if meta != self._decode_meta:
            self._decode, self._decode_meta, self.decode_by_op = None, meta, False
            args = (x, w1, w2, weights, ids, b1, b2, shared)
            if decode_planned(self.plan, x, w1, w2, weights, b1, b2, shared):
                if needs_dispatcher(args):
                    self.decode_by_op = True
                else:
                    self._decode = DecodeLaunch(*args, self.plan.configs.epilogue,
                                                self.plan.decode, True)  # fmt: skip
        return self._decode


def _positive_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}={value}: expected >= {minimum}")
    return value


def _nonneg_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not 0 <= value < math.inf:
        raise ValueError(f"{name}={value}: expected a finite number >= 0")
    return float(value)


class MoELayer(ExpertWeights, nn.Module):
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
        H = _positive_int("hidden_size", hidden_size)
        inter = _positive_int("intermediate_size", intermediate_size)
        E = _positive_int("num_experts", num_experts)
        K = _positive_int("top_k", top_k)
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
        aux_loss_coef = _nonneg_float("aux_loss_coef", aux_loss_coef)
        z_loss_coef = _nonneg_float("z_loss_coef", z_loss_coef)
        if capacity_factor is not None:
            expert_capacity(capacity_factor, 1, K, E)  # validates the factor
        n_shared = _positive_int("num_shared_experts", num_shared_experts, minimum=0)
        if shared_intermediate_size is not None:
            _positive_int("shared_intermediate_size", shared_intermediate_size)
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
    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_weights [T, K], topk_ids [T, K])`` of this layer's router for ``[T, E]``
        logits (before any capacity drop)."""
        if self.router == "softmax":
            weights, ids = route_softmax(logits, self.top_k, self.renormalize, self.backend)
            if self.routed_scaling_factor != 1.0:
                weights = weights * self.routed_scaling_factor
            return weights, ids
        # checked at construction; the bias is the layer's own [E] buffer
        return route_sigmoid_grouped(
            logits, self.top_k, self.n_group, self.topk_group, self.expert_bias,
            self.routed_scaling_factor, self.renormalize, self.backend,
        )  # fmt: skip

    def logits_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the router's matmul and logits for tokens of ``dtype`` (the layer's):
        ``router_dtype`` resolved (``"auto"``: float32 promoted with ``dtype``)."""
        rdt = self.router_dtype
        if rdt is None:
            return dtype
        if isinstance(rdt, str):  # "auto": a float64 layer routes in float64
            return torch.promote_types(torch.float32, dtype)
        return rdt

    def router_logits(self, x2: torch.Tensor) -> torch.Tensor:
        """``[T, E]`` logits of ``[T, H]`` tokens, in :meth:`logits_dtype`: the tokens and the
        gate's weight converted to it, then multiplied.

        In inference on a GPU, 16-bit tokens and weights go into one matmul with float32
        output instead (no converted copies; the products of 16-bit values are exact in
        float32 either way, and both sum in float32).

        The two conversions cost more host time than the matmul (docs/decisions.md, "Call
        memos").
        """
        rdt = self.logits_dtype(x2.dtype)
        w = self.gate.weight
        if x2.dtype == rdt and w.dtype == rdt:
            return F.linear(x2, w)
        if (
            rdt == torch.float32
            and x2.is_cuda
            and x2.dtype == w.dtype
            and x2.dtype in (torch.float16, torch.bfloat16)
            and not (torch.is_grad_enabled() and (x2.requires_grad or w.requires_grad))
            and not torch.compiler.is_compiling()
        ):
            logits = _mm_float32(x2, w.t())
            if logits is not None:
                return logits
        return F.linear(x2.to(rdt), w.to(rdt))

    def router_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """``[T, E]`` distributions for the load-balancing loss: the softmax of the logits, or
        the sigmoid scores normalised per token (DeepSeek-V3's balance loss) for the
        ``sigmoid_grouped`` router."""
        scores = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
        if self.router == "softmax":
            return torch.softmax(scores, dim=-1)
        s = torch.sigmoid(scores)
        return s / s.sum(dim=-1, keepdim=True)

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
        _check_x(x, H, w1.dtype)
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
        act, layout, plan = self.activation, self.gate_up_layout, call.plan
        shared = self.shared_expert(x2)
        decode = None if capturing else call.decode_launch(x2, w1, w2, weights, ids, b1, b2, shared)
        if decode is not None:
            counts = ids.new_empty(E, dtype=torch.int64)
            out = decode(x2, w1, w2, weights, ids, b1, b2, shared, counts)
        elif call.decode_by_op and not capturing:
            out, counts = DECODE(x2, w1, w2, weights, ids, b1, b2, shared, act, layout, True)
        else:
            maps_call, experts = call.sorted_path(x2, w1, w2, weights, ids, b1, b2, shared, act,
                                                  layout)  # fmt: skip
            maps = maps_call(ids)
            if experts is not None:
                out = experts(x2, w1, w2, weights, maps, b1, b2, shared)
            else:
                out = run_experts(plan, x2, w1, w2, weights, maps, act, layout, b1, b2, shared)
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

    def _eager_call(self, x2, w1, w2, b1, b2, gate_w) -> _LayerCall:
        """The decisions of a forward on ``x2`` (:class:`_LayerCall`): kept per call signature
        in eager mode, made afresh under torch.compile and a torch dispatch mode."""
        key = None
        compiling = torch.compiler.is_compiling()
        if not compiling and not torch._C._len_torch_dispatch_stack():
            key = (tensor_key(x2), tensor_key(w1), tensor_key(w2), tensor_key(b1),
                   tensor_key(b2), tensor_key(gate_w), self.shared_w1 is None, self.router,
                   self.top_k, self.renormalize, self.router_dtype, self.activation,
                   self.gate_up_layout, self.finalize, self.deterministic, self.backend,
                   torch.is_grad_enabled(), memo_env())  # fmt: skip
            call = self._calls.get(key)
            if call is not None:
                return call
        plan = moe_plan(x2, w1, w2, self.top_k, self.activation, self.gate_up_layout,
                        self.finalize, self.deterministic, None, False, self.backend)  # fmt: skip
        check_interpreter_dtype("x", x2, plan.backend)
        router = None
        if self.router == "softmax":  # eager inference at small T: one launch for the router
            rdt = self.logits_dtype(x2.dtype)
            expert = (math.prod(w1.shape[1:]) + math.prod(w2.shape[1:])) * x2.element_size()
            router = fused_router(x2, gate_w, self.top_k, self.renormalize, rdt, expert,
                                  self.backend)  # fmt: skip
        # (under torch.compile nothing is prepared, and no capture query is traced)
        call = _LayerCall(plan, router, x2.is_cuda and not compiling, key is not None)
        if key is not None and not needs_dispatcher((x2, w1, w2, b1, b2, gate_w)):
            if len(self._calls) >= MAX_CALLS:
                self._calls.clear()
            self._calls[key] = call
        return call

    def _losses_and_capacity(self, logits, ids, T: int):
        """``(load-balancing loss, z-loss, aux_loss, ids)``: the router's losses (float32,
        float64 for a float64 router: gradcheck), then the capacity's drops in ``ids``."""
        E = self.num_experts
        sdt = torch.float64 if logits.dtype == torch.float64 else torch.float32
        lb = z = aux = self._zero_loss(sdt, logits.device)
        if self.aux_loss_coef:
            lb = load_balancing_loss(self.router_probs(logits), ids, E)
        if self.z_loss_coef:
            z = router_z_loss(logits)
        if self.aux_loss_coef or self.z_loss_coef:
            aux = self.aux_loss_coef * lb + self.z_loss_coef * z
        if self.capacity_factor is not None:
            cap = expert_capacity(self.capacity_factor, T, self.top_k, E)
            ids = apply_capacity(ids, E, cap, backend=self.backend)
        return lb, z, aux, ids

    def _zero_loss(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The zero scalar the switched-off losses report: in eager mode one tensor per dtype
        and device, made once (and again if something wrote into it), not a fill launch per
        call.

        A fill launch per call costs measurable host time at decode sizes (docs/decisions.md,
        "Call memos").
        """
        if torch.compiler.is_compiling():  # traced once: nothing to save, no state to keep
            return torch.zeros((), dtype=dtype, device=device)
        key = (dtype, device)
        zero = self._zeros.get(key)
        if zero is None or zero._version:  # (an in-place write bumps the version)
            # a normal tensor even under inference_mode (an inference tensor has no version
            # to check, and could not be saved for a backward later)
            with torch.inference_mode(False):
                zero = self._zeros[key] = torch.zeros((), dtype=dtype, device=device)
        return zero

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

    # ------------------------------------------------------------------ expert bias
    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor, rate: float = 1e-3) -> None:
        """DeepSeek-V3's aux-loss-free balancing: ``expert_bias += rate · sign(mean - count)``.

        An overloaded expert's bias falls, an idle one's rises, by ``rate`` per call; the bias
        only steers the choice of experts, never the weights. Call it after the optimizer
        step with ``MoEOutput.tokens_per_expert`` (summed over micro-batches, or all-reduced
        over data-parallel ranks, as you see fit). In place, on the device, no host sync.

        Args:
            tokens_per_expert: ``[E]`` counts, of an integer dtype or (e.g. averaged over
                ranks) a floating one, on any device. Counts must be finite and ``>= 0``: a
                negative, NaN or infinite count raises ``ValueError`` when the counts are on
                the CPU; on a GPU, where reading them would synchronise, such a call leaves
                the bias as it was (so one bad step never writes NaN into it).
            rate: a finite real number ``>= 0`` (a Python or NumPy scalar; ``0`` changes
                nothing), at most the largest value of ``expert_bias``'s dtype (float32).
        """
        if self.expert_bias is None:
            raise ValueError(
                f"update_expert_bias needs router='sigmoid_grouped' (this layer's router is "
                f"{self.router!r}, which has no expert bias)"
            )
        if isinstance(rate, bool) or not isinstance(rate, numbers.Real):
            raise TypeError(
                f"rate must be a real number (a Python float), got {type(rate).__name__}"
            )
        if not math.isfinite(rate) or rate < 0:
            raise ValueError(f"rate must be a finite number >= 0, got {rate!r}")
        if rate > torch.finfo(self.expert_bias.dtype).max:
            raise ValueError(
                f"rate={rate!r} is past the largest {self.expert_bias.dtype} (expert_bias's "
                f"dtype, {torch.finfo(self.expert_bias.dtype).max:.4g}): expected a smaller rate"
            )
        counts = _checks.check_tensor("tokens_per_expert", tokens_per_expert, ndim=1)
        if counts.dtype == torch.bool or counts.dtype.is_complex:
            raise TypeError(
                f"tokens_per_expert must hold counts of an integer or floating dtype, got "
                f"{_checks.describe(counts)}"
            )
        if counts.shape[0] != self.num_experts:
            raise ValueError(
                f"tokens_per_expert must be [E] = [{self.num_experts}], got "
                f"{_checks.describe(counts)}"
            )
        unread = not _counts_read_on_host(counts)
        if not unread:
            bad = ~torch.isfinite(counts) | (counts < 0)
            if bool(bad.any()):
                e = int(bad.nonzero()[0])
                raise ValueError(
                    f"tokens_per_expert[{e}] = {counts[e].item()}: expected finite counts "
                    f">= 0, got {_checks.describe(counts)}"
                )
        # float64: integer counts below 2**53 compare with their mean exactly.
        counts = counts.to(device=self.expert_bias.device, dtype=torch.float64)
        step = torch.sign(counts.mean() - counts)
        if unread:  # not checked (a sync): a bad count cancels the whole update
            ok = (torch.isfinite(counts) & (counts >= 0)).all()
            step = torch.where(ok, step, 0.0)
        self.expert_bias.add_(step.to(self.expert_bias.dtype), alpha=float(rate))

    def _forward_quantized(self, x: torch.Tensor) -> MoEOutput:
        """:meth:`forward` on quantised experts: the same routing, losses and capacity, the
        experts by :func:`moe_route.fused_moe` on the codes and scales."""
        H = self.hidden_size
        _check_x(x, H, self.gate.weight.dtype)  # (the experts hold codes, not the dtype)
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


def _check_x(x: object, H: int, dtype: torch.dtype) -> None:
    """Raise unless ``x`` is a ``[..., H]`` tensor of the layer's ``dtype``."""
    _checks.check_tensor("x", x)
    if x.dim() < 1 or x.shape[-1] != H:
        raise ValueError(f"x must be [..., hidden_size] = [..., {H}], got {_checks.describe(x)}")
    if x.dtype != dtype:
        raise TypeError(
            f"x has dtype {x.dtype} but the layer's parameters are {dtype}: convert one of them "
            "(layer.to(dtype) or x.to(dtype))"
        )


def _counts_read_on_host(counts: torch.Tensor) -> bool:
    """Whether ``update_expert_bias`` checks the counts by reading them (CPU tensors);
    elsewhere a read would synchronise, and a negative or non-finite count cancels the update
    on the device instead."""
    return counts.device.type == "cpu"


#: Whether this torch's ``torch.mm`` takes ``out_dtype`` (float32 out of 16-bit CUDA operands:
#: torch 2.8 and later); set False by the first call that finds it does not.
_MM_OUT_DTYPE = True


def _mm_float32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """``a @ b`` in float32 from 16-bit CUDA operands in one matmul, or None where this torch's
    ``torch.mm`` has no ``out_dtype`` (setup.cfg allows torch 2.4)."""
    global _MM_OUT_DTYPE
    if not _MM_OUT_DTYPE:
        return None
    try:
        return torch.mm(a, b, out_dtype=torch.float32)
    except TypeError:  # an unexpected keyword argument: an older torch
        _MM_OUT_DTYPE = False
        return None
