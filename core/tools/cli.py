"""The ``vllm-ir`` command line: see and steer every choice the dispatcher makes.

Verbs: ``providers [list]``, ``ops [NAME ...]``, ``explain``, ``doctor``, ``bench``, ``tune``
(`VERBS`). The first four take ``--json`` (stable fields on stdout instead of the table,
documented in docs/cli.md); ``bench`` and ``tune`` take ``--json FILE`` (every figure written to
FILE). Every JSON document starts with ``"schema": "vllm-ir.<verb>/<version>"`` and a
``machine`` block (`machine_block`), so two runs can be compared by a program. Human output
is a table that fits the terminal (``COLUMNS`` wins; ``--wide``: never wrapped).

Exit codes: 0 success; 1 a failure the command reports (``doctor``: problems listed); 2 a
usage error (a bad argument, an argument this machine cannot honour); 141 the reader closed
the pipe (``vllm-ir doctor | head -3``: nothing printed about it). Every error is one line
on stderr naming the argument (or setting) and the accepted values.
``VLLM_IR_LOG_LEVEL=DEBUG`` adds the traceback of an unexpected error.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn

from vllm_ir.tools.arguments import (
    DTYPE_HELP,
    UsageError,
    check_memory,
    comma_list,
    get_op,
    parse_device,
    parse_dtype,
    parse_dtypes,
    parse_shape,
    positive_int,
    positive_int_list,
)
from vllm_ir.tools.output import (
    JSON_VERSION,
    format_table,
    json_document,
    one_line,
)

#: Exit status when the reader of stdout went away (``| head``): 128 + SIGPIPE, as a shell tool.
EXIT_BROKEN_PIPE = 141


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``vllm-ir explain: error: argument --shape: ...`` (exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ---------------------------------------------------------------------------------------
# Output: tables that fit the terminal, JSON documents with a schema and the machine


def _columns(args: argparse.Namespace) -> int | None:
    """Columns a table may use: the terminal's (``COLUMNS`` wins, 80 when unknown); None with ``--wide``."""
    if getattr(args, "wide", False):
        return None
    return max(40, shutil.get_terminal_size().columns)


def _emit(args: argparse.Namespace, payload: dict[str, Any], text: str) -> None:
    if args.json:
        json.dump(json_document(args.schema, payload), sys.stdout, indent=2, sort_keys=False)
        sys.stdout.write("\n")
    else:
        print(text)


# ---------------------------------------------------------------------------------------
# Verbs


def cmd_providers_list(args: argparse.Namespace) -> int:
    import vllm_ir

    records = vllm_ir.provider_records()
    bridge = _vllm_bridge()
    from vllm_ir.plugins import discovery as plugins

    facts = plugins.provider_facts()
    payload = {"providers": [r.to_json() for r in records], "provider_facts": facts, "vllm_bridge": bridge}
    columns = _columns(args)

    def listing(ops: Sequence[str]) -> str:  # the ops themselves only with --wide (vllm-ir ops has them all)
        return ", ".join(ops) if columns is None else f"{len(ops)} op{'s' if len(ops) != 1 else ''}"

    rows = []
    for r in records:
        declared = [f"declares {listing(r.ops)}"] if r.ops else []
        impls = "; ".join(declared + [f"{p}: {listing(ops)}" for p, ops in r.implementations.items()])
        dist = f"{r.distribution} {r.version}" if r.distribution else ""
        rows.append((r.name, dist, r.status.value, impls, one_line(r.reason)))
    text = (
        format_table(["entry point", "distribution", "status", "implements", "reason"], rows, columns)
        if rows
        else ("no providers installed (entry point group vllm_ir.providers)")
    )
    hint = ["(--wide: the ops each provider implements; vllm-ir ops NAME: one op)"] if columns and rows else []
    notes = [*hint, *_describe_provider_facts(facts), _describe_bridge(bridge)]  # prose: the terminal wraps it
    _emit(args, payload, "\n".join([text, *notes]))
    return 0


def _describe_provider_facts(facts: dict[str, dict[str, str]]) -> list[str]:
    """One line per fact a provider reports about how it runs here (``vllm_ir_provider_facts``)."""
    return [f"{plugin}: {name}: {line}" for plugin, items in facts.items() for name, line in items.items()]


def _vllm_bridge() -> dict[str, Any]:
    """The vLLM bridge's status (`vllm_ir.integrations.vllm.describe`); never fails the command."""
    try:
        from vllm_ir.integrations import vllm as vllm_bridge

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
    """Every op in one line each; ``ops NAME ...``: those ops in full."""
    import vllm_ir
    from vllm_ir.settings import config

    vllm_ir.load_providers()
    chosen = [get_op(name, "names") for name in args.names] if args.names else list(vllm_ir.ops)
    ops = [_op_json(op) for op in chosen]
    columns = _columns(args)
    site = config.current().path
    header = [f"site config: {site} (VLLM_IR_CONFIG); its entries show as [config {site}]"] if site else []
    if args.names:
        blocks = [_describe_op(op, columns) for op in ops]
    else:
        rows = [
            (
                op["name"],
                ", ".join(i["provider"] for i in op["implementations"] if i["supported"]),
                " > ".join(e["provider"] for e in op["priority"]["eager"]),
            )
            for op in ops
        ]
        hint = "(vllm-ir ops NAME: one op's signature, implementations and priorities)"
        blocks = [format_table(["op", "supported here", "eager priority"], rows, columns) + "\n" + hint]
    _emit(args, {"config": site, "ops": ops}, "\n\n".join(header + blocks))
    return 0


def _describe_op(op: dict[str, Any], columns: int | None) -> str:
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
    prio = [
        f"priority ({mode}): " + " > ".join(f"{e['provider']} [{e['source']}]" for e in entries)
        for mode, entries in op["priority"].items()
    ]
    table = format_table(
        ["provider", "supported here", "inplace", "batch-invariant", "from"], impl_rows, columns, indent=2
    )
    return "\n".join([op["signature"], table, *(f"  {line}" for line in prio)])


# ---------------------------------------------------------------------------------------
# Argument checks: each names its argument and the accepted values.


def explain_inputs(op: Any, shape: Sequence[int], dtype: Any, device: str, **options: Any) -> tuple[Any, ...]:
    """Inputs whose first activation (``x``; rotary_embedding: ``query``) has ``shape``: what
    ``explain --shape`` means for every op, so its answer is that of a real call with such an input.

    An input generator's shape is the op's own notion (a gated op's: the output, its ``x`` twice
    as wide), so the generator is asked for the shape that yields this input, and where none
    does (``x`` [16, 4097] for silu_and_mul) the activations are replaced by tensors of ``shape``.
    """
    import torch

    shape = tuple(shape)
    inputs = op.generate_inputs(shape, dtype, device, **options)
    if not op.activation_indices:
        return inputs
    first = op.activation_indices[0]
    made = inputs[first]
    if not isinstance(made, torch.Tensor) or tuple(made.shape) == shape:
        return inputs
    if made.dim() == len(shape):  # scale each dimension back: [16, 8194] from 16x4097 asks for 16x2048
        guess = tuple(max(1, s * s // m) if m else s for s, m in zip(shape, made.shape, strict=True))
        inputs = op.generate_inputs(guess, dtype, device, **options)
        made = inputs[first]
        if tuple(made.shape) == shape:
            return inputs
    g = torch.Generator().manual_seed(0)
    out = list(inputs)
    for i in op.activation_indices:
        t = out[i]
        if isinstance(t, torch.Tensor) and t.shape == made.shape:
            out[i] = (2.0 * torch.randn(shape, generator=g)).to(device=t.device, dtype=t.dtype)
    return tuple(out)


def _not_in_priority(op: Any, args: Sequence[Any], listed: set[str], mode: str) -> list[dict[str, Any]]:
    """Installed implementations no priority layer names: what they would say to this call."""
    from vllm_ir.ir.dispatch import selection
    from vllm_ir.ir.impl import reason_of

    out = []
    for provider, impl in op.impls.items():
        if provider in listed:
            continue
        if not impl.supported:
            what = f"unsupported here: {impl.unsupported_reason}"
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a raising predicate is the doctor's to report
                verdict = selection.ask(impl, op._bind(args))
            what = "it would accept this call" if verdict else f"it would decline: {reason_of(verdict, 'declined')}"
        reason = f"no priority layer names it for {mode}; {what}"
        if impl.supported:
            reason += f" (to try it: VLLM_IR_OP_PRIORITY={op.name}={provider})"
        out.append({"provider": provider, "status": "not in priority", "reason": reason, "layer": None, "source": None})
    return out


def cmd_explain(args: argparse.Namespace) -> int:
    import vllm_ir

    vllm_ir.load_providers()
    if args.device is None:
        args.device = vllm_ir.current_platform().device_type
    op = get_op(args.op)
    dtypes = [args.dtype] + ([args.weight_dtype] if args.weight_dtype is not None else [])
    check_memory("argument --shape", args.shape, dtypes, args.device)
    options = {"weight_dtype": args.weight_dtype} if args.weight_dtype is not None else {}
    inputs = explain_inputs(op, args.shape, args.dtype, args.device, **options)
    exp = op.explain(*inputs, mode=args.mode)
    verdicts = [
        {
            "provider": v.provider,
            "status": v.status,
            "reason": v.reason,
            "layer": v.layer.name.lower(),
            "source": v.source,
        }
        for v in exp.verdicts
    ]
    verdicts += _not_in_priority(op, inputs, {v.provider for v in exp.verdicts}, args.mode)
    shape_of = op.activations[0] if op.activations else None
    dtype = str(args.dtype).removeprefix("torch.")
    payload = {
        "op": exp.op,
        "mode": exp.mode,
        "tuning": exp.tuning,
        "shape": list(args.shape),
        "shape_of": shape_of,
        "dtype": dtype,
        "device": args.device,
        "chosen": exp.chosen,
        "verdicts": verdicts,
    }
    columns = _columns(args)
    call = f"{shape_of} [{', '.join(map(str, args.shape))}] {dtype} on {args.device}"
    rows = [(v["provider"], v["status"], v["source"] or "", v["reason"] or "") for v in verdicts]
    lines = [
        f"{exp.op} ({exp.mode}), {call}: chose {exp.chosen}",
        format_table(["provider", "verdict", "from", "reason"], rows, columns, indent=2),
        *([f"  tuning: {exp.tuning}"] if exp.tuning else []),
    ]
    text = "\n".join(lines)
    if args.verbose:  # where the op and each implementation were registered (innermost frame last)
        stacks = {"(op)": op.registration_stack}
        stacks.update(
            {v["provider"]: op.impls[v["provider"]].registration_stack for v in verdicts if v["provider"] in op.impls}
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

#: Variables vllm-ir itself reads besides vllm_ir.settings.env.VARIABLES (a close miss of any is a typo).
_OTHER_VARIABLES = ("VLLM_IR_BUILD_EXTENSION",)


def _setting_findings() -> list[Any]:
    """Every problem with the environment and the config file, read now (what an op call would read)."""
    from vllm_ir.ir import priority, tuning
    from vllm_ir.plugins import discovery as plugins
    from vllm_ir.settings import env

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the doctor lists them; no need to warn as well
        priority.settings()
        tuning.layer()
    declared = plugins.provider_variables()  # the plugins' own (vllm_ir_environment_variables)
    findings = env.findings()
    known = (*env.VARIABLES, *_OTHER_VARIABLES, *declared)
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
    from vllm_ir.ir import priority
    from vllm_ir.plugins import discovery as plugins
    from vllm_ir.settings import config, env

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
    from vllm_ir.ir.dispatch import fast_lookup

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
        "reference_mode": priority.reference_reason(priority.current_scope()),
        "tracing": {"process": priority.process_traced, "variable": env.ENV_TRACE},
        "triton": triton,
        "settings": {
            name: os.environ[name] for name in sorted((*env.VARIABLES, *_OTHER_VARIABLES)) if name in os.environ
        },
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
    from vllm_ir.ir.dispatch import selection

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
    if report["reference_mode"]:
        lines.append(f"REFERENCE MODE: every op runs native ({report['reference_mode']})")
    if report["tracing"]["process"]:
        lines.append(f"tracing: every op call of this process ({report['tracing']['variable']}=1)")
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
    status = doctor_status(report, strict=args.strict)
    if status:
        why = "problems listed" if report["problems"] else "--strict, and settings warned about"
        lines.append(f"exit status {status}: {why}")
    _emit(args, report, "\n".join(lines))
    return status


def doctor_status(report: dict[str, Any], *, strict: bool = False) -> int:
    """The doctor's exit status, so a CI can gate on it: 1 when it lists a problem; with
    ``strict`` also when a setting was warned about (it names something this machine lacks),
    though not for a provider that merely cannot run here; else 0."""
    warned = [n for n in report["not_for_this_machine"] if n["setting"]]
    return 1 if report["problems"] or (strict and warned) else 0


# ---------------------------------------------------------------------------------------
# Parser


MODE_HELP = "the dispatch to explain: eager (calls from Python) or compile (what torch.compile traces); default eager"
JSON_HELP = "print the JSON document (schema vllm-ir.{verb}/" + f"{JSON_VERSION}, with the machine) instead of a table"
WIDE_HELP = "do not fit the table to the terminal (COLUMNS, else its width): long cells stay on one line"
DOCTOR_EPILOG = """exit status (for CI):
  0    no problem listed ("not for this machine" notes do not count)
  1    problems listed: a failed or incompatible provider, a raising predicate, a bad
       setting, competing platform claims, a refused vLLM bridge; with --strict also a
       setting that names something this machine lacks (a warning when read)
  2    usage error
  141  stdout closed early (vllm-ir doctor | head -3)"""


def add_verb(
    sub: Any,
    name: str,
    help_text: str,
    func: Any,
    *,
    json_flag: bool = True,
    table: bool = True,
    epilog: str | None = None,
    schema: str | None = None,
    nested: bool = False,
) -> argparse.ArgumentParser:
    """One verb's parser with the options every human/JSON verb shares: ``--json`` (the document
    on stdout) and ``--wide``; ``schema`` names its JSON (``vllm-ir.<schema>/<version>``, default
    the verb). A ``nested`` verb (``providers list``) leaves options its parent already parsed alone."""
    formatter = argparse.RawDescriptionHelpFormatter if epilog else argparse.HelpFormatter
    p = sub.add_parser(name, help=help_text, description=help_text, epilog=epilog, formatter_class=formatter)
    unset = {"default": argparse.SUPPRESS} if nested else {}
    if json_flag:
        p.add_argument("--json", action="store_true", help=JSON_HELP.format(verb=schema or name), **unset)
    if table:
        p.add_argument("--wide", action="store_true", help=WIDE_HELP, **unset)
    p.set_defaults(func=func, prog=p.prog, schema=schema or name)
    return p


def _providers_parser(sub: Any) -> None:
    providers = add_verb(sub, "providers", "installed provider plugins (alone: providers list)", cmd_providers_list)
    verbs = providers.add_subparsers(dest="providers_command", metavar="command", parser_class=_Parser)
    list_help = "every discovered provider with its status and reason (the default)"
    add_verb(verbs, "list", list_help, cmd_providers_list, schema="providers", nested=True)


def _ops_parser(sub: Any) -> None:
    ops = add_verb(sub, "ops", "every op in a line; with names: signature, implementations, priority per mode", cmd_ops)
    ops.add_argument("names", nargs="*", metavar="NAME", help="ops to show in full, e.g. rms_norm")


def _explain_parser(sub: Any) -> None:
    explain = add_verb(sub, "explain", "which provider a call would use, and what each installed one says", cmd_explain)
    explain.add_argument("op", help="op name, e.g. rms_norm")
    explain.add_argument(
        "--shape",
        type=parse_shape,
        default=(16, 4096),
        help="shape of the op's first input (x; rotary_embedding: query), e.g. 16x4096; a gated op's x is "
        "twice its output's width",
    )
    explain.add_argument("--dtype", type=parse_dtype, default="float32", help=f"activation dtype: {DTYPE_HELP}")
    explain.add_argument(
        "--device", type=parse_device, default=None, help="torch device (default: the platform's device type)"
    )
    explain.add_argument("--weight-dtype", type=parse_dtype, default=None, help="weight dtype (default: --dtype)")
    explain.add_argument("--mode", choices=("eager", "compile"), default="eager", help=MODE_HELP)
    explain.add_argument(
        "--verbose", action="store_true", help="also show where the op and each implementation were registered"
    )


def _doctor_parser(sub: Any) -> None:
    help_text = "environment, platform, Triton and provider problems with suggested fixes"
    doctor = add_verb(sub, "doctor", help_text, cmd_doctor, table=False, epilog=DOCTOR_EPILOG)
    doctor.add_argument(
        "--strict", action="store_true", help="also exit 1 for a setting that names something this machine lacks"
    )


def _measuring_arguments(parser: Any, ops_help: str, tokens_help: str) -> None:
    """What bench and tune measure: ops, providers, dtypes and token counts."""
    parser.add_argument("ops", nargs="*", help=ops_help)
    parser.add_argument("--providers", type=comma_list, default=None, help="only these providers, e.g. vllm_c,aten")
    parser.add_argument(
        "--dtype",
        type=parse_dtypes,
        default=None,
        help=f"activation dtypes, comma-separated: {DTYPE_HELP} (default: float32,bfloat16)",
    )
    parser.add_argument("--tokens", type=positive_int_list, default=None, help=tokens_help)


def _bench_parser(sub: Any) -> None:
    bench = add_verb(
        sub,
        "bench",
        "validate and time every available implementation; say which wins",
        cmd_bench,
        json_flag=False,
        table=False,
    )
    _measuring_arguments(bench, "ops to measure (default: all)", "e.g. 1,16,256,4096")
    bench.add_argument("--hidden", type=positive_int, default=None, help="hidden size (default: 4096; --model: 1024)")
    bench.add_argument(
        "--model",
        default=None,
        metavar="NAME",
        help="time a transformers model instead of ops: llama, mistral, qwen2, qwen3 or gemma (random weights), "
        "stock vs kernelized, eager and compiled; --tokens is then the prompt length (default 128)",
    )
    bench.add_argument("--layers", type=positive_int, default=2, help="decoder layers of the --model (default: 2)")
    bench.add_argument("--no-compile", action="store_true", help="with --model: eager variants only")
    bench.add_argument(
        "--device", type=parse_device, default=None, help="torch device (default: the platform's device type)"
    )
    bench.add_argument(
        "--json",
        dest="json_file",
        metavar="FILE",
        default=None,
        help=f"write every figure to FILE (schema vllm-ir.bench/{JSON_VERSION}, with the machine); the table "
        "is still printed. Unlike the other verbs' --json, this one takes a file",
    )
    bench.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="one summary figure: a heat map of ops x token counts, colour = speed-up over native of the "
        "dispatcher's choice (the fastest provider named where it is another), hatched where noise could "
        "explain it (needs matplotlib); with --model: step times",
    )
    bench.add_argument(
        "--plot-detail",
        metavar="FILE.png",
        default=None,
        help="also the per-op panels: GB/s vs tokens per provider with interquartile error bars, %% of copy_ "
        "bandwidth where the working set exceeds the last-level cache (needs matplotlib)",
    )
    bench.add_argument("--quick", action="store_true", help="fewer shapes and repeats (under a minute on CPU)")
    bench.add_argument(
        "--rounds",
        type=positive_int,
        default=None,
        help="timing rounds per figure (default: 5); a figure spread over 10%% gets up to 2 more sets",
    )
    bench.add_argument(
        "--emit-priority",
        action="store_true",
        help="print the VLLM_IR_OP_PRIORITY string (and config-file form) that puts the measured winners first",
    )


def _tune_parser(sub: Any) -> None:
    tune = add_verb(
        sub,
        "tune",
        "measure every provider per op, dtype and token count; write a tuning table (JSON)",
        cmd_tune,
        json_flag=False,
        table=False,
    )
    _measuring_arguments(
        tune,
        "ops to tune (default: every op with a provider besides native)",
        "token counts (default 1,16,256,4096; --quick 1,16,256)",
    )
    tune.add_argument("--hidden", type=positive_int, default=None, help="hidden size (default: 4096)")
    tune.add_argument(
        "--device", type=parse_device, default=None, help="torch device (default: the platform's device type)"
    )
    tune.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="the table to write (default: $VLLM_IR_TUNING, else ./vllm-ir-tuning.json)",
    )
    tune.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    tune.add_argument("--rounds", type=positive_int, default=None, help="timing rounds per figure (default: 5)")
    tune.add_argument("--force", action="store_true", help="write the table even when the machine was busy")
    tune.add_argument(
        "--json", dest="json_file", metavar="FILE", default=None, help="write the figures the table learns from to FILE"
    )


def _trace_parser(sub: Any) -> None:
    trace = add_verb(
        sub,
        "trace",
        "run a command with every vllm-ir call traced; print what ran when it exits",
        cmd_trace,
        json_flag=False,
        table=False,
        epilog="Runs COMMAND (vllm-ir trace -- python serve.py) with VLLM_IR_TRACE=1. When it exits, prints the\n"
        "merged trace of every Python process it started that imported vllm_ir: calls, time and fallbacks\n"
        "per op, provider, dtype and token range, and the kernels of the graphs compiled.\n"
        "Exit status: the command's (1 if a requested file could not be written).",
    )
    trace.add_argument("--json", dest="json_file", metavar="FILE", default=None, help="also write the trace to FILE")
    trace.add_argument(
        "--chrome", metavar="FILE", default=None, help="also write a Chrome trace (Perfetto, chrome://tracing) to FILE"
    )
    trace.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")


def cmd_trace(args: argparse.Namespace) -> int:
    from vllm_ir.tools import tracing

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise UsageError("give the command to trace after --, e.g. vllm-ir trace -- python script.py")
    return tracing.run_command(command, json_file=args.json_file, chrome_file=args.chrome)


#: Each verb's parser, in ``vllm-ir --help`` order: a new verb is one function added here.
VERBS: list[Any] = [
    _providers_parser,
    _ops_parser,
    _explain_parser,
    _doctor_parser,
    _bench_parser,
    _tune_parser,
    _trace_parser,
]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="vllm-ir", description="Inspect and steer vllm-ir kernel dispatch.")
    sub = parser.add_subparsers(dest="verb", required=True, parser_class=_Parser)
    for add in VERBS:
        add(sub)
    return parser


def cmd_tune(args: argparse.Namespace) -> int:
    from vllm_ir.tools import tune

    return tune.main(args)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.model is not None:
        from vllm_ir.tools import model_bench

        return model_bench.main(args)
    from vllm_ir.tools import bench

    return bench.main(args)


def _one_line_warnings(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None):
    print(f"vllm-ir: warning: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prog = args.prog
    shown, warnings.showwarning = warnings.showwarning, _one_line_warnings
    try:
        status = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here rather than at exit
        return status
    except BrokenPipeError:
        return _pipe_closed()
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        from vllm_ir.plugins.discovery import interrupted_plugin

        print(f"{prog}: {interrupted_plugin(exc) or 'interrupted'}", file=sys.stderr)
        return 130
    except Exception as exc:
        from vllm_ir.errors import VllmIrError
        from vllm_ir.settings.log import get_logger

        get_logger("cli").debug("%s failed", prog, exc_info=True)
        what = str(exc) if isinstance(exc, (VllmIrError, ValueError, TypeError)) else f"{type(exc).__name__}: {exc}"
        print(f"{prog}: error: {what.splitlines()[0] if what else type(exc).__name__}", file=sys.stderr)
        return 1
    finally:
        warnings.showwarning = shown


def _pipe_closed() -> int:
    """The reader of stdout left (``| head``): say nothing, as a shell tool, and exit 141.

    What is still buffered cannot be written; stdout is pointed at /dev/null so the
    interpreter's own flush at exit does not raise (and print) the same error again.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real stdout (captured): nothing to redirect
        pass
    return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
