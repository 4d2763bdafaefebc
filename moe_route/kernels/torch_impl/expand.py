"""Expand (permute) rows in the torch backend: one gather of the routed rows, the dropped rows
zero."""

from __future__ import annotations

import torch


# --------------------------------------------------------------------------- expand
def expand_rows_torch(
    x: torch.Tensor, dest_to_src: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """``x_perm[d] = x[dest_to_src[d] mod T]`` for routed rows, zero for dropped ones."""
    if x.device.type != "cpu":
        return _expand_rows_masked(x, dest_to_src, offsets)
    T = x.shape[0]
    n = offsets[-1].item()  # one host read (a memory read on the CPU)
    out = x.new_empty(dest_to_src.numel(), x.shape[1])
    if n:
        torch.index_select(x, 0, dest_to_src[:n] % T, out=out[:n])
    out[n:] = 0
    return out


def _expand_rows_masked(x, dest_to_src, offsets):
    """:func:`expand_rows_torch` without reading ``offsets`` (for GPU tensors): every row
    gathered, the dropped ones zeroed."""
    N, T = dest_to_src.numel(), x.shape[0]
    if T == 0:
        return x.new_zeros(N, x.shape[1])
    rows = x.index_select(0, dest_to_src % T)
    dropped = torch.arange(N, device=x.device) >= offsets[-1]
    return rows.masked_fill_(dropped.unsqueeze(1), 0)
