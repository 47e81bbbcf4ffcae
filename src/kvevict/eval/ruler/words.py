"""What the RULER tasks are made of: word lists, the noise sentence, a sentence splitter, even depths.

RULER draws its keys (`adjective-noun`) and its common words from the lists shipped in
the PyPI package `wonderwords` (3.0: `assets/nounlist.txt`, `adjectivelist.txt`,
`verblist.txt`). They are read as files, found with `find_spec` (the package is never
imported), so nothing is downloaded at run time.

RULER splits its essay haystack into sentences with NLTK's `sent_tokenize`, whose model
is a download; `sentences` is a regex splitter instead (a sentence ends at `.`, `?` or
`!` followed by white space), which is what the needles need: a place between two
sentences.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from ...errors import KvevictError

#: RULER's "noise" haystack: one paragraph repeated (scripts/data/synthetic/niah.py)
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

_SENTENCE_END = re.compile(r"(?<=[.?!])\s+")


def _asset(name: str) -> list[str]:
    spec = importlib.util.find_spec("wonderwords")
    if spec is None or not spec.submodule_search_locations:
        raise KvevictError("the RULER tasks need the word lists of the PyPI package 'wonderwords': "
                           "pip install wonderwords")
    path = Path(list(spec.submodule_search_locations)[0]) / "assets" / name
    return [w.strip() for w in path.read_text(encoding="utf-8").splitlines() if w.strip()]


def nouns() -> list[str]:
    return _asset("nounlist.txt")


def adjectives() -> list[str]:
    return _asset("adjectivelist.txt")


def verbs() -> list[str]:
    return _asset("verblist.txt")


def common_words() -> list[str]:
    """RULER's cwe vocabulary: nouns, adjectives and verbs, sorted and deduplicated."""
    return sorted(set(nouns() + adjectives() + verbs()))


def sentences(text: str) -> list[str]:
    """`text` cut after every `.`, `?` or `!` that white space follows (NLTK's splitter is a download)."""
    return [s for s in _SENTENCE_END.split(text.strip()) if s]


def van_der_corput(index: int) -> float:
    """The `index`-th point of the base-2 van der Corput sequence in [0, 1).

    Any first N points are spread evenly over [0, 1) (0, 0.5, 0.25, 0.75, ...), so the
    needle depths of the first N samples cover the context evenly whatever N is, and
    sample i's depth does not change when more samples are asked for (a resumed run
    keeps its prompts).
    """
    value, base, i = 0.0, 0.5, index
    while i:
        value += base * (i & 1)
        i >>= 1
        base /= 2
    return value


def spread_depths(index: int, count: int) -> list[float]:
    """`count` depths in [0, 1] for sample `index`: evenly spaced, shifted by the sample's point.

    One needle: the van der Corput point itself. Several: `count` depths `1/count` apart,
    all shifted by it, so every sample's needles cover its context and the samples
    together cover every depth.
    """
    shift = van_der_corput(index)
    return sorted(((shift + j) / count) % 1.0 for j in range(count))


class Material:
    """The haystack text and the word lists of one run, loaded on first use and kept for its samples."""

    def __init__(self, text: str = "pg-essays") -> None:
        self.text = text
        self._loaded: dict[str, list[str]] = {}

    def _get(self, name: str, load) -> list[str]:
        if name not in self._loaded:
            self._loaded[name] = load()
        return self._loaded[name]

    def essay_words(self) -> list[str]:
        """The essays as one run of words (RULER: white space collapsed, split on spaces)."""
        from ...data import load_text

        return self._get("essay", lambda: re.sub(r"\s+", " ", load_text(self.text)).strip().split(" "))

    def nouns(self) -> list[str]:
        return self._get("nouns", lambda: sorted(set(nouns())))

    def adjectives(self) -> list[str]:
        return self._get("adjectives", lambda: sorted(set(adjectives())))

    def common_words(self) -> list[str]:
        return self._get("common", common_words)
