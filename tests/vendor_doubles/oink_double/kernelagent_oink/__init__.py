"""TEST DOUBLE of KernelAgent-Oink (``kernelagent_oink``; not the real package): see blackwell/oink_custom_ops.py."""

from __future__ import annotations

IS_TEST_DOUBLE = True
#: Every call of the double's ops: {"fn", argument names -> values}.
CALLS: list[dict] = []
