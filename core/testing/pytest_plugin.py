"""pytest plugin (entry point ``pytest11: vllm_ir``): ``--vllm-ir-conformance --vllm-ir-provider NAME``.

Cheap when unused: nothing from vllm_ir or torch is imported unless the option is given.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_SUITE = Path(__file__).with_name("conformance_suite.py")
_active: list[pytest.Config] = []


def active_config() -> pytest.Config:
    """The config of the pytest run that asked for the conformance suite."""
    if not _active:
        raise RuntimeError("vllm_ir.testing.conformance_suite is collected by `pytest --vllm-ir-conformance` only")
    return _active[-1]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("vllm-ir", "vllm-ir conformance kit")
    group.addoption("--vllm-ir-conformance", action="store_true", help="run the vllm-ir conformance kit")
    group.addoption(
        "--vllm-ir-provider",
        action="append",
        default=[],
        metavar="NAME",
        help="provider to check (repeatable); default: every loaded provider",
    )
    group.addoption("--vllm-ir-small", action="store_true", help="small shapes only (slow back-ends)")
    group.addoption("--vllm-ir-examples", type=int, default=20, help="hypothesis examples per op")
    group.addoption(
        "--vllm-ir-skip-compile",
        action="store_true",
        help="skip the eager-vs-compiled check (e.g. Triton kernels on the CPU interpreter)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--vllm-ir-conformance"):
        _active.append(config)
        # Without explicit paths pytest would collect the current folder: run the kit alone.
        if config.args == [str(config.invocation_params.dir)]:
            config.args[:] = [str(_SUITE)]
        elif str(_SUITE) not in config.args:
            config.args.append(str(_SUITE))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not config.getoption("--vllm-ir-conformance"):
        return
    from vllm_ir.testing.checks import OUTCOMES

    worst: dict[tuple[str, str], object] = {}
    declined: dict[tuple[str, str, str], int] = {}
    for o in OUTCOMES:
        key = (o.op, o.provider)
        if o.status == "ok" and (key not in worst or o.worst_ratio > worst[key].worst_ratio):
            worst[key] = o
        elif o.status == "declined":
            declined[(o.op, o.provider, o.reason or "")] = declined.get((o.op, o.provider, o.reason or ""), 0) + 1
    tr = terminalreporter
    tr.section("vllm-ir conformance")
    for (op, provider), o in sorted(worst.items()):
        tr.write_line(
            f"{provider:>12} {op:<22} worst case {o.case}: max abs error {o.max_abs_error:.3g} "
            f"({o.worst_ratio:.2f}x tolerance)"
        )
    for (op, provider, reason), n in sorted(declined.items()):
        tr.write_line(f"{provider:>12} {op:<22} declined {n} case(s): {reason}")
