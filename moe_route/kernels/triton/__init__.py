"""Triton kernels and their launchers, one file per stage.

A launcher computes the grid and the constexpr flags and launches; it trusts its inputs (the
public functions in :mod:`moe_route` validate them). A kernel only computes.
"""
