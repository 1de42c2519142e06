"""Pure-PyTorch providers for vllm-ir: ``aten`` and ``inductor`` (one entry point each)."""

__version__ = "0.1.0"
