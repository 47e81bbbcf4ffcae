"""`qB` (`q8`, `q4`, `q2`): B-bit affine codes (HQQ's quantizer), values per token, keys per token or per channel.

Per kept entry: the key's and value's packed codes (`D * bits / 8` bytes each), and for the value (and
the key, `keys=token`) `D / group` scales and zero points at the model's dtype (`hqq_codes.py`: per
entry, so an entry's codes never depend on what was quantized beside it).

`keys=channel` is KIVI's key quantization (arXiv 2402.02750, section 3.3: keys per channel, since a few
channels carry outliers far larger than the rest, values per token): one scale and zero point per
channel over a block of `group` consecutive positions, taken once the whole block is older than the
`residual` (until then its keys are read at full precision). The block's scales stay valid for the
entries eviction leaves in it; the storage keeps them per block (`key_block`), not per entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import KvevictError
from . import hqq_codes
from .base import StorageForm

#: the bit widths the packed storage holds (two 4-bit or four 2-bit codes per byte)
BITS = (8, 4, 2)
#: the axes an entry's groups may run along (KIVI, arXiv 2402.02750, quantizes keys per channel)
KEY_AXES = ("token", "channel")


@dataclass(frozen=True)
class KvQuant(StorageForm):
    """How a quantized cache holds each entry.

    `bits`: code width (8, 4 or 2); `group`: channels sharing one scale and zero point (must divide
    the model's head_dim); `residual`: the most recent tokens read at full precision (as KIVI and
    transformers' `QuantizedCache` keep them); `keys`: the axis of a key's groups, `token` (the
    channels of one key) or `channel` (one channel over a block of `group` positions: KIVI's keys).
    Values are grouped per token. `keys=token` stays the default: a spec written `q4+P` keeps meaning
    what it measured.
    """

    family: ClassVar[str] = "q"

    bits: int = 4
    group: int = 32
    residual: int = 0
    keys: str = "token"

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise KvevictError(
                f"q{self.bits} is not a supported KV width: use q8, q4 or q2 (codes packed into bytes)"
            )
        if self.group < 1:
            raise KvevictError(f"quantization group={self.group} must be a positive number of channels, e.g. group=32")
        if self.residual < 0:
            raise KvevictError(f"quantization residual={self.residual} must be 0 or more recent tokens")
        if self.keys not in KEY_AXES:
            raise KvevictError(f"quantization keys={self.keys} is not an axis: use keys=token or keys=channel")

    def number(self) -> int:
        return self.bits

    def check_head_dim(self, head_dim: int) -> None:
        """Raise unless `group` divides the model's `head_dim` (a group never spans two entries)."""
        if head_dim % self.group:
            divisors = [g for g in (16, 32, 64, 128) if head_dim % g == 0]
            raise KvevictError(
                f"quantization group={self.group} does not divide this model's head_dim {head_dim}: "
                f"use a divisor, e.g. group={divisors[-1] if divisors else head_dim}"
            )

    def require(self) -> None:
        hqq_codes.require()

    def parts(self, head_dim: int, dtype: torch.dtype) -> dict[str, tuple[int, torch.dtype]]:
        groups = head_dim // self.group
        return {"codes": (head_dim * self.bits // 8, torch.uint8), "scale": (groups, dtype), "zero": (groups, dtype)}

    def encode(self, x: torch.Tensor, state: dict) -> dict[str, torch.Tensor]:
        held = hqq_codes.quantize(x, self.bits, self.group)
        return {"codes": held.codes, "scale": held.scale, "zero": held.zero}

    def decode(self, held: dict[str, torch.Tensor], dtype: torch.dtype, state: dict) -> torch.Tensor:
        return hqq_codes.dequantize(hqq_codes.Codes(**held), self.bits, self.group, dtype)

    def decode_into(self, held: dict[str, torch.Tensor], out: torch.Tensor, state: dict) -> None:
        hqq_codes.dequantize(hqq_codes.Codes(**held), self.bits, self.group, out.dtype, out)

    def entry_bytes(self, head_dim: int, number: int) -> int:
        codes, scales = head_dim * self.bits // 8, 2 * (head_dim // self.group) * number
        if self.key_block:  # the key's scales are its block's (`block_scales`), counted by the storage
            return 2 * codes + scales
        return 2 * (codes + scales)  # key and value

    # --- KIVI's keys (`keys=channel`): scales per channel over a block of `group` positions ------------
    @property
    def key_block(self) -> int:
        """Positions whose keys share a scale and zero point per channel: `group` for keys=channel, else 0."""
        return self.group if self.keys == "channel" else 0

    def key_parts(self, head_dim: int, dtype: torch.dtype) -> dict[str, tuple[int, torch.dtype]]:
        """Per slot, for keys: their codes alone under keys=channel (the scales are the block's)."""
        if not self.key_block:
            return self.parts(head_dim, dtype)
        return {"codes": (head_dim * self.bits // 8, torch.uint8)}

    def block_scales(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys of whole blocks `[B, H, blocks, group, D]` to each block's per-channel `scale` and `zero`
        `[B, H, blocks, D]`: HQQ's affine min/max (as `hqq_codes.quantize`), along the block's positions."""
        top = 2**self.bits - 1
        low, high = blocks.amin(3), blocks.amax(3)
        inverse = (top / (high - low)).clamp(max=2e4)  # HQQ's bound for a constant channel
        return 1.0 / inverse, -low * inverse

    def encode_keys(self, keys: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """Keys `[..., D]` with their blocks' `scale` and `zero` `[..., D]` to packed codes."""
        codes = (keys / scale + zero).round().clamp(0, 2**self.bits - 1)
        return hqq_codes.pack(codes.to(torch.uint8), self.bits)

    def decode_keys(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
        """Packed codes with their blocks' `scale` and `zero` `[..., D]` back to keys `[..., D]`."""
        return (hqq_codes.unpack(codes, self.bits, dtype) - zero) * scale
