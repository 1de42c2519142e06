"""Code objects of generated functions, cached on disk the way Python caches bytecode.

Every op's entry points are generated as Python source (`vllm_ir.ir.dispatch.entry_points`):
compiling its ~9 functions cost ~1 ms per op, a quarter of start-up. A code object depends
only on its source text, the file name it is compiled under, the compiler flags and the
interpreter, so a batch of them is marshalled (as ``.pyc`` files are) into one file of a
per-user cache named by a hash of all of those: a changed source is another file, never a
stale hit. Anything wrong with a file (missing, truncated, corrupt, not the batch asked for)
means ``compile()``, silently; where bytecode is not written (``PYTHONDONTWRITEBYTECODE``,
``-B``) the cache is only read, and a failure to write is ignored.
"""

from __future__ import annotations

import hashlib
import importlib.util
import marshal
import os
import sys
import tempfile
from collections.abc import Sequence
from types import CodeType

#: Flags every generated function is compiled with: those its generators' modules always had
#: (``from __future__ import annotations``, whose feature object that import binds here),
#: stated instead of inherited from the caller.
FLAGS = annotations.compiler_flag
#: First bytes of every cache file (the format's version).
MAGIC = b"vllm-ir code cache 1\n"
#: Files kept per interpreter; past it, writing a new one drops the older half.
MAX_FILES = 2048


def directory() -> str:
    """``$XDG_CACHE_HOME/vllm_ir/code/<cache tag>`` (``~/.cache`` without XDG_CACHE_HOME)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "vllm_ir", "code", sys.implementation.cache_tag or sys.implementation.name)


def compile_fresh(filename: str, source: str) -> CodeType:
    """The reference path: what the cache stores for ``(filename, source)``."""
    return compile(source, filename, "exec", flags=FLAGS, dont_inherit=True)


def compile_all(units: Sequence[tuple[str, str]]) -> list[CodeType]:
    """``compile_fresh`` of every ``(filename, source)``, read from the cache where it holds them."""
    digest = _digest(units)
    path = os.path.join(directory(), digest.hex() + ".bin")
    codes = _read(path, digest, units)
    if codes is None:
        codes = [compile_fresh(filename, source) for filename, source in units]
        if not sys.dont_write_bytecode:
            _write(path, digest, codes)
    return codes


def _digest(units: Sequence[tuple[str, str]]) -> bytes:
    h = hashlib.sha256(MAGIC + importlib.util.MAGIC_NUMBER)
    h.update(f"{FLAGS} {sys.flags.optimize} {len(units)}\n".encode())
    for filename, source in units:
        for text in (filename, source):
            data = text.encode("utf-8", "surrogatepass")
            h.update(b"%d:" % len(data) + data)
    return h.digest()


def _read(path: str, digest: bytes, units: Sequence[tuple[str, str]]) -> list[CodeType] | None:
    """The batch stored at ``path``, or None for anything but exactly the batch asked for."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    head = MAGIC + digest
    if not data.startswith(head):
        return None
    try:
        codes = marshal.loads(data[len(head) :])
    except (EOFError, ValueError, TypeError):
        return None
    if not isinstance(codes, tuple) or len(codes) != len(units):
        return None
    for code, (filename, _source) in zip(codes, units, strict=True):
        if not isinstance(code, CodeType) or code.co_filename != filename:
            return None
    return list(codes)


def _write(path: str, digest: bytes, codes: Sequence[CodeType]) -> None:
    """Store ``codes`` at ``path`` atomically (a reader sees the old file or the whole new one)."""
    folder = os.path.dirname(path)
    tmp = None
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + digest + marshal.dumps(tuple(codes)))
        os.replace(tmp, path)
        tmp = None
        _prune(folder)
    except (OSError, ValueError):
        pass
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _prune(folder: str) -> None:
    """Past `MAX_FILES`, drop the older half (ops declared by tests come and go)."""
    names = [n for n in os.listdir(folder) if n.endswith(".bin")]
    if len(names) <= MAX_FILES:
        return
    aged = []
    for name in names:
        try:
            aged.append((os.stat(os.path.join(folder, name)).st_mtime, name))
        except OSError:
            continue
    for _mtime, name in sorted(aged)[: len(aged) - MAX_FILES // 2]:
        try:
            os.unlink(os.path.join(folder, name))
        except OSError:
            pass
