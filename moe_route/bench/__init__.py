"""The benchmark suite behind ``python -m moe_route bench`` (see DESIGN.md, "Measuring").

* :mod:`.harness` — ceilings (copy bandwidth, matmul rate), roofline rows, CSV/JSON, and
  :mod:`.timing`'s functions re-exported; :mod:`.timing` — CUDA-event, wall-clock and host
  timing, one implementation or several in turns;
* :mod:`.baselines` — the PyTorch code a user would otherwise write;
* :mod:`.shapes` — the standard shapes and what ``--shapes`` selects;
* :mod:`.context` — what a stage works with: the inputs of a shape, the context that checks and
  times;
* :mod:`.stages` — the registry of the stages, pluggable through :func:`.stages.register_stage`;
  one module per stage: :mod:`.routing` (maps, expand, finalize), :mod:`.gemm`,
  :mod:`.forward`, :mod:`.train`, :mod:`.backward`, :mod:`.quant`, :mod:`.host`;
* :mod:`.profiling` — what ``torch.profiler`` tells them: kernels grouped into steps, the
  activation memory of a training step;
* :mod:`.suite` — the command line: runs stages × shapes with a progress bar;
* :mod:`.sweeps` — ``--sweep NAME``: the tuning sweeps over tile configurations (gemm, wgrad,
  act, decode, bwd_decode; one module each), on a GPU or, as a check, a tiny case through the
  Triton interpreter;
* :mod:`.results` — saved JSON read back (:class:`.results.Source`), and the order of stages,
  shapes and implementations; :mod:`.tables` — the markdown tables; :mod:`.plots` — the PNG
  plots; :mod:`.report` — the markdown results section and the README block (the other three's
  entry points importable from it).

Nothing here is imported by ``import moe_route``.
"""
