"""RULER's common words extraction (`cwe`, scripts/data/synthetic/common_words_extraction.py).

A numbered list of words in which 10 words appear many times and the others few times;
the answer names the 10 most common (all 10 must appear; 120 tokens to answer). Below a
4,096-token length each common word appears 6 times and each other word once, with one
solved example of 20 words (3 and 1 times); from 4,096 tokens on, 30 and 3 times, with
an example of 40 words (10 and 3 times). The words are wonderwords' nouns, adjectives
and verbs (RULER falls back to a downloaded English word list beyond them; here that
list is not needed below ~2,900 distinct words, and longer lists repeat the vocabulary).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .sample import Question, RulerTask, Sample
from .words import Material

TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. "
            "Memorize the ones that appear most often.\n{context}")
QUESTION = "\nQuestion: What are the 10 most common words in the above list?"
PREFIX = " Answer: The top 10 words that appear most often in the list are:"


def numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))


@dataclass(frozen=True)
class CommonWords(RulerTask):
    name: str = "cwe"
    common: int = 10
    family: str = "cwe"
    tokens_to_generate: int = 120
    metric: str = "all"

    def _list(self, count: int, repeats: int, rare: int, rng: random.Random, material: Material):
        vocabulary = material.common_words()
        chosen = rng.sample(vocabulary, min(count, len(vocabulary)))
        common, others = chosen[: self.common], chosen[self.common :]
        words = common * repeats + others * rare
        rng.shuffle(words)
        return numbered(words), common

    def build(self, units: int, index: int, length: int, rng: random.Random, material: Material) -> Sample:
        long = length >= 4096
        shot, shot_answer = self._list(40 if long else 20, 10 if long else 3, 3 if long else 1, rng, material)
        example = (TEMPLATE.format(context=shot) + QUESTION + PREFIX + " " + numbered(shot_answer))
        context, answer = self._list(max(units, self.common), 30 if long else 6, 3 if long else 1, rng, material)
        return Sample(self.name, index, example + "\n" + TEMPLATE.format(context=context),
                      Question(QUESTION, PREFIX, answer), units=units)
