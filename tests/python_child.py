"""`run_python`: ``subprocess.run([sys.executable, *args])`` without paying ``import torch`` each time.

A CLI test's child interpreter spends ~2 s of its ~2.2 s importing torch. This module keeps one
warm interpreter per test process that has imported torch and nothing of vllm_ir; each call is
a process forked from it, which then behaves as a fresh ``python`` would: its own environment
(replaced whole), working directory, ``sys.argv``, ``sys.path`` (``PYTHONPATH`` applied as at
start-up), stdin, stdout and stderr; ``-m``, ``-c`` and script forms; ``SystemExit`` codes,
uncaught exceptions (traceback, exit 1), non-daemon threads joined and ``atexit`` run at exit.
vllm_ir, its providers and their entry points are imported and discovered in the child, from
scratch, exactly as in a new interpreter.

What a fork cannot give is what the interpreter or torch reads once at start-up; a call whose
environment changes any of that (``PYTHON*`` besides ``PYTHONPATH``, ``TORCH*``, OpenMP/MKL
threads, ``LD_*``, CUDA settings) runs as a real ``subprocess.run`` instead, as does every call
when fork is unavailable. Tests of start-up itself (imports, console scripts, closed pipes)
keep using real interpreters.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

#: Called once per child started (tests/conftest.py notes the test's "subprocess" cost).
ON_CHILD: list[Callable[[], None]] = []

_START_UP_PREFIXES = ("PYTHON", "TORCH", "OMP_", "MKL_", "KMP_", "GOMP_", "LD_", "CUDA", "MALLOC", "ATEN_")

_SERVER = r"""
import json, os, sys, traceback
import torch  # the cost every child skips; nothing of vllm_ir is imported here

server_path = list(sys.path[1:])
server_pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
base_path = [p for p in server_path if p not in server_pythonpath]
# The protocol on its own descriptors: a child starts with untouched stdin/stdout objects, and a
# stray print here cannot corrupt a reply.
protocol_in, protocol_out = os.fdopen(os.dup(0), "r"), os.fdopen(os.dup(1), "w")
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)


def child(request):
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, flags in ((0, request["stdin"], os.O_RDONLY), (1, request["stdout"], os.O_WRONLY),
                            (2, request["stderr"], os.O_WRONLY)):
        os.dup2(os.open(path, flags), fd)
    args = request["args"]
    pythonpath = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    import importlib, runpy, types
    importlib.invalidate_caches()
    code = 0
    try:
        if args[0] == "-m":
            sys.argv = ["-m", *args[2:]]
            sys.path[:] = [os.getcwd(), *pythonpath, *base_path]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            sys.path[:] = ["", *pythonpath, *base_path]
            main = sys.modules["__main__"] = types.ModuleType("__main__")
            main.__builtins__ = __builtins__
            exec(compile(args[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = list(args)
            sys.path[:] = [os.path.dirname(os.path.abspath(args[0])), *pythonpath, *base_path]
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as exit:
        if exit.code is None:
            code = 0
        elif isinstance(exit.code, int):
            code = exit.code
        else:
            print(exit.code, file=sys.stderr)
            code = 1
    except BaseException as error:  # as the interpreter prints it: from the caller's frame on
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)
        code = 1
    try:
        import threading, atexit
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    os._exit(code & 0xFF)


for line in protocol_in:
    request = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        protocol_in.close()
        protocol_out.close()
        child(request)
    protocol_out.write(json.dumps({"pid": pid}) + "\n")
    protocol_out.flush()
    _, status = os.waitpid(pid, 0)
    protocol_out.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")
    protocol_out.flush()
"""


class _Server:
    """One warm interpreter; calls are serialized (a test process runs one test at a time)."""

    def __init__(self) -> None:
        self.env = dict(os.environ)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=self.env
        )
        self.lock = threading.Lock()
        atexit.register(self.close)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)

    def run(self, request: dict, timeout: float | None) -> int:
        with self.lock:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pid = json.loads(self.proc.stdout.readline())["pid"]
            reply: list[str] = []
            reader = threading.Thread(target=lambda: reply.append(self.proc.stdout.readline()), daemon=True)
            reader.start()
            reader.join(timeout)
            if reader.is_alive():  # as subprocess.run does: kill the child, then raise
                os.kill(pid, 9)
                reader.join()
                raise subprocess.TimeoutExpired([sys.executable, *request["args"]], timeout)
            return json.loads(reply[0])["status"]


_server: _Server | None = None


def _forkable(env: Mapping[str, str]) -> bool:
    if not hasattr(os, "fork"):
        return False
    base = _server.env if _server is not None else os.environ
    keys = {k for k in (*env, *base) if k.startswith(_START_UP_PREFIXES) and k != "PYTHONPATH"}
    return all(env.get(k) == base.get(k) for k in keys)


def run_python(
    args: Sequence[str | os.PathLike],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    input: str | None = None,
    timeout: float | None = 300,
) -> subprocess.CompletedProcess:
    """What ``subprocess.run([sys.executable, *args], capture_output=True, text=True, ...)``
    returns, from a child forked off the warm interpreter where that is the same thing."""
    global _server
    args = [os.fspath(a) for a in args]
    env = dict(os.environ if env is None else env)
    for note in ON_CHILD:
        note()
    if not _forkable(env):
        return subprocess.run(
            [sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd, input=input, timeout=timeout
        )
    if _server is None or _server.proc.poll() is not None:
        _server = _Server()
    with tempfile.TemporaryDirectory(prefix="python-child-") as scratch:
        files = {name: Path(scratch, name) for name in ("stdin", "stdout", "stderr")}
        files["stdin"].write_text(input or "")
        for name in ("stdout", "stderr"):
            files[name].touch()
        request = {
            "args": args,
            "env": env,
            "cwd": os.path.abspath(cwd if cwd is not None else os.getcwd()),
            **{name: str(path) for name, path in files.items()},
        }
        status = _server.run(request, timeout)
        return subprocess.CompletedProcess(
            [sys.executable, *args], status, files["stdout"].read_text(), files["stderr"].read_text()
        )
