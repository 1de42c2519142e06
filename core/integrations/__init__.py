"""Bridges from model libraries to vllm-ir ops.

Each integration is its own module, imported explicitly (``vllm_ir.integrations.transformers``),
so that ``import vllm_ir`` never imports a model library.
"""
