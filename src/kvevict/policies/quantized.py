"""`qB+P`: policy P, its kept entries held as B-bit codes. A storage request, not a policy.

Quantization changes how each kept entry is stored, never which entries are kept, so it is a
wrapper that forwards every declaration to its inner policy unchanged and adds one: `kv_storage`,
the `KvQuant` settings the cache reads to give its layers a quantized storage form
(`cache/quantized.py`). Which tokens stay is the inner policy's decision, made on what attention
actually reads (the dequantized keys).

Spec: `q4+sink4+h2o`, `q8+full`, with options after the bits: `q4:group=64,residual=32+snapkv`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import KvevictError
from .base import Policy
from .capabilities import Capabilities, with_fields
from .wrapper import Wrapper

#: the bit widths the packed storage holds (two 4-bit or four 2-bit codes per byte)
BITS = (8, 4, 2)
#: the axes an entry's groups may run along (KIVI, arXiv 2402.02750, quantizes keys per channel)
KEY_AXES = ("token", "channel")


@dataclass(frozen=True)
class KvQuant:
    """How a quantized cache holds each entry.

    `bits`: code width (8, 4 or 2); `group`: channels sharing one scale and zero point (must divide
    the model's head_dim); `residual`: the most recent tokens read at full precision (as KIVI and
    transformers' `QuantizedCache` keep them); `keys`: the axis of a key's groups, `token` (the
    channels of one key) or `channel` (one channel over many tokens: KIVI's keys, refused under
    eviction since a group would span tokens evicted one by one). Values are grouped per token.
    """

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

    def prefix(self) -> str:
        """The spec's storage part: `q4`, or `q4:group=64,residual=32` when options differ from the defaults."""
        default = KvQuant(self.bits)
        options = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                   if f.name != "bits" and getattr(self, f.name) != getattr(default, f.name)]
        return f"q{self.bits}" + (":" + ",".join(options) if options else "")

    def check_head_dim(self, head_dim: int) -> None:
        """Raise unless `group` divides the model's `head_dim` (a group never spans two entries)."""
        if head_dim % self.group:
            divisors = [g for g in (16, 32, 64, 128) if head_dim % g == 0]
            raise KvevictError(
                f"quantization group={self.group} does not divide this model's head_dim {head_dim}: "
                f"use a divisor, e.g. group={divisors[-1] if divisors else head_dim}"
            )


@dataclass(eq=False)
class Quantized(Wrapper):
    """Policy `inner`, every entry it keeps held as `storage` asks."""

    storage: KvQuant
    inner: Policy

    def __post_init__(self) -> None:
        if self.inner.kv_storage is not None:
            raise KvevictError(f"'{self.spec()}' quantizes twice: write one qN+ prefix, e.g. {self.storage.prefix()}+"
                               f"<policy>")
        if self.inner.varies_by_head:
            raise KvevictError(
                f"'{self.spec()}': per-head layers (adakv) hold ragged segments that have no quantized storage form "
                f"yet: run {self.inner.spec()} unquantized, or quantize a uniform policy (e.g. q4+snapkv)"
            )

    def wrap(self, inner: Capabilities) -> Capabilities:
        """A storage form changes nothing about which entries stay: every declaration of the rule is the inner
        policy's; it adds how entries are held (`kv_storage`)."""
        return with_fields(super().wrap(inner), kv_storage=self.storage, pinned=inner.pinned,
                           unbounded=inner.unbounded, slot_local=inner.slot_local, preset=inner.preset,
                           bounds_every_layer=inner.bounds_every_layer, fifo_after=inner.fifo_after)

    def spec(self) -> str:
        return f"{self.storage.prefix()}+{self.inner.spec()}"

    def check_budget(self, budget: int) -> None:
        self.inner.check_budget(budget)
