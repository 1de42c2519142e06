"""What every ``vllm-ir`` verb accepts: dtypes, shapes, devices, token lists, output paths, op
names -- parsed once, and refused with a `UsageError` (one line on stderr, exit 2).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_ir.errors import VllmIrError

#: Activation dtypes the commands accept (the ops are floating-point ops).
FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")


#: Short names accepted wherever ``--dtype`` is (tables print ``bf16``, so people type it).
DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp64": "float64",
    "double": "float64",
}


DTYPE_HELP = f"{', '.join(FLOAT_DTYPES)} (or {', '.join(DTYPE_ALIASES)})"
#: Largest single dimension accepted from the command line.
MAX_DIM = 2**31 - 1


class UsageError(VllmIrError):
    """A command-line argument is wrong (or cannot be honoured here): one line on stderr, exit 2."""


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in text.lower().replace(",", "x").split("x") if d.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid shape {text!r}: expected sizes >= 0 such as 16x4096") from None
    if not shape or any(d < 0 or d > MAX_DIM for d in shape):
        raise argparse.ArgumentTypeError(
            f"invalid shape {text!r}: expected sizes between 0 and {MAX_DIM} such as 16x4096"
        )
    return shape


def parse_dtype(text: str) -> Any:
    import torch

    name = text.strip().lower().removeprefix("torch.")
    dtype = getattr(torch, DTYPE_ALIASES.get(name, name), None) if name else None
    if not isinstance(dtype, torch.dtype):
        hint = did_you_mean(name, [*FLOAT_DTYPES, *DTYPE_ALIASES])
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; accepted: {DTYPE_HELP}{hint}")
    if not dtype.is_floating_point or dtype.itemsize < 2:
        raise argparse.ArgumentTypeError(f"{text!r} is not a floating-point dtype the ops take; accepted: {DTYPE_HELP}")
    return dtype


def did_you_mean(name: str, choices: Sequence[str]) -> str:
    from vllm_ir.settings import env

    return env.did_you_mean(name, choices)


def parse_dtypes(text: str) -> list[Any]:
    names = comma_list(text)
    if not names:
        raise argparse.ArgumentTypeError(f"no dtype given; accepted: {', '.join(FLOAT_DTYPES)}")
    return list(dict.fromkeys(parse_dtype(n) for n in names))


def parse_device(text: str) -> str:
    """A torch device this machine has: ``cpu``, ``cuda``, ``cuda:1``, ..."""
    import torch

    available = available_devices()
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


def available_devices() -> list[str]:
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


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer between 1 and {MAX_DIM}, got {text!r}") from None
    if not 1 <= value <= MAX_DIM:
        raise argparse.ArgumentTypeError(f"expected an integer between 1 and {MAX_DIM}, got {text!r}")
    return value


def comma_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def positive_int_list(text: str) -> list[int]:
    items = comma_list(text)
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
    free = free_memory(device)
    if free is not None and need > free:
        shape_text = "x".join(map(str, shape))
        raise UsageError(
            f"{what}: a [{shape_text}] case needs about {format_bytes(need)} on {device}, "
            f"which has {format_bytes(free)} free; "
            "choose smaller sizes"
        )


def free_memory(device: str) -> int | None:
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


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} PiB"


def get_op(name: str, argument: str = "op") -> Any:
    """The op called ``name``; a usage error listing the known ops otherwise."""
    import vllm_ir
    from vllm_ir.settings import env

    try:
        return vllm_ir.ops.__getattr__(name)
    except AttributeError:
        known = sorted(op.name for op in vllm_ir.ops)
        hint = env.did_you_mean(name, known)
        raise UsageError(f"argument {argument}: unknown op {name!r}; known ops: {', '.join(known)}{hint}") from None
