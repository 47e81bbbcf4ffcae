"""`qB` (`q8`, `q4`, `q2`): each entry's channels in groups of `group`, B-bit affine codes (HQQ's quantizer).

Per kept entry: the key's and value's packed codes (`D * bits / 8` bytes each), and `D / group` scales
and zero points each at the model's dtype (`hqq_codes.py`: per entry, so an entry's codes never depend
on what was quantized beside it).
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
    channels of one key) or `channel` (one channel over many tokens: KIVI's keys, refused under
    eviction since a group would span tokens evicted one by one). Values are grouped per token.
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
            raise KvevictError(f"quantization keys={self.keys} is not an axis: use keys=token (or keys=channel)")
        if self.keys == "channel":
            raise KvevictError(
                "keys=channel (KIVI's per-channel keys) groups one channel across many tokens, which an evicting "
                "cache removes one at a time: use keys=token (each key's channels grouped, as QuantizedCache does)"
            )

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

    def entry_bytes(self, head_dim: int, number: int) -> int:
        return 2 * (head_dim * self.bits // 8 + 2 * (head_dim // self.group) * number)  # key and value
