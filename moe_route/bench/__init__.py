"""The benchmark suite behind ``python -m moe_route bench`` (see DESIGN.md, "Measuring").

* :mod:`.harness` — ceilings (copy bandwidth, matmul rate), timing, roofline rows, CSV/JSON;
* :mod:`.baselines` — the PyTorch code a user would otherwise write;
* :mod:`.stages` — the standard shapes and the stages (maps, expand, finalize, gemm, forward,
  train, and :mod:`.backward`, :mod:`.quant`, :mod:`.host`), pluggable through
  :func:`.stages.register_stage`;
* :mod:`.profiling` — what ``torch.profiler`` tells them: kernels grouped into steps, the
  activation memory of a training step;
* :mod:`.suite` — the command line: runs stages × shapes with a progress bar;
* :mod:`.report` — plots and the markdown results table from saved JSON.

Nothing here is imported by ``import moe_route``.
"""
