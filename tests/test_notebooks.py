"""Execute every notebook under notebooks/ top to bottom (and the inference example), so that
none can rot.

Each notebook checks itself with ``assert`` (the mapping walkthrough compares every table and
tensor with moe_route.reference); a failing cell fails the test with the cell's traceback. The
kernel inherits this process's environment: on a CPU-only machine ``TRITON_INTERPRET=1`` (set by
``conftest.py``), so the notebooks' moe_route calls run the Triton kernels interpreted.
Figures go to matplotlib's Agg backend (nothing is displayed, nothing is written back).
"""

from __future__ import annotations

import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert {p.name for p in NOTEBOOKS} >= {"mapping_tables.ipynb", "performance.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    nb = nbformat.read(path, as_version=4)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # The kernel is a fresh interpreter: let it import this checkout's moe_route, and give its
    # Triton interpreter (if it runs one) the patch conftest gives this process
    # (tests/interpreter_patch.py: the kernels compute the same), in a cell before the
    # notebook's own (the copy in memory: nothing is written back).
    paths = [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, paths)))
    patch = "import interpreter_patch\n\ninterpreter_patch.apply_if_interpreting()"
    nb.cells.insert(0, nbformat.v4.new_code_cell(patch))
    client = nbclient.NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()  # raises CellExecutionError with the failing cell and its traceback


def test_inference_example_runs(capsys):
    """examples/infer_moe.py on its tiny preset: fused_moe vs the loop, checked vs float64."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("infer_moe", ROOT / "examples" / "infer_moe.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = ["--preset", "tiny", "--tokens", "5", "--warmup", "0", "--iters", "1"]
    assert example.main(["--device", "cpu", *args]) == 0
    assert "OK: fused_moe agrees" in capsys.readouterr().out
