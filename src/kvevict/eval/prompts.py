"""Prompt framing shared by the retrieval and generation tasks.

Both tasks put a long piece of text inside one user turn of the model's chat template
and ask a question at the end. The template is rendered once around a marker and
split, so the long text can be spliced in as token ids (it is tokenised once, not once
per prompt). A tokenizer without a chat template gets a plain `Question: / Answer:`
prompt instead, and the caller is told so through `Frame.chat`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data import stream_start, tokenize

_MARKER = "\u2063KVEVICT\u2063"


@dataclass
class Frame:
    """Token ids before the user's text, and the text that closes the turn after the question."""

    before: torch.Tensor
    after: str
    chat: bool


def frame(tokenizer) -> Frame:
    """The chat template split around the user's content, or a plain-prompt fallback."""
    template = getattr(tokenizer, "chat_template", None)
    if template:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": _MARKER}], tokenize=False, add_generation_prompt=True
        )
        if isinstance(rendered, str) and rendered.count(_MARKER) == 1:
            head, tail = rendered.split(_MARKER)
            return Frame(tokenize(head, tokenizer), tail, True)
    # what the tokenizer puts before a text (Gemma's BOS), as every stream starts: a tokenizer's
    # `add_bos_token` flag can say False while it adds BOS all the same (Gemma's from GGUF)
    return Frame(torch.tensor(stream_start(tokenizer), dtype=torch.long), "\nAnswer:", False)


def question_ids(question: str, tokenizer, shape: Frame) -> torch.Tensor:
    """Token ids of the question that follows the long text, and the end of the turn."""
    text = f"\n\n{question}" if shape.chat else f"\n\nQuestion: {question}"
    return tokenize(text + shape.after, tokenizer)


def stop_ids(tokenizer) -> list[int]:
    """Tokens that end an answer: the end-of-sequence token (the chat turn's end for chat models)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for name in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
        token = tokenizer.convert_tokens_to_ids(name) if name in tokenizer.get_vocab() else None
        if token is not None:
            ids.add(token)
    return sorted(ids)


def _ends_sentence(token: str) -> bool:
    return any(mark in token for mark in (".", "?", "!"))


def sentence_start(tokens: list[str], index: int) -> int:
    """The nearest index at or before `index` that starts a sentence (after a token holding '.', '?' or '!').

    Splicing a sentence in at a sentence boundary keeps the haystack grammatical. The two
    ends are kept as they are (depth 0 and depth 1 mean first and last), and with no
    boundary before `index`, `index` itself is used.
    """
    if index <= 0 or index >= len(tokens):
        return index
    for i in range(index, 0, -1):
        if _ends_sentence(tokens[i - 1]):
            return i
    return index


def filler(corpus: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """`count` corpus tokens from `start`, wrapping around the end of the corpus."""
    index = (torch.arange(count) + start) % corpus.numel()
    return corpus[index]


def essay_span(corpus: torch.Tensor, tokenizer, start: int, count: int, look: int = 200) -> torch.Tensor:
    """`count` corpus tokens beginning at the first sentence start at or after `start`
    (within `look` tokens), so a prompt never opens in the middle of a sentence."""
    start %= corpus.numel()
    if start == 0:
        return filler(corpus, 0, count)
    # previous[i] is the token just before start + i
    previous = tokenizer.convert_ids_to_tokens(filler(corpus, start - 1, look).tolist())
    skip = next((i for i, token in enumerate(previous) if _ends_sentence(token)), 0)
    return filler(corpus, start + skip, count)
