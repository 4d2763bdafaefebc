"""Saved benchmark results read back: the suite's JSON (or older files) as :class:`Source`
objects, and the order stages, shapes and implementations are shown in
(:mod:`moe_route.bench.tables`, :mod:`moe_route.bench.plots`, :mod:`moe_route.bench.report`)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from .harness import BASELINES, Row, add_speedups, row_from_dict
from .quant import DECODE as QUANT_DECODE
from .quant import HOST as QUANT_HOST
from .quant import STAGE as QUANT

STAGE_ORDER = (
    "maps", "expand", "finalize", "gemm1", "gemm2+fin", "forward", "train", "backward", "host",
    QUANT, QUANT_DECODE, QUANT_HOST,
)  # fmt: skip
# Tuning sweeps (tile / block / GEMM config) are not part of the tables or plots.
_SWEEP_IMPL = re.compile(r"^(tile=|block=|\d+/\d+/)")
# bench_moe.py before the suite labelled two shapes "decode T=64": its last one had the
# deepseek-v3 dimensions (H=7168, I=2048, E=256, K=8), so its second occurrence is renamed.
_LEGACY_RELABEL = {"decode T=64": "deepseek-v3 T=64"}


@dataclass
class Source:
    path: str
    env: dict
    rows: list[Row]
    shapes: dict = field(default_factory=dict)  # label -> {model, T, H, I, E, K}
    failures: list = field(default_factory=list)
    skipped: list = field(default_factory=list)  # optional baselines not offered there


def parse_label(label: str) -> tuple[str, dict]:
    """``"qwen3-30b-a3b T=8192"`` -> ``("qwen3-30b-a3b", {"T": 8192})``."""
    name, params = [], {}
    for tok in label.split():
        k, sep, v = tok.partition("=")
        if sep and v.lstrip("-").isdigit():
            params[k] = int(v)
        else:
            name.append(tok)
    return " ".join(name), params


def load(paths) -> list[Source]:
    """Read result files; rows of tuning sweeps and repeated (stage, shape, impl) are dropped."""
    sources = []
    for path in [paths] if isinstance(paths, str) else paths:
        with open(path) as f:
            data = json.load(f)
        legacy = "schema" not in data
        seen: set[tuple[str, str, str]] = set()
        relabelled: set[tuple[str, str, str]] = set()
        rows = []
        for d in data.get("rows", []):
            r = row_from_dict(d)
            if _SWEEP_IMPL.match(r.impl):
                continue
            key = (r.stage, r.shape, r.impl)
            if key in seen:
                if not (legacy and r.shape in _LEGACY_RELABEL) or key in relabelled:
                    continue
                relabelled.add(key)
                r.shape = _LEGACY_RELABEL[r.shape]
            seen.add(key)
            rows.append(r)
        sources.append(
            Source(path, data.get("environment", {}), add_speedups(rows),
                   data.get("shapes", {}), data.get("failures", []), data.get("skipped", []))
        )  # fmt: skip
    return sources


def all_rows(sources: list[Source]) -> list[Row]:
    return [r for s in sources for r in s.rows]


def _stages(rows: list[Row]) -> list[str]:
    present = list(dict.fromkeys(r.stage for r in rows))
    return [s for s in STAGE_ORDER if s in present] + [s for s in present if s not in STAGE_ORDER]


def _shapes(rows: list[Row]) -> list[str]:
    return list(dict.fromkeys(r.shape for r in rows))


def _impls(rows: list[Row]) -> list[str]:
    """Implementations in a stable order: moe_route ones first, then the baselines."""
    impls = list(dict.fromkeys(r.impl for r in rows))
    ours = [i for i in impls if i not in BASELINES]
    ours.sort(key=lambda i: (not i.startswith("moe_route"), i != "moe_route"))
    return ours + [i for i in impls if i in BASELINES]
