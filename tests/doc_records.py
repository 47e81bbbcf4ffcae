"""What the doc-figure tests read: a doc's prose and tables as written, and the figures recomputed from the raw records
in `docs/results/`, independently of the report code that printed them.

Records are read as the JSON lines they are (no `kvevict.records`); a paired PPL ratio and its interval are the
stated method written out with scipy (a percentile bootstrap over the recorded windows of the stream, each weighted
by its predictions, the same windows resampled for both rows, 2,000 resamples from seed 0, 95%); a hit rate's
interval is Wilson's, scipy's. A figure is compared at the precision the doc writes it.
"""

from __future__ import annotations

import json
import math
import re
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"

# --- the docs ----------------------------------------------------------------------------------------------------


def read(path: str) -> str:
    """A doc's text as written (`changed` hands the checks another)."""
    return (ROOT / path).read_text(encoding="utf-8")


@cache
def doc(path: str) -> str:
    """A doc as one line of prose: line breaks and runs of spaces made one (so a figure may wrap anywhere)."""
    return " ".join(read(path).split())


@contextmanager
def changed(path: str, old: str, new: str):
    """Inside it, every check reads `path` with its first `old` written `new` (a figure changed in the doc alone)."""
    global read
    text = read(path)
    assert old in text, f"{path} no longer holds '{old}': pick another figure for this check"
    original = read
    read = lambda p: text.replace(old, new, 1) if p == path else original(p)  # noqa: E731
    doc.cache_clear()
    try:
        yield
    finally:
        read = original
        doc.cache_clear()


def caught_when_changed(path: str, cases: list) -> object:
    """A parametrized test: each `(check, old, new)` of `cases`, run with `path`'s first `old` written `new`, must
    fail (the check reads that figure, so changing it alone in the doc is caught)."""

    @pytest.mark.parametrize("check_,old,new", cases, ids=[f"{c.__name__}-{i}" for i, (c, *_) in enumerate(cases)])
    def test(check_, old, new):
        with changed(path, old, new), pytest.raises(AssertionError):
            check_()

    return test


def said(text: str, pattern: str) -> tuple[str, ...]:
    """The numbers a sentence of `text` states, as written: the groups of `pattern` (regex, spaces flexible)."""
    found = re.search(pattern.replace(" ", r"\s+"), text)
    assert found, f"the doc no longer says /{pattern}/: update the sentence and its check together"
    return found.groups()


def table(path: str, after: str) -> list[list[str]]:
    """The body rows of the first Markdown table after the line holding `after`, each a list of its cells."""
    return headed_table(path, after)[1]


def headed_table(path: str, after: str) -> tuple[list[str], list[list[str]]]:
    """The header cells and the body rows of the first Markdown table after the line holding `after`."""
    lines = read(path).splitlines()
    start = next((i for i, line in enumerate(lines) if after in line), None)
    assert start is not None, f"{path} no longer has a line holding '{after}': update the check with the doc"
    first = next(i for i in range(start, len(lines)) if lines[i].startswith("|"))
    cells = lambda line: [cell.strip() for cell in line.strip().strip("|").split("|")]  # noqa: E731
    rows = []
    for line in lines[first + 2:]:
        if not line.startswith("|"):
            break
        rows.append(cells(line))
    return cells(lines[first]), rows


def number(text: str) -> float:
    return float(text.replace(",", "").replace("−", "-"))


def matches(written: str, value: float) -> bool:
    """`value` rounded to the decimals `written` shows equals it ("4.2" against 4.15 holds, against 4.26 not)."""
    decimals = len(written.split(".")[1]) if "." in written else 0
    return round(value, decimals) == pytest.approx(number(written), abs=1e-9)


def check(written: str, value: float, what: str) -> None:
    assert matches(written, value), f"the doc says {written} for {what}; the records give {value:.5f}"


INTERVAL = r"(\d+\.?\d*) \[(\d+\.?\d*), (\d+\.?\d*)\]"


def check_interval(written: tuple[str, str, str], found: tuple[float, float, float], what: str) -> None:
    """A figure written `1.017 [1.009, 1.024]` against (estimate, low, high)."""
    for text, value, part in zip(written, found, ("", " (low)", " (high)"), strict=True):
        check(text, value, what + part)


# --- the records -------------------------------------------------------------------------------------------------


@cache
def lines(name: str) -> tuple[dict, ...]:
    """Every record of a file in docs/results/, as its JSON line says."""
    text = (RESULTS / name).read_text(encoding="utf-8")
    return tuple(json.loads(line) for line in text.splitlines() if line.strip())


ANY = object()


def row(name: str, label: str, budget=ANY) -> dict:
    """The perplexity row `label` (as the command line spelled it) of a file, at `budget` where given."""
    found = [r for r in lines(name) if "ppl" in r and r.get("kind") != "oracle"
             and (r.get("label") or r.get("policy")) == label and (budget is ANY or r.get("budget") == budget)]
    assert found, f"{name} holds no {label} at {budget}"
    return found[0]


def full(name: str) -> dict:
    return next(r for r in lines(name) if r.get("kind") == "full" and "ppl" in r)


def mib(record: dict, field: str = "kv_bytes_bf16") -> float:
    return record[field] / 2**20


def _windows(record: dict) -> tuple[tuple[int, ...], np.ndarray, np.ndarray]:
    """A row's recorded windows: their starts, mean NLL (log of each window's PPL) and predictions."""
    curve = record["curve"]
    nll = np.array([math.log(w["ppl"]) for w in curve])
    weight = np.array([float(w.get("n", w["end"] - w["start"] + 1)) for w in curve])
    return tuple(w["start"] for w in curve), nll, weight


def _difference(a_nll, a_weight, b_nll, b_weight, axis=-1):
    mean = lambda x, w: (x * w).sum(axis=axis) / w.sum(axis=axis)  # noqa: E731
    return mean(a_nll, a_weight) - mean(b_nll, b_weight)


@cache
def _paired(a_key: tuple, b_key: tuple) -> tuple[float, float]:
    a, b = _by_key(*a_key), _by_key(*b_key)
    a_starts, a_nll, a_weight = _windows(a)
    b_starts, b_nll, b_weight = _windows(b)
    assert a_starts == b_starts, "rows of another stream or windows cannot be paired"
    found = stats.bootstrap((a_nll, a_weight, b_nll, b_weight), _difference, paired=True, vectorized=True,
                            n_resamples=2000, confidence_level=0.95, method="percentile",
                            rng=np.random.default_rng(0))
    return math.exp(found.confidence_interval.low), math.exp(found.confidence_interval.high)


def _by_key(name: str, key: str) -> dict:
    return next(r for r in lines(name) if r.get("key") == key)


def paired(a: tuple[str, dict], b: tuple[str, dict]) -> tuple[float, float, float]:
    """PPL of row `a` over row `b` (each `(file, record)`) and its paired 95% interval."""
    (a_file, a_row), (b_file, b_row) = a, b
    low, high = _paired((a_file, a_row["key"]), (b_file, b_row["key"]))
    return a_row["ppl"] / b_row["ppl"], low, high


def wilson(hits: int, n: int) -> tuple[float, float]:
    found = stats.binomtest(hits, n).proportion_ci(confidence_level=0.95, method="wilson")
    return max(0.0, float(found.low)), min(1.0, float(found.high))


def answers(name: str, **where) -> dict[int, float]:
    """sample -> score of the RULER answers of a file whose fields equal `where` (`policy` matched by its name before
    its options: `tova` is `tova:per_group=0`)."""
    policy = where.pop("policy", None)
    return {r["sample"]: r["score"] for r in lines(name) if r.get("kind") == "ruler"
            and (policy is None or r["policy"] == policy or r["policy"].startswith(policy + ":"))
            and all(r.get(k) == v for k, v in where.items())}
