"""RULER's scores (scripts/eval/synthetic/constants.py); their binomial interval is `stats.uncertainty.wilson`.

`string_match_all`: the share of a sample's references found in its answer,
case-insensitively. `string_match_part`: 1 when any reference is found. RULER averages
either over samples (and prints percent); here each sample's score is kept, in [0, 1].
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_CONTROL = re.compile(r"[\x00-\x1f]")


def clean(answer: str) -> str:
    """RULER's post-processing: strip, control characters to newlines, strip again."""
    return _CONTROL.sub("\n", answer.strip()).strip()


def match_all(answer: str, references: Sequence[str]) -> float:
    text = clean(answer).lower()
    return sum(ref.lower() in text for ref in references) / len(references)


def match_part(answer: str, references: Sequence[str]) -> float:
    text = clean(answer).lower()
    return float(any(ref.lower() in text for ref in references))


METRICS = {"all": match_all, "part": match_part}


def score(metric: str, answer: str, references: Sequence[str]) -> float:
    return METRICS[metric](answer, references)
