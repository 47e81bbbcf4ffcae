"""`StorageForm`: how a cache holds each kept entry, as a spec prefix (`q4:group=64+`, `fp8+`) and a codec.

A form is settings (a frozen dataclass whose fields are its spec options, read off its constructor
like a policy's) plus the two halves of a codec, as transformers' `QuantizedLayer` splits a backend
into `_quantize` / `_dequantize`:

* `encode(x, state)`: entries `x` `[2, B, H, q, D]` (keys then values) to the per-slot tensors held for
  them, `{part: [2, B, H, q, width]}` (each part's width and dtype declared by `parts`);
* `decode(held, dtype, state)`: those tensors, for `n` slots, back to the entries `[2, B, H, n, D]`
  attention reads (`decode_into`: the same, written into a given tensor).

`state` is a dict the storage keeps for the layer (a form's numbers that are not per slot: fp8's
scales, calibrated on the first entries); `state_bytes` counts it. The storage (`cache/storage/quantized.py`)
moves the per-slot tensors with their slots, keeps the `residual` latest tokens at full precision, and
counts the bytes; the form never sees slots, policies or positions. Forms sit below the policies and
the cache: they import torch and their own library only.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch


class StorageForm:
    """Base of the registered forms (`storage_forms.FORMS`); subclasses are frozen dataclasses."""

    #: the spec's family word: `q` (`q8`, `q4`, `q2`), `fp` (`fp8`); the number after it is the width. A word
    #: with a variant (`q_0`) is written with the number before the variant (`q8_0`, `q4_0`)
    family: ClassVar[str] = ""
    #: the most recent tokens read at full precision (a form with a `residual` option overrides it)
    residual: int = 0
    #: keys encoded per channel over blocks of this many positions (`integer.KvQuant`, keys=channel: its
    #: `key_parts`, `block_scales`, `encode_keys`, `decode_keys`), or 0: keys encoded per entry like values
    key_block: int = 0

    @property
    def chunk_exact(self) -> bool:
        """Whether a forward of many tokens reads what its tokens read one per forward. Encoding is per
        entry, so it is, unless something is counted at a forward's end: the `residual` (a chunk's own
        tokens older than it are read as images, where one per forward each was read at full precision
        while it was recent) or a key block (taken once whole, so the chunk's later tokens read it as
        images before its last token is in). Where it is not, a stream is read one token per forward."""
        return self.residual == 0 and self.key_block == 0

    @property
    def width(self) -> str:
        """What a report tells storage widths apart by: the family and its number (`q4`, `fp8`), the number
        written before a family's variant (family `q_0`: `q8_0`, as ggml names its types)."""
        word, underscore, variant = self.family.partition("_")
        return f"{word}{self.number()}{underscore}{variant}"

    def number(self) -> int:
        """The number written after the family (bits per code)."""
        raise NotImplementedError

    def prefix(self) -> str:
        """The spec's storage part: `q4`, or `q4:group=64,residual=32` when options differ from the defaults."""
        default = type(self)(self.number())
        first = dataclasses.fields(self)[0].name  # the width field, written as the number
        options = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                   if f.name != first and getattr(self, f.name) != getattr(default, f.name)]
        return self.width + (":" + ",".join(options) if options else "")

    def check_head_dim(self, head_dim: int) -> None:
        """Raise a `KvevictError` naming the fix unless the form can hold this model's entries."""

    def require(self) -> None:
        """Raise a `KvevictError` naming the install unless the form's library is there."""

    def parts(self, head_dim: int, dtype: torch.dtype) -> dict[str, tuple[int, torch.dtype]]:
        """Per slot, for keys and for values alike: each held part's width and dtype."""
        raise NotImplementedError

    def key_parts(self, head_dim: int, dtype: torch.dtype) -> dict[str, tuple[int, torch.dtype]]:
        """Per slot, for keys: the same parts as values unless keys are encoded per block."""
        return self.parts(head_dim, dtype)

    def encode(self, x: torch.Tensor, state: dict) -> dict[str, torch.Tensor]:
        """Entries `x` `[2, B, H, q, D]` to their held parts `{part: [2, B, H, q, width]}`."""
        raise NotImplementedError

    def decode(self, held: dict[str, torch.Tensor], dtype: torch.dtype, state: dict) -> torch.Tensor:
        """Held parts `{part: [2, B, H, n, width]}` back to the entries `[2, B, H, n, D]` in `dtype`."""
        raise NotImplementedError

    def decode_into(self, held: dict[str, torch.Tensor], out: torch.Tensor, state: dict) -> None:
        """`decode` written into `out` `[2, B, H, n, D]` (a part of the storage's working buffer, any
        strides, its dtype the entries'). A form whose arithmetic can write there directly overrides this
        with the same numbers (`tests/test_working_buffer.py` holds every form to `decode`), and saves a
        fresh tensor of the cache's size per layer and step."""
        out.copy_(self.decode(held, out.dtype, state))

    def entry_bytes(self, head_dim: int, number: int) -> int:
        """Bytes held per entry (its key and its value), floating-point parts counted at `number` bytes."""
        raise NotImplementedError

    def state_bytes(self, state: dict) -> int:
        """Bytes of the layer's numbers that are not per slot (none by default)."""
        return 0
