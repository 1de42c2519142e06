"""Inputs the conformance kit feeds an implementation: a fixed grid plus property-based cases.

Everything op-specific comes from the op itself: its input generator and its named input
variants (``op.input_variants``, e.g. "no weight", "fp32 weight"). Layout variants
(3-D, zero tokens, odd hidden sizes, non-contiguous rows) are applied generically.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_ir.ir.op import IrOp

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FULL_TOKENS = (0, 1, 3, 64)
FULL_HIDDEN = (1, 7, 64, 4096, 5120)
#: For implementations that are slow here (the Triton interpreter runs ~3 ms per 4096-row).
SMALL_TOKENS = (0, 1, 3)
SMALL_HIDDEN = (1, 7, 64)


@dataclass(frozen=True)
class Case:
    """One generated call: shape, dtype, an input variant and a layout."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    variant: str = "default"
    options: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    #: Make every 2-D+ tensor argument a row-strided view (rows padded by this many elements).
    row_padding: int = 0
    seed: int = 0

    @property
    def id(self) -> str:
        dims = "x".join(map(str, self.shape))
        layout = f"-rowpad{self.row_padding}" if self.row_padding else ""
        return f"{dims}-{str(self.dtype).removeprefix('torch.')}-{self.variant}{layout}"

    def make_args(self, op: IrOp, device: str | torch.device = "cpu") -> tuple[Any, ...]:
        args = op.generate_inputs(self.shape, self.dtype, device, seed=self.seed, **self.options)
        if self.row_padding:
            args = tuple(row_strided(a, self.row_padding) for a in args)
        return args


def row_strided(value: Any, pad: int) -> Any:
    """The same values as a view whose rows are ``pad`` elements apart beyond their length."""
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return value
    wide = torch.zeros(*value.shape[:-1], value.shape[-1] + pad, dtype=value.dtype, device=value.device)
    view = wide[..., : value.shape[-1]]
    view.copy_(value)
    return view


def grid(op: IrOp, *, small: bool = False, dtypes: tuple[torch.dtype, ...] = DTYPES) -> Iterator[Case]:
    """The fixed grid: every dtype over tokens x hidden, then each variant and layout once or twice."""
    tokens = SMALL_TOKENS if small else FULL_TOKENS
    hidden = SMALL_HIDDEN if small else FULL_HIDDEN
    for dtype in dtypes:
        for t in tokens:
            for h in hidden:
                yield Case((t, h), dtype)
        yield Case((2, 3, 64), dtype, "3d")
        yield Case((5, 64), dtype, row_padding=16)
        for name, options in op.input_variants.items():
            for h in (7, 64):
                yield Case((3, h), dtype, name, options)


def property_strategy(op: IrOp, *, small: bool = False, dtypes: tuple[torch.dtype, ...] = DTYPES):
    """A hypothesis strategy of cases: odd sizes, zero tokens, 3-D, padded rows, every variant."""
    from hypothesis import strategies as st

    max_hidden = 96 if small else 1100
    variants = ["default", *op.input_variants]

    @st.composite
    def cases(draw):
        leading = draw(st.lists(st.integers(0, 6), min_size=1, max_size=2))
        hidden = draw(st.integers(1, max_hidden))
        variant = draw(st.sampled_from(variants))
        return Case(
            (*leading, hidden),
            draw(st.sampled_from(dtypes)),
            variant,
            dict(op.input_variants.get(variant, {})),
            row_padding=draw(st.sampled_from((0, 0, 5))),
            seed=draw(st.integers(0, 2**16)),
        )

    return cases()
