"""What llama-server's log says about its KV cache: the one place its KV bytes are visible.

From outside, llama-server declares its context (`/props`: `default_generation_settings.n_ctx` per slot,
`total_slots`; `/slots`: each slot's `n_ctx`), not what a cached token costs. Its log does, once at start
(src/llama-kv-cache.cpp, the `llama_kv_cache` constructor):

    llama_kv_cache: size =   22.50 MiB (  1024 cells,  30 layers,  1/1 seqs), K (f16):   11.25 MiB, V (f16):   11.25 MiB

`kv_cache_size` reads that line, so its bytes can be set beside kvevict's capacity arithmetic
(`capacity.py`) for the same KV type and context.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LINE = re.compile(r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers, +(\d+)/(\d+) seqs\), "
                   r"K \((\w+)\): +([\d.]+) MiB, V \((\w+)\): +([\d.]+) MiB")


@dataclass(frozen=True)
class LoggedKv:
    """One KV cache as llama-server logged it: cells (its context), layers, K and V types and MiB (2 decimals)."""

    cells: int
    layers: int
    seqs: int
    k_type: str
    k_mib: float
    v_type: str
    v_mib: float

    @property
    def mib(self) -> float:
        return self.k_mib + self.v_mib

    def as_dict(self) -> dict:
        return {"cells": self.cells, "layers": self.layers, "seqs": self.seqs, "k_type": self.k_type,
                "k_mib": self.k_mib, "v_type": self.v_type, "v_mib": self.v_mib}


def kv_cache_size(log: str) -> list[LoggedKv]:
    """Every KV cache llama-server's log text `log` reports (one per cache: a model with sliding-window layers logs
    its full-attention and its sliding caches apart), in order."""
    return [LoggedKv(int(cells), int(layers), int(seqs), k_type, float(k_mib), v_type, float(v_mib))
            for _, cells, layers, seqs, _, k_type, k_mib, v_type, v_mib in _LINE.findall(log)]
