"""RULER prompts inside the model's chat template, as token ids.

The user turn holds the task's text (instruction, context, question); the assistant
turn opens with RULER's answer prefix, so the model continues it (RULER's `template +
answer_prefix`). The leading space of the prefix is dropped after a chat template's
newline. A tokenizer without a chat template gets RULER's `base` template: the text and
the prefix, nothing around them. `turn` is the text between an answer and the next
question of a dialogue (the `multi` protocol's `turns` form), None where the chat template
cannot render one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...data import stream_start, tokenize
from ..prompts import frame

_A, _B = "\u2063KVA\u2063", "\u2063KVB\u2063"


@dataclass
class Framing:
    """How one tokenizer wraps a RULER prompt."""

    tokenizer: object
    before: torch.Tensor  # ids before the user's text
    after: str  # the end of the user turn and the start of the answer
    turn: str | None  # between an answer and the next question; None: the template renders no dialogue
    chat: bool

    def context_ids(self, head: str) -> torch.Tensor:
        return torch.cat([self.before, tokenize(head, self.tokenizer)])

    def question_ids(self, question, first: bool = True) -> torch.Tensor:
        text = question.text if first else self.turn + question.text.lstrip()
        prefix = question.answer_prefix.lstrip() if self.chat else question.answer_prefix
        return tokenize(text + self.after + prefix, self.tokenizer)


def framing(tokenizer) -> Framing:
    """The framing of `tokenizer`: its chat template when it has one, else RULER's plain `base` template."""
    shape = frame(tokenizer)
    if not shape.chat:
        start = torch.tensor(stream_start(tokenizer), dtype=torch.long)
        return Framing(tokenizer, start, "", "\n", False)
    return Framing(tokenizer, shape.before, shape.after, dialogue_turn(tokenizer), True)


def dialogue_turn(tokenizer) -> str | None:
    """The chat template's text between an answer and the next question, or None where the template cannot
    render a dialogue: it refuses one (a template's `raise_exception` raises jinja2's `TemplateError`) or
    renders the answer other than once. None leaves the prompts without follow-up turns, and
    `multi --form turns`, the one protocol that asks them, refuses the tokenizer (`MultiTurns.check_prompt`)."""
    from jinja2 import TemplateError

    try:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": _A}, {"role": "user", "content": _B}],
            tokenize=False, add_generation_prompt=True,
        )
    except TemplateError:
        return None
    if isinstance(rendered, str) and rendered.count(_A) == 1 and rendered.count(_B) == 1:
        return rendered.split(_A)[1].split(_B)[0]
    return None
