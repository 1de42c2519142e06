"""tests/python_child.py's forked child answers as a real ``python`` does: a differential test.

Each case runs once through ``run_python`` and once as ``subprocess.run([sys.executable, ...])``
and compares exit status, stdout and stderr (tracebacks by their last line).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.python_child import _forkable, run_python

pytestmark = pytest.mark.subprocess

SHOW = textwrap.dedent(
    """
    import json, os, sys
    print(json.dumps({
        "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "env": os.environ.get("CHILD_VALUE"),
        "stdin": sys.stdin.read(), "main": __name__, "file": globals().get("__file__"),
        "pythonpath_first": [p for p in sys.path if p.endswith("extra_dir")],
        "vllm_ir_loaded": "vllm_ir" in sys.modules,
    }))
    """
)


def _real(args, *, env, cwd, input=None):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd, input=input)


def _same(forked: subprocess.CompletedProcess, real: subprocess.CompletedProcess) -> None:
    assert forked.returncode == real.returncode, (forked.stderr, real.stderr)
    assert forked.stdout == real.stdout
    if "Traceback" in real.stderr:  # the frames above the user's code differ (runpy's, the server's)
        assert "Traceback" in forked.stderr and forked.stderr.splitlines()[-1] == real.stderr.splitlines()[-1]
    else:
        assert forked.stderr == real.stderr


@pytest.mark.parametrize(
    "form",
    ["code", "script", "module", "exit_code", "exit_text", "exception", "atexit_and_thread", "stdin"],
)
def test_a_forked_child_answers_as_a_real_interpreter(form, tmp_path):
    extra = tmp_path / "extra_dir"
    extra.mkdir()
    (extra / "child_module.py").write_text(SHOW)
    script = tmp_path / "script.py"
    script.write_text(SHOW)
    env = {
        **os.environ,
        "CHILD_VALUE": "42",
        "PYTHONPATH": os.pathsep.join([str(extra), os.environ.get("PYTHONPATH", "")]),
    }
    args, input = {
        "code": (["-c", SHOW, "a", "b"], None),
        "script": ([str(script), "--flag"], None),
        "module": (["-m", "child_module", "x"], None),
        "exit_code": (["-c", "import sys; print('out'); sys.exit(7)"], None),
        "exit_text": (["-c", "raise SystemExit('a message')"], None),
        "exception": (["-c", "def f():\n    raise ValueError('boom')\nf()"], None),
        "atexit_and_thread": (
            [
                "-c",
                "import atexit, threading, time\natexit.register(print, 'at exit')\n"
                "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()",
            ],
            None,
        ),
        "stdin": (["-c", SHOW], "some input"),
    }[form]
    _same(run_python(args, env=env, cwd=tmp_path, input=input), _real(args, env=env, cwd=tmp_path, input=input))


def test_the_vllm_ir_cli_answers_the_same_forked_and_real(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_IR_")}
    args = ["-m", "vllm_ir", "explain", "rms_norm"]  # every provider discovered, one op explained
    forked, real = run_python(args, env=env, cwd=tmp_path), _real(args, env=env, cwd=tmp_path)
    assert forked.returncode == real.returncode == 0, (forked.stderr, real.stderr)
    assert forked.stdout == real.stdout and forked.stderr == real.stderr


def test_a_start_up_setting_runs_a_real_interpreter():
    assert _forkable(dict(os.environ))
    assert not _forkable({**os.environ, "OMP_NUM_THREADS": "3"})
    assert not _forkable({**os.environ, "PYTHONHASHSEED": "7"})
    assert _forkable({**os.environ, "PYTHONPATH": "/elsewhere", "VLLM_IR_FALLBACK": "error"})
    code = "import torch; print(torch.get_num_threads())"
    assert run_python(["-c", code], env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout.strip() == "1"


def test_a_child_past_its_timeout_is_killed_and_the_next_call_works():
    with pytest.raises(subprocess.TimeoutExpired):
        run_python(["-c", "import time; time.sleep(30)"], timeout=1)
    assert run_python(["-c", "print('next')"]).stdout == "next\n"
