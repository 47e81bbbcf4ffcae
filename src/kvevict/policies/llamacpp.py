"""`llamacpp` and `ollama`: llama.cpp's context shift (llama-server's, which Ollama runs).

What llama-server does when a generating slot is full (`tools/server/server-context.cpp`
of the llama.cpp vendored in llama-cpp-python 0.3.36, see `docs/engines.md`): before
decoding the next token, if `tokens held + 1 >= n_ctx`, it keeps `n_keep` tokens (`--keep`,
default 0; plus one when the vocabulary adds BOS; at most `n_ctx - 4`), discards half of
the rest (`n_discard = (held - n_keep) / 2`, at most `held - n_keep - 1`) and moves every
later token down by `n_discard` (keys re-rotated: positions stay contiguous, the cache's
own). So the most entries ever held is `n_ctx - 1` and a shift frees about half of them.

Here the budget is `n_ctx`. The shift of llama-server happens before the next decode; the
cache does it at the end of the forward that filled it, which no later token can tell
apart. `bos` says whether the model's vocabulary adds BOS (Gemma 3: 1, SmolLM2: 0); llama.cpp
reads it from the model (`n_keep += add_bos_token`, `llama_vocab_get_add_bos`), and so does
this preset by default: unset, it is what the model's tokenizer puts before a text
(`with_stream_start`, called where the tokenizer is known: the sweep, the CLI commands).
`bos=0|1` overrides it. The policy itself never sees the tokenizer, and llama.cpp's BOS rule is
exactly "one more kept token".
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import KvevictError
from .engine_preset import EnginePreset

#: llama-server clamps n_keep to n_ctx - 4
RESERVED = 4


@dataclass(eq=False)
class LlamaCpp(EnginePreset):
    keep: int = 0
    #: 1 when the model's vocabulary adds BOS; None: the model's, set by `with_stream_start`
    bos: int | None = None

    bounds_every_layer = True  # n_ctx cells hold every layer; SWA layers shift only with --swa-full

    def __post_init__(self) -> None:
        if self.keep < 0 or self.bos not in (None, 0, 1):
            raise KvevictError(
                f"'{self.spec()}': keep is a number of tokens >= 0 and bos is 0 or 1 (1 when the model's vocabulary "
                "adds BOS, as Gemma 3's does; leave it out to read it from the model)"
            )

    def name(self) -> str:
        return "llamacpp"

    def spec(self) -> str:
        return f"{self.name()}:keep={self.keep}" + ("" if self.bos is None else f",bos={self.bos}")

    def with_stream_start(self, adds_bos: bool) -> LlamaCpp:
        return replace(self, bos=int(adds_bos)) if self.bos is None else self

    def head(self) -> int:
        if self.bos is None:
            raise KvevictError(
                f"'{self.spec()}' reads add-BOS from the model's tokenizer, which this run does not know: write "
                f"bos=1 (the vocabulary adds BOS, as Gemma 3's does) or bos=0, or call "
                "policy.with_stream_start(bool(kvevict.data.stream_start(tokenizer)))"
            )
        return self.keep + self.bos

    def check_budget(self, budget: int) -> None:
        head = self.keep + (self.bos or 0)  # before the tokenizer is known: the least it keeps
        if head > budget - RESERVED:
            raise KvevictError(
                f"'{self.spec()}' keeps {head} tokens, but llama.cpp keeps at most n_ctx - {RESERVED} = "
                f"{budget - RESERVED} at budget (n_ctx) {budget}: lower keep or raise --budget to at least "
                f"{head + RESERVED}"
            )

    def evict_to(self, budget: int, held: int) -> int | None:
        if held + 1 < budget:
            return None
        left = held - self.head()
        discard = min(left // 2, max(0, left - 1))
        # a forward longer than the context (a prompt: llama-server refuses it, Ollama cuts it to fit)
        # keeps no more than a full context would
        return min(held - discard, budget - 1) if discard > 0 else None


@dataclass(eq=False)
class Ollama(LlamaCpp):
    """Ollama's default: llama-server with `--context-shift --keep 4` (`num_keep` 4, Ollama's default)."""

    keep: int = 4

    def name(self) -> str:
        return "ollama"
