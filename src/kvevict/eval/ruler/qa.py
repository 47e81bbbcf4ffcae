"""Question answering over a user's own documents, in RULER's QA format.

RULER's QA tasks (SQuAD, HotpotQA) need datasets that cannot be downloaded here, so a
team brings its own: a JSONL file, one object per line,

    {"context": "...documents...", "question": "...", "answers": ["...", ...], "answer_prefix": " Answer:"}

`answer_prefix` is optional (RULER's " Answer:" by default). The prompt is RULER's QA
template (scripts/data/synthetic/constants.py); an answer is right when it contains any
of the references, case-insensitively (`string_match_part`); 32 tokens to answer. Each
line runs at its own length: nothing is padded or cut.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from ...errors import KvevictError
from .sample import Question, RulerTask, Sample

INSTRUCTION = ("Answer the question based on the given documents. Only give me the answer and do not output "
               "any other words.")
TEMPLATE = INSTRUCTION + "\n\nThe following are given documents.\n\n{context}"
QUESTION = "\n\n" + INSTRUCTION + "\n\nQuestion: {question}"
PREFIX = " Answer:"


@dataclass(frozen=True)
class QaRow:
    context: str
    question: str
    answers: list[str]
    answer_prefix: str = PREFIX


def load_qa(path: str | Path) -> list[QaRow]:
    """The rows of a QA file; any line that is not a complete row is an error naming the line and the fix."""
    path = Path(path)
    if not path.is_file():
        raise KvevictError(f"QA file '{path}' not found: give a .jsonl file of "
                           '{"context", "question", "answers"} objects')
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            raise KvevictError(f"{where} is not JSON: write one object per line") from None
        if not isinstance(data, dict):
            raise KvevictError(f"{where} is not a JSON object: write {{\"context\", \"question\", \"answers\"}}")
        missing = [k for k in ("context", "question", "answers") if k not in data]
        if missing:
            raise KvevictError(f"{where} lacks {', '.join(repr(k) for k in missing)}: every line needs "
                               '"context", "question" and "answers"')
        answers = data["answers"]
        if isinstance(answers, str):
            answers = [answers]
        if not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a.strip() for a in answers):
            raise KvevictError(f"{where} has an empty answer list: give at least one non-empty reference answer")
        if not isinstance(data["context"], str) or not isinstance(data["question"], str) or not data["question"]:
            raise KvevictError(f"{where}: 'context' and 'question' must be strings (a non-empty question)")
        prefix = data.get("answer_prefix", PREFIX)
        if not isinstance(prefix, str):
            raise KvevictError(f"{where}: 'answer_prefix' must be a string")
        rows.append(QaRow(data["context"], data["question"], answers, prefix))
    if not rows:
        raise KvevictError(f"QA file '{path}' holds no rows: write one JSON object per line")
    return rows


@dataclass(frozen=True)
class QaFile(RulerTask):
    """A user's QA file as a task; sample `index` is line `index` (blank lines skipped)."""

    rows: tuple[QaRow, ...]
    name: str = "qa"
    family: str = "qa"
    tokens_to_generate: int = 32
    metric: str = "part"

    def build(self, units: int, index: int, length: int, rng: random.Random, material=None) -> Sample:
        row = self.rows[index]
        return Sample(self.name, index, TEMPLATE.format(context=row.context),
                      Question(QUESTION.format(question=row.question), row.answer_prefix, list(row.answers)))
