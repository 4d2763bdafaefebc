"""Expert parallelism: the experts of a :class:`moe_route.MoELayer` sharded over a process group.

Rank ``r`` of a ``torch.distributed`` group of ``W`` ranks holds the ``E/W`` experts
``[r·E/W, (r+1)·E/W)``; the router, the expert bias and the shared experts are replicated. A
forward on the rank's own tokens ``x [T, H]``:

1. routes them locally (the replicated router);
2. when the aux losses or the capacity ask for them, gathers the global statistics in one
   ``all_gather``: the per-expert slot counts and ``T`` (int64), and the per-expert sums of
   router probabilities and of ``logsumexp²`` (float, as their bits), summed on every rank in
   rank order;
3. applies the capacity over the global batch in rank-major token order (a slot's place in its
   expert's queue is the count of that expert's slots on lower ranks plus its place here);
4. works out which ranks each token goes to (those holding any of its experts) and builds the
   *rank maps*: the routing maps of those choices, with the rank as the expert (``K = E =
   W``). Their expand writes the send buffer: the rows for rank ``d`` form one block in token
   order. A token travels **once per destination rank**, whatever the number of its experts
   there, with a metadata row ``[router weights | expert ids + 1]`` (float; ``0``: no slot);
5. exchanges the rows and the metadata (``all_to_all_single``); the received rows are grouped
   by source rank, in the source's token order;
6. runs its experts over the received rows through :func:`moe_route.fused_moe`'s plan and
   launches (as the layer does, without the argument checks), the slots of other ranks
   dropped: each row comes out as the router-weighted sum of its experts here, rounded once;
7. sends those rows back with the reverse split, where they land in the send buffer's
   layout, and adds each token's rows in rank order and the shared expert as the bias: the
   finalize (:func:`moe_route.finalize_moe_routing`) over the rank maps, unit weights.

Against one process, each output sums the same products in fp32 in the same slot order, in
``W`` partial sums each rounded to the activation dtype (one rounding apart from the plain
layer, which rounds once; float64 and float32 agree to a few ulps).

Three ways to size the exchange (``ep_capacity``):

* ``None`` (default): blocks of ``T`` rows, the chunk's own token count: every token fits
  (nothing is ever dropped), and no size is read on the host, so the forward and backward
  compile with ``fullgraph=True`` and can be captured in a CUDA graph. Every rank of the
  group must pass the same number of tokens per call (as in training). A block's rows beyond
  the tokens routed to that rank are zero padding: they travel, but no expert multiplies them.
  With ``K`` experts per token over ``W`` ranks, the routed share of the blocks is about
  ``1 - (1 - 1/W)^K`` (0.90 at ``W = 4``, ``K = 8``).
* an int ``C``: blocks of ``C`` rows, for ranks with different token counts (serving): a
  bound every rank shares. A rank's tokens for another beyond ``C`` are dropped
  deterministically (the first ``C`` in token order travel) and their slots on that rank become
  ``-1`` in ``topk_ids``, like capacity drops; ``C >= T`` never drops.
* ``"exact"``: only the routed rows, with split sizes read on the host: **one host
  synchronisation per forward** (the ``.tolist()`` of the split sizes of every chunk at once,
  after their exchange); the backward reuses the forward's sizes. Any token counts.

``ep_chunks=n`` splits the rank's tokens into ``n`` contiguous chunks (after the routing, the
statistics and the capacity, which see the whole batch) that go through steps 4-7 each: every
chunk's rows are sent before any expert runs, so the all-to-all of one chunk proceeds on the
communication stream while the experts of another compute, and each chunk's results travel
back while the next computes (``ep_capacity`` then counts rows per pair and chunk). The
results equal the unchunked ones (each row's arithmetic is the same).

The backward goes through the same exchanges in reverse (the autograd of
``torch.distributed._functional_collectives.all_to_all_single``): every expert weight gets the
gradient of every rank's tokens, ``x`` its own, the replicated parameters the rank's share (their
sum over ranks is the single-process gradient, as data parallelism expects). ``aux_loss`` has
the global value on every rank; its gradient reaches only the rank's own router probabilities
and logits. The router weights' gradient comes back with the metadata.

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

from .. import arch
from .._checks import check_interpreter_dtype
from .._dispatch import needs_dispatcher
from ..experts import program_for
from ..finalize import finalize_moe_routing
from ..kernels.torch_impl import rank_maps_torch
from ..kernels.triton.rank_maps import rank_maps_triton
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
    #: ``ep_capacity``: ``None`` (tokens per pair of ranks and chunk: the chunk's ``T``),
    #: an int (that many), or ``"exact"`` (the routed tokens, split sizes read on the host).
    capacity: int | str | None
    #: Chunks of the local batch whose exchanges overlap the other chunks' experts.
    chunks: int = 1

    @property
    def first_expert(self) -> int:
        return self.rank * self.num_local_experts

    def rows_per_pair(self, tokens: int) -> int | None:
        """Rows each rank sends every rank for a chunk of ``tokens`` tokens (``None``: the
        exact counts)."""
        if self.capacity is None:
            return tokens
        return None if self.capacity == "exact" else self.capacity

    def __deepcopy__(self, memo):
        # A process group is shared by the copies (it cannot be copied, and a copied layer
        # exchanges over the same ranks).
        return self


#: The most experts an expert-parallel layer holds: the exchange's metadata carries expert ids
#: as float32, exact up to 2**24.
MAX_EXPERTS = 2**24


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
    if num_experts > MAX_EXPERTS:  # the same on every rank: all fail before the collective
        raise ValueError(
            f"num_experts={num_experts} with ep_group: expert parallelism carries expert ids "
            f"in float32 metadata, exact up to {MAX_EXPERTS} experts"
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
    exact = isinstance(capacity, str) and capacity == "exact"
    count = isinstance(capacity, int) and not isinstance(capacity, bool) and capacity >= 1
    if not (capacity is None or exact or count):
        raise ValueError(
            f"ep_capacity={capacity!r}: expected None (every rank's T tokens, no host sync), "
            "an int >= 1 (tokens per pair of ranks, no host sync) or 'exact' (the routed "
            "tokens, one host sync)"
        )
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"ep_chunks={chunks!r}: expected an int >= 1")
    return ExpertParallel(group, W, rank, num_experts // W, capacity, chunks)


# --------------------------------------------------------------------------- exchange helpers
def _exchange(rows: torch.Tensor, out_splits, in_splits, group) -> torch.Tensor:
    """The autograd all-to-all (``None`` splits: equal chunks); its backward is the reverse
    exchange. The result waits lazily: the first op that reads it waits for it."""
    # The functional collective: the autograd one is deprecated, cannot be compiled and waits
    # at once, where the chunks' overlap relies on the lazy wait (docs/decisions.md,
    # "Expert-parallel all-to-all").
    return fc.all_to_all_single_autograd(rows.contiguous(), out_splits, in_splits, group)


def _float_bits(t: torch.Tensor) -> torch.Tensor:
    """float32 / float64 values as the int64 bits of their float64 (exact both ways): to travel
    in one collective with int64 counts."""
    return t.to(torch.float64).view(torch.int64)


def _bits_float(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`_float_bits` undone (``bits`` ``[..., n]`` int64)."""
    return bits.contiguous().view(torch.float64).to(dtype)


def _waited(t: torch.Tensor) -> torch.Tensor:
    """A functional collective's result as a plain tensor (its wait issued: on CUDA a stream
    wait, not the host's). Every op on the wrapper itself dispatches through Python (about
    0.1 ms of host time each), so results are unwrapped before any use."""
    return t.wait() if isinstance(t, fc.AsyncCollectiveTensor) else t


def _run_experts(layer, rows: torch.Tensor, local_ids: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``(Σ_k weights[r, k] · expert_{local_ids[r, k]}(rows[r]), maps)`` over the row's
    slots on this rank (ids outside ``[0, El)``: none; a row with none is a zero row, never
    multiplied), and the maps of ``local_ids``.

    ``fused_moe`` without its argument checks, as :meth:`moe_route.MoELayer.forward` runs it:
    the rows, ids and weights come from the exchange, the parameters are the layer's own."""
    act, layout = layer.activation, layer.gate_up_layout
    w1, w2, b1, b2 = layer.w1, layer.w2, layer.b1, layer.b2
    plan = moe_plan(rows, w1, w2, local_ids.shape[1], act, layout, layer.finalize,
                    layer.deterministic, None, False, layer.backend)  # fmt: skip
    check_interpreter_dtype("x", rows, plan.backend)
    maps = maps_op(local_ids, w1.shape[0], plan.maps_backend)
    program = program_for(rows, w1, w2, weights, b1, b2, None, act, layout, plan.path,
                          plan.gather, False, plan.backend)  # fmt: skip
    return program(rows, w1, w2, weights, maps.tensors(), b1, b2), maps


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


def _rank_maps(layer, ids: torch.Tensor, C: int, tokens: int) -> tuple[RoutingMaps, torch.Tensor]:
    """The rank maps of ``ids`` over ``tokens`` tokens (``K = E = W``: slot ``(t, d)``, token
    ``t`` to rank ``d``) in blocks of ``C`` rows (``0``: the exact layout), and the ids
    without the slots whose token does not travel to their rank
    (:mod:`moe_route.kernels.triton.rank_maps`)."""
    ep = layer.ep
    W, El = ep.size, ep.num_local_experts
    backend = arch.cached_backend(ids.device, layer.backend)
    if backend == "torch" or torch.compiler.is_compiling() or needs_dispatcher((ids,)):
        tables = rank_maps_torch(ids, El, W, C, tokens)
        ids_out = tables[4]
    else:
        N = tokens * W
        s2d, d2s, efs = (ids.new_empty(N, dtype=torch.int32) for _ in range(3))
        off = ids.new_empty(W + 1, dtype=torch.int64)
        ids_out = torch.empty_like(ids)
        rank_maps_triton(ids, El, W, C, tokens, s2d, d2s, efs, off, ids_out)
        tables = (s2d, d2s, efs, off)
    return RoutingMaps._built(tables[:4], tokens, W, W), ids_out


class _Chunk:
    """One chunk of a rank's tokens through the exchange: which ranks each token travels to
    and its rows to send (constructor), the rows out and back (:meth:`send`,
    :meth:`compute`), the sum of what came back (:meth:`combine`).

    A token travels once to each rank that holds any of its experts, with its router weights
    and expert ids (the metadata row ``[weights | ids + 1]``, float, ``0`` for no slot); that
    rank returns one row, the weighted sum of its experts' outputs, and the origin adds the
    rows of the ranks in rank order and the shared expert (the finalize with ``K = W`` and
    unit weights over the "rank maps", whose expert is the destination rank)."""

    def __init__(self, layer, x, ids, weights, ep: ExpertParallel):
        self.layer, self.ep = layer, ep
        T, K = ids.shape
        C = ep.rows_per_pair(T)
        Tp = T if C is None else max(T, C)  # a capacity above T: padding tokens, no slots
        self.T, self.C, self.Tp = T, C, Tp
        maps, ids = _rank_maps(layer, ids, C or 0, Tp)
        if C is None:
            self.counts = torch.diff(maps.expert_first_token_offset)  # [W] rows per rank
        mdt = torch.float64 if x.dtype == torch.float64 else torch.float32
        meta = torch.cat([weights.to(mdt), (ids + 1).to(mdt)], 1)
        if Tp > T:
            x = torch.cat([x, x.new_zeros(Tp - T, x.shape[1])])
            meta = torch.cat([meta, meta.new_zeros(Tp - T, 2 * K)])
        self.maps, self.ids, self.meta_dtype = maps, ids, mdt
        self.rows = expand_rows(x, maps, backend=layer.backend)  # [Tp·W, H]
        self.meta = expand_rows(meta, maps, backend=layer.backend)  # [Tp·W, 2K]
        self.in_splits = self.out_splits = None  # exact mode: set from the count exchange

    def send(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows this rank's experts get from every rank (source-major, token order)
        and their metadata."""
        n = sum(self.in_splits) if self.C is None else self.ep.size * self.C
        g = self.ep.group
        return (
            _exchange(self.rows[:n], self.out_splits, self.in_splits, g),
            _exchange(self.meta[:n], self.out_splits, self.in_splits, g),
        )

    def compute(self, recv: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        """This rank's experts on the received rows; the weighted sums travel back."""
        K, first = self.ids.shape[1], self.ep.first_expert
        # Waited for here, where the experts need them (eager: a stream wait, not the host's),
        # so that the experts get plain tensors.
        recv, meta = _waited(recv), _waited(meta)
        weights = meta[:, :K].contiguous()
        # ids + 1 - (1 + first): the other ranks' experts and the padding rows' zeros fall
        # outside [0, El), which the maps count as dropped slots
        local_ids = (meta[:, K:].detach() - (1 + first)).to(torch.int32)
        y, maps = _run_experts(self.layer, recv, local_ids, weights)
        self.local_counts = torch.diff(maps.expert_first_token_offset)  # [El], every source
        return _exchange(y, self.in_splits, self.out_splits, self.ep.group)

    def combine(self, back: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
        """``out[t] = Σ_d back[row(t, d)] + shared[t]`` over the ranks ``t`` went to."""
        T, Tp, W = self.T, self.Tp, self.ep.size
        N = Tp * W
        back = _waited(back)
        if back.shape[0] < N:  # the exact rows, or a capacity below T: rows that never left
            back = torch.cat([back, back.new_zeros(N - back.shape[0], back.shape[1])])
        if shared is not None and Tp > T:
            shared = torch.cat([shared, shared.new_zeros(Tp - T, shared.shape[1])])
        unit = torch.ones(Tp, W, dtype=self.meta_dtype, device=back.device)
        out = finalize_moe_routing(back, unit, self.maps, bias=shared, backend=self.layer.backend)
        return out if Tp == T else out[:T]


# --------------------------------------------------------------------------- forward
def forward(layer, x2: torch.Tensor):
    """The expert-parallel forward of ``layer`` on this rank's tokens ``x2 [T, H]``.

    Returns the fields of :class:`moe_route.MoEOutput` (``output`` still ``[T, H]``).
    """
    ep: ExpertParallel = layer.ep
    group, W, me = ep.group, ep.size, ep.rank
    T = x2.shape[0]
    E, K = layer.num_experts, layer.top_k
    dev = x2.device
    logits = layer.router_logits(x2)
    weights, ids = layer.route(logits)
    sdt = torch.float64 if logits.dtype == torch.float64 else torch.float32

    # ---- global statistics (no host sync): per-expert slots and T, and the float sums, in
    # one all_gather (the floats travel as their bits)
    lb = z = torch.zeros((), dtype=sdt, device=dev)
    aux_on, z_on = bool(layer.aux_loss_coef), bool(layer.z_loss_coef)
    if aux_on or z_on or layer.capacity_factor is not None:
        local_i = torch.cat([tokens_per_expert(ids, E), torch.full((1,), T, device=dev)])
        if aux_on or z_on:
            parts = [torch.zeros(E, dtype=sdt, device=dev), torch.zeros(1, dtype=sdt, device=dev)]
            if aux_on:
                parts[0] = layer.router_probs(logits).to(sdt).sum(dim=0)
            if z_on:
                parts[1] = torch.logsumexp(logits.to(sdt), dim=-1).square().sum().view(1)
            local_f = torch.cat(parts)
            local_i = torch.cat([local_i, _float_bits(local_f.detach())])
        every = _waited(all_gather(local_i, 0, group)).view(W, -1)
        every_i = every[:, : E + 1]
        total_i = every_i.sum(0)
        denom = total_i[E].clamp(min=1).to(sdt)  # T over all ranks (>= 1, as max(T, 1))
    if aux_on or z_on:
        total_f = _bits_float(every[:, E + 1 :], sdt).sum(0)
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

    # ---- dispatch: per chunk of tokens, the rows for each rank
    n = ep.chunks
    cuts = [c * T // n for c in range(n + 1)]  # static chunk bounds
    spans = list(itertools.pairwise(cuts))
    chunks = [_Chunk(layer, x2[a:b], ids[a:b], weights[a:b], ep) for a, b in spans]
    ids = chunks[0].ids if n == 1 else torch.cat([c.ids for c in chunks])  # minus the drops
    tpe = None
    if ep.capacity == "exact":  # the one host sync: every chunk's split sizes at once
        # with the slots per expert after every drop (tokens_per_expert is global)
        local = torch.cat([tokens_per_expert(ids, E), *(c.counts for c in chunks)])
        every = _waited(all_gather(local, 0, group)).view(W, -1)
        tpe = every[:, :E].sum(0)
        counts = every[:, E:].view(W, n, W)  # [source, chunk, destination]
        sizes = torch.stack([counts[me], counts[:, :, me].t()]).tolist()
        for c, chunk in enumerate(chunks):
            chunk.in_splits, chunk.out_splits = sizes[0][c], sizes[1][c]
    # Every chunk's rows are on their way before any expert runs: the all-to-all of chunk
    # c + 1 runs on the communication stream while the experts of chunk c compute, and the
    # results of chunk c travel back while chunk c + 1 computes.
    recv = [chunk.send() for chunk in chunks]
    back = [chunk.compute(*rows) for chunk, rows in zip(chunks, recv, strict=True)]
    if tpe is None and ep.capacity is None and layer.capacity_factor is None and (aux_on or z_on):
        tpe = total_i[:E]  # nothing was dropped since the statistics counted the slots
    if tpe is None:  # each rank counted its experts' slots from every rank: gather them
        local = chunks[0].local_counts
        for chunk in chunks[1:]:
            local = local + chunk.local_counts
        tpe = _waited(all_gather(local, 0, group))  # [W·El] = [E], in expert order
    shared = layer.shared_expert(x2)  # replicated: computes while the last results travel
    outs = [
        chunk.combine(rows, None if shared is None else shared[a:b])
        for chunk, rows, (a, b) in zip(chunks, back, spans, strict=True)
    ]
    out = outs[0] if n == 1 else torch.cat(outs)
    return out, aux, logits, tpe, ids, weights, lb, z
