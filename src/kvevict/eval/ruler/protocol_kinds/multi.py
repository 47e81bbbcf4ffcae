"""`multi`: one compressed context, several questions, each needing another key; three forms.

* `requests`: every question starts from the same compressed context (a copy of the
  frozen state).
* `turns`: a dialogue, each question after the previous answer, the budget enforced
  throughout (the cache is never frozen, so each budget reads its own prefill).
* `aware-requests` (SCBench's case): the first question (but its last token) is read
  after the context and the context compressed with it, the question pinned whole beside
  the budget (`policies/span.py`); the first request reads on from there, and every later
  one starts from the compressed context with the first question taken back out
  (`EvictingCache.crop`), as a prefix cache holding the context would serve it. What a
  query-aware policy kept for the first question is all the later ones get; the budget is
  a share of the context, as in `requests`. Like `aware`, it runs only policies that rank
  by attention, and not on a model with sliding-window layers (`check_model`).

The full cache runs each form's own read and answers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ....cache.model_info import layer_kinds, text_config
from ....errors import KvevictError
from ....policies.span import pin_span
from ...compress import Compressed
from ...reconstruction import KeptScores
from ..reading import prefill, snapshot
from ..sample import Prompt
from .agnostic import Agnostic
from .base import Asked, Asking


class Multi(Agnostic):
    """What the forms share: the questions are each key's, and a task must hide several."""

    name = "multi"
    asks_each_key = True

    def check_prompt(self, prompt: Prompt) -> None:
        if not prompt.per_key:
            raise KvevictError(f"protocol multi needs a task with several keys in one context, not "
                               f"{prompt.sample.task}: use niah_multikey_1/2/3 or niah_multiquery")


class MultiRequests(Multi):
    form = "requests"

    def answer(self, asking: Asking, state: Compressed) -> list[Asked]:
        """Each question from its own copy of the frozen context."""
        state.cache.freeze(final=True)
        out = []
        for q, ids in enumerate(asking.prompt.per_key):
            copy_state = snapshot(state) if q < len(asking.prompt.per_key) - 1 else state
            copy_state.feed(asking.model, ids)
            out.append((q, asking.decode(copy_state, self.one_line(asking.prompt, q)), state.kept))
        return out


class MultiTurns(Multi):
    form = "turns"
    shares_prefill = False

    def check_prompt(self, prompt: Prompt) -> None:
        super().check_prompt(prompt)
        if len(prompt.follow_ups) < len(prompt.per_key):
            raise KvevictError(
                "protocol multi --form turns asks its later questions as turns of a dialogue, and this tokenizer's "
                "chat template cannot render one (an answer followed by another question): use --form requests or "
                "aware-requests, or a model whose template renders a dialogue")

    def answer(self, asking: Asking, state: Compressed) -> list[Asked]:
        """A dialogue: each question after the previous answer, evicting throughout."""
        out = []
        prompt = asking.prompt
        for q, ids in enumerate([prompt.per_key[0], *prompt.follow_ups[1:]]):
            state.feed(asking.model, ids)
            out.append((q, asking.decode(state, self.one_line(prompt, q)), state.kept))
        return out


class MultiAwareRequests(Multi):
    form = "aware-requests"
    reads_question = True

    def pinned_span(self, prompt: Prompt) -> int:
        """The first question but its last token: read after the context, kept whole beside the budget, taken
        back out for the later requests."""
        return prompt.per_key[0].numel() - 1

    def check_model(self, model) -> None:
        """The first question is taken back out of the compressed state (`EvictingCache.crop`); a sliding-window
        layer holds only the model's last `W - 1` tokens, so reading the question pushed context out of it that
        the later requests would have seen."""
        text = text_config(model)
        if "sliding_attention" in layer_kinds(text, type(model).__name__):  # the kinds the cache gives its layers
            raise KvevictError(
                f"protocol multi --form aware-requests cannot run on {type(model).__name__}: its sliding-window "
                f"layers keep only the last {text.sliding_window - 1} tokens, so the first question would push out "
                "context the later requests need; use --form requests or turns, or a model without sliding-window "
                "layers"
            )

    def read(self, asking: Asking, specs: Sequence[str], entries: int | None, defer: bool = False, tokenizer=None,
             kept: KeptScores | None = None) -> Compressed:
        """The context and the first question but its last token, that question pinned whole beside the budget."""
        prompt = asking.prompt
        span, start = self.pinned_span(prompt), prompt.context.numel()
        if not span:  # a one-token question: nothing to pin, the context alone
            return super().read(asking, specs, entries, defer, tokenizer, kept)
        rows = [pin_span(spec, span, start) for spec in specs] if entries is not None else list(specs)
        return prefill(asking.model, torch.cat([prompt.context, prompt.per_key[0][:-1]]), rows,
                       None if entries is None else entries + span, asking.positions, defer=defer,
                       tokenizer=tokenizer, kept=kept)

    def answer(self, asking: Asking, state: Compressed) -> list[Asked]:
        """The first request reads on; every later one from the context with the first question cropped out."""
        prompt = asking.prompt
        state.cache.freeze(final=True)
        span = self.pinned_span(prompt)
        kept = state.kept - span  # the context's entries: the question is the request's, as in `requests`
        later = snapshot(state) if len(prompt.per_key) > 1 else None
        state.feed(asking.model, prompt.per_key[0][-1:])
        out = [(0, asking.decode(state, self.one_line(prompt, 0)), kept)]
        for q in range(1, len(prompt.per_key)):
            copy_state = snapshot(later) if q < len(prompt.per_key) - 1 else later
            copy_state.cache.crop(-span)  # the first question out: the context as it compressed it
            copy_state.feed(asking.model, prompt.per_key[q])
            out.append((q, asking.decode(copy_state, self.one_line(prompt, q)), kept))
        return out
