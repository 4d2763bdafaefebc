"""Routers, auxiliary losses and expert capacity: the first stage of the MoE token path.

Every function here is plain PyTorch on device tensors: no ``.item()``, ``.tolist()``, no
boolean indexing, no op whose output size depends on values, so all of it runs under
``torch.compile(fullgraph=True)`` and CUDA-graph capture. Counts are integer sums (same bits on
every run); the only float reductions are torch's deterministic ``sum`` / ``mean``.

Routers (``[T, E]`` logits in, ``(topk_weights [T, K], topk_ids [T, K])`` out):

* :func:`softmax_topk` — ``softmax`` over experts, top-``K``, optionally renormalised over the
  ``K`` chosen (Mixtral always, Qwen2/3-MoE by ``norm_topk_prob``). On CUDA one Triton launch
  (:mod:`moe_route.kernels.triton.router_softmax`), forward and backward; :func:`softmax_topk_torch`
  is the same router in torch ops (the ``"torch"`` backend, and the kernel's oracle).
* :func:`sigmoid_grouped_topk` — DeepSeek-V3: sigmoid scores, an additive (aux-loss-free)
  expert bias for the *choice* only, group-limited top-``K``, weights from the unbiased scores.
  On CUDA one Triton launch as well, forward and backward, ``routed_scaling_factor`` included;
  :func:`sigmoid_grouped_topk_torch` is its torch path.

Both score in float32 whatever the logits' dtype (float64 stays float64, for ``gradcheck``);
the caller picks the dtype of the router *matmul* (:class:`moe_route.MoELayer`'s
``router_dtype``). Ids come in descending order of the choice score, ties to the lower expert
id on every device (a stable sort, not ``torch.topk``, whose tie order is unspecified); the
weights are differentiable w.r.t. the logits, the ids are not. The softmax router ranks the
*logits* (the probabilities' order, softmax being monotone), so that no device's rounding of
``exp`` can merge two experts into a tie.

The kernels run as custom ops (schema, fake, autograd): :mod:`moe_route.router_ops`.
Plain-loop oracles of everything here live at the end of :mod:`moe_route.reference`.
"""

from __future__ import annotations

import math

import torch

from . import _checks, arch
from ._dispatch import needs_dispatcher
from ._env import getenv
from .kernels.triton.router_gate import GateLaunch, gate_fits
from .maps import build_routing_maps
from .router_ops import SIGMOID_GROUPED_TOPK, SOFTMAX_TOPK, _score_dtype

ROUTERS = ("softmax", "sigmoid_grouped")


def _topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` along the last dim, ties to the lower index on every device.

    ``torch.topk`` leaves the order of equal values unspecified (on the CPU it put expert 5
    before expert 4 on a tie), and ties are common with bf16 router weights; a stable
    descending sort pins them. Sorting ``E <= 256`` scores per token costs little next to the
    experts' GEMMs, so the defined order is worth it.
    """
    values, ids = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k], ids[..., :k]


def _check_logits(logits: object, k: object) -> tuple[int, int]:
    t = _checks.check_tensor("logits", logits, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    T, E = t.shape
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if not 1 <= k <= E:
        raise ValueError(f"k={k}: expected 1 <= k <= num_experts = logits.shape[1] = {E}")
    return T, E


def softmax_topk(
    logits: torch.Tensor, k: int, renormalize: bool = True, *, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k router (Mixtral: ``renormalize=True``; Qwen3-MoE: ``norm_topk_prob``).

    Args:
        logits: ``[T, E]`` router logits, any float dtype, any strides.
        k: ``K``, experts per token, ``1 <= K <= E``.
        renormalize: divide the ``K`` chosen probabilities by their sum (then they sum to 1).
        backend: ``"auto"`` (one Triton launch on CUDA up to
            :data:`moe_route.kernels.triton.router.MAX_EXPERTS` experts, the torch ops
            otherwise), ``"triton"`` (on the CPU: the interpreter, ``TRITON_INTERPRET=1``),
            ``"torch"``; ``"cupy"`` runs the Triton kernel (CuPy has no router).

    Returns:
        ``topk_weights [T, K]`` float32 (float64 for float64 logits), differentiable w.r.t.
        ``logits``, and ``topk_ids [T, K]`` int32, in descending probability order: descending
        logit, equal logits (``-0.0 == 0.0``) by lower expert id, so the ids are the same bits
        on every device and backend. A NaN logit ranks first (lower id first among NaNs) as in
        ``torch.sort``; a row holding a NaN or ``+inf`` logit, or only ``-inf``, gets NaN
        weights (its softmax is NaN) and NaN gradients.
    """
    _check_logits(logits, k)
    _checks.check_bool("renormalize", renormalize)
    return route_softmax(logits, k, renormalize, backend)


def route_softmax(
    logits: torch.Tensor, k: int, renormalize: bool, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`softmax_topk` without the argument checks (internal composition: the layer)."""
    if router_backend(logits.device, backend, logits.shape[1]) == "torch":
        return softmax_topk_torch(logits, k, renormalize)
    return SOFTMAX_TOPK(logits, k, renormalize)


#: The most tokens whose router runs as one launch (:func:`route_softmax_fused`): each program
#: of 16 tokens reads the whole gate weight. And the most bytes of expert weights the call
#: reads after it (``T*K`` times one expert's): beyond that the layer call is bound by the
#: device, where the one launch is the slower way (one program reads the gate).
FUSED_ROUTER_TOKENS = 64
FUSED_ROUTER_TOUCHED = 256 << 20
_GATE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fused_router(x: torch.Tensor, gate_weight: torch.Tensor, k: int, renormalize: bool,
                 logits_dtype: torch.dtype, expert_bytes: int, backend: str):  # fmt: skip
    """The prepared launch (:class:`moe_route.kernels.triton.router_gate.GateLaunch`) of
    :func:`route_softmax_fused` for this call, or None where it does not serve it: everything
    that decides it except CUDA-graph capture, which the caller asks per call (the layer keeps
    the answer per call signature)."""
    T, E = x.shape[0], gate_weight.shape[0]
    if not 0 < T <= FUSED_ROUTER_TOKENS or x.dtype != gate_weight.dtype:
        return None
    if T * k * expert_bytes > FUSED_ROUTER_TOUCHED:
        return None
    if x.dtype not in _GATE_DTYPES or logits_dtype not in (torch.float32, x.dtype):
        return None
    if not gate_fits(E, gate_weight.numel() * gate_weight.element_size()):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or gate_weight.requires_grad):
        return None
    if torch.compiler.is_compiling() or needs_dispatcher((x, gate_weight)):
        return None
    if router_backend(x.device, backend, E) != "triton":
        return None
    return GateLaunch(x, gate_weight, k, renormalize, logits_dtype)


def route_softmax_fused(x: torch.Tensor, gate_weight: torch.Tensor, k: int, renormalize: bool,
                        logits_dtype: torch.dtype, expert_bytes: int, backend: str):  # fmt: skip
    """``(logits, weights, ids)``: ``logits = x @ gate_weight^T`` in ``logits_dtype`` and
    :func:`softmax_topk` of them, in one launch
    (:func:`moe_route.kernels.triton.router_gate.gate_softmax_topk_triton`), or None where that
    kernel does not serve this call: more than :data:`FUSED_ROUTER_TOKENS` tokens or
    :data:`FUSED_ROUTER_TOUCHED` bytes of expert weights to read (``T*K*expert_bytes``), a gate
    larger than it takes, other dtypes (``logits_dtype`` float32 or ``x``'s), a gradient
    wanted, torch.compile, CUDA-graph capture, tensors that need the dispatcher, the torch
    backend. No argument checks (internal composition: the layer's eager inference).

    The one launch saves host time and a launch but is slower on the device than the matmul and
    the top-k kernel, hence the bound on the experts' bytes: it serves while a call is
    host-bound (docs/decisions.md, "One-launch router").
    """
    launch = fused_router(x, gate_weight, k, renormalize, logits_dtype, expert_bytes, backend)
    if launch is None or (x.is_cuda and torch._C._cuda_isCurrentStreamCapturing()):
        return None
    return launch(x, gate_weight)


def softmax_topk_torch(
    logits: torch.Tensor, k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`softmax_topk` in torch ops, differentiable by autograd (no checks).

    On CUDA the kernel runs instead: this path's stable sort alone costs several times a thin
    launch of host time (docs/decisions.md, "One-launch router").
    """
    scores = logits.to(_score_dtype(logits))
    ids = _topk(scores, k)[1]
    weights = torch.softmax(scores, dim=-1).gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


@arch.env_cached
def router_backend(device: torch.device, backend: str, num_experts: int) -> str:
    """``"triton"`` or ``"torch"``: what runs a router (:func:`softmax_topk`,
    :func:`sigmoid_grouped_topk`) for ``num_experts`` experts on ``device`` (cached like
    :func:`moe_route.arch.cached_backend`; raises before any launch when the kernels cannot
    hold ``num_experts``)."""
    chosen = arch.cached_backend(device, backend)  # names, aliases, MOE_ROUTE_BACKEND
    if chosen == "torch":
        return "torch"
    # The interpreter is for tests: "auto" on a CPU tensor is the torch path unless asked for
    # explicitly (backend="triton" or MOE_ROUTE_BACKEND=triton).
    forced = backend != "auto" or getenv("MOE_ROUTE_BACKEND").strip().lower() == "triton"
    if device.type != "cuda" and not forced:
        return "torch"
    from .kernels.triton.router import MAX_EXPERTS, check_num_experts_supported

    if num_experts > MAX_EXPERTS and backend == "auto":
        return "torch"
    check_num_experts_supported(num_experts)
    return "triton"


def check_groups(num_experts: int, k: int, n_group: object, topk_group: object) -> tuple[int, int]:
    """Validate the group-limited routing sizes; returns ``(n_group, topk_group)``."""
    if isinstance(n_group, bool) or not isinstance(n_group, int) or n_group < 1:
        raise ValueError(f"n_group={n_group!r}: expected an int >= 1")
    if num_experts % n_group:
        raise ValueError(
            f"n_group={n_group} does not divide num_experts={num_experts}: every group must "
            "hold the same number of experts"
        )
    if topk_group is None:
        topk_group = n_group
    if isinstance(topk_group, bool) or not isinstance(topk_group, int):
        raise ValueError(f"topk_group={topk_group!r}: expected an int or None")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group}: expected 1 <= topk_group <= n_group={n_group}")
    kept = topk_group * (num_experts // n_group)
    if k > kept:
        raise ValueError(
            f"k={k} experts per token but topk_group={topk_group} groups of "
            f"{num_experts // n_group} experts keep only {kept}: expected k <= {kept}"
        )
    return n_group, topk_group


def sigmoid_grouped_topk(
    logits: torch.Tensor,
    k: int,
    *,
    n_group: int = 1,
    topk_group: int | None = None,
    expert_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    renormalize: bool = True,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 router: sigmoid scores, group-limited top-k, aux-loss-free expert bias.

    With ``s = sigmoid(logits)`` and choice scores ``c = s + expert_bias``:

    1. the ``E`` experts form ``n_group`` consecutive groups of ``G = E / n_group``; a group's
       score is the sum of its top-2 choice scores (its top-1 when ``G = 1``);
    2. the ``topk_group`` best groups are kept (ties: lower group index; likewise below);
    3. the ids are the top-``K`` choice scores among the kept experts (the others are ``-inf``;
       transformers fills them with ``0``, which differs only when a kept choice score is
       negative, i.e. with a negative bias);
    4. the weights are the *unbiased* ``s`` of those ids, divided by their sum
       (``+ 1e-20``) when ``renormalize``, then multiplied by ``routed_scaling_factor``.

    Order and ties as ``torch.sort`` / ``torch.topk`` rank: descending, equal scores (group
    scores in step 2, choice scores in step 3) to the lower index, NaN above ``+inf``.

    Args:
        logits: ``[T, E]``, any float dtype, any strides (scored in float32).
        k: ``K``, experts per token.
        n_group, topk_group: group limit (``topk_group=None``: all groups, no limit).
        expert_bias: optional ``[E]`` float on the logits' device; steers the choice only,
            never the weights, and gets no gradient (``MoELayer.update_expert_bias`` learns it
            from the load).
        routed_scaling_factor: multiplies the final weights (inside the kernel).
        renormalize: ``norm_topk_prob`` of DeepSeek-V3 (True there).
        backend: as :func:`softmax_topk`: ``"auto"`` (one Triton launch on CUDA up to
            :data:`moe_route.kernels.triton.router.MAX_EXPERTS` experts, the torch ops
            otherwise), ``"triton"``, ``"torch"`` (:func:`sigmoid_grouped_topk_torch`);
            ``"cupy"`` runs the Triton kernel.

    Returns:
        ``topk_weights [T, K]`` float32 (float64 for float64 logits), differentiable w.r.t.
        ``logits``, and ``topk_ids [T, K]`` int32, in descending choice-score order. The
        kernel computes the scores as torch does (the same bits on CUDA), so its ids are the
        torch path's on the same device; its weights are within a few ulps of them.
    """
    _, E = _check_logits(logits, k)
    n_group, topk_group = check_groups(E, k, n_group, topk_group)
    if expert_bias is not None:
        _checks.check_tensor("expert_bias", expert_bias, ndim=1, dtypes=_checks.FLOAT_DTYPES)
        if expert_bias.shape[0] != E:
            raise ValueError(
                f"expert_bias must be [E] = [{E}], got {_checks.describe(expert_bias)}"
            )
        _checks.check_same_device(logits=logits, expert_bias=expert_bias)
    if isinstance(routed_scaling_factor, bool) or not isinstance(
        routed_scaling_factor, (int, float)
    ):
        raise TypeError(
            f"routed_scaling_factor must be a number, got {type(routed_scaling_factor).__name__}"
        )
    _checks.check_bool("renormalize", renormalize)
    return route_sigmoid_grouped(logits, k, n_group, topk_group, expert_bias,
                                 float(routed_scaling_factor), renormalize, backend)  # fmt: skip


def route_sigmoid_grouped(
    logits: torch.Tensor,
    k: int,
    n_group: int,
    topk_group: int,
    expert_bias: torch.Tensor | None,
    routed_scaling_factor: float,
    renormalize: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sigmoid_grouped_topk` without the argument checks (internal composition: the
    layer); ``topk_group`` an int, ``routed_scaling_factor`` a float."""
    if router_backend(logits.device, backend, logits.shape[1]) == "torch":
        return sigmoid_grouped_topk_torch(logits, k, n_group, topk_group, expert_bias,
                                          routed_scaling_factor, renormalize)  # fmt: skip
    if expert_bias is not None and expert_bias.requires_grad:
        expert_bias = expert_bias.detach()  # no gradient, as the torch path detaches it
    return SIGMOID_GROUPED_TOPK(logits, expert_bias, k, n_group, topk_group, renormalize,
                                routed_scaling_factor)  # fmt: skip


def sigmoid_grouped_topk_torch(
    logits: torch.Tensor,
    k: int,
    n_group: int,
    topk_group: int,
    expert_bias: torch.Tensor | None,
    routed_scaling_factor: float,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sigmoid_grouped_topk` in torch ops, differentiable by autograd (no checks): the
    ``"torch"`` backend, and the kernel's oracle.

    On CUDA the kernel runs instead: this path is a dozen launches (docs/decisions.md,
    "One-launch router").
    """
    T, E = logits.shape
    scores = torch.sigmoid(logits.to(_score_dtype(logits)))
    choice = scores.detach()
    if expert_bias is not None:
        choice = choice + expert_bias.detach().to(choice.dtype)
    if topk_group < n_group:
        G = E // n_group
        grouped = choice.view(T, n_group, G)
        group_scores = grouped.topk(min(2, G), dim=-1).values.sum(dim=-1)  # [T, n_group]
        keep = torch.zeros(T, n_group, dtype=torch.bool, device=logits.device)
        keep.scatter_(1, _topk(group_scores, topk_group)[1], True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, E)
    ids = _topk(choice, k)[1]
    weights = scores.gather(1, ids)  # unique ids per row: the backward's scatter is exact
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, ids.to(torch.int32)


# --------------------------------------------------------------------------- counts, losses
def tokens_per_expert(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[E] int64``: routed slots per expert (``-1`` and out-of-range ids not counted).

    An integer ``scatter_add`` (exact in any order, so deterministic), with no host sync and
    no ``[T, K, E]`` one-hot in memory.
    """
    ids = topk_ids.reshape(-1).to(torch.int64)
    routed = (ids >= 0) & (ids < num_experts)
    slot = torch.where(routed, ids, num_experts)  # a trash bin past the last expert
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, slot, torch.ones_like(slot))
    return counts[:num_experts]


def load_balancing_loss(
    router_probs: torch.Tensor, topk_ids: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """Switch / Mixtral load-balancing loss, exactly as transformers'
    ``load_balancing_loss_func`` for one layer without attention mask::

        loss = E · Σ_e f_e · P_e
        f_e = (1/T) · #{(t, k) : topk_ids[t, k] = e}   # fraction of tokens whose top-k holds e
        P_e = (1/T) · Σ_t router_probs[t, e]            # mean router probability of e

    (transformers sums ``f`` per slot ``k`` against ``P``, which is the same since a token's
    ``K`` ids are distinct.) Uniform routing (``P_e = 1/E``, ``f_e = K/E``) gives ``K``; the
    minimum over all routings is ``K`` as well when the probabilities follow the counts.
    Dropped slots (``-1``) count for no expert. Only ``P`` carries a gradient.

    Args:
        router_probs: ``[T, E]`` float, each row a distribution (the softmax of the logits;
            :class:`moe_route.MoELayer` passes the normalised sigmoid scores for the
            DeepSeek router).
        topk_ids: ``[T, K]`` int, the router's choice (before any capacity drop).
        num_experts: ``E``.

    Returns:
        A float32 scalar (float64 for float64 probabilities); zero when ``T = 0``.
    """
    _checks.check_tensor("router_probs", router_probs, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    _checks.check_tensor("topk_ids", topk_ids, ndim=2, dtypes=_checks.INDEX_DTYPES)
    T, E = router_probs.shape
    if num_experts != E or topk_ids.shape[0] != T:
        raise ValueError(
            f"router_probs {_checks.describe(router_probs)} must be [T, E] with E = "
            f"num_experts = {num_experts} and T = topk_ids.shape[0] = {topk_ids.shape[0]}"
        )
    dtype = _score_dtype(router_probs)
    denom = max(T, 1)  # a static shape, never a device value
    f = tokens_per_expert(topk_ids, E).to(dtype) / denom
    P = router_probs.to(dtype).sum(dim=0) / denom
    return E * (f * P).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: ``mean_t (logsumexp_e logits[t, e])²`` in float32 (float64 stays).

    Zero when ``T = 0``. Keeps the logits small, so the router's softmax stays well-conditioned.
    """
    _checks.check_tensor("logits", logits, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    lse = torch.logsumexp(logits.to(_score_dtype(logits)), dim=-1)
    return lse.square().sum() / max(logits.shape[0], 1)


# --------------------------------------------------------------------------- capacity
def expert_capacity(capacity_factor: float, num_tokens: int, top_k: int, num_experts: int) -> int:
    """``ceil(capacity_factor · T · K / E)``, at most ``T · K``: the most slots one expert keeps
    (static shapes).

    ``T · K`` is every slot of the batch, so a factor ``>= E`` keeps them all: the result is
    capped there, and an absurdly large factor (``1e308``) means "drop nothing" rather than
    overflowing.

    Args:
        capacity_factor: a finite number ``> 0`` (``TypeError`` / ``ValueError`` otherwise).
        num_tokens: ``T >= 0``. top_k: ``K >= 1``. num_experts: ``E >= 1``. Python ints.
    """
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)):
        raise TypeError(f"capacity_factor must be a number, got {type(capacity_factor).__name__}")
    if not capacity_factor > 0 or (
        isinstance(capacity_factor, float) and math.isinf(capacity_factor)
    ):
        raise ValueError(f"capacity_factor={capacity_factor}: expected a finite number > 0")
    T = _checks.check_size("num_tokens", num_tokens, 0)
    K = _checks.check_size("top_k", top_k, 1)
    E = _checks.check_num_experts(num_experts)
    if capacity_factor >= E:  # compared exactly: c · T · K / E could overflow a float
        return T * K
    return math.ceil(capacity_factor * T * K / E)


def apply_capacity(
    topk_ids: torch.Tensor, num_experts: int, capacity: int, *, backend: str = "auto"
) -> torch.Tensor:
    """Drop (set to ``-1``) every slot beyond its expert's ``capacity``, earliest tokens first.

    An expert keeps its slots in the order token ``t`` ascending, then slot ``k``, which is the
    routing maps' permuted order inside one expert: a slot's rank in its expert is its dest row
    minus ``expert_first_token_offset[e]``, so this builds the maps of
    :func:`moe_route.build_routing_maps` (``backend`` picks their kernel) and keeps the slots
    of rank ``< capacity``. Deterministic, no host sync.

    Args:
        topk_ids: ``[T, K]`` int32/int64; ``-1`` slots stay dropped.
        num_experts: ``E``.
        capacity: slots per expert, an int ``>= 0`` (see :func:`expert_capacity`); any
            capacity ``>= T · K`` drops nothing.

    Returns:
        ``[T, K]`` ids of ``topk_ids``'s dtype (a new tensor).
    """
    E = _checks.check_num_experts(num_experts)
    ids = _checks.check_topk_ids(topk_ids, E)
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        raise TypeError(f"capacity must be an int, got {type(capacity).__name__} {capacity!r}")
    if capacity < 0:
        raise ValueError(f"capacity={capacity!r}: expected an int >= 0")
    T, K = ids.shape
    # Past T·K it keeps every slot; clamped, it compares as an int64 without overflow.
    capacity = min(capacity, T * K)
    maps = build_routing_maps(ids, E, backend=backend)
    dest = maps.expanded_source_row_to_expanded_dest_row.view(K, T).t().to(torch.int64)
    expert = maps.expert_for_source_row.view(K, T).t().to(torch.int64)
    first = maps.expert_first_token_offset[expert.clamp(min=0)]
    keep = (expert >= 0) & (dest - first < capacity)
    return torch.where(keep, ids, torch.full_like(ids, -1))
