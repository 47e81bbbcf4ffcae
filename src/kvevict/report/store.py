"""The results store: one JSON object per finished cell in `results.jsonl`.

A sweep can be killed at any moment (Ctrl-C, SIGKILL, a lost machine). Each append
rewrites the file to a temporary sibling, fsyncs it and renames it over the original,
so the file on disk is always a complete set of whole lines: a finished cell is never
lost and a half-written line never appears. Reading is still defensive: a line that
does not parse (from some other writer) is reported and skipped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path


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
        new = [json.dumps(r, sort_keys=True) for r in records]
        if not new:
            return
        existing = self.path.read_bytes() if self.path.exists() else b""
        if existing and not existing.endswith(b"\n"):
            existing += b"\n"
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as handle:
            handle.write(existing + ("\n".join(new) + "\n").encode("utf-8"))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self.path)
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
