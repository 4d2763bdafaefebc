"""CUDA C kernels of the memory-bound stages, compiled at run time by NVRTC through CuPy.

A second, independent implementation of routing maps, expand and the standalone finalize
(``*.cu`` here, shared device code in ``common.cuh``), with the same outputs bit for bit as the
Triton kernels. Each ``<stage>.py`` holds the launcher: it picks the template instantiation
(dtypes, vector width) and the grid, and trusts its inputs (the public functions validate
them). Nothing here imports CuPy at import time; :mod:`._nvrtc` does, at the first launch.
"""
