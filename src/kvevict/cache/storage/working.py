"""`WorkingBuffer`: the one buffer a cache's storage-form layers decode their held entries into.

A storage form (`quantized.QuantizedStorage`) holds codes between forwards; in a forward each layer
decodes them into a working copy `kv` `[2, B, H, capacity, D]` that attention and the policies read, and
drops it when the layer is done (`release`). A fresh copy per layer and step costs more than the decode
itself on a CPU: at Llama-3.1-8B's attention shape (4,096 entries) the copy is 34 MB, which the
allocator maps and the first write faults in page by page: about 9 ms per layer and step, where a
DynamicCache step at that shape takes 16 ms (docs/benchmarks.md, decode at real shapes). Layers run one
after another, so one buffer serves them all: the cache keeps it and lends it to one layer at a time, as
an engine keeps one compute buffer (llama.cpp reserves its graph's buffers once; vLLM its workspace).

It is held between forwards, so it is counted: `bytes` is one layer's working copy, which the cache
adds once to its allocated bytes (`cache.memory`), never to the entries it holds. A lend to a second
layer while the first still holds it (a layer that holds its copy past its attention: a compression's
held-back eviction) is refused and that layer decodes into a fresh copy of its own, so no layer's
entries are ever overwritten by another's. A buffer grown for a long forward (a chunked prefill's
whole context) shrinks back once the layer it was sized for needs less than half of it (as
`SlotStorage.fit` gives back a layer's buffers); a smaller layer (Gemma 3's sliding ones beside its
global ones) reads a part of it and never shrinks it, so layers of two sizes do not take turns
reallocating it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


class WorkingBuffer:
    """One flat buffer, lent whole to one holder at a time (see the module docstring)."""

    def __init__(self) -> None:
        self._flat: torch.Tensor | None = None
        self._holder: object | None = None
        self._sized_for: object | None = None  # the holder whose need set the size

    def lend(self, holder: object, shapes: Sequence[tuple[int, ...]], dtype: torch.dtype,
             device: torch.device) -> list[torch.Tensor] | None:
        """Tensors of `shapes` (uninitialised) inside the buffer, now lent to `holder`; None while another
        holder has it."""
        if self._holder is not None and self._holder is not holder:
            return None
        sizes = [math.prod(shape) for shape in shapes]
        need = sum(sizes)
        flat = self._flat
        shrinks = holder is self._sized_for and flat is not None and flat.numel() > 2 * need
        if flat is None or flat.dtype != dtype or flat.device != device or flat.numel() < need or shrinks:
            self._flat = None  # the old one goes before the new one is made: never two at once
            self._flat = flat = torch.empty(need, dtype=dtype, device=device)
            self._sized_for = holder
        self._holder = holder
        lent, at = [], 0
        for shape, size in zip(shapes, sizes, strict=True):
            lent.append(flat[at:at + size].view(shape))
            at += size
        return lent

    def lent_to(self, holder: object) -> bool:
        """Whether `holder` has the buffer now."""
        return self._holder is holder

    def give_back(self, holder: object) -> None:
        """`holder` is done with what it was lent (nothing happens for anyone else)."""
        if self._holder is holder:
            self._holder = None

    def bytes(self) -> int:
        """Bytes the buffer holds now."""
        return 0 if self._flat is None else self._flat.numel() * self._flat.element_size()

    def __deepcopy__(self, memo: dict) -> WorkingBuffer:
        return WorkingBuffer()  # a copied cache decodes into a buffer of its own (two caches, two threads)
