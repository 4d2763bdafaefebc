"""CUDA C kernels of the memory-bound stages, compiled at run time by NVRTC through CuPy.

A second, independent implementation of routing maps, expand and the standalone finalize
(``*.cu`` here, shared device code in ``common.cuh``), with the same outputs bit for bit as the
Triton kernels. Each ``<stage>.py`` holds the launcher: it picks the template instantiation
(dtypes, vector width) and the grid, and trusts its inputs (the public functions validate
them). Nothing here imports CuPy at import time; :mod:`._nvrtc` does, at the first launch.
"""

import torch


def cupy_install_hint() -> str:
    """How to install CuPy for the CUDA version torch was built with."""
    major = (torch.version.cuda or "13").split(".")[0]
    return (
        f"pip install 'moe_route[cupy-cuda{major}]' (or pip install cupy-cuda{major}x, the CuPy "
        f"wheel for CUDA {major}.x)"
    )


def import_cupy():
    """Import CuPy, or raise ``ImportError`` saying how to install it.

    Not cached: a test may hide CuPy with ``monkeypatch.setitem(sys.modules, "cupy", None)``,
    and once CuPy is imported this is a dictionary look-up.
    """
    try:
        import cupy
    except ImportError as exc:
        raise ImportError(
            f"the CuPy backend needs CuPy, which is not installed ({exc}): {cupy_install_hint()}"
        ) from exc
    return cupy
