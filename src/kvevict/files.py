"""Writing a file whole or not at all: the one atomic write every output of kvevict goes through.

A run can be killed at any moment (Ctrl-C, SIGKILL, a lost machine). A file written in
place can then be left half-written: a `run.json` that no longer parses, a report cut
off mid-table, a model file that is only its first chunks. `atomic_write` writes a
temporary sibling (named with the process id, so two processes never share one),
flushes it to disk (`fsync`), renames it over the target (atomic within a folder on
POSIX) and fsyncs the folder, so the target is always the old file or the new one.

`results.jsonl` is not rewritten this way: it grows by whole lines (`records.store`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def fsync_folder(folder: Path) -> None:
    """Make a rename or a new file in `folder` survive a power loss (POSIX: the entry lives in the folder)."""
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def atomic_write(path: Path | str, data: str | bytes | Callable[[BinaryIO], None]) -> Path:
    """Replace `path` by `data` (text is written as UTF-8) or by what `data(handle)` writes; returns `path`.

    A callable may raise to abandon the write (a checksum that does not match): the temporary file is
    removed, `path` is left as it was, and the exception propagates.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            if callable(data):
                data(handle)
            else:
                handle.write(data.encode("utf-8") if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)
    return path
