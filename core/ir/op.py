"""`register_op` and `IrOp`: an op is a plain PyTorch function plus the object that dispatches it.

The function is the op's meaning, its ``native`` fallback implementation and the oracle
every other implementation is tested against. `IrOp` is the API: implementations, fake,
priority, explanation, tolerances and test inputs all hang off it.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, overload

import torch

from vllm_ir.errors import RegistrationError, ToleranceError
from vllm_ir.ir import priority as _priority
from vllm_ir.ir import registry, signature, torch_library
from vllm_ir.ir.comparison import Comparison
from vllm_ir.ir.dispatch import entry_points as _dispatch
from vllm_ir.ir.dispatch import selection
from vllm_ir.ir.dispatch.decision_cache import DecisionCache
from vllm_ir.ir.impl import NATIVE, RESERVED_PROVIDERS, IrOpImpl, RegistrationStack, Unsupported
from vllm_ir.ir.priority import Mode, PriorityEntry

F = TypeVar("F", bound=Callable[..., Any])

#: (atol, rtol) per dtype when an op does not override them (`IrOp.set_tolerance`): vLLM 0.33's
#: ``vllm/ir/tolerances.py`` except bfloat16's atol (1e-2 here, 1e-3 there: the suite's bf16
#: kernels were held to it). A dtype missing here has no implicit tolerance (`IrOp.tolerance` raises).
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    # fp32: torch.testing.assert_close's default (vLLM's too).
    torch.float32: (1e-5, 1.3e-6),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1e-2, 1.6e-2),
    # 52-bit mantissa (vLLM's 1e-8).
    torch.float64: (1e-8, 1e-8),
    # 3-bit mantissa, eps 0.125 (vLLM, from its fp8 kernel tests).
    torch.float8_e4m3fn: (1e-1, 1e-1),
    torch.float8_e4m3fnuz: (1e-1, 1e-1),
    # 2-bit mantissa: wider than e4m3.
    torch.float8_e5m2: (2e-1, 2e-1),
    torch.float8_e5m2fnuz: (2e-1, 2e-1),
    # Packed pairs of e2m1 (1-bit mantissa; vLLM's nvfp4 tests use atol 0.3).
    torch.float4_e2m1fn_x2: (3e-1, 3e-1),
    # Integer codes: off by one from rounding; a relative error means nothing for small integers.
    torch.int8: (1.0, 0.0),
}


def _registration_stack() -> RegistrationStack:
    """The caller's stack at a registration, without this module's frames (the decorators')."""
    return RegistrationStack.here(skip_files=(__file__,))


def registration_site(stack: Sequence[str]) -> str:
    """The innermost frame of a registration stack on one line: ``file:line in function``."""
    if isinstance(stack, RegistrationStack):
        return stack.site()
    if not stack:
        return "unknown place"
    match = _FRAME.search(stack[-1])
    return f"{match['file']}:{match['line']} in {match['func']}" if match else stack[-1].strip()


_FRAME = re.compile(r'File "(?P<file>[^"]*)", line (?P<line>\d+), in (?P<func>.*)')

InputGenerator = Callable[..., tuple[Any, ...]]


class IrOp:
    """A declared op. Call it like its function; see `register_impl`, `explain`, `get_priority`.

    ``op(*args)`` is functional (inputs untouched, fresh outputs). ``op.maybe_inplace(*args)``
    (ops declared with ``allow_inplace=True``) lets an in-place implementation overwrite the
    activation inputs and return them: using a donated tensor afterwards is a bug.

    Constructing one defines ``torch.ops.vllm_ir.<name>`` and generates the op's hot path;
    `register_op` then adds it to ``vllm_ir.ops``. Each op is an instance of its own subclass,
    whose ``__call__`` is the generated function (Python looks special methods up on the type).
    """

    maybe_inplace: Callable[..., Any]

    def __new__(cls, fn: Callable[..., Any], name: str, *args: Any, **kwargs: Any) -> IrOp:
        return super().__new__(type(f"IrOp_{name}", (cls,), {"__slots__": (), "__module__": cls.__module__}))

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str,
        activations: Sequence[str] | None,
        allow_inplace: bool,
        token_params: Sequence[str] | None = None,
        registration_stack: Sequence[str] | None = None,
    ):
        self.name = name
        self.fn = fn
        #: Where the op was declared (`traceback.format_stack` lines, innermost last): shown when
        #: a second declaration of the name is refused and by ``vllm-ir explain --verbose``.
        self.registration_stack: Sequence[str] = (
            registration_stack if registration_stack is not None else _registration_stack()
        )
        self.fake_fn: Callable[..., Any] = fn
        self.allow_inplace = allow_inplace
        self.signature = signature.check_parameters(fn, op=name, provider=None, what="the op function")
        self.schema = signature.infer_schema(fn, op=name, provider=None, what="the op function")
        self.tensor_params = signature.tensor_parameters(self.signature)
        self.list_params = {
            p.name
            for p in self.signature.parameters.values()
            if signature.is_tensor_list(p.annotation) or getattr(p.annotation, "__origin__", None) in (list, tuple)
        }
        self.activations = self._check_activations(activations)
        names = list(self.signature.parameters)
        self.activation_indices = tuple(names.index(a) for a in self.activations)
        #: Tensor parameters whose leading dimension is the token count: the one fact of a
        #: call the decision cache leaves out (see vllm_ir.ir.dispatch.cache_key).
        self.token_params = self._check_tensor_names(
            self.activations if token_params is None else token_params, "token parameter"
        )
        self.impls: dict[str, IrOpImpl] = {
            NATIVE: IrOpImpl(name, NATIVE, fn, registration_stack=self.registration_stack)
        }
        self.tensor_param_indices = tuple(names.index(t) for t in self.tensor_params)
        params = list(self.signature.parameters.values())
        self._defaults = tuple(p.default for p in params)
        self._required = sum(p.default is inspect.Parameter.empty for p in params)
        self._tolerances: dict[torch.dtype, tuple[float, float]] = {}
        self._input_generator: InputGenerator | None = None
        #: Named option sets for the input generator that conformance tests cover (e.g. no weight).
        self.input_variants: dict[str, dict[str, Any]] = {}
        #: Input variants ``vllm-ir bench`` measures besides the default inputs.
        self.benchmark_variants: list[str] = []
        #: How the conformance kit compares implementations with native (`set_comparison`).
        self.comparison = Comparison()
        self.__doc__ = fn.__doc__
        self.decision_cache = DecisionCache(self)
        self._library = torch_library.define(self, self._run_functional)
        try:
            default_overload = torch_library.overload(name)
            inplace_overload = (
                torch_library.overload(name, torch_library.MAYBE_INPLACE) if allow_inplace else default_overload
            )
            entries = _dispatch.build_entry_points(
                self, self.decision_cache, default_overload, inplace_overload, self.decision_cache.lookup
            )
        except BaseException:
            self._library._destroy()
            raise
        self.decision_cache.key = entries.key
        type(self).__call__ = entries.call
        type(self).cached_dispatch = entries.which
        self.maybe_inplace = entries.maybe_inplace if allow_inplace else self._no_maybe_inplace

    # -- implementations ---------------------------------------------------------------

    def register_impl(
        self,
        provider: str,
        *,
        supported: bool | Unsupported = True,
        supports_args: Callable[..., bool | Unsupported] | None = None,
        inplace: bool = False,
        batch_invariant: bool = False,
        cacheable: bool = True,
        exact: bool = False,
        compile_facts: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None,
    ) -> Callable[[F], F]:
        """Register ``provider``'s implementation of this op (decorator).

        :param supported: whether it can run in this process at all (or an `Unsupported` reason).
        :param supports_args: per-call predicate with the op's parameters; returns a bool or
            an `Unsupported` reason. It must not look at batch size or tensor values.
        :param inplace: the implementation overwrites the activations and returns them. A
            provider may register both forms (same options): ``op(...)`` then runs the
            functional kernel, ``op.maybe_inplace(...)`` the in-place one, without clones.
        :param batch_invariant: results do not depend on the batch composition.
        :param cacheable: False when the predicate reads what the decision key leaves out
            (`vllm_ir.ir.dispatch.cache_key`: it keeps the scalar arguments and each tensor's dtype,
            device, shape and strides, without the token count): the token count, tensor
            values or state outside the call. It then runs on every call.
        :param exact: results are bit-identical to native's wherever the predicate accepts (as
            vLLM's activation kernels are to eager PyTorch); the conformance kit holds the
            claim to zero tolerance instead of the op's dtype tolerances.
        :param compile_facts: what a compiled graph that runs this implementation depends on
            besides its code, which vllm-ir hashes itself: ``{"build": BUILD_ID}``, or a
            callable returning such a mapping (string keys, plain values), called at every
            compile -- e.g. ``lambda: {"MY_KERNEL_VARIANT": os.environ.get("MY_KERNEL_VARIANT")}``
            for a kernel that picks a variant from the environment while it is traced. The
            facts are part of the passes' cache key (``uuid()``): a changed fact misses
            Inductor's FX graph cache. torch's and Triton's versions and the versions of the
            libraries the implementation's code refers to are included without being declared.

        Example::

            def no_variance_size(x, weight, epsilon, variance_size=None):
                return variance_size is None or vllm_ir.Unsupported("variance_size not supported")

            @vllm_ir.ops.rms_norm.register_impl("mine", supports_args=no_variance_size)
            def rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
                ...
        """

        def decorator(fn: F) -> F:
            self.add_impl(
                IrOpImpl(
                    self.name,
                    provider,
                    fn,
                    supported,
                    supports_args,
                    inplace,
                    batch_invariant,
                    cacheable,
                    exact=exact,
                    compile_facts=compile_facts,
                )
            )
            return fn

        return decorator

    def register_unsupported(self, provider: str, reason: str | Unsupported, *, inplace: bool = False) -> IrOpImpl:
        """Record that ``provider`` implements this op but cannot run it here, and why.

        What a provider does when its library or device is missing: ``vllm-ir providers list``
        and ``explain`` then show the reason instead of "not installed", and nothing is imported.
        """
        verdict = reason if isinstance(reason, Unsupported) else Unsupported(reason)
        return self.add_impl(
            IrOpImpl(self.name, provider, _dispatch.build_unrunnable(self, provider), verdict, inplace=inplace)
        )

    def add_impl(self, impl: IrOpImpl) -> IrOpImpl:
        """Validate and add an implementation; a refused one leaves no trace."""
        p = impl.provider
        if not isinstance(p, str) or not signature.NAME.match(p):
            raise RegistrationError(
                f"op {self.name!r}: provider name {p!r} must match [a-z_][a-z0-9_]* "
                "(lowercase letters, digits, underscores)",
                op=self.name,
                provider=str(p),
            )
        if p in RESERVED_PROVIDERS:
            raise RegistrationError(
                f"op {self.name!r}, provider {p!r}: {sorted(RESERVED_PROVIDERS)} are reserved provider names "
                "(native is the op's own function)",
                op=self.name,
                provider=p,
            )
        if not impl.registration_stack:
            impl = dataclasses.replace(impl, registration_stack=_registration_stack())
        existing = self.impls.get(p)
        if existing is not None and not _second_form(existing, impl):
            raise RegistrationError(
                f"op {self.name!r}, provider {p!r}: already has an implementation "
                f"({_describe(existing.fn)}{', from ' + existing.origin if existing.origin else ''}, "
                f"registered at {registration_site(existing.registration_stack)}; this one at "
                f"{registration_site(impl.registration_stack)}); "
                "a provider registers one functional and/or one in-place (inplace=True) kernel per op, "
                "the second with the same options as the first",
                op=self.name,
                provider=p,
            )
        if impl.inplace and not self.allow_inplace:
            raise RegistrationError(
                f"op {self.name!r}, provider {p!r}: inplace=True needs an op declared with allow_inplace=True",
                op=self.name,
                provider=p,
            )
        if not isinstance(impl.supported, (bool, Unsupported)):
            raise RegistrationError(
                f"op {self.name!r}, provider {p!r}: supported must be a bool or vllm_ir.Unsupported, "
                f"got {type(impl.supported).__name__}",
                op=self.name,
                provider=p,
            )
        impl_sig = signature.check_parameters(impl.fn, op=self.name, provider=p, what="the implementation")
        if signature.is_unannotated(impl_sig):  # takes the op's own signature: names and defaults must match
            signature.check_same_parameters(
                impl_sig, self.signature, op=self.name, provider=p, what="the implementation"
            )
        else:  # written out: it must be exactly the op's schema
            impl_schema = signature.infer_schema(impl.fn, op=self.name, provider=p, what="the implementation")
            signature.check_same_schema(self.schema, impl_schema, op=self.name, provider=p)
        if impl.supports_args is not None:
            signature.check_predicate_signature(impl.supports_args, self.signature, op=self.name, provider=p)
        if existing is not None:  # the provider's other form: one implementation with both kernels
            functional, in_place = (existing, impl) if impl.inplace else (impl, existing)
            impl = dataclasses.replace(functional, inplace_fn=in_place.fn, origin=existing.origin or impl.origin)
        self.impls[p] = impl
        registry.invalidate()
        return impl

    def remove_impl(self, provider: str) -> IrOpImpl | None:
        """Withdraw a provider's implementation (used when a plugin fails half-way)."""
        if provider == NATIVE:
            raise RegistrationError(f"op {self.name!r}: the native implementation cannot be removed", op=self.name)
        impl = self.impls.pop(provider, None)
        if impl is not None:
            registry.invalidate()
        return impl

    def register_fake(self, fn: F) -> F:
        """Replace the fake (meta) function used while tracing; defaults to the native function."""
        signature.check_parameters(fn, op=self.name, provider=None, what="the fake function")
        fake_sig = [(q.name, q.default) for q in inspect.signature(fn).parameters.values()]
        if fake_sig != [(q.name, q.default) for q in self.signature.parameters.values()]:
            raise RegistrationError(f"op {self.name!r}: the fake function must take the op's parameters", op=self.name)
        self.fake_fn = fn
        return fn

    # -- choosing ------------------------------------------------------------------------

    def dispatch(self, *args: Any, mode: Mode = "eager") -> IrOpImpl:
        """The implementation a call with ``args`` runs (no fallback policy, no statistics)."""
        return selection.decide(self, self._bind(args), mode, _priority.current_scope()).impl

    def explain(self, *args: Any, mode: Mode = "eager") -> selection.Explanation:
        """Every provider of the effective priority with its verdict for ``args``."""
        return selection.explain(self, self._bind(args), mode)

    def get_priority(self, mode: Mode = "eager") -> list[PriorityEntry]:
        """The providers dispatch tries, in order, each with the layer that placed it."""
        return [entry for _impl, entry in _priority.resolve(self, mode, _priority.current_scope()).candidates]

    def set_default(self, priority: Sequence[str] | None, *, mode: Mode | None = None) -> None:
        """Set this op's platform-default priority from code (vLLM's ``IrOp.set_default``).

        The list replaces what the platform and provider hooks contribute for this op (in
        ``mode``, or both modes when None), and stays below every other layer: the config file,
        ``VLLM_IR_OP_PRIORITY``, `set_priority` and `priority` still go in front of it; ``native``
        still closes the list. Entries show ``set_default`` as their source. ``None`` or an empty
        list restores the hooks' defaults. Unknown providers raise `PriorityError`.
        """
        _priority.set_default(self.name, priority, mode=mode)

    def cached_dispatch(self, *args: Any) -> IrOpImpl:
        """The implementation ``op(*args)`` runs, read through the decision cache like a real call.

        `dispatch` decides afresh; the two must always agree (the conformance kit checks it).
        """
        raise NotImplementedError("register_op generates this method")

    def _no_maybe_inplace(self, *args: Any) -> Any:
        raise TypeError(
            f"op {self.name!r} has no maybe_inplace overload: it was declared without allow_inplace=True; "
            f"call vllm_ir.ops.{self.name}(...) instead"
        )

    # -- testing support -----------------------------------------------------------------

    def tolerance(self, dtype: torch.dtype) -> tuple[float, float]:
        """(atol, rtol) for comparing an implementation against native in ``dtype``.

        The op's own (`set_tolerance`), else `DEFAULT_TOLERANCES`. A dtype neither knows is a
        `ToleranceError` (a LookupError and a ValueError, as vLLM raises): a silent guess would
        pass or fail kernels for no stated reason.
        """
        found = self._tolerances.get(dtype) or DEFAULT_TOLERANCES.get(dtype)
        if found is None:
            known = sorted(str(d).removeprefix("torch.") for d in {*self._tolerances, *DEFAULT_TOLERANCES})
            raise ToleranceError(
                f"op {self.name!r} has no tolerance for {dtype}: call "
                f"vllm_ir.ops.{self.name}.set_tolerance({dtype}, atol=..., rtol=...) "
                f"(tolerances known: {', '.join(known)})"
            )
        return found

    def get_tolerance(self, dtype: torch.dtype) -> dict[str, float]:
        """`tolerance` as vLLM's ``IrOp.get_tolerance`` returns it, for ported tests::

        torch.testing.assert_close(out, ref, **op.get_tolerance(dtype))
        """
        atol, rtol = self.tolerance(dtype)
        return {"atol": atol, "rtol": rtol}

    def set_tolerance(self, dtype: torch.dtype, *, atol: float, rtol: float) -> None:
        """Allow ``|actual - native| <= atol + rtol * |native|`` for outputs computed in ``dtype``."""
        if not isinstance(dtype, torch.dtype):
            raise RegistrationError(
                f"op {self.name!r}: set_tolerance needs a torch.dtype, got {type(dtype).__name__} {dtype!r}",
                op=self.name,
            )
        for name, value in (("atol", atol), ("rtol", rtol)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise RegistrationError(
                    f"op {self.name!r}: {name} for {dtype} must be a finite number >= 0, got {value!r}",
                    op=self.name,
                )
        self._tolerances[dtype] = (float(atol), float(rtol))

    def override_tolerance(self, dtype: torch.dtype, *, atol: float, rtol: float) -> None:
        """vLLM's spelling of `set_tolerance`."""
        self.set_tolerance(dtype, atol=atol, rtol=rtol)

    def set_comparison(self, comparison: Comparison) -> None:
        """Choose how the conformance kit compares implementations with native (`Comparison`):
        per-dtype tolerance (the default), exact, or dequantized values for quantizing ops."""
        if not isinstance(comparison, Comparison):
            raise RegistrationError(
                f"op {self.name!r}: set_comparison needs a vllm_ir.Comparison, got {type(comparison).__name__}",
                op=self.name,
            )
        self.comparison = comparison

    def input_generator(self, fn: InputGenerator) -> InputGenerator:
        """Register ``fn(shape, dtype, device, **options) -> args`` that makes realistic inputs."""
        self._input_generator = fn
        return fn

    def add_input_variant(self, name: str, *, benchmark: bool = False, **options: Any) -> None:
        """Name a family of inputs (``options`` for the input generator) every provider is tested on.

        ``benchmark=True``: ``vllm-ir bench`` measures it too (a shape class that matters for
        speed, e.g. rotary embedding of half of each head).
        """
        self.input_variants[name] = options
        if benchmark and name not in self.benchmark_variants:
            self.benchmark_variants.append(name)

    def generate_inputs(
        self, shape: Sequence[int], dtype: torch.dtype, device: str | torch.device = "cpu", **options: Any
    ) -> tuple[Any, ...]:
        if self._input_generator is None:
            raise RegistrationError(f"op {self.name!r} has no input generator", op=self.name)
        return self._input_generator(tuple(shape), dtype, torch.device(device), **options)

    # -- internals -----------------------------------------------------------------------

    @property
    def torch_op(self) -> torch._ops.OpOverloadPacket:
        return getattr(getattr(torch.ops, torch_library.NAMESPACE), self.name)

    def _bind(self, args: Sequence[Any]) -> tuple[Any, ...]:
        bound = self.signature.bind(*args)
        bound.apply_defaults()
        return tuple(bound.arguments.values())

    def _run_functional(self, *args: Any) -> Any:
        """Kernel behind ``torch.ops.vllm_ir.<op>`` when the dispatcher is used.

        The dispatcher passes the arguments positionally, without trailing ones left at their
        defaults; filling those in directly saves the cost of ``Signature.bind``.
        """
        if self._required <= len(args) < len(self._defaults):
            args = args + self._defaults[len(args) :]
        elif len(args) != len(self._defaults):
            args = self._bind(args)
        return self.decision_cache.for_kernel(args).functional(*args)

    def _check_activations(self, activations: Sequence[str] | None) -> tuple[str, ...]:
        names = list(self.signature.parameters)
        if activations is None:
            return tuple(n for n in names if n.startswith("x") and n in self.tensor_params)
        return self._check_tensor_names(activations, "activation")

    def _check_tensor_names(self, names: Sequence[str], what: str) -> tuple[str, ...]:
        if isinstance(names, str):
            names = [names]
        for a in names:
            if a not in self.tensor_params:
                raise RegistrationError(
                    f"op {self.name!r}: {what} {a!r} is not a Tensor parameter of the op "
                    f"(tensor parameters: {', '.join(self.tensor_params) or 'none'})",
                    op=self.name,
                )
        return tuple(names)

    def __repr__(self) -> str:
        return f"<vllm_ir op {self.name}{self.schema} providers={sorted(self.impls)}>"

    def __str__(self) -> str:
        """``IrOp('name') - <first line of the docstring>``, as vLLM prints its ops."""
        doc = inspect.getdoc(self.fn) or ""
        first = doc.split("\n", 1)[0].strip()
        return f"IrOp({self.name!r}) - {first}" if first else f"IrOp({self.name!r})"


def _second_form(existing: IrOpImpl, new: IrOpImpl) -> bool:
    """Whether ``new`` is the other kernel form (functional vs in-place) of ``existing``, with its options."""
    options = ("supported", "supports_args", "batch_invariant", "cacheable", "exact")
    return (
        existing.inplace_fn is None
        and existing.inplace != new.inplace
        and all(getattr(existing, o) == getattr(new, o) for o in options)
    )


def _describe(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


@overload
def register_op(fn: F, /) -> IrOp: ...
@overload
def register_op(
    *,
    name: str | None = None,
    activations: Sequence[str] | None = None,
    allow_inplace: bool = False,
    token_params: Sequence[str] | None = None,
) -> Callable[[F], IrOp]: ...


def register_op(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    activations: Sequence[str] | None = None,
    allow_inplace: bool = False,
    token_params: Sequence[str] | None = None,
) -> IrOp | Callable[[Callable[..., Any]], IrOp]:
    """Declare an op from a fully annotated PyTorch function (bare or with options).

    :param name: op name (default: the function's name); a lowercase identifier.
    :param activations: parameters donated by ``maybe_inplace`` (default: tensor
        parameters whose names start with ``x``).
    :param allow_inplace: also create the ``maybe_inplace`` overload.
    :param token_params: tensor parameters whose leading dimension is the token count
        (default: the activations); every other fact of a call keys the decision cache.

    Example::

        @vllm_ir.register_op
        def scale(x: Tensor, factor: float) -> Tensor:
            return x * factor

        vllm_ir.ops.scale(torch.ones(3), 2.0)   # torch.ops.vllm_ir.scale.default under compile
    """

    def decorator(f: Callable[..., Any]) -> IrOp:
        op_name = name if name is not None else f.__name__
        signature.check_op_name(op_name)
        stack = _registration_stack()
        if registry.has_op(op_name):
            first = registry.get_op(op_name)
            raise RegistrationError(
                f"op {op_name!r} is already registered ({first.fn.__module__}, at "
                f"{registration_site(first.registration_stack)}; this declaration at {registration_site(stack)})",
                op=op_name,
            )
        op = IrOp(f, op_name, activations, allow_inplace, token_params, registration_stack=stack)
        registry.add_op(op)
        return op

    if fn is not None:
        return decorator(fn)
    return decorator
