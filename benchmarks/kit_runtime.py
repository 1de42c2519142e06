"""Time the conformance kit's command against one or more source trees, in paired rounds.

Each tree is a checkout with its own virtual environment (``TREE/.venv``, as
``scripts/setup.sh`` makes it), so that the core, its compiled extensions, the providers and
their C++ libraries all come from that tree; the script checks that they do before timing.
Rounds alternate the trees (A, B, A, B, ...) so that a machine whose speed drifts, or that
others share, slows both alike; every run is serial unless the kit arguments say otherwise.

    python benchmarks/kit_runtime.py --tree before=/work/kit-before --tree after=. --rounds 2
    python benchmarks/kit_runtime.py --tree after=. -- -k rms_norm   # extra pytest arguments

Every run starts in a fresh empty folder (no pytest cache, no hypothesis database, no project
``pyproject.toml`` options) with the kit's usual command::

    python -m pytest --vllm-ir-conformance --vllm-ir-provider vllm_c -q -p no:cacheprovider

Inductor's cache is one folder per tree, kept across its runs (and across invocations with
``--cache-root``): a warm-up run per tree (``--warmup``, default 1, not counted) fills it, so
the timed runs are a CI machine's second run. ``--cold`` gives every run an empty cache
instead. Prints each run (wall and CPU seconds, pytest's tally) and, per tree, the medians;
with two or more trees, each one's medians against the first's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KIT = ["-m", "pytest", "--vllm-ir-conformance", "-q", "-p", "no:cacheprovider"]

#: The files vllm_ir, its extension and the providers (and their compiled libraries) are imported from.
_WHERE = r"""
import importlib, json, sys
import vllm_ir, vllm_ir.testing
out = {"vllm_ir": vllm_ir.__file__, "vllm_ir.testing": vllm_ir.testing.__file__}
try:
    import vllm_ir.ir.dispatch._fast_lookup as fl
    out["vllm_ir.ir.dispatch._fast_lookup"] = fl.__file__
except ImportError as exc:
    out["vllm_ir.ir.dispatch._fast_lookup"] = f"(not built: {exc})"
for name in sys.argv[1:]:
    mod = importlib.import_module(f"vllm_ir_provider_{name}")
    out[mod.__name__] = mod.__file__
    try:  # a provider's compiled library (vllm_c's _C), where it has one
        out[mod.__name__ + "._C"] = importlib.import_module(mod.__name__ + "._C").__file__
    except ImportError:
        pass
print(json.dumps(out))
"""


def where(python: Path, providers: list[str]) -> dict[str, str]:
    """Where ``python`` imports vllm_ir, its extension and the providers from."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with tempfile.TemporaryDirectory(prefix="kit-where-") as cwd:
        out = subprocess.run(
            [str(python), "-c", _WHERE, *providers], cwd=cwd, env=env, capture_output=True, text=True, check=True
        )
    return json.loads(out.stdout)


def check_tree(tree: Path, python: Path, providers: list[str]) -> dict[str, str]:
    """The import locations, after checking that each one is inside ``tree``."""
    paths = where(python, providers)
    root = tree.resolve()
    for name, path in paths.items():
        if path.startswith("(not built"):
            continue
        if not Path(path).resolve().is_relative_to(root):
            raise SystemExit(f"{tree}: {name} is imported from {path}, outside the tree")
    return paths


_TALLY = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def tally(output: str) -> dict[str, int]:
    """pytest's final tally line (``4853 passed, 120 skipped in ...``) as counts."""
    lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    if not lines:
        return {}
    return {kind.rstrip("s") if kind.startswith("error") else kind: int(n) for n, kind in _TALLY.findall(lines[-1])}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_kit(python: Path, args: list[str], cache: str, log: Path | None, threads: int | None = None) -> dict:
    """One run: wall seconds, CPU seconds (user + system of the run and the processes it waited
    for: less sensitive than wall time to others sharing the machine), pytest's tally, exit status."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TORCHINDUCTOR_CACHE_DIR"] = cache
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    with tempfile.TemporaryDirectory(prefix="kit-run-") as cwd:
        cpu, start = _children_cpu(), time.perf_counter()
        proc = subprocess.run([str(python), *KIT, *args], cwd=cwd, env=env, capture_output=True, text=True)
        seconds, cpu = time.perf_counter() - start, _children_cpu() - cpu
    output = proc.stdout + proc.stderr
    if log is not None:
        with open(log, "a") as f:
            f.write(f"\n===== {python} {' '.join(args)} ({seconds:.1f} s, rc {proc.returncode})\n{output}")
    load = os.getloadavg()[0]
    return {"seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2), "load1": load, "rc": proc.returncode,
            "tally": tally(output)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", required=True, metavar="NAME=PATH", help="a tree to time")
    parser.add_argument("--python", action="append", default=[], metavar="NAME=PYTHON", help="default TREE/.venv")
    parser.add_argument("--provider", default="vllm_c", help="the provider whose kit is timed (default vllm_c)")
    parser.add_argument("--rounds", type=int, default=2, help="timed runs per tree (default 2)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per tree first (default 1)")
    parser.add_argument("--cold", action="store_true", help="an empty Inductor cache for every run")
    parser.add_argument(
        "--cache-root", type=Path, default=None, help="keep each tree's Inductor cache in CACHE_ROOT/NAME (reused)"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="OMP_NUM_THREADS for the runs (default: torch's own choice)"
    )
    parser.add_argument("--log", type=Path, default=None, help="append every run's output to this file")
    parser.add_argument("--json", type=Path, default=None, help="write the runs and medians to this file")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    opts = parser.parse_args()

    trees = dict(t.split("=", 1) for t in opts.tree)
    pythons = dict(p.split("=", 1) for p in opts.python)
    args = ["--vllm-ir-provider", opts.provider, *opts.pytest_args]
    setup = {}
    for name, tree in trees.items():
        python = Path(pythons.get(name, Path(tree) / ".venv" / "bin" / "python"))
        paths = check_tree(Path(tree), python, [opts.provider])
        setup[name] = {"tree": str(Path(tree).resolve()), "python": str(python), "imports": paths}
        print(f"{name}: {Path(tree).resolve()}", *(f"  {k}: {v}" for k, v in paths.items()), sep="\n")
    if opts.cache_root is not None:
        caches = {name: str(opts.cache_root / name) for name in trees}
        for cache in caches.values():
            os.makedirs(cache, exist_ok=True)
    else:
        caches = {name: tempfile.mkdtemp(prefix=f"kit-inductor-{name}-") for name in trees}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    print(f"command: python {' '.join(KIT + args)}  ({'cold' if opts.cold else 'warm'} Inductor cache)", flush=True)
    for phase, count in (("warm-up", 0 if opts.cold else opts.warmup), ("timed", opts.rounds)):
        for r in range(count):
            for name in trees:
                cache = tempfile.mkdtemp(prefix=f"kit-inductor-{name}-cold-") if opts.cold else caches[name]
                one = run_kit(Path(setup[name]["python"]), args, cache, opts.log, opts.threads)
                print(
                    f"{phase} {r + 1} {name}: {one['seconds']:.1f} s wall, {one['cpu_seconds']:.1f} s CPU, "
                    f"load {one['load1']:.1f}, rc {one['rc']}, {one['tally']}",
                    flush=True,
                )
                if phase == "timed":
                    runs[name].append(one)
    medians = {}
    for key in ("seconds", "cpu_seconds"):
        medians[key] = {name: statistics.median(r[key] for r in rs) for name, rs in runs.items() if rs}
    first = next(iter(medians["seconds"]), None)
    for name in medians["seconds"]:
        wall, cpu = medians["seconds"][name], medians["cpu_seconds"][name]
        ratio = ""
        if first and name != first:
            ratio = f"; {wall / medians['seconds'][first]:.3f}x / {cpu / medians['cpu_seconds'][first]:.3f}x {first}"
        print(f"median {name}: {wall:.1f} s wall, {cpu:.1f} s CPU over {len(runs[name])} run(s){ratio}")
    if opts.json:
        result = {
            "command": KIT + args,
            "cold": opts.cold,
            "threads": opts.threads,
            "setup": setup,
            "runs": runs,
            "medians": medians,
        }
        opts.json.write_text(json.dumps(result, indent=2) + "\n")
    sys.exit(0 if all(r["rc"] == 0 for rs in runs.values() for r in rs) else 1)


if __name__ == "__main__":
    main()
