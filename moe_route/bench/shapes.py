"""The benchmark's problem sizes: :class:`Shape`, the standard models and their token counts.

DESIGN.md "Measuring" lists them. :func:`select_shapes` is what ``--shapes``, ``--tokens``,
``--custom`` and ``--skew`` of ``python -m moe_route bench`` select; the tuning sweeps
(``bench --sweep``, :mod:`.sweeps`) and the scripts under scripts/ take :data:`TRAINING_SHAPES`
and :func:`model_shape`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Shape:
    """One problem size: ``T`` tokens, hidden ``H``, intermediate ``I``, ``E`` experts, top ``K``.

    ``model`` names the dimensions (a model of :data:`MODELS`, ``cpu-tiny`` or ``custom-...``).
    ``skew``: the router logits get a per-expert offset drawn with this standard deviation, so
    the experts' rows spread unevenly, as a trained router's do (0: uniform random routing).
    """

    model: str
    T: int
    H: int
    I: int  # noqa: E741 - the design's name
    E: int
    K: int
    skew: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.model} T={self.T}" + (f" skew {self.skew:g}" if self.skew else "")

    @property
    def decode(self) -> bool:
        """Decode-sized (latency-bound) batches: at most 128 tokens."""
        return self.T <= 128

    def dims(self) -> dict:
        return {
            "model": self.model,
            "T": self.T,
            "H": self.H,
            "I": self.I,
            "E": self.E,
            "K": self.K,
            **({"skew": self.skew} if self.skew else {}),
        }


# DESIGN.md "Measuring": model dimensions, the prefill token counts, and the decode ones.
# olmoe-1b-7b (decode only): the small decode configuration of the host-time measurements.
MODELS = {
    "mixtral-8x7b": {"H": 4096, "I": 14336, "E": 8, "K": 2, "prefill": (4096, 32768)},
    "qwen3-30b-a3b": {"H": 2048, "I": 768, "E": 128, "K": 8, "prefill": (8192, 32768)},
    "olmoe-1b-7b": {"H": 2048, "I": 1024, "E": 64, "K": 8, "prefill": ()},
    "deepseek-v3": {"H": 7168, "I": 2048, "E": 256, "K": 8, "prefill": (4096, 16384)},
}
DECODE_T = (1, 8, 64)
# --quick: the first prefill size of each model, and decode latency on qwen3's dimensions.
QUICK_DECODE_MODELS = ("qwen3-30b-a3b",)
# The CPU comparison (no GPU): tiny sizes, every stage, float32.
CPU_MODEL = {"H": 64, "I": 32, "E": 8, "K": 2}
CPU_T = (1, 8, 64, 256)


def model_shape(model: str, T: int) -> Shape:
    m = MODELS[model]
    return Shape(model, T, m["H"], m["I"], m["E"], m["K"])


#: The training shapes by short name (each model at its first prefill size), as the tuning
#: sweeps and the scripts under scripts/ take them with ``--shapes``.
TRAINING_SHAPES = {
    name: model_shape(model, MODELS[model]["prefill"][0])
    for name, model in (("mixtral", "mixtral-8x7b"), ("qwen3", "qwen3-30b-a3b"),
                        ("deepseek", "deepseek-v3"))
}  # fmt: skip


def standard_shapes(quick: bool = False) -> list[Shape]:
    """Decode sizes first (seconds), then prefill sizes (the larger ones take longer)."""
    shapes = []
    for model in MODELS:
        if not quick or model in QUICK_DECODE_MODELS:
            shapes += [model_shape(model, T) for T in DECODE_T]
    for model, m in MODELS.items():
        shapes += [model_shape(model, T) for T in (m["prefill"][:1] if quick else m["prefill"])]
    return shapes


def cpu_shapes(tokens=None) -> list[Shape]:
    c = CPU_MODEL
    return [Shape("cpu-tiny", T, c["H"], c["I"], c["E"], c["K"]) for T in tokens or CPU_T]


def custom_shape(spec: str) -> Shape:
    """``"T,H,I,E,K"`` (e.g. ``"4096,4096,1024,32,4"``) as a :class:`Shape`."""
    try:
        T, H, I, E, K = (int(v) for v in spec.replace("x", ",").split(","))  # noqa: E741
    except ValueError:
        raise ValueError(f"--custom {spec!r}: expected T,H,I,E,K (five integers)") from None
    if min(T, H, I, E, K) < 1 or K > E:
        raise ValueError(f"--custom {spec!r}: sizes must be >= 1 and K <= E")
    return Shape(f"custom-H{H}-I{I}-E{E}-K{K}", T, H, I, E, K)


def select_shapes(
    words=None, tokens=None, custom=(), quick: bool = False, cpu: bool = False, skew: float = 0.0
) -> list[Shape]:
    """The standard shapes filtered by ``words``, with ``tokens`` replacing the T values.

    ``words``: model names or prefixes (``qwen3``), ``decode``, ``prefill``; models are OR-ed,
    the regime filters AND-ed with them. ``tokens``: T values for every selected model.
    ``custom``: extra ``"T,H,I,E,K"`` shapes, always kept. ``skew``: :attr:`Shape.skew` of
    every shape.
    """
    if skew < 0:
        raise ValueError(f"--skew {skew}: a standard deviation, expected >= 0")
    words = [w.lower() for w in words or []]
    regimes = {w for w in words if w in ("decode", "prefill")}
    model_words = [w for w in words if w not in regimes]
    if cpu:
        shapes = cpu_shapes(tokens)
    else:
        models = [m for m in MODELS if not model_words or any(m.startswith(w) for w in model_words)]
        unknown = [w for w in model_words if not any(m.startswith(w) for m in MODELS)]
        if unknown:
            raise ValueError(
                f"--shapes {unknown}: not a model of {list(MODELS)}, nor decode/prefill"
            )
        if tokens:
            shapes = [model_shape(m, T) for m in models for T in tokens]
        else:
            shapes = [s for s in standard_shapes(quick) if s.model in models]
    if regimes == {"decode"}:
        shapes = [s for s in shapes if s.decode]
    elif regimes == {"prefill"}:
        shapes = [s for s in shapes if not s.decode]
    shapes += [custom_shape(c) for c in custom]
    return [replace(s, skew=skew) for s in shapes] if skew else shapes
