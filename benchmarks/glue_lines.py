"""How much provider Python glue there is, and how often it restates each op's signature.

    .venv/bin/python benchmarks/glue_lines.py [--json] [--per-op]

What is counted (no import of any provider; the op declarations are read from ``vllm_ir.ops``
with plugin autoload off):

- **glue lines**: lines (all, and non-blank ones) of ``providers/*/vllm_ir_provider_*/**.py``
  outside kernel code (Triton's ``kernels/``, the generated ``_build_info.py``), per provider;
  and **code lines**, those neither blank, comment-only nor part of a docstring (restatement is
  code; docstrings that say why are asked for, and grow as code is folded into shared helpers).
- **files per op**: the provider glue files that name the op (``ops.<op>``, ``"<op>"`` or a
  function called ``<op>``), plus its declaration file, per op (mean and max).
- **signature spellings**: per op, the places outside tests and kernels (core/ and provider
  glue) that spell its parameter list: a ``def``/``lambda`` whose positional parameters begin
  with exactly the op's parameters in order (extra trailing ones allowed, annotated or not),
  and a call passing the op's parameters by name in order (two or more of them). An op whose
  parameter list is a single name (``x``) counts only defs named after the op (``supports_<op>``,
  ``<op>``, ``<op>_supports``...) or decorated with its ``register_impl``; calls are not counted.
  Also per (op, provider), for the ops a provider names: the spellings in that provider's glue,
  where 1 is its kernel binding alone (every provider binds the op once, so the total grows with
  the providers).
- **add-an-op**: the lines of glue + declaration one op costs in native (declaration), vllm_c
  and Triton, as the mean over each family's ops of (declaration file + vllm_c family file +
  Triton ``ops/`` family file) / ops in the family; Triton's ``kernels/`` and csrc are the kernel
  math and not counted.

``--root DIR`` measures the files of another checkout (``git worktree add /tmp/base dd8a82d``:
the figures before the registration surface); op signatures always come from this one.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
ROOT = HERE  # the checkout measured (--root)
PROVIDERS = ROOT / "providers"
DECLARATIONS = ROOT / "core" / "ir" / "declarations"
KERNEL_PARTS = ("kernels",)
SKIP_FILES = ("_build_info.py",)


def glue_files() -> dict[str, list[Path]]:
    out: dict[str, list[Path]] = {}
    for package in sorted(PROVIDERS.glob("*/vllm_ir_provider_*")):
        files = [
            p
            for p in sorted(package.rglob("*.py"))
            if not any(part in KERNEL_PARTS for part in p.relative_to(package).parts[:-1]) and p.name not in SKIP_FILES
        ]
        out[package.parent.name] = files
    return out


def core_files() -> list[Path]:
    return [p for p in sorted((ROOT / "core").rglob("*.py")) if "testing" not in p.relative_to(ROOT / "core").parts]


def op_signatures() -> dict[str, tuple[list[str], Path]]:
    os.environ["VLLM_IR_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    sys.path.insert(0, str(HERE))
    import vllm_ir

    out = {}
    for op in vllm_ir.ops:
        module = sys.modules[op.fn.__module__]
        out[op.name] = (list(op.signature.parameters), Path(module.__file__).resolve())
    return out


def _positional(args: ast.arguments) -> list[str]:
    return [a.arg for a in (*args.posonlyargs, *args.args)]


def _decorated_for(node: ast.AST, op: str) -> bool:
    for dec in getattr(node, "decorator_list", ()):
        if op in ast.unparse(dec).replace("'", '"').split("(")[0].split(".") or f'"{op}"' in ast.unparse(dec):
            return True
    return False


def spellings(tree: ast.AST, sigs: dict[str, list[str]]) -> dict[str, int]:
    """Signature spellings per op in one module. A def or call whose names match several ops'
    lists counts for the longest; where ops share that list (or it is a single name), only for
    the one the def is named or decorated after."""
    counts: dict[str, int] = defaultdict(int)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            names, is_call = _positional(node.args), False
        elif isinstance(node, ast.Call):
            names = [a.id if isinstance(a, ast.Name) else None for a in node.args]
            names += [
                k.value.id if isinstance(k.value, ast.Name) and k.arg == k.value.id else None for k in node.keywords
            ]
            is_call = True
        else:
            continue
        matching = [op for op, params in sigs.items() if names[: len(params)] == params]
        if not matching:
            continue
        longest = max(len(sigs[op]) for op in matching)
        matching = [op for op in matching if len(sigs[op]) == longest]
        if len(matching) > 1 or longest == 1:
            if is_call:
                continue
            name = getattr(node, "name", "")
            matching = [op for op in matching if op in name or _decorated_for(node, op)]
            if len(matching) > 1:  # the longest op name the def is named after
                matching = [max(matching, key=len)]
        for op in matching:
            counts[op] += 1
    return counts


def mentions(text: str, tree: ast.AST, op: str) -> bool:
    if f"ops.{op}" in text or f'"{op}"' in text or f"'{op}'" in text:
        return True
    return any(isinstance(n, ast.FunctionDef) and n.name == op for n in ast.walk(tree))


def lines(path: Path) -> tuple[int, int]:
    text = path.read_text().splitlines()
    return len(text), sum(1 for line in text if line.strip())


def code_lines(path: Path) -> int:
    """Lines that are neither blank, comment-only nor part of a docstring."""
    source = path.read_text()
    text = source.splitlines()
    other = {i for i, line in enumerate(text, 1) if not line.strip() or line.strip().startswith("#")}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(getattr(first.value, "value", None), str):
                other.update(range(first.lineno, first.end_lineno + 1))
    return len(text) - len(other)


def measure() -> dict:
    sigs = op_signatures()
    providers = glue_files()
    parsed: dict[Path, tuple[str, ast.AST]] = {}
    for path in [p for files in providers.values() for p in files] + core_files():
        text = path.read_text()
        parsed[path] = (text, ast.parse(text))

    per_provider = {}
    for name, files in providers.items():
        total = [lines(p) for p in files]
        per_provider[name] = {
            "files": len(files),
            "lines": sum(t for t, _ in total),
            "nonblank": sum(b for _, b in total),
            "code": sum(code_lines(p) for p in files),
        }
    glue = [p for files in providers.values() for p in files]

    params_of = {op: params for op, (params, _) in sigs.items()}
    found = {p: spellings(parsed[p][1], params_of) for p in parsed}
    per_op = {}
    for op, (params, decl) in sorted(sigs.items()):
        files = {decl} | {p for p in glue if mentions(*parsed[p], op)}
        by_file = {str(p.relative_to(ROOT)): found[p][op] for p in parsed if found[p].get(op)}
        per_op[op] = {
            "params": len(params),
            "files": len(files),
            "signature_spellings": sum(by_file.values()),
            "where": by_file,
        }

    # add-an-op: per family, (declaration + vllm_c family + triton ops family) / ops of the family
    families = defaultdict(list)
    for op, (_, decl) in sigs.items():
        families[decl.stem].append(op)
    add_an_op = {}
    for family, ops in sorted(families.items()):
        parts = [
            DECLARATIONS / f"{family}.py",
            PROVIDERS / "vllm_c" / "vllm_ir_provider_vllm_c" / f"{family}.py",
            PROVIDERS / "triton_kernels" / "vllm_ir_provider_triton" / "ops" / f"{family}.py",
        ]
        have = [p for p in parts if p.exists()]
        if len(have) < 3:
            continue
        total = sum(lines(p)[0] for p in have)
        code = sum(code_lines(p) for p in have)
        add_an_op[family] = {
            "ops": len(ops),
            "lines": total,
            "per_op": round(total / len(ops), 1),
            "code_per_op": round(code / len(ops), 1),
        }

    # The issue's own figure: rms_norm's annotated tail, as text, in glue and core.
    tail = "weight: Tensor | None, epsilon: float, variance_size: int | None = None"
    tail_count = sum(text.count(tail) for text, _ in parsed.values())
    # Per (op, provider): the spellings in that provider's glue. The declaration spells the list
    # once; each provider's kernel binding once more, so a provider restating nothing has 1. Only
    # the ops a provider names count: a def of another op's that happens to begin with this op's
    # parameters (aiter's static_quant_fp8 custom op against silu_and_mul_static_fp8_quant) is not
    # a restatement of an op the provider does not implement.
    by_provider = {}
    for op in per_op:
        for name, files in providers.items():
            if not any(mentions(*parsed[p], op) for p in files):
                continue
            count = sum(found[p].get(op, 0) for p in files)
            if count:
                by_provider[f"{op} / {name}"] = count
    spell = [v["signature_spellings"] for v in per_op.values()]
    nfiles = [v["files"] for v in per_op.values()]
    return {
        "providers": per_provider,
        "glue_lines": sum(v["lines"] for v in per_provider.values()),
        "glue_nonblank": sum(v["nonblank"] for v in per_provider.values()),
        "glue_code": sum(v["code"] for v in per_provider.values()),
        "ops": per_op,
        "signature_spellings_total": sum(spell),
        "signature_spellings_max": max(spell),
        "ops_over_two_spellings": sorted(op for op, v in per_op.items() if v["signature_spellings"] > 2),
        "spellings_per_provider_max": max(by_provider.values(), default=0),
        "provider_ops_over_one_spelling": {k: n for k, n in sorted(by_provider.items()) if n > 1},
        "provider_ops": len(by_provider),
        "files_per_op_mean": round(sum(nfiles) / len(nfiles), 2),
        "files_per_op_max": max(nfiles),
        "add_an_op": add_an_op,
        "rms_norm_tail_text": tail_count,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--per-op", action="store_true", help="list every op's figures")
    parser.add_argument("--root", type=Path, help="measure the files of another checkout")
    args = parser.parse_args()
    if args.root is not None:
        global ROOT, PROVIDERS, DECLARATIONS
        ROOT = args.root.resolve()
        PROVIDERS, DECLARATIONS = ROOT / "providers", ROOT / "core" / "ir" / "declarations"
    m = measure()
    if args.json:
        print(json.dumps(m, indent=2))
        return
    print(f"provider glue: {m['glue_lines']} lines ({m['glue_nonblank']} non-blank, {m['glue_code']} code)")
    for name, v in m["providers"].items():
        print(f"  {name:<16} {v['files']:>3} files {v['lines']:>6} lines {v['code']:>6} code")
    print(f"files per op: mean {m['files_per_op_mean']}, max {m['files_per_op_max']}")
    print(
        f"signature spellings outside tests and kernels: {m['signature_spellings_total']} in all, "
        f"max {m['signature_spellings_max']} per op; ops above 2: {len(m['ops_over_two_spellings'])}"
    )
    over = m["provider_ops_over_one_spelling"]
    print(
        f"  per provider's glue: max {m['spellings_per_provider_max']} per op; "
        f"{len(over)} of {m['provider_ops']} (op, provider) pairs above 1 (the kernel binding)"
    )
    print(f"rms_norm's annotated parameter tail as text: {m['rms_norm_tail_text']}")
    if args.per_op:
        for op, v in m["ops"].items():
            print(f"  {op:<40} files {v['files']:>2}  spellings {v['signature_spellings']:>3}")
        for pair, n in over.items():
            print(f"  {pair:<60} {n} spellings in one provider")
    print("add-an-op (declaration + vllm_c + triton glue per op, by family):")
    for family, v in m["add_an_op"].items():
        print(
            f"  {family:<12} {v['ops']:>2} ops {v['lines']:>5} lines  {v['per_op']:>6} per op"
            f"  ({v['code_per_op']} code)"
        )


if __name__ == "__main__":
    main()
