"""MoELayer's expert weights: per-expert modules copied into the stacked layout, and the
experts quantised in place or loaded quantised (:class:`ExpertWeights`, a base of
:class:`moe_route.MoELayer`; the forward lives in :mod:`moe_route.layer`, the routing in
:mod:`moe_route.layer_router`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from . import _checks
from .quant import QuantSpec, as_quant, check_weight
from .quant import quantize_experts as quantize_weights

if TYPE_CHECKING:
    from .layer import MoELayer


class ExpertWeights:
    """Loading and quantising the experts of a :class:`moe_route.MoELayer` (which holds
    ``w1`` / ``w2`` / ``b1`` / ``b2``, the gate, the shared expert, ``ep`` and its call memo)."""

    # ------------------------------------------------------------------ loading
    @torch.no_grad()
    def load_experts_(
        self,
        experts: Sequence[nn.Module],
        *,
        gate: nn.Module | torch.Tensor | None = None,
        shared_expert: nn.Module | None = None,
        shared_expert_gate: nn.Module | torch.Tensor | None = None,
    ) -> MoELayer:
        """Copy per-expert modules into the stacked layout (either ``gate_up_layout``).

        Args:
            experts: ``E`` modules, each with ``nn.Linear`` children ``gate_proj [I, H]``,
                ``up_proj [I, H]``, ``down_proj [H, I]`` (Llama / Qwen / DeepSeek) or Mixtral's
                ``w1`` (gate), ``w3`` (up), ``w2`` (down). For a plain activation: ``up_proj``
                and ``down_proj`` (or ``w1`` and ``w2``). Linear biases go to ``b1`` / ``b2``
                (a missing one counts as zero; a bias into a ``bias=False`` layer is an error).
            gate: the router, an ``nn.Linear(H, E)`` without bias or its ``[E, H]`` weight.
            shared_expert: a module of the same form, of width ``S`` (``shared_w1``/``w2``).
            shared_expert_gate: ``nn.Linear(H, 1)`` or its ``[1, H]`` weight (Qwen2-MoE).

        Returns:
            ``self``. Values are copied (converted to the layer's dtype and device). An
            expert-parallel layer takes all ``E`` modules and copies its own experts.
        """
        if self.quant is not None:
            raise RuntimeError(f"the experts are quantised ({str(self.quant)!r}): load them into "
                               "an unquantised layer, then quantize_experts()")  # fmt: skip
        if len(experts) != self.num_experts:
            raise ValueError(f"experts has {len(experts)} modules, expected num_experts = "
                             f"{self.num_experts}")  # fmt: skip
        first = 0 if self.ep is None else self.ep.first_expert
        for e, module in enumerate(experts):
            w1, b1, w2, b2 = self._expert_tensors(module, f"experts[{e}]", self.intermediate_size)
            if not 0 <= e - first < self.w1.shape[0]:
                continue  # another rank's expert
            self.w1[e - first].copy_(w1)
            self.w2[e - first].copy_(w2)
            if self.b1 is not None:
                self.b1[e - first].copy_(b1)
                self.b2[e - first].copy_(b2)
        if gate is not None:
            self._copy_weight(self.gate.weight, gate, "gate")
        if shared_expert is not None:
            if self.shared_w1 is None:
                raise ValueError("shared_expert given but the layer has num_shared_experts=0")
            S = self.shared_w2.shape[1]
            w1, b1, w2, b2 = self._expert_tensors(shared_expert, "shared_expert", S, bias=False)
            self.shared_w1.copy_(w1)
            self.shared_w2.copy_(w2)
        if shared_expert_gate is not None:
            if self.shared_gate is None:
                raise ValueError("shared_expert_gate given but the layer has no shared gate")
            self._copy_weight(self.shared_gate.weight, shared_expert_gate, "shared_expert_gate")
        return self

    @classmethod
    def from_experts(
        cls,
        experts: Sequence[nn.Module],
        top_k: int,
        *,
        gate: nn.Module | torch.Tensor | None = None,
        shared_expert: nn.Module | None = None,
        shared_expert_gate: nn.Module | torch.Tensor | None = None,
        **kwargs,
    ) -> MoELayer:
        """A layer holding copies of per-expert modules (see :meth:`load_experts_`).

        ``H``, ``I``, ``E``, ``bias``, the shared expert's width, ``dtype`` and ``device`` come
        from the modules; ``kwargs`` are the other :class:`MoELayer` options (``activation``
        must match the modules: gated ones need a gate projection).
        """
        if not experts:
            raise ValueError("experts is empty: expected one module per expert")
        down = _linear_of(experts[0], ("down_proj", "w2"), "experts[0]")
        H, inter = down.weight.shape
        kwargs.setdefault("bias", down.bias is not None)
        kwargs.setdefault("dtype", down.weight.dtype)
        kwargs.setdefault("device", down.weight.device)
        if shared_expert is not None:
            s_down = _linear_of(shared_expert, ("down_proj", "w2"), "shared_expert")
            kwargs.setdefault("num_shared_experts", 1)
            kwargs.setdefault(
                "shared_intermediate_size", s_down.weight.shape[1] // kwargs["num_shared_experts"]
            )
        if shared_expert_gate is not None:
            kwargs.setdefault("shared_expert_gate", True)
        layer = cls(H, inter, len(experts), top_k, **kwargs)
        return layer.load_experts_(
            experts, gate=gate, shared_expert=shared_expert, shared_expert_gate=shared_expert_gate
        )

    def _expert_tensors(self, module: nn.Module, where: str, width: int, *, bias: bool = True):
        """``(w1 [N1, H], b1 [N1], w2 [H, width], b2 [H])`` of one per-expert module."""
        H = self.hidden_size
        gated = self._activation.gated
        if gated:
            if hasattr(module, "gate_proj"):
                names = ("gate_proj", "up_proj", "down_proj")
            else:
                names = ("w1", "w3", "w2")
            g, u, d = (_linear_of(module, (n,), where) for n in names)
            parts = (g, u)
        else:
            u = _linear_of(module, ("up_proj", "w1"), where)
            d = _linear_of(module, ("down_proj", "w2"), where)
            parts = (u,)
        for lin in parts:
            _expect_shape(lin.weight, (width, H), f"{where} {_name_in(module, lin)}.weight")
        _expect_shape(d.weight, (H, width), f"{where} {_name_in(module, d)}.weight")
        has_bias = self.b1 is not None and bias
        for lin in (*parts, d):
            if lin.bias is not None and not has_bias:
                raise ValueError(
                    f"{where} {_name_in(module, lin)} has a bias but the layer has bias=False: "
                    "build it with bias=True (shared experts take no bias)"
                )
        ws = [p.weight for p in parts]
        bs = [p.bias if p.bias is not None else p.weight.new_zeros(width) for p in parts]
        if gated and self.gate_up_layout == "interleaved":
            w1 = torch.stack(ws, dim=1).reshape(2 * width, H)
            b1 = torch.stack(bs, dim=1).reshape(2 * width)
        else:
            w1, b1 = torch.cat(ws, dim=0), torch.cat(bs, dim=0)
        b2 = d.bias if d.bias is not None else d.weight.new_zeros(H)
        return w1, b1, d.weight, b2

    @staticmethod
    def _copy_weight(dst: torch.Tensor, src: nn.Module | torch.Tensor, what: str) -> None:
        if isinstance(src, nn.Module):
            if getattr(src, "bias", None) is not None:
                raise ValueError(f"{what} has a bias; the layer's router and gate have none")
            src = src.weight
        _expect_shape(src, tuple(dst.shape), f"{what} weight")
        dst.copy_(src)

    # ------------------------------------------------------------------ quantised experts
    #: The experts' format once quantised (:meth:`quantize_experts`, or loaded from a quantised
    #: state dict), else None (16/32-bit ``w1`` / ``w2`` Parameters).
    quant: QuantSpec | None = None

    @torch.no_grad()
    def quantize_experts(self, quant: str | QuantSpec = "fp8") -> MoELayer:
        """Quantise the experts in place, for inference or adapter training on a frozen base.

        ``w1`` / ``w2`` stop being Parameters: they become frozen buffers of codes, beside their
        scales, so ``state_dict()`` holds (DeepSeek-V3 / transformers naming, the scales being
        the multipliers: ``w ≈ codes * scale`` block by block)

        ====================  =====================================================
        ``w1``, ``w2``        codes in the layout of ``quant`` (:mod:`moe_route.quant`),
                              same ``[E, N, K]`` as before (mxfp4: ``K/2`` bytes)
        ``w1_scale_inv``,     their scales: fp8 ``[E, ceil(N/128), ceil(K/128)]``
        ``w2_scale_inv``      float32, fp8_channel ``[E, N]``, mxfp4 ``[E, N, K/32]`` uint8
        ====================  =====================================================

        The forward then runs ``fused_moe(..., quant=quant)`` (FP8: the tokens quantised per
        call; the standalone finalize whatever ``finalize`` says). Gradients reach ``x``, the
        router (``gate.weight``, through the router weights), ``b1`` / ``b2`` and the shared
        expert, never the experts' codes. Build optimizers after this call (the old ``w1`` /
        ``w2`` Parameters are gone). ``layer.to(dtype)`` leaves the codes and scales as they are.

        A quantised state dict loads into a layer of the same shapes, quantised or not:
        ``load_state_dict`` quantises an unquantised layer first (the format read from the
        codes' dtype and the scales' shape: ``fp8``, ``fp8[ROWSx128]``, ``fp8_channel``,
        ``mxfp4``; power-of-two ``fp8_ue8m0`` scales are not told apart from ``fp8``'s: call
        ``quantize_experts("fp8_ue8m0")`` before loading those), then copies the codes and
        scales bit for bit.

        Args:
            quant: ``"fp8"`` (default), ``"fp8_ue8m0"``, ``"fp8[ROWSxCOLS]"``, ``"fp8_channel"``,
                ``"mxfp4"`` or a :class:`moe_route.QuantSpec`.

        Returns:
            ``self``.

        Raises:
            RuntimeError: the experts are quantised already.
            ValueError: an unknown format, or weights with NaN / infinite values.
            TypeError: a float64 layer (quantised experts take bf16 / fp16 / fp32 tokens).
            NotImplementedError: an expert-parallel layer.
        """
        if self.quant is not None:
            raise RuntimeError(
                f"the experts are already quantised ({str(self.quant)!r}): quantise an "
                "unquantised layer (quantising codes again would compound the error)"
            )
        spec = as_quant(quant)
        if spec is None:
            raise ValueError("quant=None: name a format to quantise to (e.g. quant='fp8')")
        self._check_quantizable()
        w1, s1 = quantize_weights(self.w1.detach(), spec)
        w2, s2 = quantize_weights(self.w2.detach(), spec)
        self._set_quantized(spec, w1, s1, w2, s2)
        return self

    def _check_quantizable(self) -> None:
        if self.ep is not None:
            raise NotImplementedError("quantised experts on an expert-parallel layer are not "
                                      "supported yet")  # fmt: skip
        if self.w1.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(
                f"the layer is {self.w1.dtype}: quantised experts take bf16 / fp16 / fp32 "
                "tokens (layer.to(torch.bfloat16) first)"
            )

    def _set_quantized(self, spec: QuantSpec, w1, s1, w2, s2) -> None:
        """Replace the ``w1`` / ``w2`` Parameters by buffers of codes and scales (checked)."""
        E, n1, H = self.w1.shape
        check_weight("w1", w1, "w1_scale_inv", s1, spec, (E, n1, H), "the layer's w1")
        check_weight("w2", w2, "w2_scale_inv", s2, spec, tuple(self.w2.shape), "the layer's w2")
        device = self.w1.device
        del self.w1, self.w2
        for name, t in (("w1", w1), ("w1_scale_inv", s1), ("w2", w2), ("w2_scale_inv", s2)):
            self.register_buffer(name, t.to(device))
        self.quant = spec
        self._calls.clear()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):  # fmt: skip
        # A quantised state dict (codes + *_scale_inv) quantises an unquantised layer first
        # (empty codes and scales of its format, then copied over); a 16/32-bit one cannot go
        # into a quantised layer (it would be cast to codes silently).
        codes, scale = state_dict.get(prefix + "w1"), state_dict.get(prefix + "w1_scale_inv")
        if self.quant is None and scale is not None and isinstance(codes, torch.Tensor):
            try:
                spec = _quant_of(codes, scale)
                self._check_quantizable()
                E, n1, H = self.w1.shape
                w2_shape = tuple(self.w2.shape)
                empty = [torch.empty(0)] * 4
                for i, shape in enumerate(((E, n1, H), w2_shape)):
                    E_, N, K = shape
                    empty[2 * i : 2 * i + 2] = _empty_quantized(spec, E_, N, K, self.w1.device)
                self._set_quantized(spec, *empty)
            except (TypeError, ValueError, NotImplementedError) as exc:
                error_msgs.append(f"quantised experts in the state dict ({prefix}w1, "
                                  f"{prefix}w1_scale_inv): {exc}")  # fmt: skip
                return
        elif (
            self.quant is not None
            and isinstance(codes, torch.Tensor)
            and (codes.dtype != self.w1.dtype or scale is None)
        ):
            error_msgs.append(
                f"{prefix}w1 is {codes.dtype}{'' if scale is not None else ' without w1_scale_inv'}"
                f" but the layer's experts are quantised ({str(self.quant)!r}: {self.w1.dtype} "
                "codes and scales): load it into an unquantised layer, then quantize_experts()"
            )
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)  # fmt: skip


def _quant_of(codes: torch.Tensor, scale: torch.Tensor) -> QuantSpec:
    """The format of quantised experts from their codes' dtype and their scales' shape."""
    if codes.dim() != 3:
        raise ValueError(f"expected [E, N, K] codes, got {_checks.describe(codes)}")
    N, K = codes.shape[1:]
    if codes.dtype == torch.uint8:
        return as_quant("mxfp4")
    if codes.dtype != torch.float8_e4m3fn:
        raise ValueError(f"codes of dtype {codes.dtype}: expected float8_e4m3fn or uint8 (mxfp4)")
    if scale.dim() == 2:
        return as_quant("fp8_channel")
    if scale.dim() != 3 or scale.shape[2] != -(-K // 128):
        raise ValueError(f"scales {_checks.describe(scale)} for codes {list(codes.shape)}: "
                         "expected [E, N/rows, K/128] blocks or [E, N] channels")  # fmt: skip
    for rows in (128, 64, 32, 16, 8, 4, 2, 1, 256, 512):
        if -(-N // rows) == scale.shape[1]:
            return QuantSpec("fp8_block", (rows, 128))
    raise ValueError(f"scales {_checks.describe(scale)}: no block of rows fits N = {N}")


def _empty_quantized(spec: QuantSpec, E: int, N: int, K: int, device) -> list[torch.Tensor]:
    """Uninitialised ``(codes, scales)`` of logical ``[E, N, K]`` experts in ``spec``."""
    if spec.format == "mxfp4":
        return [torch.empty(E, N, -(-K // 2), dtype=torch.uint8, device=device),
                torch.empty(E, N, -(-K // 32), dtype=torch.uint8, device=device)]  # fmt: skip
    codes = torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device=device)
    if spec.format == "fp8_channel":
        return [codes, torch.empty(E, N, device=device)]
    bn, bk = spec.block
    return [codes, torch.empty(E, -(-N // bn), -(-K // bk), device=device)]


def _linear_of(module: nn.Module, names: tuple[str, ...], where: str) -> nn.Module:
    for name in names:
        lin = getattr(module, name, None)
        if lin is not None:
            if not isinstance(getattr(lin, "weight", None), torch.Tensor):
                raise TypeError(f"{where}.{name} must be an nn.Linear-like module with .weight")
            return lin
    raise ValueError(
        f"{where} ({type(module).__name__}) has none of {names}: expected per-expert modules "
        "with gate_proj/up_proj/down_proj (or Mixtral's w1/w3/w2) linear layers"
    )


def _name_in(module: nn.Module, child: nn.Module) -> str:
    return next((n for n, m in module.named_children() if m is child), "?")


def _expect_shape(t: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{what} must be {list(shape)}, got {_checks.describe(t)}")
