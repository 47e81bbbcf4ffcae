"""Every record file the docs cite (`docs/results/*.jsonl`) still loads through `records/`, line by line, and
a run torn mid-line resumes: the torn line skipped, the next append cutting it back."""

import shutil
from pathlib import Path

import pytest

from kvevict.records.schema import load
from kvevict.records.store import ResultStore

FILES = sorted((Path(__file__).resolve().parents[1] / "docs" / "results").glob("*.jsonl"))


def test_there_are_record_files():
    assert len(FILES) >= 50


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_a_record_file_loads_and_resumes(path, tmp_path):
    lines = ResultStore(path).records()
    records = load(lines)
    assert lines and len(records) == len(lines)
    torn = tmp_path / "results.jsonl"
    shutil.copy(path, torn)
    last = torn.read_bytes().splitlines(keepends=True)[-1]
    with torn.open("ab") as handle:
        handle.write(last[: len(last) // 2])  # a kill in the middle of a write
    store = ResultStore(torn)
    assert store.records() == lines and store.skipped_lines == 1
    store.append([lines[-1]])
    again = ResultStore(torn)
    assert again.records() == [*lines, lines[-1]] and again.skipped_lines == 0
