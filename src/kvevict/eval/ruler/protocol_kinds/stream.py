"""`stream` (StreamingLLM's, H2O's): the budget holds from the first token, the question and answer read evicting.

The context is read in chunks, each token seeing what token-by-token eviction would
have kept (the cache's `per_token` replay, as in `eval/streaming.py`). Nothing is
compressed after a read, so each budget reads its own prefill (`shares_prefill` False).
The full cache reads as under `agnostic`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...compress import Compressed
from ...forward import body
from ...reconstruction import KeptScores
from ..reading import prefill
from .agnostic import Agnostic
from .base import Asked, Asking


class Stream(Agnostic):
    name = "stream"
    shares_prefill = False

    def read(self, asking: Asking, specs: Sequence[str], entries: int | None, defer: bool = False, tokenizer=None,
             kept: KeptScores | None = None) -> Compressed:
        if entries is None:
            return super().read(asking, specs, entries, defer, tokenizer, kept)
        return prefill(asking.model, asking.prompt.context, list(specs), entries, asking.positions, stream=True,
                       chunk=asking.stream_chunk)

    def answer(self, asking: Asking, state: Compressed) -> list[Asked]:
        """The question read in chunks, evicting, then the answer."""
        if state.budget is None:
            return super().answer(asking, state)
        question = asking.prompt.question
        with torch.inference_mode():
            for start in range(0, question.numel(), asking.stream_chunk):
                piece = question[start : start + asking.stream_chunk].long()
                state.hidden = body(asking.model, piece[None].expand(state.rows, -1), state.cache)[:, -1]
        return [(0, asking.decode(state, self.one_line(asking.prompt, 0)), state.kept)]
