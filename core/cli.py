"""The ``vllm-ir`` command line: see and steer every choice the dispatcher makes.

Verbs: ``providers list``, ``ops``, ``explain``, ``doctor``. Each takes ``--json`` (stable
fields, documented in README). Human output is a table; errors go to stderr with exit code 2
(usage) or 1 (a failure the command reports).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from typing import Any


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) if c is not None else "" for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


def _emit(args: argparse.Namespace, payload: Any, text: str) -> None:
    if args.json:
        json.dump(payload, sys.stdout, indent=2, sort_keys=False)
        sys.stdout.write("\n")
    else:
        print(text)


# ---------------------------------------------------------------------------------------
# Verbs


def cmd_providers_list(args: argparse.Namespace) -> int:
    import vllm_ir

    records = vllm_ir.provider_records()
    payload = {"providers": [r.to_json() for r in records]}
    rows = []
    for r in records:
        declared = [f"declares {', '.join(r.ops)}"] if r.ops else []
        impls = "; ".join(declared + [f"{p}: {', '.join(ops)}" for p, ops in r.implementations.items()])
        dist = f"{r.distribution} {r.version}" if r.distribution else ""
        rows.append((r.name, dist, r.status.value, impls, r.reason))
    text = (
        _table(["entry point", "distribution", "status", "implements", "reason"], rows)
        if rows
        else ("no providers installed (entry point group vllm_ir.providers)")
    )
    _emit(args, payload, text)
    return 0


def _op_json(op: Any) -> dict[str, Any]:
    return {
        "name": op.name,
        "signature": f"{op.name}{op.schema}",
        "allow_inplace": op.allow_inplace,
        "activations": list(op.activations),
        "implementations": [
            {
                "provider": impl.provider,
                "supported": bool(impl.supported),
                "unsupported_reason": impl.unsupported_reason,
                "inplace": impl.inplace,
                "batch_invariant": impl.batch_invariant,
                "has_predicate": impl.supports_args is not None,
                "origin": impl.origin,
            }
            for impl in op.impls.values()
        ],
        "priority": {
            mode: [
                {"provider": e.provider, "layer": e.layer.name.lower(), "source": e.source}
                for e in op.get_priority(mode)
            ]
            for mode in ("eager", "compile")
        },
    }


def cmd_ops(args: argparse.Namespace) -> int:
    import vllm_ir

    vllm_ir.load_providers()
    ops = [_op_json(op) for op in vllm_ir.ops]
    blocks = []
    for op in ops:
        impl_rows = [
            (
                i["provider"],
                "yes" if i["supported"] else f"no: {i['unsupported_reason']}",
                "yes" if i["inplace"] else "",
                "yes" if i["batch_invariant"] else "",
                i["origin"] or ("core" if i["provider"] == "native" else ""),
            )
            for i in op["implementations"]
        ]
        prio = "\n".join(
            f"  priority ({mode}): " + " > ".join(f"{e['provider']} [{e['source']}]" for e in entries)
            for mode, entries in op["priority"].items()
        )
        blocks.append(
            f"{op['signature']}\n"
            + _indent(_table(["provider", "supported here", "inplace", "batch-invariant", "from"], impl_rows))
            + "\n"
            + prio
        )
    _emit(args, {"ops": ops}, "\n\n".join(blocks))
    return 0


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in text.lower().replace(",", "x").split("x") if d)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid shape {text!r}: expected e.g. 16x4096") from None
    if not shape or any(d < 0 for d in shape):
        raise argparse.ArgumentTypeError(f"invalid shape {text!r}: expected e.g. 16x4096")
    return shape


def _parse_dtype(text: str) -> Any:
    import torch

    dtype = getattr(torch, text, None)
    if not isinstance(dtype, torch.dtype):
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}: expected e.g. float32, bfloat16, float16")
    return dtype


def cmd_explain(args: argparse.Namespace) -> int:
    import vllm_ir

    vllm_ir.load_providers()
    if args.device is None:
        args.device = vllm_ir.current_platform().device_type
    op = vllm_ir.ops.__getattr__(args.op)
    options = {"weight_dtype": args.weight_dtype} if args.weight_dtype is not None else {}
    inputs = op.generate_inputs(args.shape, args.dtype, args.device, **options)
    exp = op.explain(*inputs, mode=args.mode)
    payload = {
        "op": exp.op,
        "mode": exp.mode,
        "shape": list(args.shape),
        "dtype": str(args.dtype).removeprefix("torch."),
        "device": args.device,
        "chosen": exp.chosen,
        "verdicts": [
            {
                "provider": v.provider,
                "status": v.status,
                "reason": v.reason,
                "layer": v.layer.name.lower(),
                "source": v.source,
            }
            for v in exp.verdicts
        ],
    }
    _emit(args, payload, str(exp))
    return 0


def _doctor_report() -> dict[str, Any]:
    import torch

    import vllm_ir

    records = vllm_ir.provider_records()
    try:
        platform = vllm_ir.current_platform()
        platform_info: dict[str, Any] = {"name": platform.name, "claimed_by": platform.claimed_by, "error": None}
    except Exception as exc:  # the doctor reports, it does not crash
        platform_info = {"name": None, "claimed_by": None, "error": f"{type(exc).__name__}: {exc}"}
    triton: dict[str, Any] = {"installed": importlib.util.find_spec("triton") is not None}
    if triton["installed"]:
        from importlib.metadata import version

        triton["version"] = version("triton")
        triton["interpreter"] = os.environ.get("TRITON_INTERPRET") == "1"
    from vllm_ir.ir import fast_lookup

    eager_lookup = {"compiled": fast_lookup.available(), "detail": fast_lookup.describe()}
    problems = []
    for r in records:
        if r.status in (vllm_ir.ProviderStatus.LOADED, vllm_ir.ProviderStatus.NOT_LOADED):
            continue
        problems.append({"provider": r.name, "status": r.status.value, "reason": r.reason, "fix": _suggest_fix(r)})
    for (op_name, provider), problem in sorted(_probe_predicates().items()):
        problems.append(
            {
                "provider": provider,
                "status": "predicate error",
                "reason": f"op {op_name}: {problem}",
                "fix": f"a bug in {provider}'s supports_args for {op_name} (it is skipped for such calls); "
                "report it to the provider",
            }
        )
    return {
        "vllm_ir": vllm_ir.__version__,
        "python": sys.version.split()[0],
        "torch": {
            "version": torch.__version__,
            "build": "rocm" if torch.version.hip else ("cuda" if torch.version.cuda else "cpu"),
            "cuda": torch.version.cuda,
            "hip": torch.version.hip,
            "gpu_available": torch.cuda.is_available(),
            "threads": torch.get_num_threads(),
        },
        "platform": platform_info,
        "eager_lookup": eager_lookup,
        "triton": triton,
        "providers": {r.name: r.status.value for r in records},
        "problems": problems,
    }


def _probe_predicates() -> dict[tuple[str, str], str]:
    """Ask every supported predicate about generated inputs; those that raise or return garbage.

    A broken predicate only shows on the calls that reach it, so the doctor makes a few
    typical ones (2-D and 3-D, fp32 and bf16, on CPU) for every op with an input generator.
    """
    import warnings

    import torch

    import vllm_ir
    from vllm_ir.ir import selection

    for op in vllm_ir.ops:
        if op._input_generator is None:
            continue
        for shape, dtype in (((4, 64), torch.float32), ((2, 3, 64), torch.bfloat16)):
            try:
                args = op._bind(op.generate_inputs(shape, dtype, "cpu"))
            except Exception:  # an op whose generator wants other shapes: nothing to probe with
                continue
            for impl in op.impls.values():
                if impl.supported and impl.supports_args is not None:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        try:
                            selection.ask(impl, args)
                        except vllm_ir.PredicateError:  # VLLM_IR_FALLBACK=error: recorded all the same
                            pass
    return selection.predicate_errors()


def _suggest_fix(record: Any) -> str:
    from vllm_ir import ProviderStatus

    dist = record.distribution or record.name
    if record.status is ProviderStatus.INCOMPATIBLE:
        return f"install a {dist} release built for this vllm-ir, or a vllm-ir matching its requirement"
    if record.status is ProviderStatus.BLOCKED:
        return "remove it from VLLM_IR_DISABLE_PROVIDERS / add it to VLLM_IR_PROVIDERS to enable it"
    if record.status is ProviderStatus.UNSUPPORTED:
        return "expected on this machine if the reason names missing hardware or libraries; otherwise reinstall it"
    return f"run with VLLM_IR_STRICT_PLUGINS=1 for the full traceback; reinstall or uninstall {dist}"


def cmd_doctor(args: argparse.Namespace) -> int:
    report = _doctor_report()
    t = report["torch"]
    lines = [
        f"vllm-ir {report['vllm_ir']}, python {report['python']}",
        f"torch {t['version']} ({t['build']} build), GPU available: {t['gpu_available']}, threads: {t['threads']}",
    ]
    p = report["platform"]
    lines.append(
        f"platform: {p['name']}" + (f" (claimed by {p['claimed_by']})" if p["claimed_by"] else "")
        if p["error"] is None
        else f"platform: ERROR {p['error']}"
    )
    lines.append(f"eager dispatch lookup: {report['eager_lookup']['detail']}")
    tr = report["triton"]
    lines.append(
        f"triton: {tr['version']}" + (" (TRITON_INTERPRET=1: kernels run on CPU)" if tr["interpreter"] else "")
        if tr["installed"]
        else "triton: not installed"
    )
    lines.append("providers: " + (", ".join(f"{n} ({s})" for n, s in report["providers"].items()) or "none"))
    if report["problems"]:
        lines.append("problems:")
        for pr in report["problems"]:
            lines.append(f"  {pr['provider']}: {pr['status']}: {pr['reason']}\n    fix: {pr['fix']}")
    else:
        lines.append("problems: none")
    _emit(args, report, "\n".join(lines))
    return 0


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


# ---------------------------------------------------------------------------------------
# Parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-ir", description="Inspect and steer vllm-ir kernel dispatch.")
    sub = parser.add_subparsers(dest="verb", required=True)

    def verb(name: str, help_text: str, parent: Any = sub) -> argparse.ArgumentParser:
        p = parent.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        return p

    providers = sub.add_parser("providers", help="installed provider plugins")
    providers_sub = providers.add_subparsers(dest="providers_verb", required=True)
    verb("list", "every discovered provider with its status and reason", providers_sub).set_defaults(
        func=cmd_providers_list
    )
    verb("ops", "every op: signature, implementations, effective priority per mode").set_defaults(func=cmd_ops)
    explain = verb("explain", "which provider a call would use, and why each other one is skipped")
    explain.add_argument("op", help="op name, e.g. rms_norm")
    explain.add_argument("--shape", type=_parse_shape, default=(16, 4096), help="input shape, e.g. 16x4096")
    explain.add_argument("--dtype", type=_parse_dtype, default="float32", help="activation dtype")
    explain.add_argument("--device", default=None, help="torch device (default: the platform's device type)")
    explain.add_argument("--weight-dtype", type=_parse_dtype, default=None, help="weight dtype (default: --dtype)")
    explain.add_argument("--mode", choices=("eager", "compile"), default="eager")
    explain.set_defaults(func=cmd_explain)
    verb("doctor", "environment, platform, Triton and provider problems with suggested fixes").set_defaults(
        func=cmd_doctor
    )
    bench = sub.add_parser("bench", help="validate and time every available implementation; say which wins")
    bench.add_argument("ops", nargs="*", help="ops to measure (default: all)")
    bench.add_argument("--providers", type=_comma_list, default=None, help="only these providers, e.g. vllm_c,aten")
    bench.add_argument("--dtype", default=None, help="activation dtypes, e.g. bfloat16 (default: float32,bfloat16)")
    bench.add_argument("--tokens", type=_int_list, default=None, help="e.g. 1,16,256,4096")
    bench.add_argument("--hidden", type=int, default=4096)
    bench.add_argument("--device", default=None, help="torch device (default: the platform's device type)")
    bench.add_argument("--json", dest="json_file", metavar="FILE", default=None, help="write all figures to FILE")
    bench.add_argument("--plot", metavar="FILE.png", default=None, help="bandwidth vs tokens (needs matplotlib)")
    bench.add_argument("--quick", action="store_true", help="fewer shapes and repeats (under a minute on CPU)")
    bench.set_defaults(func=cmd_bench)
    return parser


def _comma_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _int_list(text: str) -> list[int]:
    try:
        return [int(t) for t in _comma_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def cmd_bench(args: argparse.Namespace) -> int:
    from vllm_ir import bench

    return bench.main(args)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except Exception as exc:
        from vllm_ir.errors import VllmIrError

        if not isinstance(exc, (VllmIrError, ValueError, TypeError)):
            raise
        print(f"vllm-ir {args.verb}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
