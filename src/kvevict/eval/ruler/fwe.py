"""RULER's frequent words extraction (`fwe`, scripts/data/synthetic/freq_words_extraction.py).

A text of coded 6-letter words whose counts follow a Zipf law (the k-th word of the
vocabulary appears `n * k^-alpha / zeta(alpha)` times, alpha 2); the most frequent is
replaced by dots ("...", noise), and the answer names the next three (all three must
appear; 50 tokens to answer). The vocabulary has `(length - 50) / 50` words, as in
RULER (its length less the answer, over 50).
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from .sample import Question, RulerTask, Sample
from .words import Material

TEMPLATE = ("Read the following coded text and track the frequency of each coded word. "
            "Find the three most frequently appeared coded words. {context}")
QUESTION = ("\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
            "What are the three most frequently appeared words in the above coded text?")
PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"


def zeta(alpha: float, terms: int = 10000) -> float:
    """Riemann zeta of `alpha` > 1: the partial sum and its Euler-Maclaurin tail (no scipy needed)."""
    head = sum(k**-alpha for k in range(1, terms))
    return head + terms ** (1 - alpha) / (alpha - 1) + 0.5 * terms**-alpha


@dataclass(frozen=True)
class FrequentWords(RulerTask):
    name: str = "fwe"
    alpha: float = 2.0
    letters: int = 6
    family: str = "fwe"
    tokens_to_generate: int = 50
    metric: str = "all"

    def build(self, units: int, index: int, length: int, rng: random.Random, material: Material) -> Sample:
        size = max(4, (length - self.tokens_to_generate) // 50)
        vocabulary: set[str] = set()
        while len(vocabulary) < size:
            vocabulary.add("".join(rng.choices(string.ascii_lowercase, k=self.letters)))
        ranked = sorted(vocabulary)
        rng.shuffle(ranked)
        ranked[0] = "..."
        norm = zeta(self.alpha)
        words = [w for k, w in enumerate(ranked, 1) for _ in range(int(units * k**-self.alpha / norm))]
        rng.shuffle(words)
        return Sample(self.name, index, TEMPLATE.format(context=" ".join(words)),
                      Question(QUESTION, PREFIX, ranked[1:4]), units=units)
