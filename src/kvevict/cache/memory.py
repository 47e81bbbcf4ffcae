"""What a cache holds, in entries and in bytes: each layer counts its own storage (`LayerMemory`),
the cache sums them per kind of layer (`CacheMemory`, `summed`).

Memory saved is memory held: the bytes are those of the tensors a layer keeps (a quantized
form counts its codes, scales, zero points and residual), never a nominal ratio.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerMemory:
    """What one layer holds, as the layer itself counts it (`CacheLayer.memory`).

    `per_head` `[B][H_kv]` entries each (row, KV head) holds; bytes count keys and values
    as the storage holds them (a quantized form: codes, scales, zero points and its residual):
    `kv_bytes` the entries held, `full_kv_bytes` a full cache of
    the tokens seen, `allocated_kv_bytes` the buffers. `heads_differ`: the heads may hold
    different numbers of entries (per-head budgets).
    """

    per_head: list[list[int]]
    kv_bytes: int
    full_kv_bytes: int
    allocated_kv_bytes: int
    heads_differ: bool
    kv_bytes_bf16: int = 0  # `kv_bytes` with every floating-point number counted at 2 bytes (the deployment dtype)


@dataclass
class CacheMemory:
    """What a cache holds now, per kind of layer, against a full cache of the same stream.

    `held`: kind -> the most entries one layer of that kind holds (per row and KV head);
    `layers`: kind -> how many layers; bytes count keys and values of every layer, row
    and KV head as their storage holds them (the model's dtype, or a quantized form's codes,
    scales, zero points and residual; un-rotated key copies and statistics left out):
    `kv_bytes` the entries held, `allocated_kv_bytes` what the buffers take (held plus
    the slack a forward writes into). `per_head`: per layer, `[B][H_kv]` entries each
    head holds, when the heads hold different numbers (`adakv:P`), else None.
    """

    held: dict[str, int]
    layers: dict[str, int]
    kv_bytes: int
    full_kv_bytes: int
    allocated_kv_bytes: int = 0
    per_head: list[list[list[int]]] | None = None
    kv_bytes_bf16: int = 0  # `kv_bytes` with every floating-point number at 2 bytes (the deployment dtype)


def summed(kinds: Sequence[str], layers: Sequence, working_bytes: int = 0) -> CacheMemory:
    """The cache's figures from its layers (`kinds[i]`: layer `i`'s kind): what each answers (`memory()`,
    None before its first forward), summed; the most entries held per kind from each layer's `n`.
    `working_bytes`: the buffer the cache keeps for its storage-form layers to decode into
    (`storage/working.py`), allocated but not held entries: counted once, in `allocated_kv_bytes`."""
    held: dict[str, int] = {}
    counts: dict[str, int] = {}
    figures = []
    for kind, layer in zip(kinds, layers):
        counts[kind] = counts.get(kind, 0) + 1
        held[kind] = max(held.get(kind, 0), layer.n)
        answer = layer.memory()  # each layer counts its own storage
        if answer is not None:
            figures.append(answer)
    return CacheMemory(
        held=held,
        layers=counts,
        kv_bytes=sum(f.kv_bytes for f in figures),
        full_kv_bytes=sum(f.full_kv_bytes for f in figures),
        allocated_kv_bytes=sum(f.allocated_kv_bytes for f in figures) + working_bytes,
        per_head=[f.per_head for f in figures] if any(layer.heads_differ for layer in layers) else None,
        kv_bytes_bf16=sum(f.kv_bytes_bf16 for f in figures),
    )
