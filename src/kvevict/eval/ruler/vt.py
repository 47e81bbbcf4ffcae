"""RULER's variable tracking (`vt`, scripts/data/synthetic/variable_tracking.py).

A chain `VAR ABCDE = 12345`, `VAR FGHIJ = VAR ABCDE`, ... (one chain of 4 hops: 5
variables, 5 uppercase letters each) is hidden line by line among repeated noise
sentences, in order, at random places; the question asks for every variable that holds
the value. All 5 names must appear in the answer; 30 tokens to answer. RULER puts one
solved example first (its own task at 500 tokens with 3-letter names); here the
example holds 20 noise sentences, about RULER's 500 tokens.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from .sample import Question, RulerTask, Sample
from .words import NOISE, Material

TEMPLATE = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}"
QUESTION = "\nQuestion: Find all variables that are assigned the value {value} in the text above."
PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {count} variables are "
          "assigned the value {value}, they are: ")
EXAMPLE_NOISE = 20


@dataclass(frozen=True)
class VariableTracking(RulerTask):
    name: str = "vt"
    hops: int = 4
    family: str = "vt"
    tokens_to_generate: int = 30
    metric: str = "all"

    def _chain(self, rng: random.Random, letters: int) -> tuple[list[str], list[str], str]:
        names: list[str] = []
        while len(names) < self.hops + 1:
            name = "".join(rng.choices(string.ascii_uppercase, k=letters))
            if name not in names:
                names.append(name)
        value = str(rng.randint(10000, 99999))
        lines = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(self.hops)]
        return names, lines, value

    def _context(self, units: int, lines: list[str], rng: random.Random) -> tuple[str, list[float]]:
        text = [NOISE] * units
        places = sorted(rng.sample(range(units), len(lines))) if units >= len(lines) else list(range(len(lines)))
        for j, (place, line) in enumerate(zip(places, lines)):
            text.insert(min(place + j, len(text)), line)
        depths = [place / max(1, units) for place in places]
        return "\n".join(text).replace(". \n", ".\n"), depths

    def _example(self, rng: random.Random) -> str:
        names, lines, value = self._chain(rng, 3)
        context, _ = self._context(EXAMPLE_NOISE, lines, rng)
        prompt = (TEMPLATE.format(context=context) + QUESTION.format(value=value)
                  + PREFIX.format(count=self.hops + 1, value=value))
        return prompt + " " + " ".join(names) + "\n"

    def build(self, units: int, index: int, length: int, rng: random.Random, material: Material) -> Sample:
        example = self._example(rng)
        names, lines, value = self._chain(rng, 5)
        context, depths = self._context(units, lines, rng)
        question = Question(QUESTION.format(value=value), PREFIX.format(count=self.hops + 1, value=value), names)
        return Sample(self.name, index, example + TEMPLATE.format(context=context), question,
                      needles=[line.strip() for line in lines], depths=depths, units=units)
