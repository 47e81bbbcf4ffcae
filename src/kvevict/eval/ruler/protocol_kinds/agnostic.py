"""`agnostic` (kvpress's, the default): the context compressed in one forward, the cache frozen, then the question.

The question is not known when the context is compressed: what a reused prefix cache
faces. It is also how the full cache answers under `aware` and `stream` (it evicts
nothing, so the three are one computation for it).
"""

from __future__ import annotations

from collections.abc import Sequence

from ...compress import Compressed
from ...reconstruction import KeptScores
from ..reading import prefill
from .base import Asked, Asking, Protocol


class Agnostic(Protocol):
    name = "agnostic"

    def read(self, asking: Asking, specs: Sequence[str], entries: int | None, defer: bool = False, tokenizer=None,
             kept: KeptScores | None = None) -> Compressed:
        """The context, compressed to `entries`."""
        return prefill(asking.model, asking.prompt.context, list(specs), entries, asking.positions, defer=defer,
                       tokenizer=tokenizer, kept=kept)

    def answer(self, asking: Asking, state: Compressed) -> list[Asked]:
        """The question after the frozen context."""
        state.cache.freeze(final=True)
        state.feed(asking.model, asking.prompt.question)
        return [(0, asking.decode(state, self.one_line(asking.prompt, 0)), state.kept)]
