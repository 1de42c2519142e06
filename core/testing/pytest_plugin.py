"""pytest plugin (entry point ``pytest11: vllm_ir``): ``--vllm-ir-conformance --vllm-ir-provider NAME``.

Cheap when unused: nothing from vllm_ir or torch is imported unless the option is given.

A conformance run verifies something only if it ran a case: when a selected provider ran
none (every case skipped, e.g. its device is missing here), the run fails with the skip
reasons unless ``--vllm-ir-allow-skip`` is given. A provider name nobody registers is a
usage error listing the known ones. ``--vllm-ir-report FILE.json`` writes per provider and
op: cases run, passed, failed, skipped (with reasons), the worst error (failed cases
included), declines with their reasons, and the versions of torch, vllm-ir and the provider.
"""

from __future__ import annotations

import json
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

_SUITE = Path(__file__).with_name("conformance_suite.py")
_active: list[pytest.Config] = []
#: The kit's test functions are ``test_conformance_<provider>_<check>``.
CHECKS = (
    "eager_vs_compiled",
    "numerics_property",
    "numerics",
    "predicate_hygiene",
    "cache_agreement",
    "odd_inputs",
    "overload_semantics",
    "opcheck",
    "batch_invariance",
)
_TOLERANCE = re.compile(r"case (\S+): max abs error (\S+) is (\S+)x the tolerance")


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
    group.addoption(
        "--vllm-ir-device",
        default="cpu",
        metavar="DEVICE",
        help="device the kit's inputs live on (default cpu; e.g. cuda for a GPU provider)",
    )
    group.addoption("--vllm-ir-small", action="store_true", help="small shapes only (slow back-ends)")
    group.addoption("--vllm-ir-examples", type=int, default=20, help="hypothesis examples per op")
    group.addoption(
        "--vllm-ir-seed",
        type=int,
        default=0,
        metavar="N",
        help="seed of the property-based cases (default 0: every run draws the same cases)",
    )
    group.addoption(
        "--vllm-ir-explore",
        action="store_true",
        help="draw new property-based cases from a random seed (printed, for --vllm-ir-seed to replay)",
    )
    group.addoption(
        "--vllm-ir-skip-compile",
        action="store_true",
        help="skip the eager-vs-compiled check (e.g. Triton kernels on the CPU interpreter)",
    )
    group.addoption(
        "--vllm-ir-allow-skip",
        action="store_true",
        help="succeed even when a selected provider ran no case (e.g. its device is missing here)",
    )
    group.addoption(
        "--vllm-ir-report",
        metavar="FILE.json",
        default=None,
        help="write per-op results (cases run, worst error, declines, versions) to FILE.json",
    )


@dataclass
class _Tally:
    """What happened to one provider's tests in this run."""

    passed: int = 0
    failed: int = 0
    skipped: int = 0
    skip_reasons: dict[str, int] = field(default_factory=dict)
    #: op -> counts and failures
    ops: dict[str, dict[str, Any]] = field(default_factory=dict)

    def op(self, name: str) -> dict[str, Any]:
        return self.ops.setdefault(name, {"passed": 0, "failed": 0, "skipped": 0, "failures": []})

    @property
    def ran(self) -> int:
        return self.passed + self.failed


class _Run:
    """The conformance run's bookkeeping: test -> (provider, check, op, case), and the tallies."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self.tests: dict[str, tuple[str, str, str | None, str | None]] = {}
        self.tallies: dict[str, _Tally] = {}
        #: (op, provider) -> (case, max abs error, ratio) of failed numerics cases
        self.failed_numerics: dict[tuple[str, str], list[tuple[str, float, float]]] = {}
        self.providers: list[str] = []

    def selected(self) -> list[str]:
        return list(dict.fromkeys(self.providers or [p for p, *_ in self.tests.values()]))


_RUN = pytest.StashKey[_Run]()


def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption("--vllm-ir-conformance"):
        return
    _active.append(config)
    run = config.stash[_RUN] = _Run(config)
    report = config.getoption("--vllm-ir-report")
    if report:
        _check_writable(report)
    _check_device(config.getoption("--vllm-ir-device"))
    named = config.getoption("--vllm-ir-provider")
    if named:
        _check_names(named)
        run.providers = list(dict.fromkeys(named))
    if config.getoption("--vllm-ir-explore"):
        import random

        config.option.vllm_ir_seed = random.SystemRandom().randrange(2**32)
    # The kit's summary gives each failure's message and a re-run command; tracebacks on request (--tb).
    if getattr(config.option, "tbstyle", "auto") == "auto":
        config.option.tbstyle = "no"
        if not any(a.startswith("-r") for a in config.invocation_params.args):
            config.option.reportchars = "E"  # the failures are in the kit's summary, with re-run commands
    # Without explicit paths pytest would collect the current folder: run the kit alone.
    if config.args == [str(config.invocation_params.dir)]:
        config.args[:] = [str(_SUITE)]
    elif not any(a == str(_SUITE) or a.startswith(f"{_SUITE}::") for a in config.args):
        config.args.append(str(_SUITE))


def _check_writable(path: str) -> None:
    p = Path(path)
    existed = p.exists()
    try:
        with open(p, "a"):
            pass
    except OSError as exc:
        raise pytest.UsageError(f"--vllm-ir-report: cannot write {path}: {exc.strerror or exc}") from None
    if not existed:
        p.unlink()


def _check_device(device: str) -> None:
    """A string torch cannot parse as a device is a usage error (a missing device only skips)."""
    import torch

    try:
        torch.device(device)
    except RuntimeError as exc:
        raise pytest.UsageError(f"--vllm-ir-device {device!r}: {exc}") from None


def _check_names(named: list[str]) -> None:
    """A provider nobody registers or installs is a usage error listing the known ones."""
    import vllm_ir
    from vllm_ir.settings import env

    by_name = {r.name: r for r in vllm_ir.provider_records()}
    records = set(by_name)
    implemented = {p for op in vllm_ir.ops for p in op.impls}
    known = sorted((records | implemented) - {"native"})
    for name in named:
        record = by_name.get(name)
        if record is not None and name not in implemented and record.implementations:
            names = ", ".join(sorted(record.implementations))
            raise pytest.UsageError(
                f"--vllm-ir-provider {name!r}: that is the entry point of {record.distribution}, not a provider "
                f"name; it registers the provider(s) {names}: pass --vllm-ir-provider with one of those"
            )
        if name not in records and name not in implemented:
            raise pytest.UsageError(
                f"--vllm-ir-provider {name!r}: unknown provider; known providers: {', '.join(known) or '(none)'}"
                f"{env.did_you_mean(name, known)}"
            )


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    run = config.stash.get(_RUN, None)
    if run is None:
        return
    for item in items:
        if Path(str(getattr(item, "fspath", ""))) != _SUITE:
            continue
        meta = _meta_of(item.nodeid)
        if meta is not None:
            run.tests[item.nodeid] = meta
            run.tallies.setdefault(meta[0], _Tally())


def _meta_of(nodeid: str) -> tuple[str, str, str | None, str | None] | None:
    """(provider, check, op, case or odd-input label) of a kit test, from its id alone.

    From the id rather than the collected item: under pytest-xdist only the workers collect,
    and the controller, which tallies the reports, sees node ids.
    """
    path, sep, _ = nodeid.partition("::")
    if not sep or (path and Path(path).name != _SUITE.name):  # the suite's own id has no path (outside rootdir)
        return None
    name, _, params = nodeid.split("::", 1)[1].partition("[")
    check = next((c for c in CHECKS if name.endswith(f"_{c}")), None)
    if check is None or not name.startswith("test_conformance_"):
        return None
    provider = name[len("test_conformance_") : -len(check) - 1]
    op_name, _, label = params.removesuffix("]").partition("-")
    return provider, check, op_name or None, label or None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not _active:
        return
    run = _active[-1].stash.get(_RUN, None)
    if run is None:
        return
    meta = run.tests.get(report.nodeid) or _meta_of(report.nodeid)
    if meta is None:
        return
    run.tallies.setdefault(meta[0], _Tally())
    provider, check, op_name, label = meta
    tally = run.tallies[provider]
    per_op = tally.op(op_name or "(all)")
    per_check = per_op.setdefault("checks", {}).setdefault(check, {"ran": 0, "failed": 0})
    if (report.passed and report.when == "call") or report.failed:
        per_check["ran"] += 1
    if report.skipped and report.when in ("setup", "call"):
        reason = _skip_reason(report)
        tally.skipped += 1
        per_op["skipped"] += 1
        tally.skip_reasons[reason] = tally.skip_reasons.get(reason, 0) + 1
    elif report.failed:
        tally.failed += 1
        per_op["failed"] += 1
        message = _failure_message(report)
        per_check["failed"] += 1
        per_op["failures"].append({"check": check, "case": label, "message": message, "rerun": _rerun(run, report)})
        found = _TOLERANCE.search(message)
        if found and op_name:
            case, abs_err, ratio = found.groups()
            run.failed_numerics.setdefault((op_name, provider), []).append(
                (case.rstrip(":,"), _float(abs_err), _float(ratio))
            )
    elif report.passed and report.when == "call":
        tally.passed += 1
        per_op["passed"] += 1


def _rerun(run: _Run, report: pytest.TestReport) -> str:
    """A command that runs exactly this kit test again (the node id with the suite's full path)."""
    import shlex

    test = report.nodeid.split("::", 1)[1]
    meta = run.tests.get(report.nodeid) or _meta_of(report.nodeid)
    parts = ["pytest", "--vllm-ir-conformance"]
    if meta is not None:
        parts += ["--vllm-ir-provider", meta[0]]
    device = run.config.getoption("--vllm-ir-device")
    if device != "cpu":
        parts += ["--vllm-ir-device", device]
    for flag in ("--vllm-ir-small", "--vllm-ir-skip-compile"):
        if run.config.getoption(flag):
            parts.append(flag)
    if test.startswith(tuple(f"test_conformance_{p}_numerics_property" for p in run.tallies)):
        parts += ["--vllm-ir-seed", str(run.config.getoption("--vllm-ir-seed"))]
        parts += ["--vllm-ir-examples", str(run.config.getoption("--vllm-ir-examples"))]
    return shlex.join([*parts, f"{_SUITE}::{test}"])


def _float(text: str) -> float:
    try:
        return float(text.rstrip(",:;"))
    except ValueError:
        return float("nan")


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _failure_message(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    # The whole message, not its first line: e.g. a LoweringError gives its reasons below it.
    text = text.strip() or "failed"
    return text if len(text) <= 2000 else text[:2000] + " ..."


def _ran_nothing(run: _Run) -> list[str]:
    return [p for p in run.selected() if run.tallies.get(p, _Tally()).ran == 0]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    run = session.config.stash.get(_RUN, None)
    if run is None:
        return
    path = session.config.getoption("--vllm-ir-report")
    if path:
        with open(path, "w") as f:
            json.dump(_report(run), f, indent=2)
    if _ran_nothing(run) and not session.config.getoption("--vllm-ir-allow-skip") and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _worst(run: _Run) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (op, provider): the worst numerics case, failed cases included."""
    from vllm_ir.testing.checks import OUTCOMES

    worst: dict[tuple[str, str], dict[str, Any]] = {}

    def offer(key: tuple[str, str], case: str, abs_err: float, ratio: float, failed: bool) -> None:
        current = worst.get(key)
        if current is None or ratio > current["tolerance_ratio"] or (failed and not current["failed"]):
            worst[key] = {"case": case, "max_abs_error": abs_err, "tolerance_ratio": ratio, "failed": failed}

    for o in OUTCOMES:
        if o.status == "ok" and o.reason is None:
            offer((o.op, o.provider), o.case, o.max_abs_error, o.worst_ratio, False)
    for key, cases in run.failed_numerics.items():
        for case, abs_err, ratio in cases:
            offer(key, case, abs_err, ratio, True)
    return worst


def _declines() -> dict[tuple[str, str], dict[str, int]]:
    from vllm_ir.testing.checks import OUTCOMES

    out: dict[tuple[str, str], dict[str, int]] = {}
    for o in OUTCOMES:
        if o.status == "declined":
            reasons = out.setdefault((o.op, o.provider), {})
            reasons[o.reason or ""] = reasons.get(o.reason or "", 0) + 1
    return out


def _report(run: _Run) -> dict[str, Any]:
    import platform

    import torch

    import vllm_ir

    records = {r.name: r for r in vllm_ir.provider_records()}
    worst, declines = _worst(run), _declines()
    allow_skip = bool(run.config.getoption("--vllm-ir-allow-skip"))
    providers: dict[str, Any] = {}
    for provider in run.selected():
        tally = run.tallies.get(provider, _Tally())
        record = records.get(provider)
        ops = {}
        for op_name, counts in sorted(tally.ops.items()):
            ops[op_name] = {
                "cases_run": counts["passed"] + counts["failed"],
                "passed": counts["passed"],
                "failed": counts["failed"],
                "skipped": counts["skipped"],
                "worst": worst.get((op_name, provider)),
                "declines": declines.get((op_name, provider), {}),
                "failures": counts["failures"],
            }
        providers[provider] = {
            "distribution": record.distribution if record else None,
            "version": record.version if record else None,
            "status": record.status.value if record else None,
            "reason": record.reason if record else None,
            "cases_run": tally.ran,
            "passed": tally.passed,
            "failed": tally.failed,
            "skipped": tally.skipped,
            "skip_reasons": tally.skip_reasons,
            "ran_nothing": tally.ran == 0,
            "ops": ops,
        }
    return {
        "versions": {
            "torch": torch.__version__,
            "vllm_ir": vllm_ir.__version__,
            "python": platform.python_version(),
        },
        "device": run.config.getoption("--vllm-ir-device"),
        "allow_skip": allow_skip,
        "providers": providers,
    }


def _failure_lines(run: _Run, provider: str, tally: _Tally, width: int) -> list[str]:
    """Per (op, check) that failed: counts, the worst case and its message, and its re-run command."""
    lines = []
    for op_name, counts in sorted(tally.ops.items()):
        by_check: dict[str, list[dict[str, Any]]] = {}
        for failure in counts["failures"]:
            by_check.setdefault(failure["check"], []).append(failure)
        for check, failures in by_check.items():
            # The worst numerics case; else the first failure with elements (an empty case says little).
            worst = max(failures, key=lambda f: (_ratio_of(f["message"]), not (f["case"] or "").startswith("0x")))
            ran = counts.get("checks", {}).get(check, {}).get("ran", len(failures))
            first = (worst["message"].splitlines() or ["failed"])[0].removeprefix("vllm_ir.errors.")
            lines.append(
                f"    {op_name} {check}: {len(failures)} of {ran} failed; worst case {worst['case'] or op_name}:"
            )
            lines += textwrap.wrap(first, max(60, width), initial_indent="      ", subsequent_indent="      ",
                                   max_lines=3, placeholder=" ... (--vllm-ir-report has it all)")  # fmt: skip
            lines.append(f"      re-run: {worst['rerun']}")
    return lines


def _ratio_of(message: str) -> float:
    found = _TOLERANCE.search(message)
    return _float(found.group(3)) if found else 0.0


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    run = config.stash.get(_RUN, None)
    if run is None:
        return
    tr = terminalreporter
    tr.section("vllm-ir conformance")
    seed = config.getoption("--vllm-ir-seed")
    how = "drawn by --vllm-ir-explore" if config.getoption("--vllm-ir-explore") else "the default"
    tr.write_line(f"property-based cases: seed {seed} ({how}; --vllm-ir-seed {seed} replays them)")
    for (op, provider), w in sorted(_worst(run).items()):
        if not w["failed"] and w["max_abs_error"] == 0 and w["tolerance_ratio"] == 0:
            tr.write_line(f"{provider:>12} {op:<22} max abs error 0 on every case")
            continue
        status = "FAILED " if w["failed"] else ""
        tr.write_line(
            f"{provider:>12} {op:<22} worst case {status}{w['case']}: max abs error {w['max_abs_error']:.3g} "
            f"({w['tolerance_ratio']:.2f}x tolerance)"
        )
    for (op, provider), reasons in sorted(_declines().items()):
        for reason, n in sorted(reasons.items()):
            tr.write_line(f"{provider:>12} {op:<22} declined {n} case(s): {reason}")
    for provider in run.selected():
        tally = run.tallies.get(provider, _Tally())
        tr.write_line(
            f"{provider:>12} ran {tally.ran} case(s): {tally.passed} passed, {tally.failed} failed, "
            f"{tally.skipped} skipped"
        )
        for line in _failure_lines(run, provider, tally, tr._tw.fullwidth):
            tr.write_line(line, red=True)
    nothing = _ran_nothing(run)
    allow = config.getoption("--vllm-ir-allow-skip")
    for provider in nothing:
        reasons = run.tallies.get(provider, _Tally()).skip_reasons
        why = "; ".join(f"{r} ({n}x)" for r, n in sorted(reasons.items(), key=lambda kv: -kv[1])) or "no test"
        verdict = "allowed by --vllm-ir-allow-skip" if allow else "this run verified nothing: FAILED"
        tr.write_line(f"provider {provider!r} ran no case ({verdict}); skipped because: {why}", red=not allow)
    if nothing and not allow:
        tr.write_line("pass --vllm-ir-allow-skip to accept a run that verifies nothing (e.g. in CI without the device)")
    path = config.getoption("--vllm-ir-report")
    if path:
        tr.write_line(f"report written to {path}")
