"""RULER's needle-in-a-haystack family: eight tasks, one definition (scripts/data/synthetic/niah.py).

A needle is "One of the special magic {numbers} for {key} is: {value}." Keys are
`adjective-noun` words (or UUIDs), values 7-digit numbers (or UUIDs). The haystack is
RULER's repeated noise paragraph (one per line), the essays (needles put between
sentences), or other needles (distractors with keys and values of their own). The
question asks for the values of one or more keys; every value must appear in the answer
(`string_match_all`), and the answer is at most 128 tokens.

Where this differs from RULER: keys draw an adjective and a noun independently instead
of choosing from the materialised list of all pairs (the same uniform distribution over
pairs, without building ~6M strings); needle depths follow `words.spread_depths`
(evenly spread within and across samples) instead of a random draw from 40 evenly
spaced depths.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass

from .sample import Question, RulerTask, Sample
from .words import NOISE, Material, sentences, spread_depths

NEEDLE = "One of the special magic {kind} for {key} is: {value}."
TEMPLATE = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {kind} afterwards.\n{context}"
)
QUESTION = "\nWhat are all the special magic {kind} for {query} mentioned in the provided text?"
PREFIX = " The special magic {kind} for {query} mentioned in the provided text are"


def _singular(text: str) -> str:
    """RULER's wording when one value is asked for (its replacements, in its order)."""
    return text.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")


@dataclass(frozen=True)
class Niah(RulerTask):
    """One NIAH task: its haystack, the kinds of keys and values, and how many of each."""

    name: str
    haystack: str  # noise | essay | needle
    key_kind: str = "words"  # words | numbers | uuids
    value_kind: str = "numbers"
    keys: int = 1
    values: int = 1
    queries: int = 1
    family: str = "niah"
    tokens_to_generate: int = 128
    metric: str = "all"

    @property
    def asks_several(self) -> bool:
        """Whether a sample asks each key on its own (`Sample.per_key`): several keys, or one among distractor
        needles (three of them are asked too)."""
        return max(self.keys, self.queries) > 1 or self.haystack == "needle"

    def _draw(self, kind: str, rng: random.Random, material: Material) -> str:
        if kind == "numbers":
            return str(rng.randint(10**6, 10**7 - 1))
        if kind == "uuids":
            return str(uuid.UUID(int=rng.getrandbits(128), version=4))
        return f"{rng.choice(material.adjectives())}-{rng.choice(material.nouns())}"

    def _wording(self, answers: int) -> tuple[str, str, str, str]:
        """(template, question, prefix, kind): RULER's templates, made singular before formatting when
        one value is asked for (so a key that contains "are" is never touched)."""
        if answers == 1:
            return _singular(TEMPLATE), _singular(QUESTION), _singular(PREFIX), self.value_kind[:-1]
        return TEMPLATE, QUESTION, PREFIX, self.value_kind

    def _question(self, keys: list[str], answers: list[str], singular: bool) -> Question:
        query = keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]
        _, text, prefix, kind = self._wording(1 if singular else 2)
        return Question(text.format(kind=kind, query=query), prefix.format(kind=kind, query=query), answers)

    def build(self, units: int, index: int, length: int, rng: random.Random, material: Material) -> Sample:
        count = max(self.keys, self.queries)
        keys: list[str] = []
        while len(keys) < count:
            key = self._draw(self.key_kind, rng, material)
            if key not in keys:
                keys.append(key)
        values = {key: [self._draw(self.value_kind, rng, material) for _ in range(self.values)] for key in keys}
        needles = [(k, NEEDLE.format(kind=self.value_kind, key=k, value=v)) for k in keys for v in values[k]]
        rng.shuffle(needles)
        queried = sorted(rng.sample(range(count), self.queries))
        singular = self.queries * self.values == 1
        asked_keys = [keys[i] for i in queried]
        question = self._question(asked_keys, [v for k in asked_keys for v in values[k]], singular)
        distractors = []
        if self.haystack == "needle":
            distractors = [(self._draw(self.key_kind, rng, material), self._draw(self.value_kind, rng, material))
                           for _ in range(units)]
        depths = spread_depths(index, len(needles))
        context = self._context(units, [text for _, text in needles], depths, material, distractors)
        # the multi protocol's questions: every key hidden in the context, one at a time; with a needle
        # haystack (one key), three distractors at spread depths too (they are needles as well)
        asked = [(k, values[k]) for k in keys]
        if distractors and len(asked) == 1:
            picks = sorted({min(units - 1, int(d * units)) for d in spread_depths(index + 1, 3)})
            asked += [(distractors[i][0], [distractors[i][1]]) for i in picks]
        per_key = [self._question([k], v, len(v) == 1) for k, v in asked] if len(asked) > 1 else []
        template, _, _, kind = self._wording(1 if singular else 2)
        return Sample(self.name, index, template.format(kind=kind, context=context), question, per_key,
                      [text for _, text in needles], depths, units)

    def _context(self, units: int, needles: list[str], depths: list[float], material: Material,
                 distractors: list[tuple[str, str]]) -> str:
        if self.haystack == "essay":
            words = material.essay_words()
            text = " ".join(words[i % len(words)] for i in range(units))
            sents = sentences(text)
            cuts = [int(len(sents) * d) for d in depths]  # depths are sorted
            parts, last = [], 0
            for cut, needle in zip(cuts, needles):
                parts += sents[last:cut] + [needle]
                last = cut
            return " ".join(parts + sents[last:])
        if self.haystack == "noise":
            lines = [NOISE] * units
        else:
            lines = [NEEDLE.format(kind=self.value_kind, key=k, value=v) for k, v in distractors]
        for depth, needle in sorted(zip(depths, needles), reverse=True):
            lines.insert(int(round(depth * units)), needle)
        return "\n".join(lines)


TASKS = [
    Niah("niah_single_1", "noise"),
    Niah("niah_single_2", "essay"),
    Niah("niah_single_3", "essay", value_kind="uuids"),
    Niah("niah_multikey_1", "essay", keys=4),
    Niah("niah_multikey_2", "needle"),
    Niah("niah_multikey_3", "needle", key_kind="uuids", value_kind="uuids"),
    Niah("niah_multivalue", "essay", values=4),
    Niah("niah_multiquery", "essay", keys=4, queries=4),
]
