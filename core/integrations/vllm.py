"""vLLM's own IR ops (``vllm.ir.ops``) run vllm-ir's implementations: the bridge.

vLLM calls every ``vllm.general_plugins`` entry point at start-up in each of its processes;
vllm-ir's (``vllm_ir = vllm_ir.integrations.vllm:register``) loads our providers and registers each
implementation of an op whose semantics vLLM shares with us as a vLLM implementation named
``vllm_ir_<provider>`` (``vllm_ir_vllm_c``, ``vllm_ir_aten``, ...). Nothing else changes in
vLLM: a bridged implementation runs only where the user names it in vLLM's IR priority
(``ir_op_priority`` of its kernel config), and vLLM's platform defaults stay as they are.

- ``supported`` is carried over as a plain bool; the `Unsupported` reason goes to vLLM's log
  (DEBUG, logger ``vllm.vllm_ir_bridge``).
- ``supports_args`` is wrapped: our verdict, plus the domain where vLLM's semantics equal ours
  (see `MAPPINGS`); a declined call logs its reason at DEBUG, and vLLM falls through its list.
- A provider registering both a functional and an in-place kernel is bridged with the in-place
  one (``inplace=True``): vLLM's functional call clones the activations first, its
  ``maybe_inplace`` donates them.
- Each bridged implementation's ``uuid()`` (vLLM's compile-cache key) hashes what it runs: the
  kernel's code and libraries, as our own compile cache does.

A vLLM outside `TESTED_VLLM` is refused as a whole (nothing registered, one warning saying
why). A failing provider is recorded by vllm-ir's loader and left out; the bridge itself never
raises into vLLM. ``VLLM_PLUGINS`` (vLLM's allow-list) without ``vllm_ir`` turns it off.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from importlib import metadata
from typing import Any

#: vLLM releases the bridge was tested with (vllm.ir's registration API is not stable yet).
TESTED_VLLM = ">=0.33.0,<0.34"
#: The entry point in group ``vllm.general_plugins`` (pyproject.toml) and the prefix of bridged names.
ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_NAME = "vllm_ir"
PREFIX = "vllm_ir_"

log = logging.getLogger("vllm.vllm_ir_bridge")  # under "vllm": vLLM's handlers and VLLM_LOGGING_LEVEL apply


@dataclasses.dataclass(frozen=True)
class OpMapping:
    """One vLLM IR op and its vllm-ir counterpart.

    ``domain`` takes the arguments of a call (vLLM's parameter order, which the bridge checks
    equals ours) and returns True where both ops have the same semantics, else a falsy reason.
    """

    vllm_op: str
    ours: str
    domain: Callable[..., Any] | None = None


#: vLLM op -> counterpart. Checked against vLLM's native functions with vLLM's own input
#: generators and tolerances (tests/test_vllm_bridge.py).
MAPPINGS: dict[str, OpMapping] = {
    # vLLM 0.33's semantics for every weight dtype (weight applied in its own dtype, result in
    # x's): no domain restriction.
    "rms_norm": OpMapping("rms_norm", "rms_norm"),
    "fused_add_rms_norm": OpMapping("fused_add_rms_norm", "fused_add_rms_norm"),
    # vLLM 0.33's expression op for op (per-row mean and population std, every step in x's dtype).
    "gelu_and_mul_sparse": OpMapping("gelu_and_mul_sparse", "gelu_and_mul_sparse"),
}
#: vLLM ops (0.33) the bridge leaves alone, and why.
NOT_BRIDGED: dict[str, str] = {}


@dataclasses.dataclass
class BridgeState:
    """What the bridge did in this process (``vllm-ir doctor`` shows it)."""

    #: "not run", "active", "refused" (vLLM version outside TESTED_VLLM) or "failed".
    status: str = "not run"
    vllm_version: str | None = None
    reason: str | None = None
    #: vLLM op -> bridged provider names registered with vLLM.
    registered: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    #: "op:provider" (or an op) -> why it was not registered.
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


state = BridgeState()


def bridged_name(provider: str) -> str:
    """The vLLM provider name of one of ours: ``vllm_c`` -> ``vllm_ir_vllm_c``."""
    return PREFIX + provider


def version_problem(version: str) -> str | None:
    """Why a vLLM version cannot be bridged (None when it is in `TESTED_VLLM`)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        ok = Version(version) in SpecifierSet(TESTED_VLLM)
    except InvalidVersion:
        return f"vLLM version {version!r} cannot be parsed"
    if ok:
        return None
    return (
        f"vLLM {version} is outside the range the vllm-ir bridge was tested with (vllm{TESTED_VLLM}); "
        "no vllm-ir implementation was registered with vLLM. Install a vllm-ir release made for this vLLM."
    )


def register() -> None:
    """The ``vllm.general_plugins`` entry point: bridge every loaded implementation, once per process.

    Never raises into vLLM (its plugin loader does not catch plugin errors): a failure is
    logged with its traceback and leaves vLLM with its own implementations only.
    """
    if state.status != "not run":
        return
    try:
        _register()
    except Exception as exc:
        state.status, state.reason = "failed", f"{type(exc).__name__}: {exc}"
        log.exception("vllm-ir bridge failed; vLLM keeps its own IR implementations only")


def _register() -> None:
    import vllm
    import vllm.ir
    from vllm.ir.op import IrOp as VllmIrOp

    state.vllm_version = str(getattr(vllm, "__version__", "unknown"))
    problem = version_problem(state.vllm_version)
    if problem is not None:
        state.status, state.reason = "refused", problem
        log.warning("%s", problem)
        return

    import vllm_ir
    from vllm_ir.ir import registry

    vllm_ir.load_providers()  # honours VLLM_IR_PROVIDERS / VLLM_IR_DISABLE_PROVIDERS; failures are recorded
    for record in vllm_ir.provider_records():
        if record.status in (vllm_ir.ProviderStatus.FAILED, vllm_ir.ProviderStatus.INCOMPATIBLE):
            log.warning("vllm-ir provider %r not bridged: %s %s", record.name, record.status.value, record.reason)

    plan: list[tuple[Any, Any, OpMapping]] = []
    for name, vop in sorted(VllmIrOp.registry.items()):
        mapping = MAPPINGS.get(name)
        if mapping is None or not registry.has_op(mapping.ours):
            why = NOT_BRIDGED.get(name, "no vllm-ir op of the same semantics")
            state.skipped[name] = why
            log.debug("vllm.ir.ops.%s not bridged: %s", name, why)
            continue
        ours = registry.get_op(mapping.ours)
        mismatch = _signature_mismatch(vop, ours)
        if mismatch is not None:
            state.skipped[name] = mismatch
            log.warning("vllm.ir.ops.%s not bridged: %s", name, mismatch)
            continue
        plan.append((vop, ours, mapping))

    for vop, ours, mapping in plan:
        for provider, impl in sorted(ours.impls.items()):
            if provider == "native":
                continue
            key = f"{vop.name}:{provider}"
            vname = bridged_name(provider)
            if vname in vop.impls:
                state.skipped[key] = f"vLLM already has a provider named {vname!r}"
                log.warning("vllm.ir.ops.%s: %s not bridged: %s", vop.name, provider, state.skipped[key])
                continue
            try:
                _register_one(vop, impl, mapping, vname)
            except Exception as exc:  # one refused registration leaves the others
                state.skipped[key] = f"vLLM refused the registration: {type(exc).__name__}: {exc}"
                log.warning("vllm.ir.ops.%s: %s not bridged: %s", vop.name, provider, state.skipped[key])
                continue
            state.registered.setdefault(vop.name, []).append(vname)
    state.status = "active"
    log.info(
        "vllm-ir bridge active (vLLM %s): %s",
        state.vllm_version,
        "; ".join(f"{op}: {', '.join(p)}" for op, p in state.registered.items()) or "nothing to bridge",
    )


def _signature_mismatch(vop: Any, ours: Any) -> str | None:
    """Why vLLM's op and ours cannot share arguments: parameter names, order and defaults must agree."""
    theirs = [(p.name, p.default) for p in vop._py_signature.parameters.values()]
    mine = [(p.name, p.default) for p in ours.signature.parameters.values()]
    if theirs != mine:
        return f"parameters differ: vLLM {theirs} vs vllm-ir {mine}"
    return None


def _register_one(vop: Any, impl: Any, mapping: OpMapping, vname: str) -> None:
    in_place = impl.inplace or impl.inplace_fn is not None
    kernel = impl.inplace_fn if impl.inplace_fn is not None else impl.fn
    if in_place and not vop.allow_inplace:  # vLLM's op has no maybe_inplace: use the functional form
        if impl.inplace_fn is None:
            raise ValueError("only an in-place kernel, and vLLM's op does not allow in-place implementations")
        kernel, in_place = impl.fn, False
    supported = bool(impl.supported)
    if not supported:
        log.debug("vllm.ir.ops.%s: %s is not supported here: %s", vop.name, vname, impl.unsupported_reason)

    def run(*args: Any, **kwargs: Any) -> Any:
        return kernel(*args, **kwargs)

    run.__signature__ = vop._py_signature  # type: ignore[attr-defined]  # vLLM infers its schema from it
    run.__name__ = run.__qualname__ = f"{vname}_{vop.name}"
    predicate = _predicate(vop, impl, mapping, vname)
    registered = vop.register_impl(vname, supported=supported, supports_args=predicate, inplace=in_place)(run)
    # vLLM hashes the file of impl_fn (this module); hash what actually runs instead.
    registered.uuid = functools.partial(_uuid, impl)


def _predicate(vop: Any, impl: Any, mapping: OpMapping, vname: str) -> Callable[..., bool]:
    ours, domain = impl.supports_args, mapping.domain

    def supports(*args: Any, **kwargs: Any) -> bool:
        if kwargs:  # rare: put every argument in its place, as the domain checks read positions
            args, kwargs = vop._py_signature.bind(*args, **kwargs).args, {}
        try:
            verdict = domain(*args) if domain is not None else True
            if verdict and ours is not None:
                verdict = ours(*args, **kwargs)
        except Exception as exc:
            verdict = False
            reason = f"its supports_args raised {type(exc).__name__}: {exc}"
        else:
            reason = getattr(verdict, "reason", "declined")
        if verdict:
            return True
        if log.isEnabledFor(logging.DEBUG):
            log.debug("vllm.ir.ops.%s: %s declines: %s", vop.name, vname, reason)
        return False

    supports.__signature__ = vop._py_signature.replace(return_annotation=bool)  # type: ignore[attr-defined]
    return supports


def _uuid(impl: Any) -> str:
    from vllm_ir.passes import cache

    return cache.combine(
        "vllm_bridge",
        cache.package_fingerprint(),
        cache.code_fingerprint(impl.fn),
        cache.code_fingerprint(impl.inplace_fn) if impl.inplace_fn is not None else None,
        cache.code_fingerprint(impl.supports_args) if impl.supports_args is not None else None,
        cache.library_facts(impl),
        cache.declared_facts(impl),
    )


def describe() -> dict[str, Any]:
    """The bridge as seen from this process, for ``providers list`` and ``doctor`` (imports no vLLM).

    ``status``: "vllm not installed", "disabled by VLLM_PLUGINS", "refused" (version outside
    `TESTED_VLLM`), "ready" (vLLM will activate it in its processes), or, in a process where
    vLLM ran the plugin, this process's own state ("active", "failed", "refused").
    """
    try:
        version: str | None = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        version = None
    out: dict[str, Any] = {
        "vllm_version": version,
        "tested_range": f"vllm{TESTED_VLLM}",
        "entry_point": f"{ENTRY_POINT_GROUP}: {ENTRY_POINT_NAME}",
        "registered": {},
        "reason": None,
    }
    if state.status != "not run":
        out.update(status=state.status, reason=state.reason, registered=state.registered, vllm_version=version)
        return out
    if version is None:
        out["status"] = "vllm not installed"
        return out
    import os

    allowed = os.environ.get("VLLM_PLUGINS")
    problem = version_problem(version)
    if problem is not None:
        out.update(status="refused", reason=problem)
    elif allowed is not None and ENTRY_POINT_NAME not in [p.strip() for p in allowed.split(",")]:
        out.update(status="disabled by VLLM_PLUGINS", reason=f"VLLM_PLUGINS={allowed!r} does not name vllm_ir")
    else:
        out.update(status="ready", registered=planned())
    return out


def planned() -> dict[str, list[str]]:
    """vLLM op -> the bridged names vLLM would get from the providers loaded here."""
    from vllm_ir.ir import registry

    plan: dict[str, list[str]] = {}
    for name, mapping in sorted(MAPPINGS.items()):
        if registry.has_op(mapping.ours):
            providers = [p for p in sorted(registry.get_op(mapping.ours).impls) if p != "native"]
            plan[name] = [bridged_name(p) for p in providers]
    return plan
