"""How the conformance kit compares an implementation's results with native's, chosen per op.

Most ops compare every output within the op's per-dtype tolerance (``tolerance``, the default)
and an implementation may claim ``exact=True`` (zero tolerance). Ops may declare more with
`IrOp.set_comparison`:

- ``exact``: every implementation must match native bit for bit;
- ``dequantized``: for quantizing ops, whose kernels may legitimately round a few elements one
  fp8 step apart. The quantized outputs dequantize (``dequantize(args, outputs)``) to within
  ``atol + rtol * |x|`` of the input, at most ``max_mismatch`` of their elements differ from
  native's, and scales match native's within float32 tolerance wherever native's is above
  ``scale_floor(args)`` (below it providers floor differently; ``scale_rtol(args)`` widens
  their relative tolerance where a scale is the absmax of a value rounded to a narrower
  dtype, which moves by that dtype's ulp when the value's last bit does). An implementation that claims
  ``exact=True`` is held to bitwise equality instead.

Every mode also: compares only the first ``valid_rows(args)`` rows of the ``padded`` outputs
(the rest is unspecified padding), asserts the outputs have native's strides (column-major
scales stay column-major) where ``check_strides``, and, where ``layout_invariant``, that a
strided input gives byte-identical results to a contiguous copy of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor

from vllm_ir.errors import RegistrationError

Mode = Literal["tolerance", "exact", "dequantized"]
MODES: tuple[str, ...] = ("tolerance", "exact", "dequantized")


@dataclass(frozen=True)
class Comparison:
    """An op's comparison mode and its parameters (see the module docstring)."""

    mode: Mode = "tolerance"
    #: Output indices whose rows past ``valid_rows(args)`` are unspecified.
    padded: tuple[int, ...] = ()
    valid_rows: Callable[[tuple], int | None] | None = None
    check_strides: bool = False
    layout_invariant: bool = False
    #: dequantized mode: which outputs hold quantized values and which hold scales.
    quantized: tuple[int, ...] = ()
    scales: tuple[int, ...] = ()
    dequantize: Callable[[tuple, tuple[Tensor, ...]], Tensor] | None = None
    scale_floor: Callable[[tuple], float] | None = None
    #: dequantized mode: the scales' relative tolerance for these args (at least float32's).
    scale_rtol: Callable[[tuple], float] | None = None
    #: dequantized mode: the values q * scale approximates (default ``args[0]``, the input of a
    #: plain quant op; a fused op's is its unquantized intermediate, e.g. the normalized x).
    reference: Callable[[tuple], Tensor] | None = None
    rtol: float = 0.15
    atol: float = 0.01
    #: The fraction of quantized elements that may differ from native's.
    max_mismatch: float = 0.002

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise RegistrationError(f"comparison mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "dequantized" and (not self.quantized or self.dequantize is None):
            raise RegistrationError("a dequantized comparison needs quantized output indices and a dequantize function")
        for name in ("rtol", "atol", "max_mismatch"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < math.inf):
                raise RegistrationError(f"comparison {name} must be a finite number >= 0, got {value!r}")
        if self.padded and self.valid_rows is None:
            raise RegistrationError("a comparison with padded outputs needs valid_rows")

    @classmethod
    def dequantized(
        cls,
        *,
        quantized: tuple[int, ...],
        dequantize: Callable[[tuple, tuple[Tensor, ...]], Tensor],
        scales: tuple[int, ...] = (),
        scale_floor: Callable[[tuple], float] | None = None,
        valid_rows: Callable[[tuple], int | None] | None = None,
        **options: Any,
    ) -> Comparison:
        """The quantized-op mode: padded quantized outputs, native's strides, layout invariance."""
        return cls(
            "dequantized",
            padded=quantized if valid_rows is not None else (),
            valid_rows=valid_rows,
            check_strides=True,
            layout_invariant=True,
            quantized=quantized,
            scales=scales,
            dequantize=dequantize,
            scale_floor=scale_floor,
            **options,
        )
