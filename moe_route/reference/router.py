"""Reference routers: softmax top-``K`` in torch ops, and loop oracles of what
:mod:`moe_route.routing` computes (both routers, the load-balancing and z losses, the expert
capacity)."""

from __future__ import annotations

import math as _math

import torch

from ._dtype import _compute_dtype


def topk_routing_reference(
    router_logits: torch.Tensor, top_k: int, *, renormalize: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing (Mixtral renormalises, Qwen3-MoE does by option).

    Args:
        router_logits: ``[T, E]`` float.
        top_k: ``K``, experts per token.
        renormalize: divide the K selected probabilities by their sum.

    Returns:
        ``(topk_weights [T, K] float32, topk_ids [T, K] int32)``; ids of a token in descending
        probability order (ties: lower expert id first, as ``torch.topk``).
    """
    probs = torch.softmax(router_logits.to(_compute_dtype(router_logits)), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(torch.float32), ids.to(torch.int32)


# --------------------------------------------------------------------------- loop oracles
# Oracles of moe_route/routing.py, written independently of it: one token (or one slot) at a
# time in Python float64 arithmetic, no torch.topk, no masks. Slow by design; tests only.
def _ranked(values: list[float], candidates) -> list[int]:
    """Candidates by descending value, ties to the lower index (``torch.topk``'s order)."""
    return sorted(candidates, key=lambda i: (-values[i], i))


def softmax_topk_reference(
    logits: torch.Tensor, k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loop: softmax, the ``k`` most probable experts, optionally renormalised.

    The experts rank by logit (the probabilities' order, without ties that only the rounding of
    ``exp`` makes), ties to the lower id. Finite logits only.

    Returns ``(topk_weights [T, K] float32, topk_ids [T, K] int32)``.
    """
    weights, ids = [], []
    for row in logits.double().tolist():
        top = max(row)
        exps = [_math.exp(v - top) for v in row]
        total = sum(exps)
        probs = [v / total for v in exps]
        chosen = _ranked(row, range(len(row)))[:k]
        w = [probs[e] for e in chosen]
        if renormalize:
            s = sum(w)
            w = [v / s for v in w]
        weights.append(w)
        ids.append(chosen)
    return _router_result(weights, ids, k)


def sigmoid_grouped_topk_reference(
    logits: torch.Tensor,
    k: int,
    *,
    n_group: int = 1,
    topk_group: int | None = None,
    expert_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    renormalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loop of the DeepSeek-V3 router (see ``routing.sigmoid_grouped_topk``).

    Returns ``(topk_weights [T, K] float32, topk_ids [T, K] int32)``.
    """
    E = logits.shape[1]
    G = E // n_group
    topk_group = n_group if topk_group is None else topk_group
    bias = [0.0] * E if expert_bias is None else expert_bias.double().tolist()
    weights, ids = [], []
    for row in logits.double().tolist():
        scores = [1.0 / (1.0 + _math.exp(-v)) for v in row]
        choice = [s + b for s, b in zip(scores, bias, strict=True)]
        group_score = []
        for g in range(n_group):
            members = _ranked(choice, range(g * G, (g + 1) * G))
            group_score.append(sum(choice[e] for e in members[:2]))
        kept = _ranked(group_score, range(n_group))[:topk_group]
        candidates = [e for g in kept for e in range(g * G, (g + 1) * G)]
        chosen = _ranked(choice, candidates)[:k]
        w = [scores[e] for e in chosen]
        if renormalize:
            s = sum(w) + 1e-20
            w = [v / s for v in w]
        weights.append([v * routed_scaling_factor for v in w])
        ids.append(chosen)
    return _router_result(weights, ids, k)


def _router_result(weights, ids, k):
    T = len(ids)
    return (
        torch.tensor(weights, dtype=torch.float64).reshape(T, k).to(torch.float32),
        torch.tensor(ids, dtype=torch.int64).reshape(T, k).to(torch.int32),
    )


def load_balancing_loss_reference(
    router_probs: torch.Tensor, topk_ids: torch.Tensor, num_experts: int
) -> float:
    """``E · Σ_e f_e · P_e`` with ``f_e`` the fraction of tokens whose (routed) top-k holds
    ``e`` and ``P_e`` the mean probability of ``e``; a Python float."""
    probs = router_probs.double().tolist()
    ids = topk_ids.tolist()
    T = max(len(ids), 1)
    total = 0.0
    for e in range(num_experts):
        f = sum(1 for row in ids if e in row) / T
        P = sum(row[e] for row in probs) / T
        total += f * P
    return num_experts * total


def router_z_loss_reference(logits: torch.Tensor) -> float:
    """``mean_t (log Σ_e exp logits[t, e])²``; a Python float."""
    rows = logits.double().tolist()
    total = 0.0
    for row in rows:
        top = max(row)
        lse = top + _math.log(sum(_math.exp(v - top) for v in row))
        total += lse * lse
    return total / max(len(rows), 1)


def apply_capacity_reference(
    topk_ids: torch.Tensor, num_experts: int, capacity: int
) -> torch.Tensor:
    """Walk the slots token by token (then slot by slot); an expert keeps its first
    ``capacity`` slots, later ones become ``-1``."""
    ids = topk_ids.tolist()
    used = [0] * num_experts
    for row in ids:
        for k, e in enumerate(row):
            if e < 0:
                continue
            if used[e] < capacity:
                used[e] += 1
            else:
                row[k] = -1
    return torch.tensor(ids, dtype=topk_ids.dtype).reshape(topk_ids.shape)
