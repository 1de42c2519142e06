"""The conformance kit: one command verifies any provider against the ops it implements.

``pytest --vllm-ir-conformance --vllm-ir-provider NAME`` (this package is a pytest plugin,
entry point ``pytest11: vllm_ir``), or ``globals().update(conformance_tests(NAME))`` in a
provider's own test module.
"""

from vllm_ir.testing.cases import Case, grid, property_strategy
from vllm_ir.testing.checks import (
    OUTCOMES,
    Outcome,
    check_batch_invariance,
    check_cache_agreement,
    check_compiled,
    check_numerics,
    check_odd_input,
    check_opcheck,
    check_overloads,
    check_predicate_hygiene,
    compare,
)
from vllm_ir.testing.kit import claims, conformance_tests, provider_impls
from vllm_ir.testing.odd_inputs import odd_inputs
from vllm_ir.testing.variations import key_variations

__all__ = [
    "OUTCOMES",
    "Case",
    "Outcome",
    "check_batch_invariance",
    "check_cache_agreement",
    "check_compiled",
    "check_numerics",
    "check_odd_input",
    "check_opcheck",
    "check_overloads",
    "check_predicate_hygiene",
    "claims",
    "compare",
    "conformance_tests",
    "grid",
    "key_variations",
    "odd_inputs",
    "property_strategy",
    "provider_impls",
]
