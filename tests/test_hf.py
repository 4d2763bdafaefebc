"""moe_route as a Hugging Face transformers experts implementation (moe_route.integrations.hf).

Two kinds of test:

* whole models, tiny random configs of two families (Mixtral, Qwen3-MoE), no download: logits
  and every parameter's gradient with ``experts_implementation="moe_route"`` against
  ``"eager"``;
* one experts module per combination of the layout flags (``has_gate``, ``has_bias``,
  ``is_transposed``, ``is_concatenated``) and per activation, against an eager forward written
  here from the flags' documented meaning (and against transformers' own ``grouped_mm`` where
  transformers agrees with that meaning), plus the fallbacks.

Tolerance, as in flash-attention's ``check_tensor_vs_ref``: the result is compared with the
same model run eagerly in float64, and may be off by at most twice the error of the eager run in
the test dtype, plus a few ulps of the result's scale. On CPU the kernels run under the Triton
interpreter (``tests/conftest.py``), except bf16, whose ``tl.dot`` the interpreter gets wrong:
there the reference backend runs.
"""

from __future__ import annotations

import copy
import types
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", minversion="5.0")

from helpers import DEVICE  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    DbrxConfig,
    Gemma4TextConfig,
    GptOssConfig,
    Inkling2TextConfig,
    JetMoeConfig,
    Llama4TextConfig,
    MixtralConfig,
    NemotronHConfig,
    Qwen3MoeConfig,
)
from transformers.activations import ACT2FN  # noqa: E402
from transformers.integrations.moe import (  # noqa: E402
    ALL_EXPERTS_FUNCTIONS,
    use_experts_implementation,
)

from moe_route.integrations import hf as moe_hf  # noqa: E402

# bf16 on the CPU: the interpreter's bf16 tl.dot is wrong, so the reference backend runs there.
BF16_NAME = "moe_route" if DEVICE.type == "cuda" else "moe_route_reference"


@pytest.fixture(scope="module", autouse=True)
def _registered():
    moe_hf.register()
    moe_hf.register("moe_route_reference", backend="reference")
    moe_hf.register("moe_route_strict", fallback="error")


# ----------------------------------------------------------------------------- tolerance
def assert_vs_exact(actual, low, exact, *, name, ulps=4):
    """``|actual - exact| <= 2 |low - exact| + ulps * eps(dtype) * max|exact|`` (max norms)."""
    a, lo, ex = (t.detach().to("cpu", torch.float64) for t in (actual, low, exact))
    assert a.shape == ex.shape, f"{name}: shape {tuple(a.shape)} != {tuple(ex.shape)}"
    err = (a - ex).abs().max().item()
    base = (lo - ex).abs().max().item()
    scale = ex.abs().max().item()
    bound = 2 * base + ulps * torch.finfo(actual.dtype).eps * scale
    assert err <= bound, (
        f"{name}: max error {err:.3g} vs float64 exceeds {bound:.3g} (eager {actual.dtype} "
        f"error {base:.3g}, scale {scale:.3g})"
    )


# ----------------------------------------------------------------------------- whole models
def tiny_config(family: str):
    common = dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    if family in ("gpt_oss", "gemma4"):  # one layer: the interpreter's time goes to the experts
        common |= dict(num_hidden_layers=1, layer_types=["full_attention"])
    if family == "mixtral":
        return MixtralConfig(
            intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, **common
        )
    if family == "gpt_oss":  # a limit that the tiny model's pre-activations reach
        return GptOssConfig(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                            swiglu_limit=1.0, **common)  # fmt: skip
    if family == "gemma4":
        return Gemma4TextConfig(
            intermediate_size=48, enable_moe_block=True, num_experts=4, top_k_experts=2,
            moe_intermediate_size=24, hidden_size_per_layer_input=0, vocab_size_per_layer_input=96,
            **common,
        )  # fmt: skip
    if family == "inkling2":  # one layer; caps that the tiny model's pre-activations reach
        return Inkling2TextConfig(
            vocab_size=96, unpadded_vocab_size=96, hidden_size=32, num_hidden_layers=1,
            layer_types=["hybrid_sliding"], num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
            sliding_window_size=16, rel_extent=16, d_rel=4, max_position_embeddings=64,
            moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2,
            mlp_gate_softcap=1.0, mlp_up_softcap=1.5, tie_word_embeddings=False,
            eos_token_id=None,
        )  # fmt: skip
    if family == "nemotron_h":  # one attention and one MoE layer (no Mamba)
        return NemotronHConfig(
            vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, layers_block_type=["attention", "moe"], n_routed_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1,
            moe_shared_expert_intermediate_size=24, intermediate_size=48,
            tie_word_embeddings=False,
        )  # fmt: skip
    return Qwen3MoeConfig(
        intermediate_size=64, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=3,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0], **common,
    )  # fmt: skip


def tiny_models(family: str, dtype: torch.dtype):
    """``(model in dtype, the same weights in float64)``, eager, eval mode, on DEVICE."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family), experts_implementation="eager")
    # Random init is small (std 0.02); widen it so that the experts dominate the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name or "gate" in name or "router" in name:
                p.normal_(0, 0.2)
    model.eval()
    exact = copy.deepcopy(model).to(DEVICE, torch.float64)
    return model.to(DEVICE, dtype), exact


def token_ids(seed=0, batch=2, seq=6, vocab=96):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g).to(DEVICE)


def experts_hit(model, ids):
    """How many distinct experts each MoE layer's tokens go to."""
    seen = []

    def hook(_mod, args):
        seen.append(args[1].unique().numel())

    handles = [
        m.register_forward_pre_hook(hook)
        for m in model.modules()
        if hasattr(m, "has_gate") and hasattr(m, "down_proj")
    ]
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    return seen


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_logits_and_gradients_match_eager(family):
    """float32: logits, then the gradient of every parameter (router and experts included)."""
    model, exact = tiny_models(family, torch.float32)
    ours = copy.deepcopy(model)
    ours.set_experts_implementation("moe_route")
    assert ours.config._experts_implementation == "moe_route"
    ids = token_ids()
    assert min(experts_hit(model, ids)) >= 3  # not a trivial routing
    g = torch.Generator().manual_seed(2)
    probe = torch.randn(*ids.shape, 96, generator=g, dtype=torch.float64).to(DEVICE)
    logits = {}
    for key, m in (("eager", model), ("exact", exact), ("ours", ours)):
        logits[key] = m(ids).logits
        (logits[key] * probe.to(m.dtype)).sum().backward()
    assert_vs_exact(logits["ours"], logits["eager"], logits["exact"], name=f"{family} logits")
    grads, grads64 = dict(model.named_parameters()), dict(exact.named_parameters())
    checked = 0
    for name, p in ours.named_parameters():
        if grads64[name].grad is None:
            continue
        assert p.grad is not None, f"{name}: no gradient through moe_route"
        assert_vs_exact(p.grad, grads[name].grad, grads64[name].grad, name=f"d {name}")
        checked += "experts" in name or name.endswith("mlp.gate.weight")
    moe_layers = len(moe_hf.describe(model))  # Mixtral: 2; Qwen3-MoE: 1 (layer 0 is dense)
    assert checked == 3 * moe_layers  # router, gate_up_proj, down_proj of every MoE layer


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_bf16_experts_match_eager(family):
    """bf16, one experts module of each family on a given routing.

    Whole-model bf16 logits are no test: a bf16 rounding difference upstream can flip a
    near-tie in the next layer's router, and then the two runs route differently.
    """
    model, exact = tiny_models(family, torch.bfloat16)
    name = next(iter(moe_hf.describe(model)))  # the first experts module
    experts, experts64 = model.get_submodule(name), exact.get_submodule(name)
    g = torch.Generator().manual_seed(3)
    T, E, K = 13, experts.num_experts, model.config.num_experts_per_tok
    x = torch.randn(T, 32, generator=g, dtype=torch.float64).to(DEVICE)
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].to(DEVICE)
    weights = torch.softmax(torch.randn(T, K, generator=g, dtype=torch.float64), -1).to(DEVICE)
    with torch.no_grad():
        ref64 = run(experts64, "eager", x, ids, weights)
        low = (x.bfloat16(), ids, weights.float())  # as the routers hand them over
        eager = run(experts, "eager", *low)
        ours = run(experts, BF16_NAME, *low)
    assert ours.dtype == torch.bfloat16
    assert_vs_exact(ours, eager, ref64, name=f"{family} bf16 experts")


FAMILY_PLANS = {
    "gpt_oss": "moe_route: swiglu(alpha=1.702, limit=1.0, up_offset=1.0) interleaved, "
    "transposed weights, biases",
    "nemotron_h": "moe_route: relu2",
    "gemma4": "moe_route: geglu_tanh concat",
}


@pytest.mark.parametrize("family", list(FAMILY_PLANS))
def test_activation_families_match_eager(family):
    """gpt-oss (clamped SwiGLU, interleaved, transposed, biases), NemotronH (relu2, ungated),
    Gemma4 (tanh GELU): float32 logits and every parameter's gradient against eager."""
    model, exact = tiny_models(family, torch.float32)
    assert set(moe_hf.describe(model).values()) == {FAMILY_PLANS[family]}
    ours = copy.deepcopy(model)
    ours.set_experts_implementation("moe_route_strict")  # no silent fallback
    ids = token_ids()
    assert min(experts_hit(model, ids)) >= 3
    if family == "gpt_oss":  # the clamp is reached, or it is not tested
        z = []
        hook = ours.model.layers[0].mlp.experts.register_forward_pre_hook(
            lambda m, a: z.append(a[0] @ m.gate_up_proj[0] + m.gate_up_proj_bias[0])
        )
        with torch.no_grad():
            ours(ids)
        hook.remove()
        assert (z[0].abs() > 1.0).float().mean() > 0.05
    g = torch.Generator().manual_seed(2)
    probe = torch.randn(*ids.shape, 96, generator=g, dtype=torch.float64).to(DEVICE)
    logits = {}
    for key, m in (("eager", model), ("exact", exact), ("ours", ours)):
        logits[key] = m(ids).logits
        (logits[key] * probe.to(m.dtype)).sum().backward()
    assert_vs_exact(logits["ours"], logits["eager"], logits["exact"], name=f"{family} logits")
    grads, grads64 = dict(model.named_parameters()), dict(exact.named_parameters())
    experts = 0
    for name, p in ours.named_parameters():
        if grads64[name].grad is None:
            continue
        assert p.grad is not None, f"{name}: no gradient through moe_route"
        assert_vs_exact(p.grad, grads[name].grad, grads64[name].grad, name=f"d {name}")
        experts += ".experts." in name
    assert experts >= 2 * len(moe_hf.describe(model))  # w1 and w2 of every MoE layer


INKLING2_PLAN = "moe_route: swiglu(gate_softcap=1.0, up_softcap=1.5) concat"


def _inkling2_caps(model, gate, up):
    """Set the soft caps of every experts module's act_fn (transformers keeps them there)."""
    for m in model.modules():
        if hasattr(m, "has_gate"):
            m.act_fn.gate_softcap.softcap, m.act_fn.up_softcap.softcap = gate, up


def test_inkling2_matches_eager():
    """Inkling2 (soft-capped SwiGLU, transformers' Inkling2Experts), a tiny random model:
    float32 logits and every parameter's gradient with moe_route against eager.

    The model cannot run in float64 (its router and activation cast to float32), so the bound
    is float32's own: relative 2e-5 of each tensor's largest value. That the caps matter at
    these sizes, and so that the comparison would catch an activation without them, is
    checked first: the eager logits move by far more than the bound when the caps are lifted.
    """
    model, _ = tiny_models("inkling2", torch.float32)
    assert set(moe_hf.describe(model).values()) == {INKLING2_PLAN}
    ours = copy.deepcopy(model)
    ours.set_experts_implementation("moe_route_strict")  # no silent fallback
    ids = token_ids()
    assert min(experts_hit(model, ids)) >= 3

    def close(got, want, name):
        bound = 2e-5 * want.abs().max().item()
        err = (got - want).abs().max().item()
        assert err <= bound, f"{name}: max error {err:.3g} exceeds {bound:.3g}"
        return bound

    uncapped = copy.deepcopy(model)
    _inkling2_caps(uncapped, 1e6, 1e6)
    with torch.no_grad():
        plain, eager = uncapped(ids).logits, model(ids).logits
    assert (plain - eager).abs().max() > 100 * 2e-5 * eager.abs().max()
    g = torch.Generator().manual_seed(2)
    probe = torch.randn(*ids.shape, 96, generator=g, dtype=torch.float64).to(DEVICE)
    logits = {}
    for key, m in (("eager", model), ("ours", ours)):
        logits[key] = m(ids).logits
        (logits[key] * probe.to(m.dtype)).sum().backward()
    close(logits["ours"], logits["eager"], "inkling2 logits")
    grads = dict(model.named_parameters())
    experts = 0
    for name, p in ours.named_parameters():
        if grads[name].grad is None:
            continue
        assert p.grad is not None, f"{name}: no gradient through moe_route"
        close(p.grad, grads[name].grad, f"d {name}")
        experts += ".experts." in name
    assert experts == 2  # gate_up_proj and down_proj of the MoE layer


def test_from_config_by_name():
    cfg = tiny_config("mixtral")
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="moe_route").to(DEVICE)
    assert model.config._experts_implementation == "moe_route"
    assert set(moe_hf.describe(model).values()) == {"moe_route: swiglu concat"}


# ----------------------------------------------------------------------------- layout grid
E, H, INTER, T, K = 4, 16, 24, 11, 2


def eager_forward(self, hidden_states, top_k_index, top_k_weights):
    """The experts computation from the flags' documented meaning, one (token, slot) at a time."""
    out = torch.zeros_like(hidden_states)
    w1 = self.gate_up_proj if self.has_gate else self.up_proj
    b1 = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias) if self.has_bias else None
    for t in range(hidden_states.shape[0]):
        for k in range(top_k_index.shape[1]):
            e = int(top_k_index[t, k])
            if e >= self.num_experts:  # another expert-parallel rank's slot
                continue
            a = w1[e].t() if self.is_transposed else w1[e]  # [N, H]
            z = a @ hidden_states[t] + (b1[e] if b1 is not None else 0)
            if self.has_gate:
                n = z.shape[0] // 2
                gate, up = (z[:n], z[n:]) if self.is_concatenated else (z[0::2], z[1::2])
                h = self.act_fn(gate) * up
            else:
                h = self.act_fn(z)
            d = self.down_proj[e].t() if self.is_transposed else self.down_proj[e]  # [H, I]
            y = d @ h + (self.down_proj_bias[e] if self.has_bias else 0)
            if self.has_post_expert_norm:
                y = self.post_expert_norm(y)
            out[t] += top_k_weights[t, k] * y
    return out


def make_experts(
    *, has_gate=True, has_bias=False, is_transposed=False, is_concatenated=True, act="silu",
    apply_gate=None, post_norm=False, dtype=torch.float32, seed=0,
):  # fmt: skip
    """An experts module as transformers' models declare them, with random weights."""
    n1 = 2 * INTER if has_gate else INTER
    name1 = "gate_up_proj" if has_gate else "up_proj"

    class Experts(nn.Module):
        def __init__(self, config):
            super().__init__()
            g = torch.Generator().manual_seed(seed)
            self.num_experts = config.num_experts
            s1 = (E, H, n1) if is_transposed else (E, n1, H)
            s2 = (E, INTER, H) if is_transposed else (E, H, INTER)
            setattr(self, name1, nn.Parameter(torch.randn(s1, generator=g) * H**-0.5))
            self.down_proj = nn.Parameter(torch.randn(s2, generator=g) * INTER**-0.5)
            if has_bias:
                setattr(self, f"{name1}_bias", nn.Parameter(torch.randn(E, n1, generator=g) / 4))
                self.down_proj_bias = nn.Parameter(torch.randn(E, H, generator=g) / 4)
            if post_norm:
                self.post_expert_norm = nn.LayerNorm(H)
            self.act_fn = ACT2FN[act]

        forward = eager_forward

    if apply_gate is not None:
        Experts._apply_gate = apply_gate
    Experts = use_experts_implementation(
        Experts, has_gate=has_gate, has_bias=has_bias, is_transposed=is_transposed,
        is_concatenated=is_concatenated, has_post_expert_norm=post_norm,
    )  # fmt: skip
    config = types.SimpleNamespace(num_experts=E, _experts_implementation="eager")
    return Experts(config).to(DEVICE, dtype)


def routing(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]
    weights = torch.softmax(torch.randn(T, K, generator=g), dim=-1)
    return x.to(DEVICE, dtype), ids.to(DEVICE), weights.to(DEVICE, dtype)


def run(module, impl, x, ids, weights):
    module.config._experts_implementation = impl
    return module(x, ids, weights)


def run_exact(module, x, ids, weights):
    m64 = copy.deepcopy(module).to(torch.float64)
    return run(m64, "eager", x.double(), ids, weights.double())


LAYOUTS = [
    dict(has_gate=g, has_bias=b, is_transposed=tr, is_concatenated=c)
    for g in (True, False)
    for b in (False, True)
    for tr in (False, True)
    for c in ((True, False) if g else (True,))
]


def layout_id(flags):
    return "-".join(k.removeprefix("has_").removeprefix("is_") for k, v in flags.items() if v) or (
        "plain"
    )


@pytest.mark.parametrize("flags", LAYOUTS, ids=[layout_id(f) for f in LAYOUTS])
def test_layouts_forward(flags):
    module = make_experts(**flags)
    x, ids, weights = routing()
    assert moe_hf.describe(module)[""].startswith("moe_route:")
    with torch.no_grad():
        exact = run_exact(module, x, ids, weights)
        eager = run(module, "eager", x, ids, weights)
        ours = run(module, "moe_route_strict", x, ids, weights)
        assert_vs_exact(ours, eager, exact, name=f"{flags} vs eager")
        if flags["is_concatenated"]:
            # transformers' grouped_mm splits gate/up in halves whatever is_concatenated says,
            # so it is a second witness only for the concatenated layout.
            theirs = run(module, "grouped_mm", x, ids, weights)
            assert_vs_exact(theirs, eager, exact, name="grouped_mm witness")


def test_layout_check_can_fail():
    """The comparison above is sharp: reading the gate/up rows in the other layout fails it."""
    module = make_experts(is_concatenated=False)
    x, ids, weights = routing()
    with torch.no_grad():
        exact = run_exact(module, x, ids, weights).float()
        ours = run(module, "moe_route_strict", x, ids, weights)
        module.is_concatenated = True
        wrong = run(module, "moe_route_strict", x, ids, weights)
    assert (wrong - exact).abs().max() > 1e4 * (ours - exact).abs().max()


@pytest.mark.parametrize(
    "has_gate,act,expected",
    [
        (True, "gelu", "geglu"),
        (True, "gelu_pytorch_tanh", "geglu_tanh"),  # Gemma4's GELUTanh
        (True, "gelu_new", "geglu_tanh"),  # the same function written out
        (False, "silu", "silu"),
        (False, "gelu", "gelu"),
        (False, "gelu_pytorch_tanh", "gelu_tanh"),
        (False, "relu", "relu"),
        (False, "relu2", "relu2"),  # NemotronH
        (False, "linear", "identity"),
    ],
)
def test_activations(has_gate, act, expected):
    module = make_experts(has_gate=has_gate, act=act, has_bias=True)
    assert moe_hf.plan_for(module).activation == expected
    x, ids, weights = routing(seed=3)
    with torch.no_grad():
        exact = run_exact(module, x, ids, weights)
        eager = run(module, "eager", x, ids, weights)
        ours = run(module, "moe_route_strict", x, ids, weights)
    assert_vs_exact(ours, eager, exact, name=f"{act} (gated={has_gate})")


def test_expert_parallel_sentinels_are_dropped():
    module = make_experts(has_bias=True)
    module._is_expert_parallel = True
    x, ids, weights = routing(seed=4)
    ids = ids.clone()
    ids[::3, 1] = E  # slots owned by another rank: transformers zeroes their weights
    weights = weights.masked_fill(ids >= E, 0.0)
    with torch.no_grad():
        exact = run_exact(module, x, ids, weights)
        eager = run(module, "eager", x, ids, weights)
        ours = run(module, "moe_route_strict", x, ids, weights)
    assert_vs_exact(ours, eager, exact, name="expert-parallel sentinels")


@pytest.mark.parametrize(
    "flags", [LAYOUTS[0], dict(has_gate=True, has_bias=True, is_transposed=True)], ids=layout_id
)
def test_layouts_backward(flags):
    module = make_experts(**flags)
    x, ids, weights = routing(seed=5)
    g = torch.Generator().manual_seed(6)
    probe = torch.randn(T, H, generator=g, dtype=torch.float64).to(DEVICE)

    def grads(mod, impl, dtype):
        mod = copy.deepcopy(mod).to(dtype)
        xx = x.to(dtype).requires_grad_()
        ww = weights.to(dtype).requires_grad_()
        (run(mod, impl, xx, ids, ww) * probe.to(dtype)).sum().backward()
        return {"x": xx.grad, "topk_weights": ww.grad} | {
            n: p.grad for n, p in mod.named_parameters()
        }

    exact = grads(module, "eager", torch.float64)
    eager = grads(module, "eager", torch.float32)
    ours = grads(module, "moe_route_strict", torch.float32)
    for name in exact:
        assert_vs_exact(ours[name], eager[name], exact[name], name=f"d {name}")


# ----------------------------------------------------------------------------- fallbacks
def clamp_after_activation(self, gate_up):  # Step-3.7's form: not one of moe_route's
    gate, up = gate_up.chunk(2, dim=-1)
    return self.act_fn(gate).clamp(max=0.5) * up


@pytest.mark.parametrize(
    "kwargs,reason",
    [
        (dict(apply_gate=clamp_after_activation), "_apply_gate computes none"),
        (dict(has_gate=False, act="quick_gelu"), "computes none of moe_route's activations"),
        (dict(has_gate=True, act="relu"), "no fused moe_route activation"),
        (dict(post_norm=True), "has_post_expert_norm"),
    ],
    ids=["custom_gate", "quick_gelu", "gated_relu", "post_norm"],
)
def test_unsupported_falls_back_with_a_warning(kwargs, reason):
    module = make_experts(**kwargs)
    x, ids, weights = routing(seed=7)
    assert reason in moe_hf.describe(module)[""]
    with torch.no_grad():
        eager = run(module, "eager", x, ids, weights)
        with pytest.warns(moe_hf.MoeRouteFallbackWarning, match=reason):
            ours = run(module, "moe_route", x, ids, weights)
        with pytest.raises(NotImplementedError, match=reason):
            run(module, "moe_route_strict", x, ids, weights)
    if "apply_gate" in kwargs or "post_norm" in kwargs:
        # The fallback is transformers' grouped_mm, which runs the module's own gate / norm.
        torch.testing.assert_close(ours, run(module, "grouped_mm", x, ids, weights))
    else:
        torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5)


def test_eager_fallback_runs_the_modules_own_forward():
    moe_hf.register("moe_route_eager_fallback", fallback="eager")
    module = make_experts(apply_gate=clamp_after_activation)
    x, ids, weights = routing(seed=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", moe_hf.MoeRouteFallbackWarning)
        ours = run(module, "moe_route_eager_fallback", x, ids, weights)
    torch.testing.assert_close(ours, run(module, "eager", x, ids, weights), rtol=0, atol=0)


def test_register_validates_its_arguments():
    with pytest.raises(ValueError, match="fallback"):
        moe_hf.register("x", fallback="nope")
    with pytest.raises(TypeError, match="activation"):
        moe_hf.register("x", activation="relu")
    assert "x" not in ALL_EXPERTS_FUNCTIONS
    assert moe_hf.register("moe_route") == "moe_route"
    assert "moe_route" in ALL_EXPERTS_FUNCTIONS


@pytest.mark.parametrize(
    ("name", "exc", "match"),
    [
        (123, TypeError, r"name must be a str, got int 123"),
        (None, TypeError, r"name must be a str, got NoneType"),
        ("", ValueError, r"name='': expected a non-empty name"),
        (" moe_route", ValueError, r"without surrounding spaces"),
        ("eager", ValueError, r"name='eager' already names an experts implementation"),
        ("grouped_mm", ValueError, r"name='grouped_mm' already names"),
        ("batched_mm", ValueError, r"name='batched_mm' already names"),
    ],
)
def test_register_rejects_bad_and_taken_names(name, exc, match):
    """A name must be a non-empty str that none of transformers' implementations holds:
    registering over ``"eager"`` would make ``set_experts_implementation("eager")`` run
    moe_route."""
    before = dict(ALL_EXPERTS_FUNCTIONS.items())
    with pytest.raises(exc, match=match):
        moe_hf.register(name)
    assert dict(ALL_EXPERTS_FUNCTIONS.items()) == before
    assert moe_hf.register("moe_route") == "moe_route"  # ours: registered again


def test_eager_stays_eager_after_a_rejected_registration(monkeypatch):
    with pytest.raises(ValueError, match="eager"):
        moe_hf.register("eager")

    def no_fused_moe(*args, **kwargs):
        raise AssertionError("experts_implementation='eager' ran moe_route")

    monkeypatch.setattr(moe_hf.forward, "fused_moe", no_fused_moe)
    module = make_experts()
    x, ids, weights = routing(seed=8)
    with torch.no_grad():
        torch.testing.assert_close(run(module, "eager", x, ids, weights),
                                   run_exact(module, x, ids, weights).float())  # fmt: skip


@pytest.mark.parametrize(
    ("options", "exc", "match"),
    [
        (dict(backend="cuda"), ValueError, r"backend='cuda'"),
        (dict(backend=None), ValueError, r"backend=None"),
        (dict(finalize="sideways"), ValueError, r"finalize='sideways': expected one of"),
        (dict(deterministic="no"), TypeError, r"deterministic must be a bool, got str 'no'"),
        (dict(allow_tf32=1), TypeError, r"allow_tf32 must be a bool, got int 1"),
        (dict(gather="yes"), TypeError, r"gather must be a bool or None"),
    ],
)
def test_register_checks_the_fused_moe_options_at_registration(options, exc, match):
    with pytest.raises(exc, match=match):
        moe_hf.register("moe_route_bad_options", **options)
    assert "moe_route_bad_options" not in ALL_EXPERTS_FUNCTIONS


# ----------------------------------------------------------------------------- the example
def _load_example():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "hf_swap.py"
    spec = importlib.util.spec_from_file_location("hf_swap_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_hf_swap_example_fails_on_a_mismatch(monkeypatch, capsys):
    """The example's per-module check is sharp: a 1 % error in fp16 makes it exit 1."""
    example = _load_example()
    right = moe_hf.moe_route_experts_forward
    monkeypatch.setattr(moe_hf, "moe_route_experts_forward", lambda *a, **k: right(*a, **k) * 1.01)
    args = ["--device", str(DEVICE), "--seq", "4", "--warmup", "0", "--iters", "1"]
    try:
        assert example.main([*args, "--dtype", "float16", "--backend", "reference"]) == 1
    finally:
        moe_hf.register()
    assert "MISMATCH in float16" in capsys.readouterr().out


def test_hf_swap_example_runs(capsys):
    """examples/hf_swap.py: tiny Mixtral in fp32, bf16 and fp16, every check passes."""
    example = _load_example()
    args = ["--device", str(DEVICE), "--seq", "4", "--warmup", "0", "--iters", "1"]
    if DEVICE.type == "cpu":
        args += ["--backend", "reference"]  # a smoke test: the interpreter runs above
    try:
        assert example.main(args) == 0
    finally:
        moe_hf.register()  # the example re-registered "moe_route" with its own options
    out = capsys.readouterr().out
    assert "OK: checked float32, bfloat16, float16" in out and "logits agree within" in out
    assert "moe_route: swiglu concat" in out and "MISMATCH" not in out


# ----------------------------------------------------------------------------- _apply_gate
def _experts_of(cls_path: str, dtype=torch.float32, limit=1.5, seed=0):
    """A transformers experts class built from a namespace config, random weights."""
    import importlib

    module_name, cls_name = cls_path.rsplit(".", 1)
    cls = getattr(importlib.import_module(f"transformers.models.{module_name}"), cls_name)
    config = types.SimpleNamespace(
        num_experts=E, num_local_experts=E, n_routed_experts=E, hidden_size=H,
        intermediate_size=INTER, moe_intermediate_size=INTER, hidden_act="silu",
        swiglu_alpha=1.702, swiglu_limit=limit, mlp_gate_softcap=1.0, mlp_up_softcap=1.5,
        _experts_implementation="eager",
    )  # fmt: skip
    module = cls(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            fan_in = H if "gate_up" in name else INTER
            p.copy_(torch.randn(p.shape, generator=g) * (0.25 if "bias" in name else fan_in**-0.5))
    return module.to(DEVICE, dtype)


# transformers' experts classes that override _apply_gate -> the plan moe_route recognises.
CLAMPED_CLASSES = {
    "gpt_oss.modeling_gpt_oss.GptOssExperts":
        "swiglu(alpha=1.702, limit=1.5, up_offset=1.0) interleaved, transposed weights, biases",
    "openai_privacy_filter.modeling_openai_privacy_filter.OpenAIPrivacyFilterExperts":
        "swiglu(alpha=1.702, limit=1.5, up_offset=1.0) concat, transposed weights, biases",
    "minimax_m3_vl.modeling_minimax_m3_vl.MiniMaxM3VLExperts":
        "swiglu(alpha=1.702, limit=1.5, up_offset=1.0) concat",
    "deepseek_v4.modeling_deepseek_v4.DeepseekV4Experts": "swiglu(limit=1.5) concat",
    "hy_v4.modeling_hy_v4.HYV4Experts": "swiglu(limit=1.5) concat",
    "glm5_next.modeling_glm5_next.Glm5NextTextExperts": "swiglu(limit=1.5) concat",
    "beam.modeling_beam.BeamExperts": "swiglu concat",  # the default gate, in float32
}  # fmt: skip


@pytest.mark.parametrize("cls_path", list(CLAMPED_CLASSES), ids=lambda p: p.rsplit(".", 1)[1])
def test_overridden_apply_gate_is_recognised(cls_path):
    """The computation of each class's own _apply_gate is recognised (parameters read from the
    module, layout from what _apply_gate reads); forward against transformers' batched_mm in
    float64 (it runs that _apply_gate) and the class's own eager forward in float32."""
    module = _experts_of(cls_path)
    assert moe_hf.describe(module)[""] == f"moe_route: {CLAMPED_CLASSES[cls_path]}"
    x, ids, weights = routing(seed=9)
    with torch.no_grad():
        m64 = copy.deepcopy(module).to(torch.float64)
        exact = run(m64, "batched_mm", x.double(), ids, weights.double())
        eager = run(module, "eager", x, ids, weights)
        ours = run(module, "moe_route_strict", x, ids, weights)
    assert_vs_exact(ours, eager, exact, name=cls_path)


class _Float64SoftcappedSwiGLU(nn.Module):
    """transformers' Inkling2SoftcappedSwiGLU.forward without its cast to float32 (so that a
    float64 module is exact), on the module's own Softcap submodules."""

    def __init__(self, act):
        super().__init__()
        self.gate_softcap, self.up_softcap = act.gate_softcap, act.up_softcap

    def forward(self, gate, up):
        return self.gate_softcap(gate) * torch.sigmoid(gate) * self.up_softcap(up)


INKLING2_CLASSES = ["inkling2.modeling_inkling2.Inkling2Experts",
                    "inkling2_loop.modeling_inkling2_loop.Inkling2LoopExperts"]  # fmt: skip


@pytest.mark.parametrize("cls_path", INKLING2_CLASSES, ids=lambda p: p.rsplit(".", 1)[1])
def test_inkling2_experts_forward_and_backward(cls_path):
    """Inkling2's experts (soft caps 1.0 / 1.5, reached by these pre-activations): the plan,
    then forward and every gradient against the class's own eager forward in float32 and a
    float64 run of it (its activation without the float32 cast)."""
    module = _experts_of(cls_path)
    assert moe_hf.describe(module)[""] == INKLING2_PLAN
    x, ids, weights = routing(seed=12)
    z = x @ module.gate_up_proj[0].T
    assert (z.abs() > 1.5).float().mean() > 0.1  # both caps bend these values
    probe = torch.randn(T, H, generator=torch.Generator().manual_seed(13), dtype=torch.float64)

    def grads(impl, dtype):
        mod = copy.deepcopy(module).to(dtype)
        if dtype == torch.float64:
            mod.act_fn = _Float64SoftcappedSwiGLU(mod.act_fn)
        xx = x.to(dtype).requires_grad_()
        ww = weights.to(dtype).requires_grad_()
        out = run(mod, impl, xx, ids, ww)
        (out * probe.to(DEVICE, dtype)).sum().backward()
        return {"out": out, "x": xx.grad, "topk_weights": ww.grad} | {
            n: p.grad for n, p in mod.named_parameters()
        }

    exact, eager = grads("eager", torch.float64), grads("eager", torch.float32)
    ours = grads("moe_route_strict", torch.float32)
    for name in exact:
        assert_vs_exact(ours[name], eager[name], exact[name], name=f"{cls_path} {name}")


def test_inkling2_recognition_follows_the_caps():
    """The caps are read from act_fn's Softcap modules; the plan follows a change of them."""
    module = _experts_of("inkling2.modeling_inkling2.Inkling2Experts")
    first = moe_hf.plan_for(module)
    assert moe_hf.plan_for(module) is first  # probed once
    module.act_fn.up_softcap.softcap = 7.0
    assert moe_hf.plan_for(module).activation == "swiglu(gate_softcap=1.0, up_softcap=7.0)"


def test_gpt_oss_experts_backward():
    """Gradients through the fused clamped-SwiGLU backward (interleaved, transposed, biases)."""
    module = _experts_of("gpt_oss.modeling_gpt_oss.GptOssExperts", limit=1.0)
    x, ids, weights = routing(seed=10)
    probe = torch.randn(T, H, generator=torch.Generator().manual_seed(11), dtype=torch.float64)

    def grads(impl, dtype):
        mod = copy.deepcopy(module).to(dtype)
        xx = x.to(dtype).requires_grad_()
        ww = weights.to(dtype).requires_grad_()
        (run(mod, impl, xx, ids, ww) * probe.to(DEVICE, dtype)).sum().backward()
        return {"x": xx.grad, "topk_weights": ww.grad} | {
            n: p.grad for n, p in mod.named_parameters()
        }

    exact, eager = grads("batched_mm", torch.float64), grads("eager", torch.float32)
    ours = grads("moe_route_strict", torch.float32)
    for name in exact:
        assert_vs_exact(ours[name], eager[name], exact[name], name=f"d {name}")


def test_recognition_is_cached_and_follows_the_parameters():
    module = _experts_of("gpt_oss.modeling_gpt_oss.GptOssExperts")
    first = moe_hf.plan_for(module)
    assert moe_hf.plan_for(module) is first  # probed once
    module.limit = 3.0
    assert moe_hf.plan_for(module).activation == "swiglu(alpha=1.702, limit=3.0, up_offset=1.0)"
    module.limit = 0.0  # gate.clamp(max=0) is no activation moe_route has
    assert "computes none" in moe_hf.describe(module)[""]


def test_switching_plans_the_experts_before_any_forward(monkeypatch):
    """The probes run when moe_route is asked for, once per module, never inside a forward."""
    calls = []
    probe = moe_hf.plan._recognise_apply_gate
    monkeypatch.setattr(moe_hf.plan, "_recognise_apply_gate", lambda m: calls.append(m) or probe(m))
    model = AutoModelForCausalLM.from_config(tiny_config("gpt_oss"), experts_implementation="eager")
    model = model.to(DEVICE)
    assert calls == []
    model.set_experts_implementation("moe_route_reference")
    assert len(calls) == 1  # one MoE layer
    with torch.no_grad():
        model(token_ids())
    assert len(calls) == 1


# ----------------------------------------------------------------------------- no silent no-ops
def _dbrx_config():
    # attn_config rope_theta: DbrxAttention reads it (transformers 5 omits it from the config).
    return DbrxConfig(
        d_model=32, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=96,
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0),
        ffn_config=dict(ffn_hidden_size=24, moe_num_experts=4, moe_top_k=2),
    )  # fmt: skip


BYPASSING = {
    "dbrx": (_dbrx_config, {"transformer.blocks.0.ffn.experts": "DbrxExperts"}),
    "llama4": (
        lambda: Llama4TextConfig(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=24,
            intermediate_size_mlp=48,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=1,
        ),
        {"model.layers.0.feed_forward.experts": "Llama4TextExperts"},
    ),
    "jetmoe": (
        lambda: JetMoeConfig(
            vocab_size=96,
            hidden_size=32,
            num_hidden_layers=1,
            num_key_value_heads=2,
            kv_channels=8,
            intermediate_size=24,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
        {"model.layers.0.mlp.input_linear": "JetMoeParallelExperts"},
    ),
    # Found by what it holds (an embedding row per expert), not by its class name.
    "doge": (
        lambda: transformers.DogeConfig(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=24,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            is_moe=True,
            num_experts=16,
            num_experts_per_tok=2,
        ),
        {"model.layers.0.mlp": "DogeCDMoE"},
    ),
    "longcat_flash": (
        lambda: transformers.LongcatFlashConfig(
            vocab_size=96,
            hidden_size=32,
            ffn_hidden_size=24,
            expert_ffn_hidden_size=8,
            num_layers=1,
            num_attention_heads=4,
            n_routed_experts=4,
            moe_topk=2,
            zero_expert_num=2,
            kv_lora_rank=8,
            q_lora_rank=8,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
        ),
        {"model.layers.0.mlp.experts": "LongcatFlashExperts"},
    ),
}


@pytest.mark.parametrize("family", list(BYPASSING))
def test_describe_lists_blocks_outside_the_interface(family):
    make_config, some = BYPASSING[family]
    model = AutoModelForCausalLM.from_config(make_config(), experts_implementation="eager")
    report = moe_hf.describe(model)
    if family == "longcat_flash" and not moe_hf.bypassing_experts(model):
        # newer transformers decorate LongcatFlashExperts: it is then on the interface
        assert report == {next(iter(some)): "moe_route: swiglu concat"}
        return
    for name, cls in some.items():
        assert report[name].startswith(f"no-op: {cls} builds its experts without")
    assert all(v.startswith("no-op: ") for v in report.values())
    assert f"no-op: {next(iter(some.values()))}" in str(report)


def test_describe_finds_experts_by_what_they_hold():
    """VitPose's experts are a ModuleList of ``num_experts`` linear layers called
    ``VitPoseNaiveMoe``; blocks around interface experts, routers and whole models that count
    experts are not listed."""
    backbone = transformers.VitPoseBackboneConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_experts=3,
        part_features=8, image_size=[32, 24], patch_size=[8, 8], out_indices=[1],
    )  # fmt: skip
    model = transformers.VitPoseForPoseEstimation(
        transformers.VitPoseConfig(backbone_config=backbone)
    )
    report = moe_hf.describe(model)
    assert list(report) == ["backbone.encoder.layer.0.mlp.experts"]
    assert report["backbone.encoder.layer.0.mlp.experts"].startswith("no-op: VitPoseNaiveMoe")
    for family in ("qwen3_moe", "mixtral", "gpt_oss"):
        model = AutoModelForCausalLM.from_config(
            tiny_config(family), experts_implementation="eager"
        )
        assert moe_hf.bypassing_experts(model) == {}, family


def test_switching_doge_to_moe_route_warns():
    make_config, _ = BYPASSING["doge"]
    with pytest.warns(moe_hf.MoeRouteNoOpWarning, match=r"layers\.0\.mlp \(DogeCDMoE\)"):
        AutoModelForCausalLM.from_config(make_config(), experts_implementation="moe_route")


def test_switching_dbrx_to_moe_route_warns_once():
    with pytest.warns(moe_hf.MoeRouteNoOpWarning, match=r"blocks\.0\.ffn\.experts \(DbrxExperts\)"):
        model = AutoModelForCausalLM.from_config(_dbrx_config(), experts_implementation="moe_route")
    with warnings.catch_warnings():
        warnings.simplefilter("error", moe_hf.MoeRouteNoOpWarning)
        model.set_experts_implementation("eager")
        model.set_experts_implementation("moe_route")  # named once already: silent
    fresh = AutoModelForCausalLM.from_config(_dbrx_config(), experts_implementation="eager")
    with pytest.warns(moe_hf.MoeRouteNoOpWarning, match="2 MoE block") as record:
        fresh.set_experts_implementation("moe_route_reference")
    assert len(record) == 1
    with warnings.catch_warnings():  # a model whose experts all use the interface: no warning
        warnings.simplefilter("error", moe_hf.MoeRouteNoOpWarning)
        AutoModelForCausalLM.from_config(tiny_config("mixtral"), experts_implementation="moe_route")


def test_describe_says_how_to_register():
    model = AutoModelForCausalLM.from_config(tiny_config("mixtral"), experts_implementation="eager")
    assert moe_hf.describe(model).notes == []
    notes = moe_hf.describe(model, name="moe_route_unregistered").notes
    assert len(notes) == 1 and "moe_route.integrations.hf.register()" in notes[0]
    with pytest.raises(ValueError, match="moe_route_unregistered"):  # transformers' own error
        model.set_experts_implementation("moe_route_unregistered")


def test_from_pretrained_plans_at_load_and_warns_about_bypassing_blocks(tmp_path):
    """from_pretrained builds the model under torch.device("meta"): the post_init hook still
    plans gpt-oss's experts at load (on the CPU), the loaded model agrees with eager, and a
    DBRX checkpoint loaded for moe_route warns once."""
    torch.manual_seed(0)
    src = AutoModelForCausalLM.from_config(tiny_config("gpt_oss"), experts_implementation="eager")
    src.save_pretrained(tmp_path / "gpt_oss")
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "gpt_oss", experts_implementation="moe_route_reference"
    ).eval()
    (experts,) = [m for m in model.modules() if hasattr(m, "has_gate")]
    _, plan = experts.__dict__["_moe_route_plan"]  # planned at load, before any forward
    assert plan.activation == "swiglu(alpha=1.702, limit=1.0, up_offset=1.0)"
    ids = token_ids()
    with torch.no_grad():
        ours = model(ids).logits
        model.set_experts_implementation("eager")
        eager = model(ids).logits
    torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5)

    AutoModelForCausalLM.from_config(_dbrx_config()).save_pretrained(tmp_path / "dbrx")
    with pytest.warns(moe_hf.MoeRouteNoOpWarning, match="DbrxExperts") as record:
        AutoModelForCausalLM.from_pretrained(tmp_path / "dbrx", experts_implementation="moe_route")
    assert sum(r.category is moe_hf.MoeRouteNoOpWarning for r in record) == 1


def test_switch_hooks_are_installed_once_and_leave_other_models_alone():
    from transformers import PreTrainedModel

    hooks = (PreTrainedModel.post_init, PreTrainedModel.set_experts_implementation)
    moe_hf.register("moe_route_again", backend="reference")  # registering again: no new wrapper
    assert (PreTrainedModel.post_init, PreTrainedModel.set_experts_implementation) == hooks
    assert all(h._moe_route_hook for h in hooks)
    with warnings.catch_warnings():  # no moe_route warning for models that never ask
        warnings.simplefilter("error", moe_hf.MoeRouteNoOpWarning)
        warnings.simplefilter("error", moe_hf.MoeRouteFallbackWarning)
        AutoModelForCausalLM.from_config(_dbrx_config(), experts_implementation="eager")
        mixtral = AutoModelForCausalLM.from_config(tiny_config("mixtral"))
        mixtral.set_experts_implementation("eager")
    assert not any("_moe_route_plan" in m.__dict__ for m in mixtral.modules())


# ----------------------------------------------------------------------------- FP8 experts
# transformers loads FineGrainedFP8 checkpoints (DeepSeek-V3, Qwen3-MoE FP8, ...) into
# FP8Experts: e4m3 gate_up_proj / down_proj with float32 (or e8m0) weight_scale_inv per 128x128
# block, expert_dtype="fp4": packed e2m1 with e8m0 scales per 32. Its own implementations
# ("batched_mm", "grouped_mm", "deepgemm", and the eager loop's fp8_linear) need CUDA kernels
# from the hub, so on the CPU the references here are (a) the format's arithmetic written out in
# float64 (FP8: tokens and GEMM2's input quantised per token per 128 columns, as fused_moe's
# contract and transformers' finegrained kernels do) and (b) transformers' own FP8Experts eager
# loop on the dequantised weights (its linear takes a plain matmul for 16/32-bit weights).

import inspect  # noqa: E402
import re  # noqa: E402

from transformers.integrations.finegrained_fp8 import (  # noqa: E402
    ALL_FP8_EXPERTS_FUNCTIONS,
    FP8Experts,
)

import moe_route  # noqa: E402
from moe_route import quant as Q  # noqa: E402

# The torch backend on the CPU (the interpreter's FP8 products are covered in test_quant.py).
QUANT_NAME = "moe_route" if DEVICE.type == "cuda" else "moe_route_reference"
#: e4m3 keeps 3 mantissa bits: a value rounds by at most half an ulp, 2^-4 of itself.
E4M3_REL = 2.0**-4


def fp8_experts_class():
    """FP8Experts decorated as transformers' FP8 quantizer does (on a subclass: the decorator
    patches the class it is given)."""

    class TinyFP8Experts(FP8Experts):
        pass

    return use_experts_implementation(TinyFP8Experts, experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)


def to_fp8_experts(model, quant="fp8", **kwargs):
    """:func:`moe_route.integrations.hf.to_fp8_experts` (FP4: skipped on a transformers whose
    FP8Experts has none)."""
    if Q.as_quant(quant).format == "mxfp4" and (
        "expert_dtype" not in inspect.signature(FP8Experts.__init__).parameters
    ):
        pytest.skip("this transformers' FP8Experts has no FP4 experts (expert_dtype)")
    return moe_hf.to_fp8_experts(model, quant, **kwargs)


def fp8_weights(module, proj):
    """``(codes, scales, spec)`` of one FP8Experts projection in moe_route's terms."""
    q, s = getattr(module, proj).detach(), getattr(module, f"{proj}_scale_inv").detach()
    if q.dtype == torch.int8:
        return q.view(torch.uint8), s.view(torch.uint8), Q.as_quant("mxfp4")
    return q, s.float(), Q.QuantSpec("fp8_block", (128, 128), s.dtype == torch.float8_e8m0fnu)


def dequantized(model):
    """A copy of ``model`` whose FP8Experts hold their dequantised weights in the model's dtype,
    running transformers' eager loop (a plain matmul per expert)."""
    ref = copy.deepcopy(model)
    dtype = ref.get_output_embeddings().weight.dtype
    for module in ref.modules():
        if isinstance(module, FP8Experts):
            for proj in ("gate_up_proj", "down_proj"):
                q, s, spec = fp8_weights(module, proj)
                K = 2 * q.shape[2] if spec.format == "mxfp4" else q.shape[2]
                w = Q.dequantize_experts(q, s, spec, K).to(dtype)
                setattr(module, proj, nn.Parameter(w))
    ref.set_experts_implementation("eager")
    return ref


def fp8_emulated(module, x, ids, weights):
    """The FP8 / MXFP4 experts' arithmetic in float64 on the module's own codes: FP8 tokens and
    GEMM2's input quantised per token per 128 columns (from float32), products exact."""
    q1, s1, spec = fp8_weights(module, "gate_up_proj")
    q2, s2, _ = fp8_weights(module, "down_proj")
    H, inter = x.shape[1], q1.shape[1] // 2
    W1 = Q.dequantize_experts(q1, s1, spec, H).double()
    W2 = Q.dequantize_experts(q2, s2, spec, inter).double()

    def rows(a):
        if not spec.fp8:
            return a.double()
        aq, asc = Q.quantize_fp8_rows(a.float(), 128, ue8m0=spec.ue8m0)
        return Q.dequantize_fp8_rows(aq, asc, 128).double()

    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            z = rows(x[t : t + 1]) @ W1[e].T
            h = torch.nn.functional.silu(z[:, :inter]) * z[:, inter:]
            out[t] += float(weights[t, k]) * (rows(h) @ W2[e].T)[0]
    return out


def tiny_fp8_model(family="qwen3_moe", dtype=torch.float32, quant="fp8", **kwargs):
    """A tiny model of ``family`` (H = 256 and I = 128: two scale blocks, one per gate / up
    half) with its experts quantised into FP8Experts, eval mode, on DEVICE."""
    common = dict(
        vocab_size=96, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        intermediate_size=256, moe_intermediate_size=128, num_experts_per_tok=2,
    )  # fmt: skip
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config

        config = DeepseekV3Config(
            n_routed_experts=8, n_group=2, topk_group=1, n_shared_experts=1,
            first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
            qk_nope_head_dim=16, v_head_dim=16, **(common | dict(num_key_value_heads=4)),
        )  # fmt: skip
    else:
        config = Qwen3MoeConfig(num_experts=4, norm_topk_prob=True, mlp_only_layers=[0],
                                head_dim=32, **common)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    with torch.no_grad():  # widen the small init so that the experts dominate the logits
        for name, p in model.named_parameters():
            if "experts" in name or "gate" in name:
                p.normal_(0.0, 0.06)
    model = model.to(DEVICE, dtype).eval()
    return model, to_fp8_experts(copy.deepcopy(model), quant, **kwargs)


def fp8_routing(seed=0, T=9, E=4, K=2, H=256, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]
    weights = torch.softmax(torch.randn(T, K, generator=g), dim=-1)
    return x.to(DEVICE, dtype), ids.to(DEVICE), weights.to(DEVICE, dtype)


@pytest.mark.parametrize("quant", ["fp8", "fp8_ue8m0", "mxfp4"])
def test_fp8_experts_module_matches_the_format(quant):
    """One FP8Experts module: moe_route against the format's arithmetic (the torch backend: to
    float32 rounding and the odd activation code one rounding away; the GPU's FP8 products round
    otherwise than float64, so more activations land one code away there: within e4m3's 2^-4)
    and against transformers' eager loop on the dequantised weights (off by the tokens'
    quantisation only: at most e4m3's 2^-4 of each product's magnitude per GEMM; MXFP4 keeps
    the tokens, so there the two agree to rounding)."""
    _, model = tiny_fp8_model(quant=quant)
    experts = model.model.layers[1].mlp.experts
    x, ids, weights = fp8_routing()
    expected = {"fp8": "quant='fp8'", "fp8_ue8m0": "quant='fp8_ue8m0'", "mxfp4": "quant='mxfp4'"}
    assert expected[quant] in moe_hf.describe(model)["model.layers.1.mlp.experts"]
    model.set_experts_implementation(QUANT_NAME)
    with torch.no_grad():
        ours = experts(x, ids, weights)
        exact = fp8_emulated(experts, x, ids, weights)
        plain = dequantized(model).model.layers[1].mlp.experts(x, ids, weights)
    scale = exact.abs().max().item()
    codes_apart = E4M3_REL if DEVICE.type == "cuda" else 2e-3
    assert (ours.double() - exact).abs().max().item() <= codes_apart * scale
    # |W (x - q(x))| <= 2^-4 |W| |x| for each GEMM; the bound of the sum, per token
    err = (ours.double() - plain.double()).abs().max().item()
    rounding = 2.0**-7 if DEVICE.type == "cuda" else 1e-5  # the GPU's MXFP4 takes bf16 tokens
    assert err <= (E4M3_REL * 2 if quant != "mxfp4" else rounding) * scale, err


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_fp8_model_logits(family):
    """A whole model whose experts are FP8Experts: logits on moe_route against transformers'
    eager loop on the dequantised weights (the tokens' quantisation apart: within e4m3's 2^-4
    of the logits' scale) and against the unquantised model (weights and tokens quantised:
    twice that)."""
    original, model = tiny_fp8_model(family)
    n_fp8 = sum(isinstance(m, FP8Experts) for m in model.modules())
    report = moe_hf.describe(model)
    assert n_fp8 and sum("FP8 weights" in how for how in report.values()) == n_fp8, str(report)
    ids = token_ids()
    model.set_experts_implementation(QUANT_NAME)
    with torch.no_grad():
        ours = model(ids).logits.double()
        plain = dequantized(model)(ids).logits.double()
        full = original(ids).logits.double()
    scale = plain.abs().max().item()
    assert (ours - plain).abs().max().item() <= E4M3_REL * scale
    assert (ours - full).abs().max().item() <= 2 * E4M3_REL * scale
    # the tokens' quantisation is what separates moe_route from the dequantised model
    assert (ours - plain).abs().max().item() > 0


def test_fp8_experts_gradients_reach_the_tokens_not_the_codes():
    """The FP8 weights are frozen (as transformers' own FP8 backward has them); the tokens'
    gradient is the dequantised experts' (fused_moe's backward runs on the dequantised
    weights at the unquantised tokens)."""
    _, model = tiny_fp8_model()
    experts = model.model.layers[1].mlp.experts
    ref = dequantized(model).model.layers[1].mlp.experts
    x, ids, weights = fp8_routing()
    model.set_experts_implementation(QUANT_NAME)
    grads = []
    for module in (experts, ref):
        xg, wg = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = module(xg, ids, wg)
        out.backward(torch.ones_like(out))
        grads.append((xg.grad, wg.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-5, atol=1e-5)
    # the router weights' gradient is GEMM2's output (quantised tokens): e4m3 apart
    g0, g1 = grads[0][1], grads[1][1]
    assert (g0 - g1).abs().max() <= 2 * E4M3_REL * g1.abs().max()
    assert all(p.grad is None for p in experts.parameters())


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        (dict(activation_scheme="static"), "activation_scheme='static'"),
        (dict(block_size=None), "block_size=None"),
        (dict(block_size=(128, 64)), "block_size=\\[128, 64\\]"),
    ],
)
def test_fp8_experts_unsupported_fall_back(kwargs, reason):
    """What moe_route cannot run is said by describe() and falls back to transformers' FP8
    implementations (which need CUDA kernels: ``fallback="error"`` shows the reason here)."""
    cls = fp8_experts_class()
    experts = cls(Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=128, num_experts=4),
                  **({"block_size": (128, 128)} | kwargs))  # fmt: skip
    assert moe_hf.describe(experts)[""].startswith("fallback: ")
    assert re.search(reason, moe_hf.describe(experts)[""])
    experts.config._experts_implementation = "moe_route_strict"
    x, ids, weights = fp8_routing(E=4, H=256)
    with pytest.raises(NotImplementedError, match=reason):
        experts(x, ids, weights)


def test_fp8_experts_registered_in_transformers_fp8_interface():
    assert ALL_FP8_EXPERTS_FUNCTIONS.get_interface("moe_route", None) is not None
    assert moe_hf.is_quantized_experts(fp8_experts_class()(Qwen3MoeConfig(), block_size=(128, 128)))


@pytest.mark.parametrize("quant", [None, "fp8_channel", "fp8[64x128]"])
def test_to_fp8_experts_rejects_formats_fp8experts_has_not(quant):
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"))
    with pytest.raises(ValueError, match=re.escape(f"quant={quant!r}: transformers' FP8Experts")):
        moe_hf.to_fp8_experts(model, quant)


def test_fp8_experts_example_runs(capsys):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "fp8_experts.py"
    spec = importlib.util.spec_from_file_location("fp8_experts_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main(["--backend", "torch" if DEVICE.type == "cpu" else "auto"])
    out = capsys.readouterr().out
    assert "max |moe_route fp8 - bf16|" in out and "OK" in out


def test_describe_reports_experts_the_switch_does_not_reach():
    """An experts module whose config is a sub-config (Dots3-Note's vision tower) keeps the
    implementation that config names when the model switches to moe_route: describe() reports
    that one, and the switch warns, naming the module."""
    model = AutoModelForCausalLM.from_config(
        tiny_config("qwen3_moe"), experts_implementation="eager"
    )
    names = [
        n for n, m in model.named_modules() if hasattr(m, "has_gate") and hasattr(m, "down_proj")
    ]
    vision = model.get_submodule(names[0])
    vision.config = copy.copy(vision.config)  # a sub-config: the switch leaves it alone
    moe_hf.register()
    with pytest.warns(moe_hf.MoeRouteNoOpWarning, match=names[0]):
        model.set_experts_implementation("moe_route")
    assert vision.config._experts_implementation == "eager"
    report = moe_hf.describe(model)
    assert report[names[0]].startswith("eager: its config (Qwen3MoeConfig) asks for 'eager'")
    assert "(on moe_route: moe_route: swiglu concat)" in report[names[0]]
    assert all(report[n] == "moe_route: swiglu concat" for n in names[1:])


# ----------------------------------------------------------------------------- warm-up
# moe_hf.warmup(model, max_tokens) makes fused_moe's first call of each token bucket, once per
# distinct configuration, through the forward's own code. What a later forward would compile
# is observed through what a first call of a signature makes: a FusedCall (fused_moe's
# decisions for the signature) and a MoEProgram (the experts' plan and prepared launches),
# and, on a GPU, a ThinKernel's first launch of a variant (Triton compiles or finds it; the
# interpreter never takes that path).
import moe_route.experts  # noqa: E402
import moe_route.moe  # noqa: E402
import moe_route.plan  # noqa: E402
from moe_route.kernels.triton import ThinKernel  # noqa: E402


@pytest.fixture
def first_calls(monkeypatch):
    """Counts, by kind, the first calls of a signature from here on (every memo emptied)."""
    moe_route.plan.clear_plans()
    counts = dict.fromkeys(("FusedCall", "MoEProgram", "first launch"), 0)

    def counting(name, real):
        def counted(*args, **kwargs):
            counts[name] += 1
            return real(*args, **kwargs)

        return counted

    for cls in (moe_route.moe.FusedCall, moe_route.experts.MoEProgram):
        monkeypatch.setattr(cls, "__init__", counting(cls.__name__, cls.__init__))
    monkeypatch.setattr(ThinKernel, "_first_launch",
                        counting("first launch", ThinKernel._first_launch))  # fmt: skip
    return counts


def two_moe_layer_model(name="moe_route", dtype=torch.float32):
    """The tiny Qwen3-MoE with both layers MoE, on ``name``, eval mode, on DEVICE."""
    config = tiny_config("qwen3_moe")
    config.mlp_only_layers = []
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, experts_implementation=name)
    return model.to(DEVICE, dtype).eval()


def test_warmup_warms_one_configuration_and_the_forward_compiles_nothing(first_calls):
    model = two_moe_layer_model()
    names = [n for n, how in moe_hf.describe(model).items() if how.startswith("moe_route")]
    assert len(names) == 2
    warmed = moe_hf.warmup(model, 6)
    assert len(warmed) == 1, [str(w) for w in warmed]
    (w,) = warmed
    assert w.modules == tuple(names) and w.buckets == (1, 2, 4, 8)
    assert w.description == ("swiglu concat; w1 [4, 48, 32] float32; top_k 3, tokens float32, "
                             "ids int64, router weights float32")  # fmt: skip
    # one fused_moe signature per bucket, not per layer
    assert first_calls["FusedCall"] == first_calls["MoEProgram"] == 4
    assert all(p.grad is None for p in model.parameters())
    first_calls.update(dict.fromkeys(first_calls, 0))
    with torch.no_grad():
        for batch, seq in ((2, 3), (1, 1), (1, 2), (1, 3), (1, 5)):  # T = 6, 1, 2, 3, 5
            model(token_ids(batch=batch, seq=seq))
    assert first_calls == dict.fromkeys(first_calls, 0)
    # the count can fail: T = 9 is a bucket (16) the warm-up did not reach
    with torch.no_grad():
        model(token_ids(batch=1, seq=9))
    assert first_calls["FusedCall"] == first_calls["MoEProgram"] == 1


@pytest.mark.parametrize("family, router", [("mixtral", "float32"), ("qwen3_moe", "bfloat16")])
def test_warmup_takes_the_routers_dtypes(family, router, first_calls):
    """bf16 tokens: Mixtral's router hands its experts float32 weights, Qwen3-MoE's bf16 ones;
    the warm-up calls carry what the model's own forward hands its experts."""
    model, _ = tiny_models(family, torch.bfloat16)
    model.set_experts_implementation(BF16_NAME)
    (w,) = moe_hf.warmup(model, 12)
    assert f"tokens bfloat16, ids int64, router weights {router}" in w.description
    assert len(w.modules) == len(moe_hf.describe(model)) and w.buckets == (1, 2, 4, 8, 16)
    first_calls.update(dict.fromkeys(first_calls, 0))
    with torch.no_grad():
        model(token_ids())  # T = 12
    assert first_calls == dict.fromkeys(first_calls, 0)


def test_warmup_backward_warms_a_training_step(first_calls):
    model = two_moe_layer_model("moe_route_reference")
    (w,) = moe_hf.warmup(model, 12, backward=True)
    assert w.buckets == (1, 2, 4, 8, 16)
    assert all(p.grad is None for p in model.parameters())  # nothing accumulated
    first_calls.update(dict.fromkeys(first_calls, 0))
    model(token_ids()).logits.sum().backward()  # T = 12, with gradients
    assert first_calls == dict.fromkeys(first_calls, 0)
    assert model.model.layers[0].mlp.experts.gate_up_proj.grad is not None


@pytest.mark.parametrize("quant", ["fp8", "mxfp4"])
def test_warmup_quantised_experts(quant, first_calls):
    """FP8Experts: the warm-up passes the quantised operands and scales as the forward does."""
    _, model = tiny_fp8_model(quant=quant)
    model.set_experts_implementation(QUANT_NAME)
    (w,) = moe_hf.warmup(model, 4)
    assert f"quant={quant!r}" in w.description and w.buckets == (1, 2, 4)
    first_calls.update(dict.fromkeys(first_calls, 0))
    with torch.no_grad():
        model(token_ids(batch=1, seq=3))
    assert first_calls == dict.fromkeys(first_calls, 0)


def test_warmup_probes_the_moe_block_outside_a_whole_model(first_calls):
    """Given an MoE block (no transformers model around it: no two-token forward), the probe
    calls the experts' parent block; a lone experts module cannot be probed."""
    model = two_moe_layer_model("moe_route_reference")
    block = model.model.layers[1].mlp
    (w,) = moe_hf.warmup(block, 4)
    assert w.modules == ("experts",) and "router weights float32" in w.description
    first_calls.update(dict.fromkeys(first_calls, 0))
    with torch.no_grad():
        block(torch.randn(1, 3, 32, device=DEVICE))
    assert first_calls == dict.fromkeys(first_calls, 0)
    with pytest.raises(RuntimeError, match="could not be probed"):
        moe_hf.warmup(block.experts, 4)


def test_warmup_without_moe_route_experts_raises():
    eager = two_moe_layer_model("eager")
    with pytest.raises(ValueError, match=r"no experts module of Qwen3MoeForCausalLM runs on "
                       r"moe_route.*'eager'.*set_experts_implementation"):  # fmt: skip
        moe_hf.warmup(eager, 8)
    with pytest.raises(ValueError, match="Linear has no experts module"):
        moe_hf.warmup(nn.Linear(4, 4), 8)
    with pytest.raises(ValueError, match="max_tokens=0"):
        moe_hf.warmup(two_moe_layer_model(), 0)
