"""The conversation workload (`eval/conversation.py`) as two tasks of the grid: a fact recalled, the rule followed.

StreamingLLM's deployment case, run through kvevict's own cache under any protocol: a
system instruction and facts early, many filler turns, questions late.

* `conversation_fact`: the facts stated in the first turns, asked for at the end; right
  when the answer holds the fact's value. One question, the first fact (the earliest
  text), or under `multi` every fact, one at a time.
* `conversation_instruction`: an unrelated question at the end, whose answer must still
  follow the system rule (end with the marker word); read to the end of the turn.

A sample is one conversation rendered by the tokenizer's own chat template: the context
is the system message and every (user, scripted assistant) turn, a question is the probe
as the next user turn with the assistant's turn opened. Haystack units are filler turns:
`fit` finds the most that fit the length, as for RULER's tasks. Filler is cut from the
embedded essays whatever `--text` says (the workload is the one a deployment audit sends).
A tokenizer without a chat template is refused: a conversation is its template.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from ...data import tokenize
from ...errors import KvevictError
from ..conversation import Conversation, Probe, build_conversation, messages, score
from .framing import Framing
from .sample import Prompt, Question, RulerTask, Sample


@dataclass
class ConversationSample(Sample):
    """A sample whose context is a conversation (`head` is its system instruction, for reading)."""

    conversation: Conversation | None = None


def _render(tokenizer, chat: list[dict[str, str]], opened: bool) -> str:
    return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=opened)


@dataclass(frozen=True)
class ConversationTask(RulerTask):
    """One kind of probe (`probe`: "fact" or "instruction") asked after a conversation of `facts` fact turns and
    as many filler turns of `words_per_turn` essay words as fit."""

    name: str
    probe: str
    tokens_to_generate: int
    family: str = "conversation"
    facts: int = 3
    words_per_turn: int = 60

    @property
    def metric(self) -> str:
        return self.probe  # scored by `conversation.score`, not by a RULER metric

    @property
    def asks_several(self) -> bool:
        return self.probe == "fact" and self.facts > 1

    def build(self, units: int, index: int, length: int, rng: random.Random, material=None) -> Sample:
        conversation = build_conversation(rng.getrandbits(63), self.facts, self.facts + units, self.words_per_turn)
        probes = [p for p in conversation.probes if p.kind == self.probe]
        asked = [Question(p.question, "", [p.answer], reads_whole=p.kind == "instruction") for p in probes]
        if self.probe == "fact":  # where each fact was stated: its turn's share of the conversation
            stated = [user for user, _ in conversation.turns[: self.facts]]
            depths = [i / len(conversation.turns) for i in range(self.facts)]
        else:
            stated, depths = [conversation.system], [0.0]
        return ConversationSample(self.name, index, conversation.system, asked[0], asked if len(asked) > 1 else [],
                                  stated, depths, units, conversation=conversation)

    def prompt(self, sample: Sample, length: int, framing: Framing) -> Prompt:
        """The conversation in the tokenizer's chat template: the history as the context, each probe as the next
        user turn with the assistant's turn opened (the text the template adds for it, so context + question is
        exactly what the template renders for the whole chat)."""
        tokenizer, conversation = framing.tokenizer, sample.conversation
        if not framing.chat:
            raise KvevictError(f"task {self.name} is a chat conversation and this tokenizer has no chat template: "
                               "use a chat model, or a RULER task (niah_single_1, ...)")
        probes = [Probe(q.text, q.answers[0], self.probe) for q in [sample.question, *sample.per_key]]
        history = messages(conversation, probes[0])[:-1]
        context = _render(tokenizer, history, opened=False)
        asked = []
        for probe in probes:
            whole = _render(tokenizer, messages(conversation, probe), opened=True)
            if not whole.startswith(context):
                raise KvevictError(f"this tokenizer's chat template renders the history of a conversation "
                                   f"differently once another turn follows, so task {self.name} has no context to "
                                   "compress apart from its question: use a RULER task")
            asked.append(tokenize(whole[len(context):], tokenizer))
        follow_ups = ([framing.question_ids(q, first=False) for q in sample.per_key]
                      if framing.turn is not None else [])
        return Prompt(sample, length, tokenize(context, tokenizer), asked[0], asked[1:], follow_ups,
                      self.tokens_to_generate)

    def score(self, answer: str, references: Sequence[str]) -> float:
        """1 when the answer passes the probe (`conversation.score`), else 0."""
        return float(score(Probe("", references[0], self.probe), answer))


TASKS = [
    ConversationTask("conversation_fact", "fact", tokens_to_generate=32),
    ConversationTask("conversation_instruction", "instruction", tokens_to_generate=128),
]
