"""Expert parallelism: the experts of a :class:`moe_route.MoELayer` sharded over a process group.

Rank ``r`` of a ``torch.distributed`` group of ``W`` ranks holds the ``E/W`` experts
``[r·E/W, (r+1)·E/W)``; the router, the expert bias and the shared experts are replicated. A
forward on the rank's own tokens ``x [T, H]``:

1. routes them locally (the replicated router);
2. when the aux losses or the capacity ask for them, gathers the global statistics: one
   ``all_gather`` of the per-expert slot counts and ``T`` (int64), one of the per-expert sums of
   router probabilities and of ``logsumexp²`` (float), summed on every rank in rank order;
3. applies the capacity over the global batch in rank-major token order (a slot's place in its
   expert's queue is the count of that expert's slots on lower ranks plus its place here);
4. builds the routing maps of the final ids and expands the rows: the permuted order is expert
   ascending, and rank ``d`` owns a contiguous range of experts, so the rows for rank ``d`` are
   the contiguous block ``[offset[d·E/W], offset[(d+1)·E/W])``; dropped slots sit after
   ``offset[E]`` and never travel;
5. exchanges the per-(destination, local expert) counts (an ``all_gather`` of ``[W, E/W]``
   int64, which also gives every rank the global ``tokens_per_expert``), then the rows
   (``all_to_all_single``); the received rows are grouped by source rank, then local expert;
6. runs its experts over the received rows through :func:`moe_route.fused_moe`'s plan and
   launches (as the layer does, without the argument checks) at ``K = 1`` and unit router
   weights (which returns each row's expert output, rounded once: ``1.0·y = y``);
7. sends the results back with the reverse split, where they land in the permuted order of
   step 4, and combines them with :func:`moe_route.finalize_moe_routing` (router weights, the
   ``K``-way reduction in ascending ``k``, the shared expert as its bias): the same arithmetic
   as one process.

Two ways to size the exchange:

* **exact** (default): the routed rows only, with split sizes read on the host: one host
  synchronisation per forward (the ``.tolist()`` of the ``2W`` split sizes per chunk, all
  chunks at once, after the count exchange); the backward reuses the forward's sizes.
* **fixed capacity** (``ep_capacity=C`` rows per (source, destination) pair): every rank sends
  ``W`` blocks of exactly ``C`` rows (the padding is ignored through the exchanged counts), so
  nothing waits on the host: the forward and backward compile with ``fullgraph=True`` and
  can be captured in a CUDA graph. The block for rank ``d`` keeps its first ``C`` rows in the
  permuted order (local expert ascending, then token, then slot); the rows beyond are dropped
  like capacity drops: their slot becomes ``-1`` in ``topk_ids``, contributes nothing to the
  output and is not counted in ``tokens_per_expert``. Nothing is dropped while ``C >= T·K``.
  The price: every rank sends, receives and computes ``W·C`` rows, whatever the routing.

``ep_chunks=n`` splits the rank's tokens into ``n`` contiguous chunks (after the routing, the
statistics and the capacity, which see the whole batch) that go through steps 4-7 each: every
chunk's rows are sent before any expert runs, so the all-to-all of one chunk proceeds on the
communication stream while the experts of another compute, and each chunk's results travel
back while the next computes (``ep_capacity`` then counts rows per pair and chunk). The
results equal the unchunked ones (each row's arithmetic is the same). Only the forward
overlaps: autograd runs the chunks' backward exchanges one after the other.

The backward goes through the same exchanges in reverse (the autograd of
``torch.distributed._functional_collectives.all_to_all_single``): every expert weight gets the
gradient of every rank's tokens, ``x`` its own, the replicated parameters the rank's share (their
sum over ranks is the single-process gradient, as data parallelism expects). ``aux_loss`` has
the global value on every rank; its gradient reaches only the rank's own router probabilities
and logits.

Deterministic: integer counts, exact copies in the exchanges, ``fused_moe`` and the finalize in
fixed order, and the float statistics summed in rank order after an ``all_gather`` (not an
``all_reduce``, whose order belongs to the backend).
"""

from __future__ import annotations

import dataclasses
import itertools
import struct
import zlib

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

from ..experts import run_experts
from ..finalize import finalize_moe_routing
from ..grouped_gemm import check_interpreter_dtype
from ..maps import RoutingMaps, build_routing_maps, maps_op
from ..permute import expand_rows
from ..plan import moe_plan
from ..routing import tokens_per_expert

# Newer torch (2.13 here) names it all_gather_single and warns on all_gather_tensor, the only
# name older releases have.
all_gather = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor


@dataclasses.dataclass(frozen=True, eq=False)
class ExpertParallel:
    """A layer's place in its expert-parallel group (``MoELayer.ep``)."""

    #: The ``torch.distributed`` process group the experts are sharded over.
    group: dist.ProcessGroup
    #: ``W``, ranks in the group.
    size: int
    #: This rank's index in the group.
    rank: int
    #: ``E / W``, experts on each rank; this rank holds ``[rank·E/W, (rank+1)·E/W)``.
    num_local_experts: int
    #: Rows per (source, destination) pair and chunk of the fixed-capacity exchange, or
    #: ``None`` (the exact rows, split sizes read on the host).
    capacity: int | None
    #: Chunks of the local batch whose exchanges overlap the other chunks' experts.
    chunks: int = 1

    @property
    def first_expert(self) -> int:
        return self.rank * self.num_local_experts

    def __deepcopy__(self, memo):
        # A process group is shared by the copies (it cannot be copied, and a copied layer
        # exchanges over the same ranks).
        return self


def _backend_name(group: dist.ProcessGroup) -> str:
    try:
        return str(dist.get_backend(group))
    except (ValueError, RuntimeError):  # a group not registered with c10d
        return group.name() if hasattr(group, "name") else type(group).__name__


def _probe_device(group: dist.ProcessGroup) -> torch.device:
    """The device whose tensors the group's backend exchanges (NCCL: the current GPU)."""
    name = _backend_name(group)
    if "nccl" in name and "cpu:" not in name:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _config_value(value: object) -> int:
    """An int64 that identifies a configuration value the same way on every rank."""
    if isinstance(value, bool) or value is None:
        return -1 if value is None else int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return struct.unpack("<q", struct.pack("<d", value))[0]
    return zlib.crc32(repr(value).encode())  # str, dtype: the same on every rank (no hash())


def _config_text(mine: object, theirs: int) -> str:
    """Another rank's value of a field, read back from its int64 where the type allows."""
    if isinstance(mine, float):
        return repr(struct.unpack("<d", struct.pack("<q", theirs))[0])
    if isinstance(mine, int) and not isinstance(mine, bool):
        return repr(theirs)
    return "another value"


def setup(
    group: object, num_experts: int, capacity: object, chunks: object, config: dict[str, object]
) -> ExpertParallel:
    """Validate an expert-parallel group and check that every rank built the same layer.

    The check is one ``all_to_all_single`` of a few int64 (the configuration values), which
    also proves the backend can do the exchange the forward needs. It is a collective: every
    rank of the group must construct the layer.
    """
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"ep_group must be a torch.distributed ProcessGroup (e.g. dist.new_group(ranks) on "
            f"every rank, or dist.group.WORLD), got {type(group).__name__}; a rank outside the "
            "group gets no group object and cannot hold the layer's experts"
        )
    # The exchange comes first, so that a rank built differently fails with the others below
    # instead of leaving them waiting in the collective.
    W, rank = group.size(), group.rank()
    config = {"ep_capacity": capacity, "ep_chunks": chunks, **config}
    names = list(config)
    mine = torch.tensor([_config_value(config[n]) for n in names], dtype=torch.int64)
    device = _probe_device(group)
    out = torch.empty(W * len(names), dtype=torch.int64, device=device)
    try:
        dist.all_to_all_single(out, mine.to(device).repeat(W), group=group)
    except (RuntimeError, NotImplementedError, ValueError) as err:
        raise ValueError(
            f"ep_group (backend {_backend_name(group)!r}) cannot run all_to_all_single on "
            f"{device} tensors ({err}); expert parallelism exchanges rows with it: use NCCL "
            "for CUDA tensors or gloo for CPU tensors"
        ) from err
    every = out.view(W, len(names)).cpu()
    for i, name in enumerate(names):
        differs = (every[:, i] != mine[i]).nonzero()
        if differs.numel():
            other = int(differs[0, 0])
            theirs = _config_text(config[name], int(every[other, i]))
            raise ValueError(
                f"ep_group: the layer's {name} differs between ranks (rank {rank}: "
                f"{config[name]!r}; rank {other}: {theirs}): every rank of the group must "
                "build the layer with the same arguments and dtype"
            )
    if num_experts % W:
        raise ValueError(
            f"ep_group has {W} ranks, which does not divide num_experts={num_experts}: every "
            "rank must hold the same number of experts"
        )
    if capacity is not None and (
        isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1
    ):
        raise ValueError(
            f"ep_capacity={capacity!r}: expected None (exact exchange, one host sync) or an int "
            ">= 1 (rows per pair of ranks)"
        )
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"ep_chunks={chunks!r}: expected an int >= 1")
    return ExpertParallel(group, W, rank, num_experts // W, capacity, chunks)


# --------------------------------------------------------------------------- exchange helpers
class _PermuteRows(torch.autograd.Function):
    """``out[i] = src[index[i]] if valid[i] else 0``, where ``index`` is a bijection between the
    valid entries of ``out`` and of ``src``; the backward is the same gather through the
    inverse (``inverse``, ``inverse_valid``): no scatter, no atomics."""

    @staticmethod
    def forward(ctx, src, index, valid, inverse, inverse_valid):
        ctx.save_for_backward(inverse, inverse_valid)
        return _gather(src, index, valid)

    @staticmethod
    def backward(ctx, grad):
        inverse, inverse_valid = ctx.saved_tensors
        return _gather(grad, inverse, inverse_valid), None, None, None, None


def _gather(src: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    if src.shape[0] == 0:  # static shape: nothing to read, every entry is invalid
        return src.new_zeros(index.shape[0], *src.shape[1:])
    rows = src.index_select(0, index.clamp(0, src.shape[0] - 1))
    # masked_fill with a Python scalar: a CPU 0-d tensor here is a host-to-device copy, which
    # syncs eagerly and is refused inside CUDA-graph capture.
    return rows.masked_fill(~valid.unsqueeze(1), 0)


def _exchange(rows: torch.Tensor, out_splits, in_splits, group) -> torch.Tensor:
    """The autograd all-to-all (``None`` splits: equal chunks); its backward is the reverse
    exchange. The result waits lazily: the first op that reads it waits for it."""
    # The functional collective: the autograd one is deprecated, cannot be compiled and waits
    # at once, where ep_chunks relies on the lazy wait (docs/decisions.md, "Expert-parallel
    # all-to-all").
    return fc.all_to_all_single_autograd(rows.contiguous(), out_splits, in_splits, group)


def _run_experts(layer, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
    """Each row's output of its local expert (``local_ids [R, 1]``, ``-1``: a zero row).

    ``fused_moe`` without its argument checks, as :meth:`moe_route.MoELayer.forward` runs it:
    the rows and ids are built here, the parameters are the layer's own."""
    wdt = torch.float64 if rows.dtype == torch.float64 else torch.float32
    unit = torch.ones(rows.shape[0], 1, dtype=wdt, device=rows.device)
    act = layer.activation
    plan = moe_plan(rows, layer.w1, layer.w2, 1, act, layer.gate_up_layout, layer.finalize,
                    layer.deterministic, None, False, layer.backend)  # fmt: skip
    check_interpreter_dtype("x", rows, plan.backend)
    maps = maps_op(local_ids, layer.w1.shape[0], plan.maps_backend)
    return run_experts(plan, rows, layer.w1, layer.w2, unit, maps, act, layer.gate_up_layout,
                       layer.b1, layer.b2)  # fmt: skip


def _keep_within(ids: torch.Tensor, num_experts: int, limit: torch.Tensor, backend: str):
    """``apply_capacity`` with a per-expert limit ``[E]``: a slot stays if its place in its
    expert's queue here (token ascending, then slot: the permuted order) is below the limit."""
    T, K = ids.shape
    maps = build_routing_maps(ids, num_experts, backend=backend)
    dest = maps.expanded_source_row_to_expanded_dest_row.view(K, T).t().to(torch.int64)
    expert = maps.expert_for_source_row.view(K, T).t().to(torch.int64).clamp(min=0)
    place = dest - maps.expert_first_token_offset[expert]
    keep = (ids >= 0) & (place < limit[expert])
    return torch.where(keep, ids, torch.full_like(ids, -1))


class _Chunk:
    """One chunk of a rank's tokens through the exchange: routing maps and rows to send
    (constructor), the rows out and back (:meth:`send`, :meth:`compute`), the finalize
    (:meth:`combine`). ``counts [W, E/W]``: its rows for each (destination, local expert)."""

    def __init__(self, layer, x, ids, weights, ep: ExpertParallel):
        self.layer, self.ep, self.weights = layer, ep, weights
        T, K = ids.shape
        W, El = ep.size, ep.num_local_experts
        maps = build_routing_maps(ids, layer.num_experts, backend=layer.backend)
        self.x_perm = expand_rows(x, maps, backend=layer.backend)
        offsets = maps.expert_first_token_offset
        counts = torch.diff(offsets).view(W, El)
        C = ep.capacity
        if C is not None:  # keep the first C rows of each destination's block
            before_in_block = counts.cumsum(1) - counts
            counts = (C - before_in_block).clamp(min=0).minimum(counts)
            efs = maps.expert_for_source_row.to(torch.int64)
            block = offsets[efs.clamp(min=0) // El * El]
            sent = (efs >= 0) & (maps.expanded_source_row_to_expanded_dest_row - block < C)
            ids = torch.where(sent.view(K, T).t(), ids, torch.full_like(ids, -1))
            # the finalize skips the slots not sent, exactly like dropped ones; a slot not sent
            # keeps its dest row inside its expert's range, which the public constructor's
            # check rejects, so these maps are built unchecked
            src_to_dest, dest_to_src, efs, offs = maps.tensors()
            efs = torch.where(sent, efs, -1)
            maps = RoutingMaps._built((src_to_dest, dest_to_src, efs, offs), T, K, maps.num_experts)
            self._fixed_indices(offsets, counts.sum(1), T * K)
        self.maps, self.ids, self.counts = maps, ids, counts
        self.in_splits = self.out_splits = None  # dynamic mode: set from the count exchange
        self.recv_counts = None

    def _fixed_indices(self, offsets, kept, N):
        """The bijection between the sent rows (``[W·C]``, block ``d`` for rank ``d``) and
        the permuted rows (``[N]``) that travel, in both directions."""
        W, El, C = self.ep.size, self.ep.num_local_experts, self.ep.capacity
        dev = offsets.device
        j = torch.arange(C, device=dev)
        block_start = offsets[::El]  # [W+1]: the destinations' blocks of permuted rows
        self.send_index = (block_start[:W].unsqueeze(1) + j).reshape(-1)
        self.send_valid = (j < kept.unsqueeze(1)).reshape(-1)
        p = torch.arange(N, device=dev)
        dest = torch.searchsorted(block_start[1:].contiguous(), p, right=True).clamp(max=W - 1)
        in_block = p - block_start[dest]
        self.row_index = dest * C + in_block
        self.row_valid = (p < offsets[-1]) & (in_block < C)

    def send(self) -> torch.Tensor:
        """The rows this rank's experts get from every rank (source-major, then local expert)."""
        if self.ep.capacity is None:
            routed = sum(self.in_splits)
            rows = self.x_perm[:routed]
            return _exchange(rows, self.out_splits, self.in_splits, self.ep.group)
        rows = _PermuteRows.apply(
            self.x_perm, self.send_index, self.send_valid, self.row_index, self.row_valid
        )
        return _exchange(rows, None, None, self.ep.group)

    def compute(self, recv: torch.Tensor) -> torch.Tensor:
        """Run the local experts on the received rows and send the results back."""
        W, El, C = self.ep.size, self.ep.num_local_experts, self.ep.capacity
        dev = recv.device
        if C is None:
            R = sum(self.out_splits)
            local = torch.arange(El, device=dev).repeat(W)
            local_ids = torch.repeat_interleave(local, self.recv_counts.reshape(-1), output_size=R)
            y = _run_experts(self.layer, recv, local_ids.view(R, 1).to(torch.int32))
            return _exchange(y, self.in_splits, self.out_splits, self.ep.group)
        # row i of a source's C rows belongs to the local expert whose count range holds i
        bounds = self.recv_counts.cumsum(1)
        i = torch.arange(C, device=dev).expand(W, C).contiguous()
        local = torch.searchsorted(bounds, i, right=True)
        local_ids = torch.where(local < El, local, -1).view(W * C, 1).to(torch.int32)
        y = _run_experts(self.layer, recv, local_ids)
        return _exchange(y, None, None, self.ep.group)

    def combine(self, back: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
        """The finalize at the origin: router weights, ``K``-way reduction, shared expert."""
        N, H = self.x_perm.shape
        if self.ep.capacity is None:
            y_perm = torch.cat([back, back.new_zeros(N - back.shape[0], H)])
        else:
            y_perm = _PermuteRows.apply(
                back, self.row_index, self.row_valid, self.send_index, self.send_valid
            )
        return finalize_moe_routing(
            y_perm, self.weights, self.maps, bias=shared, backend=self.layer.backend
        )


# --------------------------------------------------------------------------- forward
def forward(layer, x2: torch.Tensor):
    """The expert-parallel forward of ``layer`` on this rank's tokens ``x2 [T, H]``.

    Returns the fields of :class:`moe_route.MoEOutput` (``output`` still ``[T, H]``).
    """
    ep: ExpertParallel = layer.ep
    group, W, me, El = ep.group, ep.size, ep.rank, ep.num_local_experts
    T = x2.shape[0]
    E, K = layer.num_experts, layer.top_k
    dev = x2.device
    logits = layer.router_logits(x2)
    weights, ids = layer.route(logits)
    sdt = torch.float64 if logits.dtype == torch.float64 else torch.float32

    # ---- global statistics (no host sync): per-expert slots and T, then the float sums
    lb = z = torch.zeros((), dtype=sdt, device=dev)
    aux_on, z_on = bool(layer.aux_loss_coef), bool(layer.z_loss_coef)
    if aux_on or z_on or layer.capacity_factor is not None:
        local_i = torch.cat([tokens_per_expert(ids, E), torch.full((1,), T, device=dev)])
        every_i = all_gather(local_i, 0, group).view(W, E + 1)
        total_i = every_i.sum(0)
        denom = total_i[E].clamp(min=1).to(sdt)  # T over all ranks (>= 1, as max(T, 1))
    if aux_on or z_on:
        parts = [torch.zeros(E, dtype=sdt, device=dev), torch.zeros(1, dtype=sdt, device=dev)]
        if aux_on:
            parts[0] = layer.router_probs(logits).to(sdt).sum(dim=0)
        if z_on:
            parts[1] = torch.logsumexp(logits.to(sdt), dim=-1).square().sum().view(1)
        local_f = torch.cat(parts)
        total_f = all_gather(local_f.detach(), 0, group).view(W, E + 1).sum(0)
        # The global value exactly (local - local.detach() is 0), the local part's gradient.
        sums = total_f + (local_f - local_f.detach())
        if aux_on:
            f = total_i[:E].to(sdt) / denom
            lb = E * (f * (sums[:E] / denom)).sum()
        if z_on:
            z = sums[E] / denom
    aux = layer.aux_loss_coef * lb + layer.z_loss_coef * z

    # ---- capacity over the global batch, rank-major: earlier ranks' slots queue first
    if layer.capacity_factor is not None:
        cap = torch.ceil(layer.capacity_factor * total_i[E].to(torch.float64) * K / E)
        before = every_i[:me, :E].sum(0)  # slots of each expert on lower ranks
        ids = _keep_within(ids, E, cap.to(torch.int64) - before, layer.backend)

    # ---- dispatch: per chunk of tokens, the rows for each rank, then one count exchange
    n = ep.chunks
    cuts = [c * T // n for c in range(n + 1)]  # static chunk bounds (T may differ per rank)
    spans = list(itertools.pairwise(cuts))
    chunks = [_Chunk(layer, x2[a:b], ids[a:b], weights[a:b], ep) for a, b in spans]
    ids = torch.cat([c.ids for c in chunks])  # minus the fixed-capacity drops
    every = torch.stack([c.counts for c in chunks]).reshape(-1)
    every = all_gather(every, 0, group).view(W, n, W, El)  # [source, chunk, dest, local]
    tpe = every.sum((0, 1)).reshape(E)  # global slots per expert, after every drop
    if ep.capacity is None:  # the one host sync: every chunk's split sizes at once
        sizes = torch.stack([every[me, :, :, :].sum(-1), every[:, :, me].sum(-1).t()])
        sizes = sizes.tolist()
        for c, chunk in enumerate(chunks):
            chunk.in_splits, chunk.out_splits = sizes[0][c], sizes[1][c]
    for c, chunk in enumerate(chunks):
        chunk.recv_counts = every[:, c, me]  # [source, local expert]
    # Every chunk's rows are on their way before any expert runs: the all-to-all of chunk
    # c + 1 runs on the communication stream while the experts of chunk c compute.
    recv = [chunk.send() for chunk in chunks]
    back = [chunk.compute(rows) for chunk, rows in zip(chunks, recv, strict=True)]
    shared = layer.shared_expert(x2)
    out = torch.cat([
        chunk.combine(rows, None if shared is None else shared[a:b])
        for chunk, rows, (a, b) in zip(chunks, back, spans, strict=True)
    ])  # fmt: skip
    return out, aux, logits, tpe, ids, weights, lb, z
