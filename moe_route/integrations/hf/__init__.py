"""Hugging Face transformers (>= 5) integration: moe_route as an *experts implementation*.

transformers 5 runs the expert computation of an MoE layer through
``transformers.integrations.moe.ExpertsInterface``: an experts class decorated with
``@use_experts_implementation`` calls ``fn(experts_module, hidden_states, top_k_index,
top_k_weights)`` for the implementation its config names (``"eager"``, ``"grouped_mm"``, ...).
:func:`register` adds ``"moe_route"`` to that table::

    import moe_route.integrations.hf as moe_hf

    moe_hf.register()  # first: transformers rejects an unknown name
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="moe_route")
    model.set_experts_implementation("moe_route")  # or switch a model already loaded

and the experts then run as one :func:`moe_route.fused_moe` call per layer, forward and backward.

Layouts. The decorator's flags describe how the module stores its weights; each maps onto
``fused_moe``'s arguments as a view, never a copy:

* ``has_gate=True``: ``gate_up_proj [E, 2I, H]`` is ``w1``, ``down_proj [E, H, I]`` is ``w2``;
  ``has_gate=False``: ``up_proj [E, I, H]`` is ``w1`` and the activation is a plain one.
* ``is_transposed=True``: the module holds ``[E, H, 2I]`` (or ``[E, H, I]``) and ``[E, I, H]``;
  ``w1``/``w2`` are their ``.transpose(1, 2)`` views (fused_moe reads strides).
* ``is_concatenated``: gate rows then up rows (``gate_up_layout="concat"``); ``False``:
  alternating gate/up rows (``"interleaved"``).
* ``has_bias=True``: ``gate_up_proj_bias`` (or ``up_proj_bias``) ``[E, N]`` is ``b1``,
  ``down_proj_bias [E, H]`` is ``b2`` (scaled by the router weight, as in transformers).

The activation is recognised from what the module computes, not from its class name:

* the module's ``act_fn`` is evaluated on a probe vector and compared with moe_route's
  element-wise functions (SiLU, exact GELU, tanh-approximated GELU, ReLU, squared ReLU, the
  identity); gated with transformers' default ``_apply_gate`` that gives ``swiglu`` /
  ``geglu`` / ``geglu_tanh``, with the gate/up layout of ``is_concatenated`` (honoured as
  interleaved rows, as transformers' ``sonicmoe`` does, although the default ``_apply_gate``
  splits in halves);
* a class that overrides ``_apply_gate`` (gpt-oss, DeepSeek-V4, GLM-5, MiniMax-M3, Inkling2,
  ...) has its ``_apply_gate`` evaluated on a probe ``[gate | up]`` tensor and compared with
  the clamped and soft-capped SwiGLU family and the plain gated activations, in both gate/up
  layouts, with the parameters the module holds (``alpha`` / ``swiglu_alpha``, ``limit`` /
  ``swiglu_limit``; the soft caps ``gate_softcap`` / ``up_softcap`` on the module or its
  ``act_fn``, as numbers or as submodules with a ``softcap``) and an ``up_offset`` of 0 or 1.
  The one that agrees (to float32 rounding) is what runs; its layout is the one
  ``_apply_gate`` reads (gpt-oss: interleaved). gpt-oss's experts, for instance, run as
  ``swiglu(alpha=1.702, limit=7.0, up_offset=1.0)``, interleaved, transposed weights, biases;
  Inkling2's as ``swiglu(gate_softcap=4.0, up_softcap=25.0)`` (the config's
  ``mlp_gate_softcap`` / ``mlp_up_softcap``).

The probes run once per module (CPU, float64, a few hundred values) and the plan is kept on
the module until its ``act_fn``, parameters or flags change. Slots that transformers' expert
parallelism sends elsewhere (ids ``>= E``, weight zero) become dropped slots (``-1``).

Quantised experts. transformers loads FineGrainedFP8 checkpoints (DeepSeek-V3, Qwen3-MoE FP8,
...) into ``FP8Experts``, whose implementations come from a second table,
``transformers.integrations.finegrained_fp8.FP8ExpertsInterface`` (``"batched_mm"``,
``"grouped_mm"``, ``"deepgemm"``); :func:`register` installs ``name`` there too, and such a
module runs as ``fused_moe(..., quant=..., w1_scale=..., w2_scale=...)`` on its own tensors
(detached views, no copy: the quantised weights are frozen, gradients reach the tokens and the
router weights):

* FP8: ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` ``float8_e4m3fn`` are ``w1`` /
  ``w2`` as stored (``[out, in]``, no transpose), ``gate_up_proj_scale_inv [E, ceil(2I/bn),
  ceil(H/bk)]`` / ``down_proj_scale_inv`` their float32 block scales (the multipliers, DeepSeek's
  "scale_inv"), ``quant="fp8[bn x bk]"`` from the module's ``block_size`` (``"fp8"`` at 128x128;
  ``bk`` must be 128, ``bn`` a multiple or divisor of 128). ``scale_fmt="ue8m0"`` scales
  (``float8_e8m0fnu``) run as ``"fp8_ue8m0"`` from a float32 copy of the scales made once per
  module (1/16384 of the weights' bytes). moe_route quantises the tokens per token and 128
  columns at each call, as transformers' ``activation_scheme="dynamic"`` does.
* FP4 (``expert_dtype="fp4"``, DeepSeek-V4): ``int8 [E, N, K/2]`` e2m1 pairs (low nibble first)
  with e8m0 scales ``[E, N, K/32]`` are ``quant="mxfp4"`` through ``.view(torch.uint8)``
  (float32 power-of-two scales: converted once); the tokens stay 16-bit (DeepGEMM quantises
  them to FP8 there).
* Falls back (see below; to transformers' FP8 table): ``activation_scheme="static"``,
  ``block_size=None`` (one scale per matrix), other block widths, scales of another shape
  (e.g. the two-row gate/up scale transformers allocates when ``2I < bn``).

gpt-oss's MXFP4 experts (``transformers.integrations.mxfp4.Mxfp4GptOssExperts``) have no such
table: they are not decorated with ``@use_experts_implementation``, ``Mxfp4GptOssMLP`` calls the
hub's Triton ``matmul_ogs`` directly, and the loaded weights are swizzled into that kernel's
tensor objects. :func:`describe` lists them as blocks outside the interface. To run gpt-oss on
moe_route, load it dequantised (``Mxfp4Config(dequantize=True)``: bf16 experts, moe_route's
16-bit path), or quantise a layer's experts with ``moe_route.quantize_experts(w, "mxfp4")`` (the
same e2m1 + ue8m0-per-32 format, unswizzled) and call ``fused_moe(..., quant="mxfp4")``.

Not supported, and what happens then: an ``act_fn`` or ``_apply_gate`` that matches none of
the above (e.g. Step-3.7's clamp after the activation, a gated ReLU),
``has_post_expert_norm=True`` (the norm sits between GEMM2 and the weighted sum that fused_moe
fuses), weights of another dtype than float32 / float16 / bfloat16 or of two dtypes. Such a
module *falls back*: a :class:`MoeRouteFallbackWarning` names the class and the reason (once per
distinct message, by Python's default warning filter), and transformers' ``"grouped_mm"``
implementation runs it. A warning rather than an error, so that one unsupported MoE block (say,
in a vision tower) does not stop a model whose other layers run on moe_route;
``register(fallback="error")`` raises ``NotImplementedError`` instead.

Blocks that ``experts_implementation`` never reaches: some families (DBRX, Llama 4, JetMoE,
LongCat-Flash in older transformers, Step-3.7, Doge, VitPose, ...) build their experts without
``@use_experts_implementation``, so whatever the implementation asked for, they run their own
forward. Asking for a moe_route name on a model that has such blocks
(``from_pretrained``/``from_config(..., experts_implementation=...)`` or
``set_experts_implementation``) emits one :class:`MoeRouteNoOpWarning` naming them. transformers
offers no hook there, so :func:`register` wraps ``PreTrainedModel.post_init`` and
``PreTrainedModel.set_experts_implementation`` (once; they call the originals unchanged) to see
the request.

:func:`describe` lists, before running anything, which modules of a model run where and why, the
blocks that bypass the interface included, and says when moe_route is not registered yet.

Modules: :mod:`.plan` (how an experts module maps onto ``fused_moe``: the activation's
recognition, :class:`ExpertsPlan`, :func:`plan_for`), :mod:`.quantized` (FP8 / FP4 experts:
their operands and scales; :func:`to_fp8_experts`, a model's experts quantised into transformers'
``FP8Experts``), :mod:`.forward` (the experts forward and its fallback),
:mod:`.switch` (the blocks a request does not reach, the hook that warns about them),
:mod:`.registration` (:func:`register`, :func:`is_registered`), :mod:`.description`
(:func:`describe`), :mod:`.warmup` (:func:`warmup`: compile the experts' kernels before the
first request).
"""

from .description import Description, describe
from .forward import MoeRouteFallbackWarning, moe_route_experts_forward
from .plan import PARAMETER_ATTRS, ExpertsPlan, Unsupported, plan_for
from .quantized import is_quantized_experts, to_fp8_experts
from .registration import FALLBACKS, FUSED_MOE_OPTIONS, NAME, is_registered, register
from .switch import MoeRouteNoOpWarning, bypassing_experts
from .warmup import WarmedExperts, warmup

__all__ = [
    "FALLBACKS",
    "FUSED_MOE_OPTIONS",
    "NAME",
    "PARAMETER_ATTRS",
    "Description",
    "ExpertsPlan",
    "MoeRouteFallbackWarning",
    "MoeRouteNoOpWarning",
    "Unsupported",
    "WarmedExperts",
    "bypassing_experts",
    "describe",
    "is_quantized_experts",
    "is_registered",
    "moe_route_experts_forward",
    "plan_for",
    "register",
    "to_fp8_experts",
    "warmup",
]
