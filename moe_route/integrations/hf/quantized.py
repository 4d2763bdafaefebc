"""Quantised experts: transformers' ``FP8Experts`` (FP8 blocks, FP4) as ``fused_moe(quant=...)``.

Their weights and scales are read as they are stored (views, detached: quantised weights are
frozen); scales in another dtype than the one moe_route takes are converted once and kept on
the module. Modules this cannot run raise :class:`~.plan.Unsupported` with the reason.
"""

from __future__ import annotations

import torch
from torch import nn

from .plan import ExpertsPlan, Unsupported

# --------------------------------------------------------------------------- quantised experts
# transformers' FP8Experts (FineGrainedFP8Config: DeepSeek-V3, Qwen3-MoE FP8, ...) holds
#   gate_up_proj [E, 2I, H] float8_e4m3fn + gate_up_proj_scale_inv [E, ceil(2I/bn), ceil(H/bk)]
#   down_proj    [E, H, I]  float8_e4m3fn + down_proj_scale_inv    [E, ceil(H/bn), ceil(I/bk)]
# (block_size = (bn, bk); scales float32, or float8_e8m0fnu for scale_fmt="ue8m0"), which is
# fused_moe's quant="fp8" layout as it stands: w1 = gate_up_proj, w2 = down_proj, the scales
# are the multipliers (w ~= q * scale, DeepSeek's "scale_inv"). expert_dtype="fp4" (DeepSeek-V4)
# holds int8 [E, N, K/2] e2m1 pairs (low nibble first) and [E, N, K/32] e8m0 scales: moe_route's
# "mxfp4" layout, read through .view(torch.uint8).
_E8M0 = getattr(torch, "float8_e8m0fnu", None)


def is_quantized_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds quantised expert weights with their ``*_scale_inv`` scales
    (transformers' ``FP8Experts``, FP8 or FP4)."""
    return hasattr(module, "down_proj_scale_inv")


def _converted_scales(module: nn.Module, scales: tuple[torch.Tensor, ...], convert):
    """``convert(scale)`` of each scale, made once and kept on the module until a scale tensor
    changes (its storage or version)."""
    key = tuple((s.data_ptr(), s._version, s.device, tuple(s.shape)) for s in scales)
    cached = module.__dict__.get("_moe_route_scales")
    if cached is None or cached[0] != key:
        with torch.no_grad():
            cached = (key, tuple(convert(s.detach()) for s in scales))
        module.__dict__["_moe_route_scales"] = cached
    return cached[1]


def _float_scales(module: nn.Module, *scales: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """float32 copies of e8m0 scales (1/16384 of the FP8 weights' bytes at 128x128 blocks),
    kept on the module (:func:`_converted_scales`)."""
    return _converted_scales(module, scales, torch.Tensor.float)


def _exponent_scales(module: nn.Module, *scales: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """MXFP4 scales as ``uint8`` ue8m0 exponents: a view of e8m0 or uint8 scales; float32
    powers of two converted once (kept like :func:`_float_scales`); others are unsupported."""
    if all(s.dtype == torch.uint8 or (_E8M0 is not None and s.dtype == _E8M0) for s in scales):
        return tuple(s.detach().view(torch.uint8) for s in scales)
    if any(s.dtype != torch.float32 for s in scales):
        raise Unsupported(f"FP4 weight scales {[s.dtype for s in scales]}: expected e8m0, uint8 "
                          "or float32 powers of two")  # fmt: skip
    return _converted_scales(module, scales, _ue8m0_exponents)


def _ue8m0_exponents(s: torch.Tensor) -> torch.Tensor:
    mant, exp = torch.frexp(s)
    if not bool(((mant == 0.5) & (exp >= -126) & (exp <= 128)).all()):
        raise Unsupported("FP4 weight scales are not all powers of two (MXFP4 takes "
                          "ue8m0 exponents)")  # fmt: skip
    return (exp - 1 + 127).to(torch.uint8)


def _quant_operands(module: nn.Module, plan: ExpertsPlan):
    """``(w1, w2, b1, b2, {quant, w1_scale, w2_scale})`` of a quantised experts module: views
    of its own tensors (detached: quantised weights are frozen), or :class:`Unsupported`."""
    from ...quant import QuantSpec, check_weight

    scheme = getattr(module, "activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise Unsupported(
            f"activation_scheme={scheme!r}: moe_route quantises the activations per token and "
            "128 columns at each call ('dynamic'), not with the checkpoint's static scales"
        )
    if plan.transposed:
        raise Unsupported("is_transposed=True on quantised weights (the scale blocks follow the "
                          "stored [E, out, in] orientation)")  # fmt: skip
    w1, s1 = getattr(module, plan.w1_name), getattr(module, f"{plan.w1_name}_scale_inv")
    w2, s2 = module.down_proj, module.down_proj_scale_inv
    E, n1 = w1.shape[0], w1.shape[1]
    gated = plan.w1_name == "gate_up_proj"
    if w1.dtype == torch.float8_e4m3fn and w2.dtype == w1.dtype:
        block = getattr(module, "block_size", None)
        if block is None:
            raise Unsupported(
                "block_size=None (one scale per expert matrix): moe_route's FP8 experts take "
                "block scales (fp8[ROWSxCOLS], 128 columns)"
            )
        block = tuple(int(b) for b in block)
        if len(block) != 2 or block[1] != 128 or not (block[0] % 128 == 0 or 128 % block[0] == 0):
            raise Unsupported(f"block_size={list(block)}: moe_route's FP8 GEMMs take 128 columns "
                              "per scale and a multiple or divisor of 128 rows")  # fmt: skip
        ue8m0 = _E8M0 is not None and s1.dtype == _E8M0
        if ue8m0 or s2.dtype != torch.float32:
            s1, s2 = _float_scales(module, s1, s2)
        spec = QuantSpec("fp8_block", block, ue8m0)
        H = w1.shape[2]
    elif w1.dtype in (torch.int8, torch.uint8) and w2.dtype == w1.dtype:
        spec = QuantSpec("mxfp4")
        w1, w2 = w1.view(torch.uint8), w2.view(torch.uint8)
        s1, s2 = _exponent_scales(module, s1, s2)
        H = 2 * w1.shape[2]
    else:
        raise Unsupported(
            f"quantised weights {plan.w1_name} {w1.dtype} / down_proj {w2.dtype}: moe_route takes "
            "float8_e4m3fn (block scales) or int8 / uint8 packed e2m1 (FP4) weights"
        )
    w1, w2, s1, s2 = (t.detach() for t in (w1, w2, s1, s2))
    try:
        check_weight(plan.w1_name, w1, f"{plan.w1_name}_scale_inv", s1, spec, (E, n1, H))
        check_weight("down_proj", w2, "down_proj_scale_inv", s2, spec,
                     (E, H, n1 // 2 if gated else n1))  # fmt: skip
    except (TypeError, ValueError) as exc:
        raise Unsupported(str(exc)) from None
    b1 = getattr(module, f"{plan.w1_name}_bias", None) if plan.has_bias else None
    b2 = getattr(module, "down_proj_bias", None) if plan.has_bias else None
    return w1, w2, b1, b2, {"quant": spec, "w1_scale": s1, "w2_scale": s2}


def _quant_summary(quant: dict) -> str:
    """How ``describe`` names a quantised path."""
    spec = quant.get("quant")
    if spec is None:
        return ""
    if spec.format == "mxfp4":
        return f", FP4 weights as quant={str(spec)!r} (e2m1 + ue8m0 per 32; 16-bit activations)"
    rows, cols = spec.block
    return (f", FP8 weights as quant={str(spec)!r} ({rows}x{cols} blocks; activations e4m3 per "
            f"token per {cols} columns)")  # fmt: skip


def _register_quantized(name: str, fn) -> None:
    """Install ``fn`` in transformers' FP8 experts interface too (``FP8Experts`` looks its
    implementation up there, and rejects a name it does not hold)."""
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:  # a transformers without FineGrainedFP8
        return
    FP8ExpertsInterface.register(name, fn)


# --------------------------------------------------------------------------- quantising a model
def to_fp8_experts(model: nn.Module, quant="fp8", **kwargs) -> nn.Module:
    """Swap every ``.experts`` module of a transformers ``model`` for transformers' own
    ``FP8Experts`` holding its weights quantised by :func:`moe_route.quantize_experts`, in the
    layout an FP8 checkpoint loads into (``FineGrainedFP8Config``): what ``from_pretrained``
    builds from DeepSeek-V3's or Qwen3-MoE FP8's files, made from a model in memory (random
    or 16-bit weights: benchmarks, tests, trying the FP8 path without a checkpoint).

    ``quant``: ``"fp8"`` (float32 scales per 128x128 block), ``"fp8_ue8m0"`` (``e8m0``
    scales), ``"mxfp4"`` (``expert_dtype="fp4"``, where this transformers has it). ``kwargs``
    go to ``FP8Experts`` (e.g. ``activation_scheme``). The new modules take the experts
    implementation the model asks for, from transformers' FP8 table. Returns ``model``."""
    import inspect

    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts
    from transformers.integrations.moe import use_experts_implementation

    from ... import quant as Q

    spec = Q.as_quant(quant)
    block_fp8 = spec is not None and spec.format == "fp8_block" and spec.block == (128, 128)
    if not (block_fp8 or (spec is not None and spec.format == "mxfp4")):
        raise ValueError(f"quant={quant!r}: transformers' FP8Experts holds 128x128-block FP8 "
                         "('fp8', 'fp8_ue8m0') or FP4 ('mxfp4') experts")  # fmt: skip
    opts = dict(block_size=(128, 128))
    if spec.ue8m0 or spec.format == "mxfp4":
        opts["scale_fmt"] = "ue8m0"
    if spec.format == "mxfp4":
        if "expert_dtype" not in inspect.signature(FP8Experts.__init__).parameters:
            raise ValueError(f"quant={quant!r}: this transformers' FP8Experts has no FP4 "
                             "experts (no expert_dtype argument)")  # fmt: skip
        opts["expert_dtype"] = "fp4"
    opts |= kwargs

    class Experts(FP8Experts):  # (the decorator patches the class it is given)
        pass

    cls = use_experts_implementation(Experts, experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)
    for name, module in list(model.named_modules()):
        if not name.endswith(".experts"):
            continue
        new = cls(module.config, **opts)
        for proj in ("gate_up_proj", "down_proj"):
            q, s = Q.quantize_experts(getattr(module, proj).detach().float(), spec)
            if spec.format == "mxfp4":
                q, s = q.view(torch.int8), s.view(_E8M0)
            elif spec.ue8m0:
                s = s.to(_E8M0)  # powers of two: exact
            setattr(new, proj, nn.Parameter(q, requires_grad=False))
            setattr(new, f"{proj}_scale_inv", nn.Parameter(s, requires_grad=False))
        model.set_submodule(name, new.to(module.gate_up_proj.device))
    return model
