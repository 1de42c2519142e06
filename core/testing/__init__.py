"""The conformance kit: one command verifies any provider against the ops it implements.

``pytest --vllm-ir-conformance --vllm-ir-provider NAME`` (this package is a pytest plugin,
entry point ``pytest11: vllm_ir``), or ``globals().update(conformance_tests(NAME))`` in a
provider's own test module.
"""

from vllm_ir.testing.cases import Case, grid, property_strategy
from vllm_ir.testing.checks import (
    OUTCOMES,
    Outcome,
    check_compiled,
    check_numerics,
    check_opcheck,
    check_overloads,
    check_predicate_hygiene,
    compare,
)
from vllm_ir.testing.kit import conformance_tests, provider_impls

__all__ = [
    "OUTCOMES",
    "Case",
    "Outcome",
    "check_compiled",
    "check_numerics",
    "check_opcheck",
    "check_overloads",
    "check_predicate_hygiene",
    "compare",
    "conformance_tests",
    "grid",
    "property_strategy",
    "provider_impls",
]
