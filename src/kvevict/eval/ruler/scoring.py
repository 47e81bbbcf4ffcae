"""RULER's scores (scripts/eval/synthetic/constants.py) and the binomial interval of an accuracy.

`string_match_all`: the share of a sample's references found in its answer,
case-insensitively. `string_match_part`: 1 when any reference is found. RULER averages
either over samples (and prints percent); here each sample's score is kept, in [0, 1].
"""

from __future__ import annotations

import math
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


def wilson(successes: float, trials: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval (95% by default) of `successes` out of `trials`.

    A fractional score (`string_match_all` over several references) counts as that many
    successes: the interval then treats each sample as one trial whose outcome is its
    mean, an approximation that is exact when every score is 0 or 1.
    """
    if trials <= 0:
        return 0.0, 1.0
    p = successes / trials
    denom = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)
