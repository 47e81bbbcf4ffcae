"""The conversation workload: a system rule and facts early, many turns, questions late.

StreamingLLM's deployment case: a chat whose history grows past the cache's budget.
What a bounded cache may lose is what came first: the system instruction (a checkable
rule: every reply ends with one word, the marker) and the facts the user stated in the
first turns. The probes ask for each fact, and ask an unrelated question whose reply
must still follow the rule, after many filler turns.

Text only, no tokenizer: `messages` gives OpenAI chat messages, which a server takes as
they are and a local run renders with the tokenizer's chat template. The assistant's
replies in the history are scripted (teacher-forced), and follow the rule as a real
assistant's would. Everything is drawn from a `random.Random(seed)` of its own: the same
seed gives the same conversation. Filler passages are cut from the embedded essays, the
marker and the facts' subjects from wonderwords' word lists (read as files, as RULER's).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from ..data import load_text
from ..errors import KvevictError
from .ruler.words import adjectives, nouns

SYSTEM = ("You are a helpful assistant. Always end every reply with the word {marker}, in capital letters, "
          "as its very last word.")
FACT = "Please remember this for later: the {attribute} of {subject} is {value}."
FACT_REPLY = "Noted: the {attribute} of {subject} is {value}. {marker}"
FILLER = "Here is a passage from an essay I am reading:\n{passage}\nWhat is it about, briefly?"
FILLER_REPLY = "It is about this: {gist} ... {marker}"
FACT_QUESTION = "What is the {attribute} of {subject} that I told you at the start? Answer with the value."
RULE_QUESTION = "Which of the passages I sent you did you find the most interesting, and why?"
#: what a fact is about (every value a 7-digit number, so a reply contains it or does not)
ATTRIBUTES = ("locker code", "flight number", "room number", "parcel code", "badge number", "account number")


@dataclass(frozen=True)
class Probe:
    """One late question and what a correct reply holds."""

    question: str  # asked late in the conversation
    answer: str  # what a correct reply contains (a fact's value, or the instruction's marker)
    kind: str  # "fact" (recall of a fact stated early) or "instruction" (the system rule followed)


@dataclass(frozen=True)
class Conversation:
    """The system instruction, the scripted history, and the probes asked after it."""

    system: str  # the system instruction (a checkable rule: a word every reply ends with)
    turns: tuple[tuple[str, str], ...]  # (user, assistant) pairs: facts early, then filler turns
    probes: tuple[Probe, ...]


def _check(facts: int, turns: int, words_per_turn: int) -> None:
    if facts < 0 or words_per_turn < 1:
        raise KvevictError(f"a conversation needs facts >= 0 and words per turn >= 1 (got facts={facts}, "
                           f"words_per_turn={words_per_turn}): give counts in those ranges")
    if turns < max(facts, 1):
        raise KvevictError(f"a conversation of {turns} turns cannot state {facts} facts (one turn each): "
                           f"give at least {max(facts, 1)} turns, or fewer facts")


def _plain(words: list[str]) -> list[str]:
    """The list's one-word entries (no hyphen, no space), sorted: a marker is one word for `score`."""
    return sorted({w for w in words if w.isalpha()})


def _subjects(count: int, rng: random.Random) -> list[str]:
    """`count` distinct subjects, `project adjective-noun`."""
    adj, noun = _plain(adjectives()), _plain(nouns())
    found: list[str] = []
    while len(found) < count:
        subject = f"project {rng.choice(adj)}-{rng.choice(noun)}"
        if subject not in found:
            found.append(subject)
    return found


def build_conversation(seed: int, facts: int = 3, turns: int = 12, words_per_turn: int = 60) -> Conversation:
    """A conversation of `turns` (user, assistant) pairs: `facts` fact turns first, then filler.

    Each filler turn's user message holds `words_per_turn` words of essay text. The probes:
    one question per fact, in the order stated, then one rule question (`kind="instruction"`).
    """
    _check(facts, turns, words_per_turn)
    rng = random.Random(seed)
    marker = rng.choice(_plain(nouns())).upper()
    history: list[tuple[str, str]] = []
    probes: list[Probe] = []
    for subject in _subjects(facts, rng):
        attribute, value = rng.choice(ATTRIBUTES), str(rng.randint(10**6, 10**7 - 1))
        stated = dict(attribute=attribute, subject=subject, value=value, marker=marker)
        history.append((FACT.format(**stated), FACT_REPLY.format(**stated)))
        probes.append(Probe(FACT_QUESTION.format(**stated), value, "fact"))
    words = load_text("pg-essays").split()
    for _ in range(turns - facts):
        start = rng.randrange(len(words) - words_per_turn)
        passage = words[start:start + words_per_turn]
        gist = " ".join(passage[:max(1, words_per_turn // 4)])
        history.append((FILLER.format(passage=" ".join(passage)), FILLER_REPLY.format(gist=gist, marker=marker)))
    probes.append(Probe(RULE_QUESTION, marker, "instruction"))
    return Conversation(SYSTEM.format(marker=marker), tuple(history), tuple(probes))


def messages(conversation: Conversation, probe: Probe) -> list[dict[str, str]]:
    """OpenAI chat messages: system, the turns as user/assistant, then the probe's question as the last user turn."""
    out = [{"role": "system", "content": conversation.system}]
    for user, assistant in conversation.turns:
        out += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return out + [{"role": "user", "content": probe.question}]


def _normalised(text: str) -> str:
    return " ".join(text.lower().split())


def score(probe: Probe, reply: str) -> bool:
    """Whether a reply passes: contains the fact's value / follows the rule (case-insensitive, whitespace-normalised).

    The rule is followed when the reply's last word, punctuation and quotes aside, is the marker.
    """
    if probe.kind == "fact":
        return _normalised(probe.answer) in _normalised(reply)
    if probe.kind != "instruction":
        raise KvevictError(f"a probe's kind is 'fact' or 'instruction', not '{probe.kind}'")
    last = re.findall(r"[a-z0-9]+", _normalised(reply))
    return bool(last) and last[-1] == _normalised(probe.answer)
