"""`kvzip`: entries scored by context reconstruction (Kim et al., 2025, "KVzip: Query-Agnostic KV Cache
Compression with Context Reconstruction", arXiv 2505.23416), as kvpress's `KVzipPress` computes it
(NVIDIA/kvpress 0.5.5, `kvpress/presses/kvzip_press.py`).

Once a context is in the cache, the model is asked to repeat it: per chunk of `chunk_size` context
tokens (after the chat template's opening), a forward of "Repeat the previous context exactly." (for
later chunks: "Repeat the part of the previous context exactly, starting with" and the previous
chunk's last 8 tokens), the end of the user turn, and the chunk itself. Each layer's queries of that
forward attend over a window of the cache: the first `min(n_sink, chunk start)` entries, the chunk's
own entries, and the forward's tokens (causally), soft-maxed over that window only. A context entry's
score is the largest probability any of those queries gives it, over the queries of its KV head's
group. The repeat forward's own entries are taken back out after it, so it writes nothing; entries
no chunk covers (the template's opening past the sinks) score 0; the first `n_sink` always stay.

Budgets are not uniform: a layer's `KV heads x budget` entries go to its best entries of all heads
jointly, with no floor per head (kvpress: "KVzip does not rely on safeguards"), held for real in
ragged per-head storage as `adakv:` is (`cache/layers/per_head/`). With `layerwise=false` (kvpress's
default) all layers are ranked together: the model keeps its `layers x KV heads x budget` best
entries wherever they sit, so layers keep different numbers (`Policy.ranks_layers`).

This is not a per-step rule: the scores need extra forwards after the prefill. The policy holds the
arithmetic (`absorb`: the reconstruction window's maximum over one chunk; `scores`); the forwards
are `eval/reconstruction.py`, run where a context is compressed once (`kvevict.compress` with a
tokenizer, and through it needle, generation and lm-eval's loglikelihood; the RULER protocols that
compress a held-back prefill). A stream that evicts as it reads is refused (`Policy.reconstructs`),
and wrappers are refused: kvzip pins its own sinks and shares its budget across heads and layers itself.
On a hybrid model (Gemma 3) the sliding-window layers keep their window: the repeat forwards run
against a copy of them, and only the full-attention layers are scored, ranked and evicted.

Spec: `kvzip[:layerwise=false,n_sink=4,chunk_size=2048]` (kvpress's names). kvpress's
`kvzip_plus_normalization` is not built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import KvevictError
from .base import AttentionRequest, Policy, SlotView

#: the per-entry statistic: the largest reconstruction probability the entry got (0: never reconstructed)
STAT = "kvzip"


@dataclass(eq=False)
class KVzip(Policy):
    layerwise: bool = False
    n_sink: int = 4
    chunk_size: int = 2048

    stats = (STAT,)
    needs_attention = True
    requests = ("reconstruction",)
    varies_by_head = True
    reconstructs = True

    def __post_init__(self) -> None:
        if self.n_sink < 0:
            raise KvevictError(f"kvzip:n_sink must be >= 0, got {self.n_sink}")
        if self.chunk_size < 1:
            raise KvevictError(f"kvzip:chunk_size must be >= 1 context tokens a repeat forward, got {self.chunk_size}")

    @property
    def ranks_layers(self) -> bool:  # kvpress's default: every layer's entries ranked together
        return not self.layerwise

    def spec(self) -> str:
        return f"kvzip:layerwise={str(self.layerwise).lower()},n_sink={self.n_sink},chunk_size={self.chunk_size}"

    def head_floor(self, budget: int) -> int:
        return 0  # no safeguard: a head may keep nothing but its sinks

    def check_budget(self, budget: int) -> None:
        if budget <= self.n_sink:
            raise KvevictError(
                f"budget {budget} does not exceed kvzip's {self.n_sink} sinks: use a budget of at least "
                f"{self.n_sink + 1} or a smaller n_sink"
            )

    def request(self, view: SlotView, will_evict: bool) -> AttentionRequest:
        """The reconstruction window's attention (measured only during a repeat forward), `size` the sinks."""
        return AttentionRequest(kind="reconstruction", stat=STAT, size=self.n_sink, accumulate=False)

    def absorb(self, view: SlotView, request: AttentionRequest, mass: torch.Tensor) -> torch.Tensor:
        """`mass` `[b, H_kv, n]`: the chunk's entries' largest probability, NaN outside the chunk (those
        keep what an earlier chunk gave them)."""
        return torch.where(mass.isnan(), view.stats[STAT], mass)

    def scores(self, view: SlotView) -> torch.Tensor:
        """`[b, H_kv, n]` the reconstruction score; the first `n_sink` tokens `+inf` (kvpress gives them the
        highest score of all, so they stay wherever the cut falls)."""
        sink = (view.positions >= 0) & (view.positions < self.n_sink)
        return view.stats[STAT].masked_fill(sink, float("inf"))
