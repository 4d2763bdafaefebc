"""Integrations of moe_route into other libraries (imported on demand, never by ``moe_route``).

* :mod:`moe_route.integrations.hf` — an experts implementation for Hugging Face transformers 5.
"""
