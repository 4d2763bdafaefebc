"""MoELayer's router: the gate's logits, the top-k routing, the router's losses, the
capacity's drops and DeepSeek-V3's expert bias (:class:`LayerRouter`, a base of
:class:`moe_route.MoELayer`; the forward lives in :mod:`moe_route.layer`)."""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F

from . import _checks
from .routing import (
    apply_capacity,
    expert_capacity,
    load_balancing_loss,
    route_sigmoid_grouped,
    route_softmax,
    router_z_loss,
)


class LayerRouter:
    """The routing policy of a :class:`moe_route.MoELayer` (which holds ``gate``, ``router``,
    ``top_k``, ``renormalize``, the groups, ``routed_scaling_factor``, ``router_dtype``, the
    loss coefficients, ``capacity_factor``, ``expert_bias`` and the zero-loss cache)."""

    # ------------------------------------------------------------------ routing
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
