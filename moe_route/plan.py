"""The plan of a ``fused_moe`` call: everything decided once per call shape, in the order of
the data flow (backend, who builds the maps, the finalize path, gather or expand, the tiles of
every GEMM of the forward and backward, the decode path's tiles), asking :mod:`.arch` (the
backends, the maps' backend, the finalize path) and :mod:`.tuning` (the tiles) and nothing
else; and GEMM1's epilogue from the activation (:func:`epilogue_for`).

A plan is cached on everything that decides it: the device, dtypes, the weights' shapes, the
options, environment overrides and the token bucket (``T`` rounded up to a power of two;
tiles come from the bucket, never the exact ``T``). :func:`moe_plan` resolves a call's
requests (``finalize="auto"``, ``gather=None``); :func:`plan_for` looks up a resolved one;
:func:`quant_plan_for` is the same for quantised experts. :func:`clear_plans` forgets every
plan and every call memo.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from . import arch, tuning
from ._dispatch import clear_memos
from .activations import Activation, as_activation
from .kernels.triton.decode import DecodeConfig
from .kernels.triton.gemm_mainloop import GemmEpilogue
from .kernels.triton.moe import MoEConfigs, QuantConfigs
from .quant import QuantSpec
from .tuning import token_bucket


@functools.cache
def epilogue_for(activation: str | Activation, gate_up_layout: str) -> GemmEpilogue:
    """GEMM1's epilogue for an activation (its canonical string, as the ops carry it, or a
    spec) and gate/up layout; cached, so the launch keys and plans hold one object per spec."""
    spec = as_activation(activation)
    act, alpha, limit, up_offset, gate_softcap, up_softcap = spec.triton_constexprs()
    return GemmEpilogue(
        act=act, gated=spec.gated, interleaved=spec.gated and gate_up_layout == "interleaved",
        alpha=alpha, limit=limit, up_offset=up_offset, gate_softcap=gate_softcap,
        up_softcap=up_softcap,
    )  # fmt: skip


@dataclass(frozen=True)
class MoEPlan:
    """Everything decided once for a ``fused_moe`` call shape (cached; see the module doc)."""

    #: ``"triton"`` or ``"torch"`` (``"cupy"`` runs the GEMMs on Triton).
    backend: str
    #: who builds the routing maps (``"cupy"`` where those kernels measured faster).
    maps_backend: str
    #: launch configurations (Triton), or None.
    configs: object
    #: the finalize path: ``"standalone"``, ``"fused"`` or ``"fused_atomic"``.
    path: str
    #: GEMM1 reads its rows from ``x`` through the maps (no expand).
    gather: bool
    #: the decode path's tiles where eager calls that want no gradient take it
    #: (:mod:`moe_route.kernels.triton.decode`, :func:`moe_route.tuning.decode_config`), else
    #: None.
    decode: DecodeConfig | None = None


@functools.cache
def _plan(device, dtype, w1_shape, w2_shape, E, K, bucket, activation, layout, path, gather,
          allow_tf32, backend, env):  # fmt: skip
    chosen = arch.backend_for(device, backend).value
    maps_chosen = arch.maps_backend(device, backend, bucket, K, E)
    arch.check_kernel_limits(maps_chosen, E, K, device)
    if chosen == "torch":
        return MoEPlan("torch", maps_chosen, None, path, gather)
    epi = epilogue_for(activation, layout)
    M = bucket * K
    first = tuning.gemm_configs(device, dtype, E, M, epi.gated, w2_shape[2], w1_shape[2], env)
    second = tuning.gemm_configs(device, dtype, E, M, False, w2_shape[1], w2_shape[2], env)
    cfg = MoEConfigs(
        gemm1=first.forward, gemm1_z=first.forward_z, gemm2=second.forward,
        act_bwd=first.act_backward, dx=first.dx, wgrad2=second.weight_grad,
        wgrad1=first.weight_grad, epilogue=epi, finalize=path, gather=gather,
        allow_tf32=allow_tf32,
    )  # fmt: skip
    size = tuning.expert_bytes(w1_shape, w2_shape, dtype.itemsize)
    decode = tuning.decode_config(bucket, K, E, size, dtype)
    return MoEPlan("triton", maps_chosen, cfg, path, gather, decode)


def plan_for(x, w1, w2, K, activation, layout, path, gather, allow_tf32, backend):
    return _plan(
        x.device, x.dtype, tuple(w1.shape), tuple(w2.shape), w1.shape[0], K,
        token_bucket(x.shape[0]), activation, layout, path, gather, allow_tf32, backend,
        arch.env_key(),
    )  # fmt: skip


@functools.cache
def _quant_plan(device, dtype, w1_shape, w2_shape, E, K, bucket, activation, layout,
                spec: QuantSpec, backend, env):  # fmt: skip
    """The plan of a call on quantised experts: the standalone finalize, GEMM1 gathering."""
    chosen = arch.backend_for(device, backend).value
    maps_chosen = arch.maps_backend(device, backend, bucket, K, E)
    arch.check_kernel_limits(maps_chosen, E, K, device)
    if chosen == "torch":
        return MoEPlan("torch", maps_chosen, None, "standalone", True)
    epi = epilogue_for(activation, layout)
    cc = arch.compute_capability(device)
    rows = bucket * K / E
    mx = spec.format == "mxfp4"
    size = tuning.expert_bytes(w1_shape, w2_shape)
    cfg = QuantConfigs(
        gemm1=tuning.quant_gemm_config(rows, epi.gated, mx, cc),
        gemm2=tuning.quant_gemm_config(rows, False, mx, cc), epilogue=epi, fp8=spec.fp8,
        x_group=max(spec.act_group, 0), ue8m0=spec.ue8m0,
        w_block_rows=spec.block[0] if spec.format == "fp8_block" else 1,
        in_loop=tuning.quant_in_loop(rows, mx, cc, size),
    )  # fmt: skip
    decode = tuning.quant_decode_config(bucket, K, E, size, mx, cc)
    return MoEPlan("triton", maps_chosen, cfg, "standalone", True, decode)


def quant_plan_for(x, w1, w2, K, activation, layout, spec: QuantSpec, backend) -> MoEPlan:
    return _quant_plan(x.device, x.dtype, tuple(w1.shape), tuple(w2.shape), w1.shape[0], K,
                       token_bucket(x.shape[0]), activation, layout, spec, backend,
                       arch.env_key())  # fmt: skip


def moe_plan(x, w1, w2, K, activation: str, gate_up_layout: str, finalize: str,
             deterministic: bool, gather: bool | None, allow_tf32: bool,
             backend: str) -> MoEPlan:  # fmt: skip
    """The plan of a call (arguments already checked; ``activation`` canonical): one lookup
    keyed on the call's arguments as they come (the finalize request, ``gather=None``),
    resolved on a miss through :func:`_plan`."""
    key = (x.device, x.dtype, w1.shape, w2.shape, K, token_bucket(x.shape[0]), activation,
           gate_up_layout, finalize, deterministic, gather, allow_tf32, backend,
           arch.env_key())  # fmt: skip
    plan = _CALL_PLANS.get(key)
    if plan is None:
        path = arch.finalize_path_for(x.device, finalize, deterministic).value
        if gather is None:
            # Expand only where I is large enough for the TMA-fed GEMM1 to pay for it
            # (docs/decisions.md, "Gather or expand before GEMM1").
            gather = w2.shape[2] < 4096
        plan = _CALL_PLANS[key] = plan_for(x, w1, w2, K, activation, gate_up_layout, path,
                                            gather, allow_tf32, backend)  # fmt: skip
    return plan


#: :func:`moe_plan`'s answers by call arguments (bounded by the configurations a process
#: runs: weights' shapes, dtypes, flags, token buckets).
_CALL_PLANS: dict = {}


def clear_plans() -> None:
    """Forget every plan (tests that change what a plan is decided from, e.g. a tuning table)."""
    clear_memos()
    _CALL_PLANS.clear()
    _plan.cache_clear()
    _quant_plan.cache_clear()
    tuning.gemm_configs.cache_clear()
