"""`results.jsonl` grows by whole lines: a torn last line is skipped and repaired, and a sweep of N records
writes each byte once (counted by the kernel, `/proc/self/io`), not the file again per record."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvevict.files import atomic_write
from kvevict.records.store import ResultStore


def record(i: int) -> dict:
    return {"key": f"policy|window|{i}", "ppl": 10.0 + i, "note": "x" * 60}


def line(i: int) -> bytes:
    return (json.dumps(record(i), sort_keys=True) + "\n").encode()


def test_a_torn_last_line_is_skipped_then_cut_and_the_run_resumes(tmp_path):
    path = tmp_path / "results.jsonl"
    store = ResultStore(path)
    store.append([record(0), record(1)])
    whole = path.read_bytes()
    assert whole == line(0) + line(1)
    with open(path, "ab") as handle:  # a kill in the middle of the next write
        handle.write(line(2)[:25])
    assert [r["key"] for r in store.records()] == ["policy|window|0", "policy|window|1"]
    assert store.skipped_lines == 1
    assert store.done() == {"policy|window|0", "policy|window|1"}  # the torn cell is run again
    store.append([record(2)])
    assert path.read_bytes() == whole + line(2)  # the torn bytes are gone, nothing else moved
    assert len(store.records()) == 3 and store.skipped_lines == 0


def test_a_whole_last_record_without_a_line_break_is_kept(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_bytes(line(0) + line(1)[:-1])  # another writer that left out the final newline
    ResultStore(path).append([record(2)])
    assert path.read_bytes() == line(0) + line(1) + line(2)


def test_a_torn_line_longer_than_one_read_step_is_cut(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_bytes(line(0) + b'{"key": "' + b"y" * 200_000)
    ResultStore(path).append([record(1)])
    assert path.read_bytes() == line(0) + line(1)


def _written() -> int:
    """Bytes this process has handed to write(2) so far (the kernel's count)."""
    text = Path("/proc/self/io").read_text()
    return int(next(part.split()[1] for part in text.splitlines() if part.startswith("wchar:")))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux's /proc/self/io")
def test_appending_n_records_writes_each_byte_once(tmp_path):
    path = tmp_path / "results.jsonl"
    store = ResultStore(path)
    count = 300
    before = _written()
    for i in range(count):
        store.append([record(i)])
    written = _written() - before
    size = path.stat().st_size
    assert size == sum(len(line(i)) for i in range(count))
    # rewriting the file per record would write about count / 2 times its size (~45x here)
    assert size <= written <= size + 64 * count


def test_atomic_write_leaves_the_old_file_when_the_writer_fails(tmp_path):
    path = tmp_path / "run.json"
    atomic_write(path, '{"a": 1}')

    def torn(handle) -> None:
        handle.write(b'{"a": ')
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        atomic_write(path, torn)
    assert path.read_text() == '{"a": 1}' and [p.name for p in tmp_path.iterdir()] == ["run.json"]
