"""The KV quantizer: HQQ's affine quantizer, its codes packed per entry. `quantize` / `dequantize`.

The split follows transformers' `QuantizedLayer` (`_quantize` / `_dequantize`, cache_utils.py): the
storage form (`cache/storage/quantized.py`) calls these two and never sees the library.

* Codes, scales and zero points come from HQQ's `Quantizer.quantize` (hqq/core/quantize.py), with
  `axis=1`: groups of `group` consecutive channels of one entry (one key or one value vector), the
  grouping transformers' `QuantizedCache` gets from HQQ with axis 1. HQQ's optimiser is left off:
  it stops on an error summed over the whole tensor handed to it, so an entry's codes would depend
  on which other entries were quantized in the same call, and a chunk would not equal its tokens
  one by one. Without it each group is plain min/max rounding, fixed by the entry alone.
* HQQ packs along a tensor's first dimension (`BitPack.pack_4bit_u8`: row `i` with row `i + rows/2`).
  Handed the codes channel-first, `[D, entries]`, it packs two (4-bit) or four (2-bit) channels of
  the same entry into a byte, so every entry's bytes stay its own and move with its slot.
* Dequantization is HQQ's formula, `(codes - zero) * scale`, on codes unpacked here (see `dequantize`
  for why and what it measured).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import KvevictError
from .pieces import by_piece, cut

#: bits the packed storage holds (HQQ packs 8, 4 and 2 bits into uint8; 3 and 1 bits go to int32 words)
SUPPORTED_BITS = (8, 4, 2)


def require():
    try:
        from hqq.core.bitpack import BitPack
        from hqq.core.quantize import Quantizer
    except ImportError:
        raise KvevictError(
            "quantized KV storage (q8+/q4+/q2+) needs HQQ's quantizer: pip install 'kvevict[quant]' (hqq)"
        ) from None
    return Quantizer, BitPack


@dataclass
class Codes:
    """Entries `[..., D]` as held: `codes` uint8 `[..., D * bits / 8]`, `scale` and `zero` `[..., D / group]`
    (the dtype of the entries)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor


def quantize(x: torch.Tensor, bits: int, group: int) -> Codes:
    """Quantize entries `x` `[..., D]` in groups of `group` channels to `bits` bits (packed per entry)."""
    quantizer, bitpack = require()
    lead, dim = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, dim)
    if flat.shape[0] == 0:
        empty = x.new_zeros(*lead, dim * bits // 8, dtype=torch.uint8)
        return Codes(empty, x.new_zeros(*lead, dim // group), x.new_zeros(*lead, dim // group))
    codes, meta = quantizer.quantize(
        flat, nbits=bits, channel_wise=True, group_size=group, optimize=False, axis=1, bitpack=False, device=x.device
    )  # codes [entries * D / group, group] (float), scale and zero [entries * D / group, 1]
    groups = dim // group
    return Codes(
        pack(codes.reshape(*lead, dim).to(torch.uint8), bits),
        meta["scale"].to(x.dtype).reshape(*lead, groups),
        meta["zero"].to(x.dtype).reshape(*lead, groups),
    )


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes uint8 `[..., D]` packed per entry, `[..., D * bits / 8]` (HQQ's `BitPack`)."""
    _, bitpack = require()
    lead, dim = codes.shape[:-1], codes.shape[-1]
    per_entry = codes.reshape(-1, dim).t()  # [D, entries]: one column per entry
    packed = {8: bitpack.pack_8bit_u8, 4: bitpack.pack_4bit_u8, 2: bitpack.pack_2bit_u8}[bits](per_entry)
    return packed.t().reshape(*lead, dim * bits // 8)


def unpack(codes: torch.Tensor, bits: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Packed codes `[..., D * bits / 8]` back to one code per channel `[..., D]`, in `dtype` (or written into
    `out` `[..., D]`, any strides, and returned)."""
    parts = [code_at(codes, shift, bits) for shift in _SHIFTS[bits]]
    if out is None:
        return torch.cat(parts, dim=-1).to(dtype)  # [..., D]: channel i of every byte, then channel i + D/k ...
    for part, place in zip(parts, out.chunk(len(parts), dim=-1), strict=True):
        place.copy_(part)
    return out


def code_at(codes: torch.Tensor, shift: int, bits: int) -> torch.Tensor:
    """The `bits`-wide code at bit `shift` of each byte of `codes` (uint8). The top code needs no mask (a
    uint8 shift brings in zeros) and the bottom one no shift: a pass over the codes spared for each."""
    low = codes >> shift if shift else codes
    return low if shift + bits == 8 else low & ((1 << bits) - 1)


#: where each packed code sits in its byte, first channels first (HQQ's `BitPack.pack_*_u8` layout)
_SHIFTS = {8: (0,), 4: (4, 0), 2: (6, 4, 2, 0)}


def dequantize(held: Codes, bits: int, group: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The entries `[..., D]` (in `dtype`) that `held` stands for: `(codes - zero) * scale` per group; given
    `out` (`[..., D]` in `dtype`, any strides: a storage's working buffer), written there in place, the
    same numbers without a tensor of the entries' size made on the way.

    Unpacked here in place of HQQ's `BitPack.unpack_*_u8` and `Quantizer.dequantize`, which expect the
    codes channel-first and would need two transposed copies per call: for 512 entries of SmolLM2's
    three KV heads (keys and values) this takes 0.15 ms against HQQ's 0.45 ms (same bits, checked equal
    in tests/test_quantized.py), and a decode step dequantizes every layer's entries. On a CPU a large `out`
    is written a piece at a time (`pieces.by_piece`: the same numbers, each piece kept in a core's cache
    between the unpacking and the arithmetic).
    """
    if out is not None and cut(out):
        for piece, codes, scale, zero in by_piece(out, held.codes, held.scale, held.zero):
            dequantize_at_once(Codes(codes, scale, zero), bits, group, dtype, piece)
        return out
    return dequantize_at_once(held, bits, group, dtype, out)


def dequantize_at_once(held: Codes, bits: int, group: int, dtype: torch.dtype, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """`dequantize` over all of `held` in one go."""
    codes = unpack(held.codes, bits, dtype, out)
    lead, dim = codes.shape[:-1], codes.shape[-1]
    if out is not None:
        grouped = out.unflatten(-1, (dim // group, group))  # a view: the arithmetic lands in `out`
        grouped.sub_(held.zero[..., None]).mul_(held.scale[..., None])
        return out
    grouped = codes.view(*lead, dim // group, group)  # [..., D / group, group]
    return ((grouped - held.zero[..., None]) * held.scale[..., None]).view(*lead, dim)
