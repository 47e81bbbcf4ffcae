"""`aware` (SnapKV's own setting): everything but the prompt's last token compressed, the question included.

A policy ranking by attention sees the question. Only policies whose kept set depends
on attention may run it (`protocols.check_aware`): for the others (window,
streamingllm, knorm, keydiff, random) it would only spend budget on the question's
tokens, and a table would show their `aware` row beside SnapKV's as if the question had
guided them. The full cache reads as under `agnostic`.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...compress import Compressed
from ...reconstruction import KeptScores
from ..reading import prefill
from ..sample import Prompt
from .agnostic import Agnostic
from .base import Asked, Asking


class Aware(Agnostic):
    name = "aware"
    reads_question = True

    def compressed_length(self, prompt: Prompt) -> int:
        """The prompt but its last token: what is compressed."""
        return prompt.tokens - 1

    def read(self, asking: Asking, specs: Sequence[str], entries: int | None, defer: bool = False, tokenizer=None,
             kept: KeptScores | None = None) -> Compressed:
        if entries is None:
            return super().read(asking, specs, entries, defer, tokenizer, kept)
        return prefill(asking.model, asking.prompt.ids[:-1], list(specs), entries, asking.positions, defer=defer,
                       tokenizer=tokenizer, kept=kept)

    def answer(self, asking: Asking, state: Compressed) -> list[Asked]:
        """The prompt's last token after the frozen state, then the answer."""
        if state.budget is None:
            return super().answer(asking, state)
        state.cache.freeze(final=True)
        state.feed(asking.model, asking.prompt.ids[-1:])
        return [(0, asking.decode(state, self.one_line(asking.prompt, 0)), state.kept)]
