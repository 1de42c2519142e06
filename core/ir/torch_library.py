"""Defining IR ops in the ``vllm_ir`` torch library namespace (``vllm_ir_core`` beside vLLM, see NAMESPACE).

Each op gets its own `torch.library.Library` fragment so a refused registration can be
undone completely. The kernel is registered for ``CompositeExplicitAutograd`` (AOTAutograd
keeps the op as one node instead of decomposing it) and the fake delegates to the op's
current fake function, which `IrOp.register_fake` may replace.

Autograd: the forward runs whichever kernel dispatch picks; the backward is the
vector-Jacobian product of the op's native function (its semantics), recomputed from the
saved inputs (`NativeVjp`). AOTAutograd traces that backward into plain aten ops, so
compiled training graphs get native's gradients whatever the forward was lowered to. A
kernel whose forward differs from native within the op's tolerance thus gets the exact
gradient of native at the same inputs, not the derivative of its own rounding.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from vllm_ir.errors import RegistrationError

if TYPE_CHECKING:
    from vllm_ir.ir.op import IrOp

#: The namespace vllm-ir's ops are defined in: ``vllm_ir``, unless vLLM's own IR is installed.
DEFAULT_NAMESPACE = "vllm_ir"
#: vLLM's IR (``vllm.ir``, vLLM >= 0.33) defines ``vllm_ir::rms_norm`` and friends itself: two
#: definitions of one torch operator cannot share a process, and whichever module is imported
#: second would fail. With vLLM installed, vllm-ir's ops move here (torch.ops.vllm_ir_core.*)
#: so that both, and the bridge that registers our kernels with vLLM, work in one process.
VLLM_COEXISTING_NAMESPACE = "vllm_ir_core"
MAYBE_INPLACE = "maybe_inplace"


def _vllm_ir_installed() -> bool:
    """Whether an importable ``vllm`` package carries ``vllm/ir/op.py``, without importing it."""
    import importlib.util
    import os

    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return False
    locations = (spec.submodule_search_locations or []) if spec is not None else []
    return any(os.path.isfile(os.path.join(loc, "ir", "op.py")) for loc in locations)


def choose_namespace() -> str:
    """``vllm_ir``, or `VLLM_COEXISTING_NAMESPACE` where vLLM's IR could be imported too."""
    return VLLM_COEXISTING_NAMESPACE if _vllm_ir_installed() else DEFAULT_NAMESPACE


#: Decided once, at import: every op of the process lives in one namespace.
NAMESPACE = choose_namespace()


def define(op: IrOp, run_functional: Callable[..., Any]) -> torch.library.Library:
    """Define ``<NAMESPACE>::<op>`` (and ``.maybe_inplace``); undo everything on failure."""
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    overloads = [op.name] + ([f"{op.name}.{MAYBE_INPLACE}"] if op.allow_inplace else [])
    try:
        for qualname in overloads:
            lib.define(f"{qualname}{op.schema}")
            # Outside our eager fast path (a direct torch.ops call, or a compiled graph that
            # kept the node) both overloads keep the functional contract: "maybe" in-place
            # permits reuse of the inputs, it never requires it. Their schema is functional
            # too, so both get the same autograd formula.
            lib.impl(qualname, run_functional, "CompositeExplicitAutograd")
            register_fake(f"{NAMESPACE}::{qualname}", lambda *args: op.fake_fn(*args), lib, caller_source())
            _register_autograd(lib, op, qualname, run_functional)
    except Exception as exc:
        lib._destroy()
        raise RegistrationError(
            f"op {op.name!r}: cannot define torch.ops.{NAMESPACE}.{op.name}: {exc}", op=op.name
        ) from exc
    return lib


def caller_source(depth: int = 0) -> str:
    """``file:line`` of the caller (``depth`` frames further out), as torch records a registration site."""
    frame = sys._getframe(depth + 1)
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def register_fake(qualname: str, fn: Callable[..., Any], lib: torch.library.Library, source: str) -> None:
    """``torch.library.register_fake(qualname, fn, lib=lib)`` called at ``source`` (`caller_source`).

    torch finds the registration site itself by reading the caller's frame with
    ``inspect.getframeinfo``, which scans ``sys.modules`` and reads source lines: ~0.3 ms a
    fake here, ~15 ms of start-up over the ~50 fakes registered then. Given the site, this
    makes the registration torch's ``Library._register_fake`` makes (the same fake holder entry,
    pystub check, Meta kernel and handle on ``lib``); for an op defined with
    ``torch.library.custom_op``, or a torch without these internals, the public call.
    """
    try:
        custom = torch._library.custom_ops._maybe_get_opdef(qualname) is not None
        holder = torch._library.simple_registry.singleton.find(qualname).fake_impl
        check_pystubs = torch.library._check_pystubs_once
        handles = lib._registration_handles
    except AttributeError:  # pragma: no cover - another torch
        custom = True
    if custom:
        torch.library.register_fake(qualname, fn, lib=lib)
        return
    # torch wraps the fake in a check, on its first call, that an op defined in C++ names the
    # registering module (``m.set_python_module``); the module is the caller's, as torch finds it.
    module = sys._getframe(1).f_globals.get("__name__")
    if module is not None and module.startswith("torchvision."):
        module = None
    registered = check_pystubs(fn, qualname, module) if module is not None else fn
    handles.append(holder.register(registered, source, lib=lib))


def overload(op_name: str, name: str = "default") -> torch._ops.OpOverload:
    """``torch.ops.<NAMESPACE>.<op_name>.<name>``, the one object graphs and patterns hold.

    Plain attribute access: the packet caches each overload on first access, and calling its
    ``__getattr__`` directly would build a new object and replace the cached one, leaving the
    dispatcher and the passes' patterns with an overload no new graph contains.
    """
    return getattr(getattr(getattr(torch.ops, NAMESPACE), op_name), name)


#: Backends whose kernel for an IR op is the ``CompositeExplicitAutograd`` one (Meta has the fake).
_DIRECT_BACKENDS = frozenset(
    getattr(torch._C.DispatchKey, name)
    for name in ("CPU", "CUDA", "HIP", "XPU", "MPS", "HPU", "MTIA", "PrivateUse1")
    if hasattr(torch._C.DispatchKey, name)
)


def _register_autograd(lib: torch.library.Library, op: IrOp, qualname: str, run_functional: Callable[..., Any]) -> None:
    """``torch.library.register_autograd``'s kernel for the `NativeVjp` formula, plus a shortcut.

    An Autograd kernel runs on every call, grad or not, and the standard one then
    redispatches to our kernel: a second trip through Python (+3.8 us per call measured
    here; +0.7 us with the shortcut). A call that needs no gradient, with nothing between
    Autograd and the backend (no tracing mode, functionalization, functorch layer, tensor
    subclass or meta tensor: decided once per dispatch key set), runs the kernel directly.
    Without torch's kernel factory (a private API) the standard registration is used as is.
    """
    name = f"{NAMESPACE}::{qualname}"
    formula = NativeVjp(op)
    try:
        from torch._library.autograd import Info, make_autograd_impl
    except Exception:  # pragma: no cover - another torch
        torch.library.register_autograd(name, formula.backward, setup_context=formula.setup_context, lib=lib)
        return
    grad_enabled, any_requires_grad = torch.is_grad_enabled, torch._C._any_requires_grad
    direct: dict[int, bool] = {}
    # torch's kernel (an autograd.Function and a dataclass per op: ~0.8 ms each, 30 ms of
    # start-up for every op) is built on the first call that needs it.
    standard: list[Callable[..., Any]] = []

    def autograd_kernel(keyset: torch._C.DispatchKeySet, *args: Any, **kwargs: Any) -> Any:
        if not kwargs and not (grad_enabled() and any_requires_grad(*args)):
            plain = direct.get(keyset.raw_repr())
            if plain is None:
                plain = direct[keyset.raw_repr()] = _reaches_backend(keyset)
            if plain:
                return run_functional(*args)
        if not standard:
            info = Info(formula.backward, formula.setup_context)
            standard.append(make_autograd_impl(overload(*qualname.split(".")), info))
        return standard[0](keyset, *args, **kwargs)

    lib.impl(qualname, autograd_kernel, "Autograd", with_keyset=True)


def _reaches_backend(keyset: torch._C.DispatchKeySet) -> bool:
    """Below Autograd, the next kernel that runs is a backend's (ADInplaceOrView falls through)."""
    below = (keyset & torch._C._after_autograd_keyset).remove(torch._C.DispatchKey.ADInplaceOrView)
    return below.highestPriorityTypeId() in _DIRECT_BACKENDS


class NativeVjp:
    """The autograd formula of an IR op: the VJP of ``op.fn``, recomputed in backward.

    Only the inputs are saved (the forward kernel's outputs may come from a kernel that
    rounds differently from native). A parameter whose value is None, not a tensor, or not
    floating/complex gets a None gradient, as does every input autograd does not ask for;
    outputs without a gradient (unused, integer, or independent of the inputs) are left out.

    The product is taken with ``torch.autograd.grad`` rather than `torch.func.vjp`: a native
    function may call other IR ops, and their Autograd kernels (torch's autograd.Function)
    cannot run under torch.func transforms.
    """

    def __init__(self, op: IrOp):
        self.op = op

    def setup_context(self, ctx: Any, inputs: Sequence[Any], output: Any) -> None:
        tensors: list[torch.Tensor] = []
        # Per argument: ("t", slot), ("list", [slots or constants]) or ("c", constant).
        layout: list[tuple[str, Any]] = []
        for value in inputs:
            if isinstance(value, torch.Tensor):
                layout.append(("t", len(tensors)))
                tensors.append(value)
            elif isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
                items = []
                for v in value:
                    if isinstance(v, torch.Tensor):
                        items.append(("t", len(tensors)))
                        tensors.append(v)
                    else:
                        items.append(("c", v))
                layout.append(("list", items))
            else:
                layout.append(("c", value))
        ctx.save_for_backward(*tensors)
        ctx.vllm_ir_layout = layout
        ctx.set_materialize_grads(False)  # unused outputs: None, left out of the product

    def backward(self, ctx: Any, *grads: torch.Tensor | list[torch.Tensor] | None) -> tuple[Any, ...]:
        flat_grads = _flatten_outputs(grads)  # a tensor-list output hands over a list
        args, wrt = self._unpack(ctx)
        result: list[Any] = [[None] * len(p) if kind == "list" else None for kind, p in ctx.vllm_ir_layout]
        used = [k for k, g in enumerate(flat_grads) if _differentiable(g)]
        if wrt and used:
            for (i, j), g in zip(wrt, self._vjp(args, wrt, flat_grads, used), strict=True):
                if j is None:
                    result[i] = g
                else:
                    result[i][j] = g
        return tuple(result)

    @staticmethod
    def _unpack(ctx: Any) -> tuple[list[Any], list[tuple[int, int | None]]]:
        """The saved arguments, and the (argument, list element or None) of each input to differentiate."""
        saved, needs = ctx.saved_tensors, ctx.needs_input_grad
        args: list[Any] = []
        wrt: list[tuple[int, int | None]] = []
        for i, (kind, payload) in enumerate(ctx.vllm_ir_layout):
            if kind == "t":
                args.append(saved[payload])
                if needs[i] and _differentiable(saved[payload]):
                    wrt.append((i, None))
            elif kind == "list":
                elements = [saved[p] if k == "t" else p for k, p in payload]
                args.append(elements)
                flags = needs[i] if isinstance(needs[i], (list, tuple)) else [needs[i]] * len(elements)
                wrt += [(i, j) for j, e in enumerate(elements) if flags[j] and _differentiable(e)]
            else:
                args.append(payload)
        return args, wrt

    def _vjp(
        self, args: list[Any], wrt: list[tuple[int, int | None]], grads: list[Any], used: list[int]
    ) -> Sequence[torch.Tensor | None]:
        """Recompute the native function from the inputs in ``wrt`` and pull ``grads`` back to them."""
        primals = [args[i] if j is None else args[i][j] for i, j in wrt]
        # Grad mode is on in here only for a double backward (create_graph=True): then the
        # gradients must stay functions of the inputs, so the recompute starts from them.
        create_graph = torch.is_grad_enabled()
        with torch.enable_grad():
            leaves = primals if create_graph else [p.detach().requires_grad_() for p in primals]
            full = [list(a) if isinstance(a, list) else a for a in args]
            for (i, j), leaf in zip(wrt, leaves, strict=True):
                if j is None:
                    full[i] = leaf
                else:
                    full[i][j] = leaf
            outputs = _flatten_outputs(self.op.fn(*full))
            pairs = [(outputs[k], grads[k]) for k in used if outputs[k].requires_grad]
            if not pairs:
                return [None] * len(leaves)
            return torch.autograd.grad(
                [o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True, create_graph=create_graph
            )


def _differentiable(t: object) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _flatten_outputs(out: Any) -> list[Any]:
    """The op's outputs in the order autograd hands their gradients to backward."""
    if not isinstance(out, (tuple, list)):
        return [out]
    flat: list[Any] = []
    for o in out:
        flat.extend(o if isinstance(o, (tuple, list)) else [o])
    return flat
