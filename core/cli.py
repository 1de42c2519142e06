"""The ``vllm-ir`` command line: see and steer every choice the dispatcher makes.

Verbs: ``providers list``, ``ops``, ``explain``, ``doctor``, ``bench``. The first four take
``--json`` (stable fields on stdout instead of the table, documented in README); ``bench``
takes ``--json FILE`` (every figure written to FILE). Human output is a table. Every error is one line on
stderr naming the argument (or setting) and the accepted values: exit code 2 for a usage
error (a bad argument, an argument this machine cannot honour), 1 for a failure the command
reports. ``VLLM_IR_LOG_LEVEL=DEBUG`` adds the traceback of an unexpected error.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

#: Activation dtypes the commands accept (the ops are floating-point ops).
FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")
#: Largest single dimension accepted from the command line.
MAX_DIM = 2**31 - 1


class UsageError(Exception):
    """A command-line argument is wrong (or cannot be honoured here): one line on stderr, exit 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``vllm-ir explain: error: argument --shape: ...`` (exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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
    bridge = _vllm_bridge()
    from vllm_ir import plugins

    facts = plugins.provider_facts()
    payload = {"providers": [r.to_json() for r in records], "provider_facts": facts, "vllm_bridge": bridge}
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
    text = "\n".join([text, *_describe_provider_facts(facts)])
    _emit(args, payload, text + "\n" + _describe_bridge(bridge))
    return 0


def _describe_provider_facts(facts: dict[str, dict[str, str]]) -> list[str]:
    """One line per fact a provider reports about how it runs here (``vllm_ir_provider_facts``)."""
    return [f"{plugin}: {name}: {line}" for plugin, items in facts.items() for name, line in items.items()]


def _vllm_bridge() -> dict[str, Any]:
    """The vLLM bridge's status (`vllm_ir.vllm_bridge.describe`); never fails the command."""
    try:
        from vllm_ir import vllm_bridge

        return vllm_bridge.describe()
    except Exception as exc:
        return {"status": "error", "reason": f"{type(exc).__name__}: {exc}", "vllm_version": None, "registered": {}}


def _describe_bridge(bridge: dict[str, Any]) -> str:
    found = f"vLLM {bridge['vllm_version']}" if bridge.get("vllm_version") else "no vLLM"
    line = f"vLLM bridge: {bridge['status']} ({found}; tested {bridge.get('tested_range', '?')})"
    if bridge.get("reason"):
        line += f": {bridge['reason']}"
    for op_name, names in (bridge.get("registered") or {}).items():
        line += f"\n  vllm.ir.ops.{op_name}: {', '.join(names)}"
    return line


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
    from vllm_ir import config

    site = config.current().path
    header = [f"site config: {site} (VLLM_IR_CONFIG); its entries show as [config {site}]"] if site else []
    _emit(args, {"config": site, "ops": ops}, "\n\n".join(header + blocks))
    return 0


# ---------------------------------------------------------------------------------------
# Argument checks: each names its argument and the accepted values.


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in text.lower().replace(",", "x").split("x") if d.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid shape {text!r}: expected sizes >= 0 such as 16x4096") from None
    if not shape or any(d < 0 or d > MAX_DIM for d in shape):
        raise argparse.ArgumentTypeError(
            f"invalid shape {text!r}: expected sizes between 0 and {MAX_DIM} such as 16x4096"
        )
    return shape


def _parse_dtype(text: str) -> Any:
    import torch

    dtype = getattr(torch, text.strip(), None)
    if not isinstance(dtype, torch.dtype):
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; accepted: {', '.join(FLOAT_DTYPES)}")
    if not dtype.is_floating_point or dtype.itemsize < 2:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a floating-point dtype the ops take; accepted: {', '.join(FLOAT_DTYPES)}"
        )
    return dtype


def _parse_dtypes(text: str) -> list[Any]:
    names = _comma_list(text)
    if not names:
        raise argparse.ArgumentTypeError(f"no dtype given; accepted: {', '.join(FLOAT_DTYPES)}")
    return list(dict.fromkeys(_parse_dtype(n) for n in names))


def _parse_device(text: str) -> str:
    """A torch device this machine has: ``cpu``, ``cuda``, ``cuda:1``, ..."""
    import torch

    available = _available_devices()
    try:
        device = torch.device(text.strip())
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"unknown device {text!r}; accepted here: {', '.join(available)}") from None
    if device.type == "cpu":
        return str(device)
    if device.type == "meta":
        raise argparse.ArgumentTypeError(f"{text!r} holds no data; accepted here: {', '.join(available)}")
    module = getattr(torch, device.type, None)
    count = module.device_count() if module is not None and module.is_available() else 0
    if count == 0:
        build = (
            f"torch {torch.__version__} is a CPU build"
            if torch.version.cuda is None and torch.version.hip is None
            else f"no {device.type} device is visible"
        )
        raise argparse.ArgumentTypeError(
            f"{text!r} is not available here ({build}); accepted here: {', '.join(available)}"
        )
    if device.index is not None and device.index >= count:
        raise argparse.ArgumentTypeError(
            f"{text!r}: this machine has {count} {device.type} device(s); accepted here: {', '.join(available)}"
        )
    return str(device)


def _available_devices() -> list[str]:
    import torch

    out = ["cpu"]
    for kind in ("cuda", "xpu", "mps"):
        module = getattr(torch, kind, None)
        try:
            count = module.device_count() if module is not None and module.is_available() else 0
        except Exception:  # a back-end that cannot even count: not available
            count = 0
        out += [kind] + [f"{kind}:{i}" for i in range(count)] if count else []
    return out


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer between 1 and {MAX_DIM}, got {text!r}") from None
    if not 1 <= value <= MAX_DIM:
        raise argparse.ArgumentTypeError(f"expected an integer between 1 and {MAX_DIM}, got {text!r}")
    return value


def _comma_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _positive_int_list(text: str) -> list[int]:
    items = _comma_list(text)
    try:
        values = [int(t) for t in items]
    except ValueError:
        values = []
    if not values or any(not 1 <= v <= MAX_DIM for v in values):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers between 1 and {MAX_DIM} such as 1,16,256, got {text!r}"
        )
    return list(dict.fromkeys(values))


def check_writable(argument: str, path: str) -> None:
    """Fail now, not after minutes of measuring, when ``path`` cannot be written."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"argument {argument}: {path} is a directory; expected a file path")
    existed = p.exists()
    try:
        with open(p, "a"):
            pass
    except OSError as exc:
        if not p.parent.exists():
            raise UsageError(f"argument {argument}: cannot write {path}: directory {p.parent} does not exist") from None
        raise UsageError(f"argument {argument}: cannot write {path}: {exc.strerror or exc}") from None
    if not existed:
        p.unlink()


def check_memory(what: str, shape: Sequence[int], dtypes: Sequence[Any], device: str, tensors: int = 4) -> None:
    """Refuse a shape whose inputs and outputs (``tensors`` of them) cannot fit in the device's free memory."""
    import math

    numel = math.prod(shape)
    need = numel * max(d.itemsize for d in dtypes) * tensors
    free = _free_memory(device)
    if free is not None and need > free:
        shape_text = "x".join(map(str, shape))
        raise UsageError(
            f"{what}: a [{shape_text}] case needs about {_bytes(need)} on {device}, which has {_bytes(free)} free; "
            "choose smaller sizes"
        )


def _free_memory(device: str) -> int | None:
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        try:
            return torch.cuda.mem_get_info(dev)[0]
        except Exception:
            return None
    if dev.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    return None


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} PiB"


def get_op(name: str, argument: str = "op") -> Any:
    """The op called ``name``; a usage error listing the known ops otherwise."""
    import vllm_ir
    from vllm_ir import env

    try:
        return vllm_ir.ops.__getattr__(name)
    except AttributeError:
        known = sorted(op.name for op in vllm_ir.ops)
        hint = env.did_you_mean(name, known)
        raise UsageError(f"argument {argument}: unknown op {name!r}; known ops: {', '.join(known)}{hint}") from None


def cmd_explain(args: argparse.Namespace) -> int:
    import vllm_ir

    vllm_ir.load_providers()
    if args.device is None:
        args.device = vllm_ir.current_platform().device_type
    op = get_op(args.op)
    dtypes = [args.dtype] + ([args.weight_dtype] if args.weight_dtype is not None else [])
    check_memory("argument --shape", args.shape, dtypes, args.device)
    options = {"weight_dtype": args.weight_dtype} if args.weight_dtype is not None else {}
    inputs = op.generate_inputs(args.shape, args.dtype, args.device, **options)
    exp = op.explain(*inputs, mode=args.mode)
    payload = {
        "op": exp.op,
        "mode": exp.mode,
        "tuning": exp.tuning,
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
    text = str(exp)
    if args.verbose:  # where the op and each implementation were registered (innermost frame last)
        stacks = {"(op)": op.registration_stack}
        stacks.update(
            {v.provider: op.impls[v.provider].registration_stack for v in exp.verdicts if v.provider in op.impls}
        )
        payload["registration_stacks"] = {who: list(stack) for who, stack in stacks.items()}
        blocks = [
            f"{op.name} {who if who != '(op)' else 'declared'} at:\n{''.join(stack).rstrip()}"
            for who, stack in stacks.items()
        ]
        text += "\n\n" + "\n\n".join(blocks)
    _emit(args, payload, text)
    return 0


# ---------------------------------------------------------------------------------------
# doctor

#: Variables vllm-ir itself reads besides vllm_ir.env.VARIABLES (a close miss of any is a typo).
_OTHER_VARIABLES = ("VLLM_IR_LOG_LEVEL", "VLLM_IR_BUILD_EXTENSION")


def _setting_findings() -> list[Any]:
    """Every problem with the environment and the config file, read now (what an op call would read)."""
    from vllm_ir import env
    from vllm_ir.ir import priority, tuning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the doctor lists them; no need to warn as well
        priority.settings()
        tuning.layer()
    findings = env.findings()
    known = (*env.VARIABLES, *_OTHER_VARIABLES)
    for name in sorted(os.environ):
        if name.startswith(("VLLM_IR_", "VLLM_BATCH")) and name not in known:
            close = env.did_you_mean(name, known)
            if close:
                findings.append(
                    env.Finding(
                        name,
                        f"{name} is not a variable vllm-ir reads{close}",
                        f"rename it ({', '.join(env.VARIABLES)} are read)",
                    )
                )
    return findings


def _doctor_report() -> dict[str, Any]:
    import torch

    import vllm_ir
    from vllm_ir import config, env, plugins

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # listed below as problems
        records = vllm_ir.provider_records()
    try:
        platform = vllm_ir.current_platform()
        platform_info: dict[str, Any] = {
            "name": platform.name,
            "claimed_by": platform.claimed_by,
            "claims": plugins.platform_claims(),
            "error": None,
        }
    except Exception as exc:  # the doctor reports, it does not crash
        platform_info = {"name": None, "claimed_by": None, "claims": {}, "error": f"{type(exc).__name__}: {exc}"}
    triton: dict[str, Any] = {"installed": importlib.util.find_spec("triton") is not None}
    if triton["installed"]:
        from importlib.metadata import version

        triton["version"] = version("triton")
        triton["interpreter"] = os.environ.get("TRITON_INTERPRET") == "1"
    from vllm_ir.ir import fast_lookup

    eager_lookup = {"compiled": fast_lookup.available(), "detail": fast_lookup.describe()}
    problems: list[dict[str, Any]] = []
    elsewhere: list[dict[str, Any]] = []
    for r in records:
        if r.status in (vllm_ir.ProviderStatus.LOADED, vllm_ir.ProviderStatus.NOT_LOADED):
            continue
        if r.status in (vllm_ir.ProviderStatus.UNSUPPORTED, vllm_ir.ProviderStatus.BLOCKED):
            elsewhere.append({"provider": r.name, "setting": None, "status": r.status.value, "reason": r.reason})
            continue
        problems.append(
            {"provider": r.name, "setting": None, "status": r.status.value, "reason": r.reason, "fix": _suggest_fix(r)}
        )
    for (op_name, provider), problem in sorted(_probe_predicates().items()):
        problems.append(
            {
                "provider": provider,
                "setting": None,
                "status": "predicate error",
                "reason": f"op {op_name}: {problem}",
                "fix": f"a bug in {provider}'s supports_args for {op_name} (it is skipped for such calls); "
                "report it to the provider",
            }
        )
    for f in _setting_findings():
        if f.here_only:
            elsewhere.append({"provider": None, "setting": f.setting, "status": "not here", "reason": f.message})
        else:
            problems.append(
                {"provider": None, "setting": f.setting, "status": "bad setting", "reason": f.message, "fix": f.fix}
            )
    bridge = _vllm_bridge()
    if bridge["status"] in ("refused", "failed", "error"):
        problems.append(
            {
                "provider": None,
                "setting": "vllm_bridge",
                "status": f"vLLM bridge {bridge['status']}",
                "reason": bridge["reason"],
                "fix": f"install a vLLM in {bridge.get('tested_range')} or a vllm-ir release made for "
                f"vLLM {bridge['vllm_version']}",
            }
        )
    site = config.current()
    return {
        "tuning_tables": _tuning_tables(),
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
        "settings": {name: os.environ[name] for name in sorted(env.VARIABLES) if name in os.environ},
        "config": site.path,
        "providers": {r.name: r.status.value for r in records},
        "provider_facts": plugins.provider_facts(),
        "vllm_bridge": bridge,
        "problems": problems,
        "not_for_this_machine": elsewhere,
    }


def _tuning_tables() -> list[dict[str, Any]]:
    """Every tuning table read, with how many of its entries apply here."""
    from vllm_ir.ir import tuning

    applied = {(e.path, e.index) for e in tuning.applied_entries()}
    return [
        {
            "path": t.path,
            "origin": t.origin,
            "measured": t.measured,
            "machine": t.describe_machine(),
            "entries": len(t.entries),
            "applied": sum((t.path, e.index) in applied for e in t.entries),
        }
        for t in tuning.tables()
    ]


def _probe_predicates() -> dict[tuple[str, str], str]:
    """Ask every supported predicate about generated inputs; those that raise or return garbage.

    A broken predicate only shows on the calls that reach it, so the doctor makes a few
    typical ones (2-D and 3-D, fp32 and bf16, on CPU) for every op with an input generator.
    """
    import torch

    import vllm_ir
    from vllm_ir.ir import selection

    for op in vllm_ir.ops:
        probed = [i for i in op.impls.values() if i.supported and i.supports_args is not None]
        if op._input_generator is None or not probed:
            continue  # nothing to ask (and no inputs made: a collective op's set up a process group)
        for shape, dtype in (((4, 64), torch.float32), ((2, 3, 64), torch.bfloat16)):
            try:
                args = op._bind(op.generate_inputs(shape, dtype, "cpu"))
            except Exception:  # an op whose generator wants other shapes: nothing to probe with
                continue
            for impl in probed:
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
    claims = p.get("claims") or {}
    lines.append(
        f"platform: {p['name']}"
        + (f" (claimed by {p['claimed_by']})" if p["claimed_by"] else "")
        + (f"; claims: {', '.join(f'{k} ({v})' for k, v in claims.items())}" if len(claims) > 1 else "")
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
    if report["config"]:
        lines.append(f"config file: {report['config']}")
    for t in report["tuning_tables"]:
        lines.append(
            f"tuning table: {t['path']} ({t['origin']}; measured {(t['measured'] or '?')[:10]} on {t['machine']}): "
            f"{t['applied']} of {t['entries']} entries apply here"
        )
    if report["settings"]:
        lines.append("settings: " + " ".join(f"{k}={v!r}" for k, v in report["settings"].items()))
    lines.append("providers: " + (", ".join(f"{n} ({s})" for n, s in report["providers"].items()) or "none"))
    lines += _describe_provider_facts(report["provider_facts"])
    lines.append(_describe_bridge(report["vllm_bridge"]))

    def who(entry: dict[str, Any]) -> str:  # a setting's message starts with the setting's name
        return f"  {entry['provider']}: {entry['status']}: " if entry["provider"] else f"  {entry['status']}: "

    if report["problems"]:
        lines.append("problems:")
        for pr in report["problems"]:
            lines.append(f"{who(pr)}{pr['reason']}\n    fix: {pr['fix']}")
    else:
        lines.append("problems: none")
    if report["not_for_this_machine"]:
        lines.append("not for this machine (expected here, nothing to fix):")
        lines += [f"{who(note)}{note['reason']}" for note in report["not_for_this_machine"]]
    _emit(args, report, "\n".join(lines))
    return 0


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


# ---------------------------------------------------------------------------------------
# Parser


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="vllm-ir", description="Inspect and steer vllm-ir kernel dispatch.")
    sub = parser.add_subparsers(dest="verb", required=True, parser_class=_Parser)

    def verb(name: str, help_text: str, parent: Any = sub) -> argparse.ArgumentParser:
        p = parent.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        return p

    providers = sub.add_parser("providers", help="installed provider plugins")
    providers_sub = providers.add_subparsers(dest="providers_verb", required=True, parser_class=_Parser)
    verb("list", "every discovered provider with its status and reason", providers_sub).set_defaults(
        func=cmd_providers_list
    )
    verb("ops", "every op: signature, implementations, effective priority per mode").set_defaults(func=cmd_ops)
    explain = verb("explain", "which provider a call would use, and why each other one is skipped")
    explain.add_argument("op", help="op name, e.g. rms_norm")
    explain.add_argument("--shape", type=_parse_shape, default=(16, 4096), help="input shape, e.g. 16x4096")
    explain.add_argument(
        "--dtype", type=_parse_dtype, default="float32", help=f"activation dtype: {', '.join(FLOAT_DTYPES)}"
    )
    explain.add_argument(
        "--device", type=_parse_device, default=None, help="torch device (default: the platform's device type)"
    )
    explain.add_argument("--weight-dtype", type=_parse_dtype, default=None, help="weight dtype (default: --dtype)")
    explain.add_argument("--mode", choices=("eager", "compile"), default="eager")
    explain.add_argument(
        "--verbose", action="store_true", help="also show where the op and each implementation were registered"
    )
    explain.set_defaults(func=cmd_explain)
    verb("doctor", "environment, platform, Triton and provider problems with suggested fixes").set_defaults(
        func=cmd_doctor
    )
    bench = sub.add_parser("bench", help="validate and time every available implementation; say which wins")
    bench.add_argument("ops", nargs="*", help="ops to measure (default: all)")
    bench.add_argument("--providers", type=_comma_list, default=None, help="only these providers, e.g. vllm_c,aten")
    bench.add_argument(
        "--dtype",
        type=_parse_dtypes,
        default=None,
        help=f"activation dtypes, comma-separated: {', '.join(FLOAT_DTYPES)} (default: float32,bfloat16)",
    )
    bench.add_argument("--tokens", type=_positive_int_list, default=None, help="e.g. 1,16,256,4096")
    bench.add_argument("--hidden", type=_positive_int, default=None, help="hidden size (default: 4096; --model: 1024)")
    bench.add_argument(
        "--model",
        default=None,
        metavar="NAME",
        help="time a transformers model instead of ops: llama, mistral, qwen2, qwen3 or gemma (random weights), "
        "stock vs kernelized, eager and compiled; --tokens is then the prompt length (default 128)",
    )
    bench.add_argument("--layers", type=_positive_int, default=2, help="decoder layers of the --model (default: 2)")
    bench.add_argument("--no-compile", action="store_true", help="with --model: eager variants only")
    bench.add_argument(
        "--device", type=_parse_device, default=None, help="torch device (default: the platform's device type)"
    )
    bench.add_argument("--json", dest="json_file", metavar="FILE", default=None, help="write all figures to FILE")
    bench.add_argument("--plot", metavar="FILE.png", default=None, help="bandwidth vs tokens (needs matplotlib)")
    bench.add_argument("--quick", action="store_true", help="fewer shapes and repeats (under a minute on CPU)")
    bench.add_argument(
        "--rounds",
        type=_positive_int,
        default=None,
        help="timing rounds per figure (default: 5); a figure spread over 10%% gets up to 2 more sets",
    )
    bench.add_argument(
        "--emit-priority",
        action="store_true",
        help="print the VLLM_IR_OP_PRIORITY string (and config-file form) that puts the measured winners first",
    )
    bench.set_defaults(func=cmd_bench)
    tune = sub.add_parser(
        "tune", help="measure every provider per op, dtype and token count; write a tuning table (JSON)"
    )
    tune.add_argument("ops", nargs="*", help="ops to tune (default: every op with a provider besides native)")
    tune.add_argument("--providers", type=_comma_list, default=None, help="only these providers, e.g. vllm_c,aten")
    tune.add_argument(
        "--dtype",
        type=_parse_dtypes,
        default=None,
        help=f"activation dtypes, comma-separated: {', '.join(FLOAT_DTYPES)} (default: float32,bfloat16)",
    )
    tune.add_argument(
        "--tokens", type=_positive_int_list, default=None, help="token counts (default 1,16,256,4096; --quick 1,16,256)"
    )
    tune.add_argument("--hidden", type=_positive_int, default=None, help="hidden size (default: 4096)")
    tune.add_argument(
        "--device", type=_parse_device, default=None, help="torch device (default: the platform's device type)"
    )
    tune.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="the table to write (default: $VLLM_IR_TUNING, else ./vllm-ir-tuning.json)",
    )
    tune.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    tune.add_argument("--rounds", type=_positive_int, default=None, help="timing rounds per figure (default: 5)")
    tune.add_argument("--force", action="store_true", help="write the table even when the machine was busy")
    tune.add_argument(
        "--json", dest="json_file", metavar="FILE", default=None, help="write the figures the table learns from to FILE"
    )
    tune.set_defaults(func=cmd_tune)
    return parser


def cmd_tune(args: argparse.Namespace) -> int:
    from vllm_ir import tune

    return tune.main(args)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.model is not None:
        from vllm_ir import model_bench

        return model_bench.main(args)
    from vllm_ir import bench

    return bench.main(args)


def _one_line_warnings(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None):
    print(f"vllm-ir: warning: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prog = f"vllm-ir {args.verb}" + (f" {args.providers_verb}" if getattr(args, "providers_verb", None) else "")
    shown, warnings.showwarning = warnings.showwarning, _one_line_warnings
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        from vllm_ir.plugins import interrupted_plugin

        print(f"{prog}: {interrupted_plugin(exc) or 'interrupted'}", file=sys.stderr)
        return 130
    except Exception as exc:
        from vllm_ir.errors import VllmIrError
        from vllm_ir.log import get_logger

        get_logger("cli").debug("%s failed", prog, exc_info=True)
        what = str(exc) if isinstance(exc, (VllmIrError, ValueError, TypeError)) else f"{type(exc).__name__}: {exc}"
        print(f"{prog}: error: {what.splitlines()[0] if what else type(exc).__name__}", file=sys.stderr)
        return 1
    finally:
        warnings.showwarning = shown


if __name__ == "__main__":
    sys.exit(main())
