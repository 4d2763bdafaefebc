"""Checkpoints of expert-parallel layers: full (single-process) state dicts in and out.

An expert-parallel :class:`moe_route.MoELayer` holds the slice ``[rank·E/W, (rank+1)·E/W)`` of
the expert tensors ``w1``, ``w2``, ``b1``, ``b2``; everything else is replicated. Its own
``state_dict()`` is the per-rank one (the slices) and loads back as usual. In addition:

* ``layer.load_state_dict(full)`` (or a model's, for every expert-parallel layer in it)
  accepts the full ``[E, ...]`` expert tensors of a single-process checkpoint and keeps the
  rank's slice (a load-state-dict pre-hook, :func:`slice_full_experts`);
* :func:`full_state_dict` (``layer.full_state_dict()``) gathers the full tensors, on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch import nn

from .expert_parallel import all_gather

EXPERT_TENSORS = ("w1", "w2", "b1", "b2")


def slice_full_experts(module, state_dict, prefix, local_metadata, strict, missing, unexpected,
                       errors) -> None:  # fmt: skip
    """Load-state-dict pre-hook: replace full ``[E, ...]`` expert tensors by this rank's slice.

    Tensors of the local shape load unchanged; any other shape is left for
    ``load_state_dict``'s own size check to report.
    """
    ep = module.ep
    E, El = module.num_experts, ep.num_local_experts
    if El == E:
        return
    for name in EXPERT_TENSORS:
        key = prefix + name
        value = state_dict.get(key)
        param = getattr(module, name)
        if param is None or not isinstance(value, torch.Tensor) or value.dim() < 1:
            continue
        if value.shape[0] == E and tuple(value.shape[1:]) == tuple(param.shape[1:]):
            state_dict[key] = value.narrow(0, ep.first_expert, El)


def _gather_experts(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return fc.wait_tensor(all_gather(t.detach().contiguous(), 0, group))


@torch.no_grad()
def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with the experts of every expert-parallel MoELayer gathered.

    The result is the state dict of the same model built without ``ep_group`` (full ``[E,
    ...]`` expert tensors, in expert order), on every rank. A collective: every rank of each
    layer's group must call it. It holds the full expert tensors in memory on every rank, on
    the parameters' device; for a model too large for that, save each rank's ``state_dict()``.
    """
    state = module.state_dict()
    for name, sub in module.named_modules():
        ep = getattr(sub, "ep", None)
        if ep is None or not hasattr(sub, "num_experts"):
            continue
        prefix = f"{name}." if name else ""
        for tensor in EXPERT_TENSORS:
            key = prefix + tensor
            if key in state and ep.size > 1:
                state[key] = _gather_experts(state[key], ep.group)
    return state
