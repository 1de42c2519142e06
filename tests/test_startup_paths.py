"""The start-up fast paths against the reference paths they stand in for.

- `vllm_ir.ir.dispatch.code_cache`: the generated functions' code read back from the per-user
  cache is the code ``compile()`` makes of the same source; a corrupt, foreign or unwritable
  cache falls back to ``compile()`` silently.
- `vllm_ir.ir.torch_library.register_fake`: the registration torch's ``register_fake`` makes,
  with the registration site given instead of read from the stack.
- `vllm_ir.ir.signature.signature_of`: ``inspect.signature(fn, eval_str=True)``, recomputed
  whenever what it follows from changes.
- `vllm_ir.plugins.provider.all_op_names`: the dispatcher's operator names.
- `vllm_ir.plugins.provider.DeferredCustomOp`: a vendor custom op defined on first call is the
  op ``torch.library.custom_op`` defines at import.
"""

from __future__ import annotations

import functools
import inspect
import linecache
import marshal
import os
import sys
import types

import pytest
import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import vllm_ir
from tests.conftest import unique
from vllm_ir.ir import registry, signature, torch_library
from vllm_ir.ir.dispatch import code_cache, entry_points
from vllm_ir.plugins import provider

# -- code cache ---------------------------------------------------------------------------------


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh cache directory that is written to (bytecode writing on)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    return tmp_path


def _generated_units() -> list[tuple[str, str]]:
    """(file name, source) of every generated function of the declared ops, as linecache holds them."""
    units = []
    for filename, entry in linecache.cache.items():
        if filename.startswith("<vllm_ir.ops.") and len(entry) == 4:
            units.append((filename, "".join(entry[2])))
    return sorted(units)


def _same_code(a: types.CodeType, b: types.CodeType) -> None:
    """Field by field (nested code objects too), then CPython's own comparison."""
    for field in ("co_code", "co_names", "co_varnames", "co_freevars", "co_cellvars", "co_flags"):
        assert getattr(a, field) == getattr(b, field), field
    for field in ("co_filename", "co_name", "co_qualname", "co_firstlineno", "co_argcount", "co_linetable"):
        assert getattr(a, field) == getattr(b, field), field
    assert len(a.co_consts) == len(b.co_consts)
    for x, y in zip(a.co_consts, b.co_consts, strict=True):
        if isinstance(x, types.CodeType):
            _same_code(x, y)
        else:
            assert x == y and type(x) is type(y)
    assert a == b


def test_every_generated_function_reads_back_as_the_code_compile_makes(cache_dir):
    units = _generated_units()
    assert len(units) >= 9 * len(registry.all_ops()) // 2, "the declared ops' generated sources are in linecache"
    written = code_cache.compile_all(units)  # a miss: compiled and stored
    assert os.listdir(code_cache.directory())
    read = code_cache.compile_all(units)  # a hit: unmarshalled
    for (filename, source), w, r in zip(units, written, read, strict=True):
        fresh = compile(source, filename, "exec")  # what _define compiled before the cache (same future flags)
        _same_code(w, fresh)
        _same_code(r, fresh)


def test_cached_code_defines_functions_that_behave_the_same(cache_dir):
    source = "def scaled(x, factor=_default_1):\n    if _is_neg(factor):\n        return -x\n    return x * factor\n"
    units = [("<vllm_ir.ops.test.scaled>", source)]
    code_cache.compile_all(units)
    (cached,) = code_cache.compile_all(units)

    def define(code: types.CodeType) -> types.FunctionType:
        namespace = {"_default_1": 2.0, "_is_neg": lambda f: f < 0}
        exec(code, namespace)
        return namespace["scaled"]

    fresh, hit = define(code_cache.compile_fresh(*units[0])), define(cached)
    x = torch.randn(3)
    for args in ((x,), (x, 3.0), (x, -1.0)):
        torch.testing.assert_close(hit(*args), fresh(*args), rtol=0, atol=0)
    assert inspect.signature(hit) == inspect.signature(fresh)


def test_an_ops_entry_points_are_read_back_on_a_second_build(cache_dir, monkeypatch):
    compiled = []
    fresh = code_cache.compile_fresh
    monkeypatch.setattr(code_cache, "compile_fresh", lambda f, s: compiled.append(f) or fresh(f, s))

    @vllm_ir.register_op(name=unique("cached_scale"), allow_inplace=True)
    def op(x: Tensor, factor: float = 2.0) -> Tensor:
        return x * factor

    assert len(compiled) >= 6 and all(f.startswith(f"<vllm_ir.ops.{op.name}.") for f in compiled)
    compiled.clear()
    default = torch_library.overload(op.name)
    inplace = torch_library.overload(op.name, torch_library.MAYBE_INPLACE)
    again = entry_points.build_entry_points(op, op.decision_cache, default, inplace, op.decision_cache.lookup)
    assert compiled == []  # every function read back from the cache
    assert again.call.__code__ == type(op).__call__.__code__
    assert again.maybe_inplace.__code__ == op.maybe_inplace.__code__
    x = torch.randn(4)
    torch.testing.assert_close(again.call(op, x), op(x), rtol=0, atol=0)
    torch.testing.assert_close(again.call(op, x, 3.0), x * 3.0, rtol=0, atol=0)
    assert again.which(op, x) is op.cached_dispatch(x)
    assert again.key(vllm_ir.ir.priority.current_scope(), x, 2.0) == op.decision_cache.key(
        vllm_ir.ir.priority.current_scope(), x, 2.0
    )


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: b"",  # empty
        lambda data: data[: len(data) // 2],  # truncated mid-marshal
        lambda data: b"not a cache file" + data,  # foreign
        lambda data: data[: len(code_cache.MAGIC)] + bytes(32) + data[len(code_cache.MAGIC) + 32 :],  # wrong key
        lambda data: data[: len(code_cache.MAGIC) + 32] + marshal.dumps(("x",)),  # not code objects
        lambda data: data[: len(code_cache.MAGIC) + 32] + marshal.dumps((compile("1", "<other>", "exec"),)),
        lambda data: data[: len(code_cache.MAGIC) + 32] + b"\xff\xfe garbage",  # bad marshal
    ],
    ids=["empty", "truncated", "foreign", "wrong-key", "not-code", "other-file", "garbage"],
)
def test_a_damaged_cache_file_falls_back_to_compile_and_is_rewritten(cache_dir, damage):
    units = [("<vllm_ir.ops.test.f>", "def f(x):\n    return x + 1\n")]
    code_cache.compile_all(units)
    (path,) = [os.path.join(code_cache.directory(), n) for n in os.listdir(code_cache.directory())]
    with open(path, "rb") as f:
        good = f.read()
    with open(path, "wb") as f:
        f.write(damage(good))
    (code,) = code_cache.compile_all(units)
    _same_code(code, code_cache.compile_fresh(*units[0]))
    with open(path, "rb") as f:
        assert f.read() == good  # rewritten whole


def test_an_unwritable_cache_falls_back_silently(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the cache directory's parent would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    units = [("<vllm_ir.ops.test.g>", "def g(x):\n    return x\n")]
    (code,) = code_cache.compile_all(units)
    _same_code(code, code_cache.compile_fresh(*units[0]))
    assert blocker.read_text().startswith("a file")


def test_nothing_is_written_where_bytecode_is_not(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    code_cache.compile_all([("<vllm_ir.ops.test.h>", "def h():\n    return 1\n")])
    assert not os.path.exists(code_cache.directory())


def test_the_key_covers_file_name_source_and_order(cache_dir):
    a, b = ("<a>", "def f():\n    return 1\n"), ("<b>", "def f():\n    return 2\n")
    digests = {code_cache._digest(u) for u in ([a], [b], [a, b], [b, a], [(a[0], b[1])], [(b[0], a[1])])}
    assert len(digests) == 6


def test_the_cache_keeps_at_most_max_files(cache_dir, monkeypatch):
    monkeypatch.setattr(code_cache, "MAX_FILES", 4)
    for i in range(7):
        code_cache.compile_all([(f"<vllm_ir.ops.test.p{i}>", f"def p():\n    return {i}\n")])
    assert 2 <= len(os.listdir(code_cache.directory())) <= 4


# -- register_fake ------------------------------------------------------------------------------


def _fake_holder(qualname: str):
    return torch._library.simple_registry.singleton.find(qualname).fake_impl


def test_register_fake_makes_the_registration_torch_makes():
    ns = unique("vllm_ir_fakes")
    lib = torch.library.Library(ns, "FRAGMENT")
    try:
        for name in ("mine", "torchs"):
            lib.define(f"{name}(Tensor x, int n) -> Tensor")
        fake = lambda x, n: x.new_empty((n, *x.shape))  # noqa: E731
        before = len(lib._registration_handles)
        # One line: both record this line as the registration site.
        site, torchs = torch_library.caller_source(), torch._library.utils.get_source(1)
        torch_library.register_fake(f"{ns}::mine", fake, lib, site)
        torch.library.register_fake(f"{ns}::torchs", fake, lib=lib)
        assert site == torchs
        mine, theirs = _fake_holder(f"{ns}::mine").kernel, _fake_holder(f"{ns}::torchs").kernel
        assert mine.source == site and theirs.source.rsplit(":", 1)[0] == site.rsplit(":", 1)[0]
        assert type(mine.func) is type(theirs.func)  # both wrapped in torch's pystub check
        assert len(lib._registration_handles) == before + 2
        with FakeTensorMode():
            x = torch.empty(2, 3)
            a, b = getattr(torch.ops, ns).mine(x, 4), getattr(torch.ops, ns).torchs(x, 4)
        assert a.shape == b.shape == (4, 2, 3) and a.dtype == b.dtype
        m = getattr(torch.ops, ns).mine(torch.empty(2, 3, device="meta"), 5)
        assert m.shape == (5, 2, 3)
    finally:
        lib._destroy()
    assert _fake_holder(f"{ns}::mine").kernel is None  # the library's handles undo it


def test_register_fake_of_a_custom_op_takes_torchs_path():
    qualname = f"{unique('vllm_ir_fakes')}::op"

    @torch.library.custom_op(qualname, mutates_args=())
    def op(x: Tensor) -> Tensor:
        return x.clone()

    lib = torch.library.Library(qualname.split("::")[0], "FRAGMENT")
    torch_library.register_fake(qualname, lambda x: torch.empty_like(x), lib, "nowhere:0")
    with FakeTensorMode():
        assert op(torch.empty(3)).shape == (3,)
    assert op._abstract_fn is not None  # the custom op's own fake slot, as torch.library.register_fake fills


def test_ir_ops_fakes_are_registered_at_their_definition_site():
    source = _fake_holder(f"{torch_library.NAMESPACE}::rms_norm").kernel.source
    assert source.startswith(torch_library.__file__ + ":")
    with FakeTensorMode():
        x = torch.empty(4, 64)
        assert torch_library.overload("rms_norm")(x, torch.empty(64), 1e-6).shape == (4, 64)


# -- signature_of -------------------------------------------------------------------------------


def test_signature_of_is_inspect_signature_and_follows_changes():
    def f(x: Tensor, weight: Tensor | None, eps: float = 1e-6) -> Tensor:
        return x

    assert signature.signature_of(f) == inspect.signature(f, eval_str=True)
    assert signature.signature_of(f) is signature.signature_of(f)  # computed once
    f.__defaults__ = (1e-5,)
    assert signature.signature_of(f).parameters["eps"].default == 1e-5
    f.__annotations__["eps"] = "int"
    assert signature.signature_of(f).parameters["eps"].annotation is int
    f.__annotations__ = {"x": "Tensor"}
    assert signature.signature_of(f) == inspect.signature(f, eval_str=True)
    stand_in = inspect.Signature([inspect.Parameter("y", inspect.Parameter.POSITIONAL_OR_KEYWORD)])
    f.__signature__ = stand_in
    assert signature.signature_of(f) is stand_in
    del f.__signature__

    def g(a, b=2):
        return a

    f.__code__ = g.__code__
    f.__defaults__ = g.__defaults__
    f.__annotations__ = {}
    assert list(signature.signature_of(f).parameters) == ["a", "b"]
    part = functools.partial(f, 1)
    assert signature.signature_of(part) == inspect.signature(part, eval_str=True)


def test_signature_of_raises_as_inspect_does_each_time():
    def f(x: NoSuchName) -> None:  # noqa: F821
        return None

    for _ in range(2):
        with pytest.raises(NameError):
            signature.signature_of(f)


# -- all_op_names -------------------------------------------------------------------------------


def test_all_op_names_are_the_dispatchers_operator_names():
    assert sorted(provider.all_op_names()) == sorted(torch._C._dispatch_get_all_op_names())


# -- deferred custom ops ------------------------------------------------------------------------


def _deferred_module(ns: str) -> types.ModuleType:
    """A module declaring one deferred op with a fake, as a vendor provider's ops.py does."""
    module = types.ModuleType(f"tests._deferred_{ns}")
    source = f'''
from __future__ import annotations
import torch
from torch import Tensor
from vllm_ir.plugins.provider import deferred_custom_op

@deferred_custom_op("{ns}::twice", mutates_args=())
def twice(x: Tensor, bias: float) -> Tensor:
    return x * 2 + bias

@twice.register_fake
def _(x: Tensor, bias: float) -> Tensor:
    return torch.empty_like(x)
'''
    sys.modules[module.__name__] = module
    exec(compile(source, f"<{module.__name__}>", "exec"), module.__dict__)
    return module


def test_a_deferred_op_is_defined_on_first_call_as_custom_op_defines_it(monkeypatch):
    ns = unique("vllm_ir_deferred")
    module = _deferred_module(ns)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    stub = module.twice
    assert isinstance(stub, provider.DeferredCustomOp) and not stub.defined
    assert not hasattr(getattr(torch.ops, ns), "twice")  # nothing defined at import
    x = torch.randn(3)
    torch.testing.assert_close(module.twice(x, 1.0), x * 2 + 1.0)
    packet = getattr(torch.ops, ns).twice
    assert stub.defined and module.twice is packet  # the binding now calls torch.ops.<ns>.twice itself
    assert torch._library.custom_ops._maybe_get_opdef(f"{ns}::twice") is not None
    assert stub(x, 0.0).shape == (3,)  # a kept reference to the stub still calls the op
    with FakeTensorMode():
        assert packet(torch.empty(5), 1.0).shape == (5,)  # its fake
    gm = make_fx(lambda t: module.twice(t, 1.0), tracing_mode="fake")(x)
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [packet.default]


def test_a_first_call_while_tracing_defines_the_op_and_records_it():
    ns = unique("vllm_ir_deferred")
    module = _deferred_module(ns)
    try:
        x = torch.randn(2, 4)
        gm = make_fx(lambda t: module.twice(t, 0.5), tracing_mode="fake")(x)
        packet = getattr(torch.ops, ns).twice
        assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [packet.default]
        torch.testing.assert_close(gm(x), x * 2 + 0.5)
    finally:
        sys.modules.pop(module.__name__, None)


def test_define_custom_ops_defines_them_at_once():
    ns = unique("vllm_ir_deferred")
    module = _deferred_module(ns)
    try:
        assert provider.define_custom_ops(module) == [f"{ns}::twice"]
        assert module.twice is getattr(torch.ops, ns).twice
        assert provider.define_custom_ops(module) == []  # nothing deferred is left
    finally:
        sys.modules.pop(module.__name__, None)
