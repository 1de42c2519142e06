"""Triton kernels, one module per op family; imported only where Triton can run them."""
