"""A run folder read back for the report: its records, its settings, and the name a comparison calls it by.

`kvevict report` redraws one run or puts several side by side; both read folders
through `load_run`, so the check for a folder that is not a run is written once.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import KvevictError
from ..records.schema import UNRECORDED_DTYPE, Record, load
from ..records.store import ResultStore


@dataclass
class Run:
    """One `kvevict ab` run folder: `config` is `run.json`'s settings ({} when the folder has none)."""

    folder: Path
    records: list[Record]
    config: dict = field(default_factory=dict)
    skipped_lines: int = 0

    @property
    def model(self) -> str:
        """The model the run measured, as `run.json` names it; the folder name when it does not."""
        return str(self.config.get("model") or self.folder.name)

    def measured_on(self) -> str:
        """What the numbers were measured on: text, stream length, positions, seed."""
        c = self.config
        return (f"text {c.get('text')} · {c.get('tokens')} tokens · positions {c.get('positions')} · "
                f"seed {c.get('seed')}")

    @property
    def dtype(self) -> str:
        """What the model and its KV cache were held in, as `run.json` pins it (float32 where it does not)."""
        return self.config.get("dtype") or UNRECORDED_DTYPE

    def tokenization(self) -> str:
        """What the stream starts with before the text (recorded by the sweep; older runs did not)."""
        return stream_start_label(self.config)

    def notes(self) -> list[str]:
        """What the run left out of its defaults, and why (see `run_notes`)."""
        return run_notes(self.config)


def run_notes(config: dict) -> list[str]:
    """`run.json`'s sentences on default rows the run left out, and why (the recompute oracle on a
    hybrid model): every view of the report shows them, so a missing row is never a silent one."""
    return [config["oracle_left_out"]] if config.get("oracle_left_out") else []


def stream_start_label(config: dict) -> str:
    """`run.json`'s record of the stream's start, in words: "stream starts with <bos>", "no BOS"."""
    if "stream_start" not in config:
        return "stream start not recorded"
    return f"stream starts with {config['stream_start']}" if config["stream_start"] else "no BOS (text from token 0)"


def load_run(folder: str | Path) -> Run:
    """The run in `folder`; a folder without `results.jsonl` is a user mistake named in one line."""
    path = Path(folder)
    if not (path / "results.jsonl").exists():
        raise KvevictError(f"no results.jsonl in '{folder}': give the OUT/NAME folder of a `kvevict ab` run")
    store = ResultStore(path / "results.jsonl")
    records = load(store.records())
    meta = path / "run.json"
    config = json.loads(meta.read_text())["config"] if meta.exists() else {}
    return Run(path, records, config, store.skipped_lines)


def run_names(runs: Sequence[Run]) -> list[str]:
    """What the comparison calls each run: its model, with the folder beside it when two runs share a model."""
    models = [r.model for r in runs]
    return [m if models.count(m) == 1 else f"{m} ({r.folder})" for m, r in zip(models, runs)]


def record_tolerance(folder: str | Path, tolerance: dict) -> dict:
    """Write the tolerance the verdict judges by into the run's `run.json` (`config.tolerance`) and return the
    config: a report redrawn later judges by the same rule unless told otherwise. A folder without `run.json`
    gets none written."""
    meta = Path(folder) / "run.json"
    if not meta.exists():
        return {"tolerance": tolerance}
    data = json.loads(meta.read_text())
    data["config"]["tolerance"] = tolerance
    tmp = meta.with_name(meta.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(meta)
    return data["config"]
