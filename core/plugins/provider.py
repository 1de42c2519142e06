"""`Provider`: one registration surface per provider.

A provider states once what all its implementations share (its name, whether its library
loaded, batch invariance, compile facts...) and then registers each op's kernel in one call::

    from vllm_ir import Provider, Unsupported

    mine = Provider("mine", available=library_status(), batch_invariant=True)

    @mine.impl("rms_norm", supports=lambda x, variance_size: variance_size is None)
    def rms_norm(x, weight, epsilon, variance_size=None):
        ...

    # A kernel taking a trailing ``inplace`` parameter serves both forms: ``op(...)`` calls it
    # with inplace=False (fresh outputs), ``op.maybe_inplace(...)`` with inplace=True.
    @mine.impl("fused_add_rms_norm", supports=residual_ok)
    def fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size=None, inplace=False):
        ...

- ``supports`` may take only the op parameters it reads, by name, in any order: it is adapted
  once, at registration, into a predicate of the op's parameters (the dispatcher still hands a
  predicate the call's arguments). A parameter the op lacks is a `RegistrationError` naming the
  op and the provider, and nothing is registered.
- ``supports`` may also be a tuple of such predicates, each reading its own parameters
  (``supports=(rows_ok, weight_ok, scale_ok)``): they are asked in order and the first that
  declines gives the verdict, so checks that several ops share are written once and no
  predicate restates a whole signature to call the others.
- ``available`` falsy (an `Unsupported` carrying the reason: "library not installed") marks
  every implementation the provider registers unsupported with that one reason; the kernel
  bindings are registered all the same (never called), so ``explain`` and ``providers list``
  show the reason, and nothing needs an ``if available:`` around the registrations.
- Kernel-library ops that only write their ``(a!)`` arguments get their fakes from
  `default_fakes` (they return nothing, so tracing needs no outputs); the IR op's own fake is
  its declared function (`IrOp.register_fake` overrides it).
- `import_families` is the family-discovery scan providers share: every public module of a
  package is imported in name order, so adding an op family is adding a file.
- `deferred_custom_op` declares a vendor kernel's ``torch.library.custom_op``; a provider defines
  them at import where it can run (`define_custom_ops`), elsewhere each waits for its first call.
- `weight_or_ones` stands in a ones vector for ``weight=None`` where a vendor norm always
  multiplies by a weight; `empty_group_scales` is the group-quant scales buffer in native's layout;
  `aligned` copies a view whose data pointer a vector-loading kernel could not read.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any, TypeVar

import torch

from vllm_ir.errors import RegistrationError
from vllm_ir.ir import registry, signature, torch_library
from vllm_ir.ir.dispatch import code_cache
from vllm_ir.ir.dispatch import entry_points as _dispatch
from vllm_ir.ir.families import import_families
from vllm_ir.ir.impl import IrOpImpl, Unsupported
from vllm_ir.ir.op import IrOp

__all__ = [
    "INPLACE",
    "OPTIONS",
    "DeferredCustomOp",
    "Provider",
    "adapt_predicate",
    "aligned",
    "default_fakes",
    "deferred_custom_op",
    "define_custom_ops",
    "empty_group_scales",
    "import_families",
    "weight_or_ones",
]

F = TypeVar("F", bound=Callable[..., Any])
#: A ``supports`` predicate (of any of the op's parameters, by name), or a tuple of them.
Supports = Callable[..., bool | Unsupported] | Sequence[Callable[..., bool | Unsupported]]

#: Options a provider may set for all its implementations, and each `Provider.impl` for its own.
OPTIONS = ("batch_invariant", "exact", "cacheable", "compile_facts", "lowerable")
#: The trailing kernel parameter that makes one binding serve both kernel forms.
INPLACE = "inplace"


class Provider:
    """A provider's implementations, registered through one object (see the module docstring).

    :param name: the provider name in priority lists (``[a-z_][a-z0-9_]*``).
    :param available: True, or falsy (an `Unsupported` reason) when the provider's library or
        device is missing here: every implementation it registers is then unsupported with it.
    :param defaults: options shared by every implementation (``batch_invariant``, ``exact``,
        ``cacheable``, ``compile_facts``, ``lowerable``); `impl` may override each.
    """

    def __init__(self, name: str, *, available: bool | Unsupported = True, **defaults: Any):
        _check_options(defaults, f"Provider({name!r})")
        self.name = name
        self.available = available
        self.defaults = defaults
        #: Every implementation registered through this object, by op name.
        self.impls: dict[str, IrOpImpl] = {}

    @property
    def available(self) -> bool | Unsupported:
        return self._available

    @available.setter
    def available(self, value: bool | Unsupported) -> None:
        if not isinstance(value, (bool, Unsupported)):
            raise RegistrationError(
                f"provider {self.name!r}: available must be a bool or vllm_ir.Unsupported, got {type(value).__name__}",
                provider=self.name,
            )
        self._available = value

    @property
    def reason(self) -> str | None:
        """Why the provider cannot run here (None when it can)."""
        if self._available:
            return None
        return self._available.reason if isinstance(self._available, Unsupported) else "unavailable"

    def impl(
        self,
        op: str | IrOp,
        *,
        supports: Supports | None = None,
        inplace: bool = False,
        supported: bool | Unsupported = True,
        **options: Any,
    ) -> Callable[[F], F]:
        """Register the decorated kernel binding as this provider's implementation of ``op``.

        :param supports: per-call predicate over any of the op's parameters (by name), or a tuple
            of them, asked in order (the first that declines gives the verdict).
        :param inplace: the kernel overwrites the activations and returns them (in-place form
            only). A kernel whose last parameter is ``inplace=False`` serves both forms instead.
        :param supported: this one implementation cannot run here (e.g. an old library build);
            the provider's own ``available`` reason wins over it.
        :param options: ``batch_invariant``, ``exact``, ``cacheable``, ``compile_facts``,
            ``lowerable``, over the provider's defaults.
        """

        def decorator(fn: F) -> F:
            self.register(op, fn, supports=supports, inplace=inplace, supported=supported, **options)
            return fn

        return decorator

    def register(
        self,
        op: str | IrOp,
        fn: Callable[..., Any],
        *,
        supports: Supports | None = None,
        inplace: bool = False,
        supported: bool | Unsupported = True,
        **options: Any,
    ) -> IrOpImpl:
        """`impl` without the decorator: register ``fn`` for ``op`` and return the implementation."""
        ir_op = op if isinstance(op, IrOp) else registry.get_op(op)
        _check_options(options, f"op {ir_op.name!r}, provider {self.name!r}")
        merged = {**self.defaults, **options}
        functional, in_place = _kernel_forms(ir_op, self.name, fn, inplace)
        impl = IrOpImpl(
            ir_op.name,
            self.name,
            functional if functional is not None else in_place,
            supported=self._available if not self._available else supported,
            supports_args=None if supports is None else adapt_predicate(ir_op, self.name, supports),
            inplace=functional is None,
            inplace_fn=in_place if functional is not None else None,
            **merged,
        )
        impl = ir_op.add_impl(impl)
        self.impls[ir_op.name] = impl
        return impl

    def __repr__(self) -> str:
        state = "available" if self._available else f"unavailable: {self.reason}"
        return f"Provider({self.name!r}, {state}, {len(self.impls)} implementations)"


def _check_options(options: Mapping[str, Any], who: str) -> None:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise RegistrationError(f"{who}: unknown option(s) {', '.join(unknown)} (known: {', '.join(OPTIONS)})")


def _kernel_forms(
    op: IrOp, provider: str, fn: Callable[..., Any], inplace: bool
) -> tuple[Callable[..., Any] | None, Callable[..., Any] | None]:
    """(functional kernel, in-place kernel) of a binding; a trailing ``inplace`` parameter gives both."""
    try:
        sig = signature.signature_of(fn)
    except (NameError, TypeError, ValueError) as exc:
        raise RegistrationError(
            f"op {op.name!r}, provider {provider!r}: cannot read the kernel's signature: {exc}",
            op=op.name,
            provider=provider,
        ) from exc
    params = list(sig.parameters.values())
    if not params or params[-1].name != INPLACE or INPLACE in op.signature.parameters:
        return (None, fn) if inplace else (fn, None)
    last = params[-1]
    if inplace:
        raise RegistrationError(
            f"op {op.name!r}, provider {provider!r}: a kernel taking an 'inplace' parameter serves both forms; "
            "do not also pass inplace=True",
            op=op.name,
            provider=provider,
        )
    if last.default is not False or last.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
        raise RegistrationError(
            f"op {op.name!r}, provider {provider!r}: the kernel's 'inplace' parameter must be a plain "
            "trailing parameter defaulting to False",
            op=op.name,
            provider=provider,
        )
    if not op.allow_inplace:
        raise RegistrationError(
            f"op {op.name!r}, provider {provider!r}: the kernel takes 'inplace' (both forms), but the op is "
            "not declared with allow_inplace=True",
            op=op.name,
            provider=provider,
        )
    stripped = sig.replace(parameters=params[:-1])  # the op's parameters
    return _form(fn, op, stripped, False), _form(fn, op, stripped, True)


def _form(fn: Callable[..., Any], op: IrOp, sig: inspect.Signature, inplace: bool) -> functools.partial:
    """One kernel form of a binding taking ``inplace``: a partial (no extra Python frame per call;
    tracing reads its signature), named after the binding."""
    form = functools.partial(fn, inplace=inplace)
    form.__signature__ = sig  # type: ignore[attr-defined]
    form.__module__ = getattr(fn, "__module__", None)  # type: ignore[attr-defined]
    name = getattr(fn, "__qualname__", op.name) + ("[inplace]" if inplace else "")
    form.__qualname__ = form.__name__ = name  # type: ignore[attr-defined]
    return form


def adapt_predicate(op: IrOp, provider: str, pred: Supports) -> Callable[..., Any]:
    """``pred`` as a predicate of all of ``op``'s parameters (built once; returned as is when it
    already takes them). It may declare any of the op's parameters by name, in any order; a tuple
    of such predicates becomes one that asks each in order and returns the first refusal (a falsy
    verdict), or else the last one's verdict."""
    preds = tuple(pred) if isinstance(pred, (tuple, list)) else (pred,)
    if not preds:
        raise RegistrationError(
            f"op {op.name!r}, provider {provider!r}: supports is an empty sequence", op=op.name, provider=provider
        )
    reads = [_predicate_parameters(op, provider, p) for p in preds]
    op_params = op.signature.parameters
    if len(preds) == 1 and reads[0] == [(p.name, p.default) for p in op_params.values()]:
        return preds[0]
    env: dict[str, Any] = {}
    params = _dispatch.parameter_list(op.signature, env)
    name = getattr(preds[0], "__name__", "supports") if len(preds) == 1 else "supports"
    if not name.isidentifier():
        name = "supports"
    lines = ["def _adapt(_preds):", f"    def {name}({params}):"]
    for i, names in enumerate(reads):
        call = f"_preds[{i}]({', '.join(n for n, _ in names)})"
        if i < len(reads) - 1:  # a refusal (False or an Unsupported) ends the chain
            lines += [f"        verdict = {call}", "        if not verdict:", "            return verdict"]
        else:
            lines.append(f"        return {call}")
    source = "\n".join([*lines, f"    return {name}", ""])
    namespace = dict(env)
    (code,) = code_cache.compile_all([(f"<vllm_ir.ops.{op.name}.supports.{provider}>", source)])
    exec(code, namespace)
    adapted = namespace["_adapt"](preds)
    adapted.__qualname__ = " and ".join(getattr(p, "__qualname__", name) for p in preds)
    adapted.__doc__ = getattr(preds[0], "__doc__", None) if len(preds) == 1 else None
    return adapted


def _predicate_parameters(op: IrOp, provider: str, pred: Callable[..., Any]) -> list[tuple[str, Any]]:
    """The (name, default) of each parameter ``pred`` reads; a `RegistrationError` unless each is
    one of ``op``'s, with the op's default or none."""
    if not callable(pred):
        raise RegistrationError(
            f"op {op.name!r}, provider {provider!r}: supports must be callable, got {type(pred).__name__}",
            op=op.name,
            provider=provider,
        )
    sig = signature.check_parameters(pred, op=op.name, provider=provider, what="supports")
    op_params = op.signature.parameters
    unknown = [n for n in sig.parameters if n not in op_params]
    if unknown:
        raise RegistrationError(
            f"op {op.name!r}, provider {provider!r}: supports takes {', '.join(map(repr, unknown))}, which the op "
            f"does not have (op parameters: {', '.join(op_params)})",
            op=op.name,
            provider=provider,
        )
    for p in sig.parameters.values():
        want = op_params[p.name].default
        if p.default is not inspect.Parameter.empty and p.default != want:
            raise RegistrationError(
                f"op {op.name!r}, provider {provider!r}: supports gives {p.name!r} the default {p.default!r}, "
                f"the op {'none' if want is inspect.Parameter.empty else repr(want)}",
                op=op.name,
                provider=provider,
            )
    return [(p.name, p.default) for p in sig.parameters.values()]


def default_fakes(namespace: str) -> list[str]:
    """Give every op of the torch library ``namespace`` that returns nothing (it only writes its
    ``(a!)`` arguments) and has no fake yet a fake that returns None; the names given fakes."""
    prefix = f"{namespace}::"
    done = []
    for qualname in sorted(set(all_op_names())):
        if not qualname.startswith(prefix):
            continue
        schemas = [s for s in torch._C._jit_get_schemas_for_operator(qualname) if s.overload_name == ""]
        if not schemas or schemas[0].returns:
            continue
        if torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Meta"):
            continue
        # A library per fake, kept alive, as torch.library.register_fake makes one without ``lib``.
        lib = torch.library.Library(namespace, "FRAGMENT")
        try:
            torch_library.register_fake(qualname, _no_result, lib, torch_library.caller_source())
        except RuntimeError:  # a fake was registered already
            lib._destroy()
            continue
        _fake_libraries.append(lib)
        done.append(qualname)
    return done


#: The libraries holding `default_fakes`' registrations (never destroyed, as torch's own).
_fake_libraries: list[torch.library.Library] = []


def all_op_names() -> list[str]:
    """Every operator name the dispatcher knows (``ns::name`` or ``ns::name.overload``).

    The dispatcher's registrations for no particular key are every operator: the same names as
    ``torch._C._dispatch_get_all_op_names()`` in a quarter of the time (~0.6 ms against 2-6 ms here
    for ~3.6k operators), which `default_fakes` pays at start-up.
    """
    registrations = getattr(torch._C, "_dispatch_get_registrations_for_dispatch_key", None)
    if registrations is None:  # pragma: no cover - another torch
        return list(torch._C._dispatch_get_all_op_names())
    return list(registrations(""))


def _no_result(*args: object, **kwargs: object) -> None:
    return None


class DeferredCustomOp:
    """``torch.library.custom_op(qualname, mutates_args=...)`` of a vendor kernel, defined on first
    call unless `define_custom_ops` defines it at import.

    A provider that cannot run here still registers its kernel bindings (unsupported, never
    dispatched; tests call them against test doubles of the vendor library), but defining a
    custom op costs ~1.5 ms of start-up (schema inference, autograd and fake registration)
    for an op nothing will call. So a provider defines its ops at import where it can run
    and leaves them to their first call elsewhere. Once defined, the module attribute that
    held this object holds the op's ``torch.ops.<namespace>.<name>`` packet: a binding that
    calls ``ops.name(...)`` then calls exactly what ``torch.ops.<namespace>.<name>(...)`` calls.
    """

    def __init__(self, qualname: str, fn: Callable[..., Any], mutates_args: str | Sequence[str]):
        self.qualname = qualname
        self.fn = fn
        self.mutates_args = mutates_args
        self._fakes: list[Callable[..., Any]] = []
        self._packet: torch._ops.OpOverloadPacket | None = None
        functools.update_wrapper(self, fn)

    def register_fake(self, fake: F) -> F:
        """The op's fake (as ``CustomOpDef.register_fake``), registered when the op is defined."""
        with _define_lock:
            if self._packet is None:
                self._fakes.append(fake)
                return fake
        torch.library.register_fake(self.qualname, fake)
        return fake

    @property
    def defined(self) -> bool:
        return self._packet is not None

    def define(self) -> torch._ops.OpOverloadPacket:
        """Define the op (once) and return its ``torch.ops`` packet."""
        with _define_lock:
            if self._packet is None:
                op = torch.library.custom_op(self.qualname, self.fn, mutates_args=self.mutates_args)
                for fake in self._fakes:
                    op.register_fake(fake)
                namespace, name = self.qualname.split("::")
                self._packet = getattr(getattr(torch.ops, namespace), name)
                module = inspect.getmodule(self.fn)
                if module is not None and getattr(module, self.fn.__name__, None) is self:
                    setattr(module, self.fn.__name__, self._packet)
            return self._packet

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        packet = self._packet if self._packet is not None else self.define()
        return packet(*args, **kwargs)

    def __repr__(self) -> str:
        return f"DeferredCustomOp({self.qualname!r}, {'defined' if self.defined else 'not defined yet'})"


_define_lock = threading.RLock()


def deferred_custom_op(
    qualname: str, *, mutates_args: str | Sequence[str]
) -> Callable[[Callable[..., Any]], DeferredCustomOp]:
    """``@torch.library.custom_op(qualname, mutates_args=...)``, defined later (`DeferredCustomOp`)."""

    def decorator(fn: Callable[..., Any]) -> DeferredCustomOp:
        return DeferredCustomOp(qualname, fn, mutates_args)

    return decorator


def define_custom_ops(module: ModuleType) -> list[str]:
    """Define every `DeferredCustomOp` of ``module`` now (a provider that can run here: its ops
    then exist from import on, as plain ``torch.library.custom_op`` ones); their names."""
    deferred = [v for v in vars(module).values() if isinstance(v, DeferredCustomOp)]
    for op in deferred:
        op.define()
    return [op.qualname for op in deferred]


def weight_or_ones(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """``weight``, or for None a ones vector of x's last dimension, dtype and device (for vendor
    norms that always multiply by a weight): cached per (size, dtype, device), so calls do not
    allocate it, except while tracing (fake tensors are never cached for real calls)."""
    if weight is not None:
        return weight
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    return _ones(x.shape[-1], x.dtype, x.device)


def aligned(x: torch.Tensor, alignment: int = 16) -> torch.Tensor:
    """``x``, or a copy of it when its first element is not ``alignment``-byte aligned: for vendor
    kernels that load vectors from the data pointer, which a view starting mid-allocation may
    misalign (fresh allocations are aligned)."""
    return x if x.data_ptr() % alignment == 0 else x.clone()


def empty_group_scales(shape: Sequence[int], group_size: int, column_major: bool, device: torch.device) -> torch.Tensor:
    """The float32 scales a group-quant kernel writes for q of ``shape``: one per ``group_size``
    slice of the last dimension (a partial last group counts), in the layout the op returns: with
    ``column_major`` the last two dimensions transposed in memory (strides (1, M) for 2-D)."""
    groups = -(-shape[-1] // group_size)
    if column_major:
        scales = torch.empty((*shape[:-2], groups, shape[-2]), dtype=torch.float32, device=device)
        return scales.transpose(-2, -1)
    return torch.empty((*shape[:-1], groups), dtype=torch.float32, device=device)


@functools.cache
def _ones(hidden: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.ones(hidden, dtype=dtype, device=device)
