"""The results store: one JSON object per finished cell in `results.jsonl`.

A sweep can be killed at any moment (Ctrl-C, SIGKILL, a lost machine). Each append
writes its records as whole lines at the end of the file and fsyncs it, so a finished
cell is on disk before the next one starts, and a sweep of N cells writes each line
once (rewriting the file per record would write O(N^2) bytes). A kill in the middle of
a write can leave a torn last line: reading skips (and counts) any line that does not
parse, and the next append first cuts a torn tail back to the last whole line, so a
rerun resumes from every finished cell and recomputes only the torn one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from ..files import fsync_folder

#: bytes read back from the end of the file per step while looking for the last line break
_TAIL_STEP = 1 << 16


class ResultStore:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.skipped_lines = 0

    def records(self) -> list[dict]:
        if not self.path.exists():
            return []
        out = []
        self.skipped_lines = 0
        for line in self.path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                self.skipped_lines += 1
                continue
            if isinstance(record, dict) and "key" in record:
                out.append(record)
            else:
                self.skipped_lines += 1
        return out

    def done(self) -> set[str]:
        return {r["key"] for r in self.records()}

    def append(self, records: Iterable[dict]) -> None:
        """Write `records` as lines at the end of the file, after repairing a torn tail (see the module)."""
        new = [json.dumps(r, sort_keys=True) for r in records]
        if not new:
            return
        created = not self.path.exists()
        with open(self.path, "ab") as handle:
            handle.seek(0, os.SEEK_END)
            self._repair_tail(handle)
            handle.write(("\n".join(new) + "\n").encode("utf-8"))
            handle.flush()
            os.fsync(handle.fileno())
        if created:
            fsync_folder(self.path.parent)

    def _repair_tail(self, handle) -> None:
        """Make the file end at a line break: a last line without one is kept (a break added) when it is a
        whole record, and cut off when it is torn. Reads only the tail, not the file."""
        end = handle.tell()
        if end == 0:
            return
        with open(self.path, "rb") as reader:
            reader.seek(end - 1)
            if reader.read(1) == b"\n":
                return
            start = end
            while start > 0:  # back to the last line break (a line is rarely longer than one step)
                start = max(0, start - _TAIL_STEP)
                reader.seek(start)
                chunk = reader.read(end - start)
                cut = chunk.rfind(b"\n")
                if cut >= 0:
                    start += cut + 1
                    break
            reader.seek(start)
            tail = reader.read(end - start)
        try:
            whole = isinstance(json.loads(tail), dict)
        except (json.JSONDecodeError, UnicodeDecodeError):
            whole = False
        if whole:
            handle.write(b"\n")
        else:
            handle.truncate(start)
