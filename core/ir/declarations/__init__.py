"""The ops vllm-ir declares itself. Importing this package registers them."""

from vllm_ir.ir.declarations import layernorm  # noqa: F401
