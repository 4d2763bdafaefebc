"""Low-precision experts: the quantisation spec, its layouts, and the reference quantisers.

A :class:`QuantSpec` says how expert weights (and, for FP8, the activations feeding them) are
stored. Every function that takes quantised experts spells it the same way, ``quant=`` with a
spec or one of its names:

=================  ==========================================  ===============================
name               weights ``w [E, N, K]``                      activations
=================  ==========================================  ===============================
``"fp8"``          ``float8_e4m3fn``, ``w_scale`` float32       e4m3, one float32 scale per
                   ``[E, ceil(N/128), ceil(K/128)]`` (the       token per 128 columns, made by
                   DeepSeek-V3 / transformers FineGrainedFP8    :func:`quantize_fp8_rows`
                   layout; ``weight_scale_inv``)                inside the call
``"fp8_ue8m0"``    as ``"fp8"``, every scale a power of two     as ``"fp8"``, power-of-two
                   (DeepSeek-V3.1 and later)                    scales
``"fp8_channel"``  ``float8_e4m3fn``, ``w_scale`` float32       e4m3, one scale per token
                   ``[E, N]`` (``torch._scaled_grouped_mm``'s   (whole row)
                   rowwise layout)
``"mxfp4"``        e2m1 packed two per byte along ``K``         unquantised (bf16 / fp16):
                   (``uint8 [E, N, ceil(K/2)]``, the low        the GEMMs dequantise the
                   nibble first), ``w_scale`` ``uint8``         weights in their loader
                   ``[E, N, ceil(K/32)]``: ue8m0 exponents
                   (value ``2^(s-127)``), gpt-oss's layout
=================  ==========================================  ===============================

The quantisers here are the contract: the Triton kernels quantise activations to the same
bits (``tests/test_quant.py``). FP8: ``scale = max(amax, 1e-10) / 448`` over each block (rounded
up to a power of two for ue8m0), ``q = e4m3(clamp(v / scale, -448, 448))`` rounded to nearest
even; a block of zeros gets a tiny scale and zero codes. MXFP4: the scale is the smallest power
of two with ``amax / scale <= 6`` (nothing saturates), each value rounded to the nearest e2m1
value, ties to the even code. Weights with NaN or infinity are rejected. Activations are not
checked on the hot path (a check would read them on the host): a non-finite value makes its
group's scale non-finite, and that group's codes and the outputs they reach are undefined.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _checks

#: The largest finite ``float8_e4m3fn`` value.
FP8_MAX = 448.0
#: The floor of an FP8 block's absolute maximum (a block of zeros gets ``1e-10 / 448``).
FP8_EPS = 1e-10
#: The largest e2m1 magnitude.
FP4_MAX = 6.0
#: Columns per FP8 scale along the reduction (weights' block, activations' group).
SCALE_K = 128
#: Values per MXFP4 scale along ``K``.
MX_GROUP = 32
#: e2m1 magnitudes by code (bit 3 is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FORMATS = ("fp8_block", "fp8_channel", "mxfp4")


@dataclass(frozen=True)
class QuantSpec:
    """How quantised experts are stored (see the module doc). Build it by name
    (:func:`as_quant`) or directly; it validates itself."""

    #: ``"fp8_block"``, ``"fp8_channel"`` or ``"mxfp4"``.
    format: str
    #: The weight scales' block ``(rows, columns)`` of ``w [E, N, K]`` (fp8_block; the GEMMs
    #: take ``columns == 128`` and ``rows`` a multiple of 128 or a divisor of it).
    block: tuple[int, int] = (128, 128)
    #: Power-of-two scales (activations and weights; the weights' are checked when quantised
    #: here, taken as given otherwise).
    ue8m0: bool = False

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"QuantSpec.format={self.format!r}: expected one of {FORMATS}")
        block = self.block
        if (
            not isinstance(block, tuple)
            or len(block) != 2
            or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in block)
        ):
            raise ValueError(f"QuantSpec.block={block!r}: expected two positive ints (rows, cols)")
        if not isinstance(self.ue8m0, bool):
            raise TypeError(f"QuantSpec.ue8m0 must be a bool, got {self.ue8m0!r}")
        if self.format == "fp8_block" and block[1] != 128:
            raise ValueError(
                f"QuantSpec.block={block}: the FP8 GEMMs take 128 columns per scale block "
                "(the activations' group), as DeepSeek-V3 and transformers store them"
            )
        if self.format != "fp8_block" and block != (128, 128):
            raise ValueError(f"QuantSpec.block applies to fp8_block only, not {self.format}")

    @property
    def fp8(self) -> bool:
        """FP8 weights and activations (an FP8 tensor-core product)."""
        return self.format != "mxfp4"

    @property
    def act_group(self) -> int:
        """Columns per activation scale: 128 (fp8_block), 0 = the whole row (fp8_channel),
        -1 = activations not quantised (mxfp4)."""
        return {"fp8_block": self.block[1], "fp8_channel": 0}.get(self.format, -1)

    def __str__(self) -> str:
        """The spec's name (:func:`as_quant` reads it back): ``fp8``, ``fp8_ue8m0``,
        ``fp8[64x128]`` (another block), ``fp8_channel``, ``fp8_channel_ue8m0``, ``mxfp4``."""
        if self.format == "mxfp4":
            return "mxfp4"
        name = "fp8" if self.format == "fp8_block" else "fp8_channel"
        name += "_ue8m0" if self.ue8m0 else ""
        if self.format == "fp8_block" and self.block != (128, 128):
            name += f"[{self.block[0]}x{self.block[1]}]"
        return name


_NAMED = {
    "fp8": QuantSpec("fp8_block"),
    "fp8_ue8m0": QuantSpec("fp8_block", ue8m0=True),
    "fp8_channel": QuantSpec("fp8_channel"),
    "fp8_channel_ue8m0": QuantSpec("fp8_channel", ue8m0=True),
    "mxfp4": QuantSpec("mxfp4"),
}


def as_quant(quant: object) -> QuantSpec | None:
    """``quant=`` as a :class:`QuantSpec`: a spec, one of the names of its ``str`` (``"fp8"``,
    ``"fp8_ue8m0"``, ``"fp8[64x128]"``, ``"fp8_channel"``, ``"mxfp4"``, ...), or None
    (unquantised experts)."""
    if quant is None or isinstance(quant, QuantSpec):
        return quant
    if isinstance(quant, str):
        spec = _NAMED.get(quant)
        if spec is not None:
            return spec
        name, _, block = quant.partition("[")
        rows, _, cols = block.rstrip("]").partition("x")
        if (
            name in ("fp8", "fp8_ue8m0")
            and quant.endswith("]")
            and rows.isdigit()
            and cols.isdigit()
        ):
            return QuantSpec("fp8_block", (int(rows), int(cols)), name == "fp8_ue8m0")
    raise ValueError(
        f"quant={quant!r}: expected None, a QuantSpec or a name: {sorted(_NAMED)} or "
        "'fp8[ROWSxCOLS]' (a block of the weights' scales)"
    )


# --------------------------------------------------------------------------- FP8
def _pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= ``s`` (``s > 0``, float32), exactly."""
    mant, exp = torch.frexp(s)  # s = mant * 2^exp, mant in [0.5, 1)
    return torch.ldexp(torch.ones_like(s), exp - (mant == 0.5).to(exp.dtype))


def fp8_scale(amax: torch.Tensor, ue8m0: bool = False) -> torch.Tensor:
    """The FP8 scale of blocks with absolute maximum ``amax`` (float32)."""
    s = torch.clamp(amax.float(), min=FP8_EPS) / FP8_MAX
    return _pow2_ceil(s) if ue8m0 else s


def fp8_codes(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``e4m3(clamp(v / scale, -448, 448))`` with ``scale`` broadcast over ``v`` (float32)."""
    return torch.clamp(v.float() / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _check_finite(name: str, t: torch.Tensor) -> None:
    # meta tensors hold no values: quantising them gives the layout's shapes and dtypes (a
    # model built on the meta device, then materialised and loaded)
    if t.numel() and not t.is_meta and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} has NaN or infinite values ({_checks.describe(t)}): FP8 and "
                         "FP4 scales are taken from each block's absolute maximum")  # fmt: skip


def _check_float(name: str, t: object, min_dim: int) -> torch.Tensor:
    t = _checks.check_tensor(name, t, dtypes=_checks.FLOAT_DTYPES)
    if t.dim() < min_dim:
        raise ValueError(
            f"{name} must have at least {min_dim} dimensions, got {_checks.describe(t)}"
        )
    return t


def quantize_fp8_block(
    w: torch.Tensor, block: tuple[int, int] = (128, 128), *, ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of ``w [..., N, K]`` in ``block = (rows, cols)`` blocks: ``q``
    ``float8_e4m3fn`` like ``w``, ``scale`` float32 ``[..., ceil(N/rows), ceil(K/cols)]``, so
    that ``w ≈ q * scale`` block by block (DeepSeek-V3's ``weight_scale_inv``). Partial blocks at
    the edges take the maximum over their valid values."""
    w = _check_float("w", w, 2)
    _check_finite("w", w)
    if len(block) != 2 or any(
        isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in block
    ):
        raise ValueError(f"block={block!r}: expected two positive ints (rows, cols)")
    bn, bk = block
    *lead, N, K = w.shape
    nb, kb = -(-N // bn), -(-K // bk)
    padded = w.float().new_zeros(*lead, nb * bn, kb * bk)
    padded[..., :N, :K] = w.float()
    blocks = padded.view(*lead, nb, bn, kb, bk)
    scale = fp8_scale(blocks.abs().amax(dim=(-3, -1)), ue8m0)  # [..., nb, kb]
    q = fp8_codes(blocks, scale[..., :, None, :, None]).view(*lead, nb * bn, kb * bk)
    return q[..., :N, :K].contiguous(), scale


def quantize_fp8_channel(
    w: torch.Tensor, *, ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of ``w [..., N, K]``, one scale per row: ``scale [..., N]`` float32."""
    w = _check_float("w", w, 2)
    _check_finite("w", w)
    scale = fp8_scale(w.float().abs().amax(dim=-1), ue8m0)
    return fp8_codes(w, scale[..., None]), scale


def quantize_fp8_rows(
    x: torch.Tensor, group: int = 128, *, ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The activations' quantiser: ``(q [R, C] e4m3, scale [R, ceil(C/group)] float32)`` of
    ``x [R, C]``, one scale per row per ``group`` columns (``group=0``: per row, ``scale
    [R, 1]``). Values are not checked (see the module doc). The reference of the Triton
    kernel :func:`moe_route.kernels.triton.quantize_rows.quantize_rows_triton`."""
    x = _checks.check_tensor("x", x, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    R, C = x.shape
    g = C if group == 0 else group
    if g < 1:
        raise ValueError(f"group={group}: expected 0 (per row) or a positive column count")
    nb = max(-(-C // g), 1)
    padded = x.float().new_zeros(R, nb * g)
    padded[:, :C] = x.float()
    blocks = padded.view(R, nb, g)
    scale = fp8_scale(blocks.abs().amax(dim=-1), ue8m0)
    q = fp8_codes(blocks, scale[..., None]).view(R, nb * g)
    return q[:, :C].contiguous(), scale


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """``q * scale`` per block, float32 ``[..., N, K]``."""
    bn, bk = block
    N, K = q.shape[-2:]
    s = scale.float().repeat_interleave(bn, dim=-2)[..., :N, :]
    return q.float() * s.repeat_interleave(bk, dim=-1)[..., :K]


def dequantize_fp8_rows(q: torch.Tensor, scale: torch.Tensor, group: int = 128) -> torch.Tensor:
    """The inverse of :func:`quantize_fp8_rows` (float32)."""
    C = q.shape[-1]
    g = C if group == 0 else group
    return q.float() * scale.float().repeat_interleave(max(g, 1), dim=-1)[..., :C]


# --------------------------------------------------------------------------- MXFP4
def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code of each float32 value (``|v| <= 6``), ties to the even code; bit 3
    the sign (from the sign bit: ``-0.0`` keeps it)."""
    a = v.abs()
    # the midpoints between consecutive magnitudes; a tie goes to the even code
    mag = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    ).to(torch.uint8)
    return mag | (torch.signbit(v).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of e2m1 codes (``uint8``, low 4 bits)."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=codes.device)
    return table[(codes & 0xF).long()]


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed, scale)`` of ``w [..., N, K]``: e2m1 codes two per byte along ``K`` (the even
    column in the low nibble; ``uint8 [..., N, ceil(K/2)]``) and ue8m0 exponents ``uint8
    [..., N, ceil(K/32)]`` (value ``2^(s-127)``, the smallest power of two with
    ``amax / scale <= 6``)."""
    w = _check_float("w", w, 2)
    _check_finite("w", w)
    *lead, N, K = w.shape
    nb = -(-K // MX_GROUP)
    padded = w.float().new_zeros(*lead, N, nb * MX_GROUP)
    padded[..., :K] = w.float()
    groups = padded.view(*lead, N, nb, MX_GROUP)
    amax = groups.abs().amax(dim=-1)
    # smallest e with amax <= 6 * 2^e; all-zero groups take the smallest exponent
    mant, exp = torch.frexp(amax / FP4_MAX)
    e = torch.where(amax > 0, exp - (mant == 0.5).to(exp.dtype), -127).clamp(-127, 127)
    codes = _e2m1_codes(groups / torch.ldexp(torch.ones_like(amax), e)[..., None])
    codes = codes.view(*lead, N, nb * MX_GROUP)[..., : K + (K % 2)]
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (e + 127).to(torch.uint8)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, K: int) -> torch.Tensor:
    """float32 ``[..., N, K]`` of :func:`quantize_mxfp4`'s layout."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)[..., :K]
    s = torch.ldexp(torch.ones_like(scale, dtype=torch.float32), scale.long() - 127)
    return e2m1_values(codes) * s.repeat_interleave(MX_GROUP, dim=-1)[..., :K]


# --------------------------------------------------------------------------- experts
def quantize_experts(w: torch.Tensor, quant: str | QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w_q, w_scale)`` of expert weights ``w [E, N, K]`` in the layout of ``quant`` (the
    layout ``fused_moe(..., quant=quant, w1_scale=..., w2_scale=...)`` takes)."""
    spec = as_quant(quant)
    if spec is None:
        raise ValueError("quant=None: nothing to quantise to")
    w = _check_float("w", w, 3)
    if w.dim() != 3:
        raise ValueError(f"w must be [E, N, K], got {_checks.describe(w)}")
    # a few experts at a time, into outputs allocated once: the float32 temporaries stay
    # near 1 GiB whatever E (deepseek-v3's bf16 experts alone take 22.5 GB)
    step = max(1, _CHUNK_ELEMENTS // max(1, w.shape[1] * w.shape[2]))
    if w.shape[0] <= step:
        return _quantize_chunk(w, spec)
    q = s = None
    for e in range(0, w.shape[0], step):
        qc, sc = _quantize_chunk(w[e : e + step], spec)
        if q is None:
            q = qc.new_empty((w.shape[0], *qc.shape[1:]))
            s = sc.new_empty((w.shape[0], *sc.shape[1:]))
        q[e : e + step] = qc
        s[e : e + step] = sc
    return q, s


#: Elements of the weights :func:`quantize_experts` / :func:`dequantize_experts` take at once
#: (about five float32 temporaries of this size).
_CHUNK_ELEMENTS = 1 << 26


def _quantize_chunk(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    if spec.format == "fp8_block":
        return quantize_fp8_block(w, spec.block, ue8m0=spec.ue8m0)
    if spec.format == "fp8_channel":
        return quantize_fp8_channel(w, ue8m0=spec.ue8m0)
    return quantize_mxfp4(w)


def dequantize_experts(w_q: torch.Tensor, w_scale: torch.Tensor, quant: str | QuantSpec,
                       K: int | None = None, *, dtype: torch.dtype = torch.float32,
                       ) -> torch.Tensor:  # fmt: skip
    """``[E, N, K]`` values of quantised expert weights in ``dtype`` (``K``: the logical width,
    needed for mxfp4 when it is odd; default ``2 * packed width``). A few experts at a time,
    as :func:`quantize_experts`: the float32 temporaries stay near 1 GiB whatever ``E``."""
    spec = as_quant(quant)
    K = (2 * w_q.shape[-1] if K is None else K) if spec.format == "mxfp4" else w_q.shape[-1]
    out = torch.empty(*w_q.shape[:-1], K, dtype=dtype, device=w_q.device)
    step = max(1, _CHUNK_ELEMENTS // max(1, w_q.shape[1] * K))
    for e in range(0, w_q.shape[0], step):
        out[e : e + step] = _dequantize_chunk(w_q[e : e + step], w_scale[e : e + step], spec, K)
    return out


def _dequantize_chunk(w_q, w_scale, spec: QuantSpec, K: int) -> torch.Tensor:
    if spec.format == "fp8_block":
        return dequantize_fp8_block(w_q, w_scale, spec.block)
    if spec.format == "fp8_channel":
        return w_q.float() * w_scale.float()[..., None]
    return dequantize_mxfp4(w_q, w_scale, K)


def weight_shape(w_q: torch.Tensor, spec: QuantSpec) -> tuple[int, int, int]:
    """The logical ``(E, N, K)`` of quantised weights (mxfp4: ``K = 2 * packed width``)."""
    E, N, k = w_q.shape
    return E, N, 2 * k if spec.format == "mxfp4" else k


def check_weight(name: str, w: object, scale_name: str, scale: object, spec: QuantSpec,
                 shape: tuple[int, int, int], source: str = "") -> None:  # fmt: skip
    """Raise unless ``w`` / ``scale`` are quantised experts of logical ``shape = (E, N, K)`` in
    ``spec``'s layout (dtypes, shapes, device; never the values). ``source`` says where
    ``shape`` comes from, for the error (e.g. ``"K = x.shape[1]"``)."""
    E, N, K = shape
    if spec.format == "mxfp4":
        _checks.check_tensor(name, w, ndim=3, dtypes=(torch.uint8,))
        want_w, want_s, s_dtypes = (E, N, -(-K // 2)), (E, N, -(-K // MX_GROUP)), (torch.uint8,)
    else:
        _checks.check_tensor(name, w, ndim=3, dtypes=(torch.float8_e4m3fn,))
        if spec.format == "fp8_block":
            bn, bk = spec.block
            want_s = (E, -(-N // bn), -(-K // bk))
        else:
            want_s = (E, N)
        want_w, s_dtypes = (E, N, K), (torch.float32,)
    if tuple(w.shape) != want_w:
        why = f" ({source})" if source else ""
        raise ValueError(
            f"{name} must be {list(want_w)} for {spec} experts{why}, got {_checks.describe(w)}"
        )
    _checks.check_tensor(scale_name, scale, dtypes=s_dtypes)
    if tuple(scale.shape) != want_s:
        raise ValueError(
            f"{scale_name} must be {list(want_s)} for {name} {list(w.shape)} in {spec}, got "
            f"{_checks.describe(scale)}"
        )
    if w.requires_grad or scale.requires_grad:
        raise ValueError(
            f"{name} / {scale_name} require grad: quantised expert weights are frozen (train "
            "adapters on them, or the unquantised weights)"
        )
    if scale.device != w.device:
        raise ValueError(f"{scale_name} is on {scale.device} but {name} is on {w.device}")


# --------------------------------------------------------------------------- the op
def _quantize_rows_impl(
    x: torch.Tensor, group: int, ue8m0: bool, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    if backend == "torch":
        return quantize_fp8_rows(x, group, ue8m0=ue8m0)
    from .kernels.triton.quantize_rows import quantize_rows_triton

    return quantize_rows_triton(x, group, ue8m0)


def _quantize_rows_fake(x, group, ue8m0, backend):
    R, C = x.shape
    groups = 1 if group == 0 else -(-C // group)
    return (
        x.new_empty(R, C, dtype=torch.float8_e4m3fn),
        x.new_empty(R, groups, dtype=torch.float32),
    )


def _quantize_rows_op():
    from ._dispatch import Op

    return Op("quantize_fp8_rows", _quantize_rows_impl, _quantize_rows_fake)


_QUANTIZE_ROWS = None


def quantize_activations(
    x: torch.Tensor, quant: str | QuantSpec = "fp8", *, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The activations' FP8 quantiser as an op: ``(codes [R, C] e4m3, scales [R, G] float32)``
    of ``x [R, C]`` as ``fused_moe(..., quant=quant)`` quantises its tokens (per 128 columns,
    or per row for ``fp8_channel``). The Triton kernel on CUDA (``backend="triton"`` runs it
    under the interpreter too), the reference :func:`quantize_fp8_rows` elsewhere: the same
    bits. No host synchronisation; capturable and traceable by ``torch.compile``."""
    global _QUANTIZE_ROWS
    from . import arch

    spec = as_quant(quant)
    if spec is None or not spec.fp8:
        raise ValueError(f"quant={quant!r}: activations are quantised for the FP8 formats only")
    x = _checks.check_tensor("x", x, ndim=2, dtypes=_checks.FLOAT_DTYPES[:3])
    chosen = arch.backend_for(x.device, backend).value
    if _QUANTIZE_ROWS is None:
        _QUANTIZE_ROWS = _quantize_rows_op()
    return _QUANTIZE_ROWS(
        x, max(spec.act_group, 0), spec.ue8m0, "torch" if chosen == "torch" else "triton"
    )
