"""What a protocol is: how a prompt meets a bounded cache, as one object.

A protocol says what is read before the first question (`read`: the context, or more),
how each question is then asked and answered from that state (`answer`), which
questions it asks of a sample (`questions`), what a budget is a share of
(`compressed_length`), whether one prefill can serve every budget (`shares_prefill`)
and whether a question is compressed with the context (`reads_question`, which runs
only policies that rank by attention). The engine (`protocols.answer_budgets`) calls
these and never asks which protocol it holds. The full cache (`entries` None, a state
whose `budget` is None) runs through the same two methods.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ...compress import Compressed
from ...reconstruction import KeptScores
from ..sample import Prompt, Question, Sample

#: one question's answers: (its number, each row's answer ids, the entries each row held for it)
Asked = tuple[int, list[list[int]], int]


@dataclass
class Asking:
    """What a protocol reads and answers with: the model, its tokenizer, the prompt, how the cache reads.

    `decode(state, first_line)` is the engine's greedy decoder (`protocols.decode`, the task's
    answer length and stop tokens bound in): each row's answer ids.
    """

    model: object
    tokenizer: object
    prompt: Prompt
    positions: str
    stream_chunk: int
    decode: Callable[[Compressed, bool], list[list[int]]]


class Protocol:
    """One protocol. Class attributes declare what callers ask; `read` and `answer` are each protocol's own."""

    name: str = ""  # what `--protocol` names
    form: str | None = None  # `--form`, for a protocol that has forms (multi); None otherwise
    shares_prefill: bool = True  # one read of the context serves every budget (it is compressed after it)
    reads_question: bool = False  # a question is compressed with the context: attention-ranked policies only
    asks_each_key: bool = False  # its questions are each hidden key's (`Sample.per_key`), one at a time

    @property
    def label(self) -> str:
        """How records and tables name it: `agnostic`, `multi-requests`, ..."""
        return self.name if self.form is None else f"{self.name}-{self.form}"

    @property
    def described(self) -> str:
        """How a message names it, as the command line spells it."""
        return f"protocol {self.name}" if self.form is None else f"protocol {self.name} --form {self.form}"

    def questions(self, sample: Sample) -> list[Question]:
        """The questions asked of a sample, in the order their answers are numbered."""
        return sample.per_key if self.asks_each_key else [sample.question]

    def one_line(self, prompt: Prompt, question: int) -> bool:
        """Whether an answer is read to the end of its first line: its question has one reference (a list may
        run over several lines, one item a line) and is not judged by how it ends (`Question.reads_whole`)."""
        asked = self.questions(prompt.sample)[question]
        return len(asked.answers) == 1 and not asked.reads_whole

    def compressed_length(self, prompt: Prompt) -> int:
        """The tokens a budget share is taken of: the context."""
        return prompt.context.numel()

    def pinned_span(self, prompt: Prompt) -> int:
        """Tokens read after the context and kept whole beside the budget (none here)."""
        return 0

    def check_model(self, model) -> None:
        """Refuse a model the protocol cannot run on (every model runs here)."""

    def check_prompt(self, prompt: Prompt) -> None:
        """Refuse a prompt the protocol cannot ask (every prompt here)."""

    def read(self, asking: Asking, specs: Sequence[str], entries: int | None, defer: bool = False, tokenizer=None,
             kept: KeptScores | None = None) -> Compressed:
        """What is read before the first question, for the rows `specs` at `entries` (None: the full cache).
        `defer`: hold the eviction back (`reading.prefill`) where one read serves several budgets."""
        raise NotImplementedError

    def answer(self, asking: Asking, state: Compressed) -> list[Asked]:
        """Every question's answers from the state `read` left."""
        raise NotImplementedError
