"""TEST DOUBLE of Intel's vllm-xpu-kernels (not the real package): see _C.py."""

IS_TEST_DOUBLE = True
