"""The plugin layer: provider discovery (`discovery`), the pluggy hooks (`hookspecs`),
platforms (`platforms`) and the registration surface providers build on (`provider`).

It sits above the IR core: discovery hands its results to `vllm_ir.ir` once, and the core
never imports this folder.
"""
