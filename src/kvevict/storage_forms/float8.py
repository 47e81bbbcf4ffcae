"""Float8 codes read back to floats through the float16 layout: torch's own cast, several times faster on a CPU.

torch converts float8 to float32 one element at a time on a CPU (no vector kernel: 2 ns per value here,
~27 ms per decode step for the 8.4M values of a 4,096-entry cache at Llama-3.1-8B's attention shape). Both
formats sit inside float16's layout, so the read is integer shifts, float16's vectorised cast and one
multiply (the same trick vLLM's CPU kernel uses: it "unpacks codes into an fp16 layout and folds the
exponent bias into the scale", csrc/cpu/cpu_attn_fp8.hpp):

* e5m2 is float16's upper byte: `code << 8`, exactly, infinities and NaNs included.
* e4m3 (bias 7) placed in float16's exponent and mantissa bits (bias 15), `sign << 15 | (code & 0x7F) << 7`,
  is the value times 2^-8, subnormals included (float16's subnormals are the same grid scaled by 2^-8); the
  scale is multiplied by 2^8 instead, which is exact in binary floats. The one difference from the cast:
  e4m3fn's NaN codes (0x7F, 0xFF) read as ±480, and no form writes them (every encoder saturates at ±448).

`tests/test_float8.py` holds every code of both formats, and codes times a scale, to torch's cast bit for bit.
"""

from __future__ import annotations

import torch

from .pieces import by_piece, cut

#: e4m3's exponent bias (7) below float16's (15): the factor folded into the scale
E4M3_SHIFT = 2.0**8


def to_float(codes: torch.Tensor, fmt: str, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`codes` (uint8, the float8 bytes, any shape) times `scale` (broadcast; its dtype is the product's,
    float32 or float64), equal to `codes.view(float8).to(scale.dtype) * scale`. Given `out` (the codes'
    shape, any strides: a part of a storage's working buffer), the result is written there, cast to its
    dtype after the product as without it; returns the result. On a CPU a large `out` is written a piece at
    a time (`pieces.by_piece`: the same numbers, each piece kept in a core's cache between the passes)."""
    if out is not None and cut(out):
        for piece, piece_codes, piece_scale in by_piece(out, codes, scale):
            to_float_at_once(piece_codes, fmt, piece_scale, piece)
        return out
    return to_float_at_once(codes, fmt, scale, out)


def to_float_at_once(codes: torch.Tensor, fmt: str, scale: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """`to_float` in one go: the widening, shift, mask, float16 cast and product over all of `codes`."""
    wide = codes.view(torch.int8).to(torch.int16)  # the sign extended: 0xFF80 | low 7 bits for a negative code
    if fmt == "e5m2":
        half, factor = wide.bitwise_left_shift_(8), scale
    elif fmt == "e4m3":
        # shifted by 7 the sign lands on bit 15 and its extension on bit 14, which is cleared: exponent 4 bits wide
        half, factor = wide.bitwise_left_shift_(7).bitwise_and_(~(1 << 14)), scale * E4M3_SHIFT
    else:
        raise ValueError(f"float8 format {fmt!r}: e4m3 or e5m2")
    if out is not None and out.dtype == scale.dtype:  # in place: float16 to float32 (64) is exact, one rounding
        return out.copy_(half.view(torch.float16)).mul_(factor)
    product = half.view(torch.float16).to(scale.dtype).mul_(factor)
    return product if out is None else out.copy_(product)  # cast after the product, as `.to(dtype)` after it
