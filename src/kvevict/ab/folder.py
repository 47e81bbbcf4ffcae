"""Opening a run folder: writable, holding the same experiment or none yet, its `run.json` pinned.

Shared by `kvevict ab` (`run.prepare_folder`) and `kvevict ruler` (`ruler.prepare`), so
both refuse a folder of another experiment the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import KvevictError
from ..files import atomic_write
from ..records.schema import UNRECORDED_DTYPE
from ..records.store import ResultStore


def cap_identity(max_new_tokens: int | None) -> dict:
    """The identity's part for a cap on answer tokens: answers cut at another length are another experiment.
    Absent at RULER's own answer length (None or 0), so folders written before the cap was pinned still resume."""
    return {"max_new_tokens": max_new_tokens} if max_new_tokens else {}


def open_run_folder(folder: Path, identity: dict, config: dict, what: str = "results") -> ResultStore:
    """Create a run folder, check it is writable and holds the same experiment (`identity`) or none yet,
    and pin `identity` and `config` in its `run.json`. `what` names what it holds in the refusal.

    The dtype is part of the identity: a rerun in another dtype is refused (its cells would mix
    with the first dtype's), and names the fix, another `--name`."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".write-probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise KvevictError(f"cannot write to '{folder}' ({exc.strerror}): choose a writable --out folder") from None
    meta = folder / "run.json"
    if meta.exists():
        before = json.loads(meta.read_text()).get("identity", {})
        if before and "dtype" in identity:  # a folder written before the dtype was pinned measured float32
            before.setdefault("dtype", UNRECORDED_DTYPE)
        if before and before != identity:
            raise KvevictError(
                f"'{folder}' holds {what} for {before}, not {identity}: use another --name to start fresh"
            )
    atomic_write(meta, json.dumps({"identity": identity, "config": config}, indent=2))
    return ResultStore(folder / "results.jsonl")
