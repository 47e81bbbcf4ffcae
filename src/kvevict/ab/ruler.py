"""`kvevict ruler`'s harness: the run folder, the records appended as each batch is answered, resume, report.

The folder is OUT/NAME, like a sweep's: `results.jsonl` holds one `RulerRecord` per
answer (appended atomically by `records.store`, so a killed run loses at most the batch
in flight), `run.json` pins what the answers depend on (model, dtype, seed, positions, text,
QA file), and `report.html` is redrawn at the end. A rerun of the same command skips
every answer already stored; a rerun with more tasks, lengths, samples, budgets or
another protocol adds to the same folder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..eval.needle import max_positions
from ..eval.ruler.grid import RulerGrid, preflight, run_grid
from ..progress import bars
from ..records.schema import Record, RulerRecord, load
from ..records.store import ResultStore
from .folder import cap_identity, open_run_folder
from .plan import run_folder


@dataclass
class RulerRun:
    """A `kvevict ruler` run: the grid, and where and on what it is measured."""

    name: str
    out: str
    model: str = "smollm2-135m"
    grid: RulerGrid = field(default_factory=RulerGrid)
    qa_path: str | None = None
    dtype: str = "float32"  # what the model and its KV cache are held in (`loading.dtypes`)

    @property
    def folder(self) -> Path:
        return run_folder(self.out, self.name)

    def identity(self) -> dict:
        g = self.grid
        return {"model": self.model, "dtype": self.dtype, "seed": g.seed, "positions": g.positions, "text": g.text,
                "qa": self.qa_path, **cap_identity(g.max_new_tokens)}

    def config(self) -> dict:
        g = asdict(self.grid)
        g.pop("qa", None)
        return {"name": self.name, "model": self.model, "dtype": self.dtype, "text": self.grid.text,
                "positions": self.grid.positions, "seed": self.grid.seed, "tokens": None, "ruler": g,
                "qa": self.qa_path}


def prepare(run: RulerRun) -> ResultStore:
    """The run folder, writable and holding the same experiment (or none yet)."""
    return open_run_folder(run.folder, run.identity(), run.config(), what="answers")


def run_ruler(run: RulerRun, model, tokenizer, progress: bool = True, executor=None,
              allow_download: bool = False, device: str = "cpu") -> list[Record]:
    """Answer everything the run's grid holds that its folder does not; returns every record of the folder.
    With an `executor` (`executors.Executor`, e.g. Ray's) the samples are shared out across its workers
    (`grid_shards`), each loading the model itself where it runs elsewhere; the shards it gave up on are left in
    `executor.failed` and stay unanswered."""
    limit = max_positions(model)
    total = preflight(run.grid, tokenizer, limit)
    store = prepare(run)
    done = store.done()
    if executor is not None:
        from .grid_shards import GridSpec, run_shards, shard

        spec = GridSpec(run.model, run.dtype, allow_download, device, model, tokenizer)
        with executor.opened():
            run_shards(executor, spec, shard(kept_in(run), done), keeper(store, done, run.dtype), progress)
        return load(store.records())
    with bars(progress) as bar:
        task = bar.add_task(f"ruler {run.name}: batches", total=total)

        stored = keeper(store, done, run.dtype)

        def keep(lines: list[dict]) -> None:
            stored(lines)
            bar.advance(task)

        run_grid(model, tokenizer, kept_in(run), done, keep, limit, on_skip=lambda: bar.advance(task))
    return load(store.records())


def kept_in(run: RulerRun) -> RulerGrid:
    """The run's grid, keeping reconstruction scores (KVzip's) in the folder's `reconstruction/`: a rerun that
    adds budgets or policies to a context already read skips its repeat forwards (`reconstruction.KeptScores`)."""
    return run.grid if run.grid.scores is not None else replace(run.grid, scores=str(run.folder / "reconstruction"))


def keeper(store: ResultStore, done: set[str], dtype: str) -> Callable[[list[dict]], None]:
    """What the grid runner (or an executor) hands each batch's answers to: stored as `RulerRecord`s, the ones not
    yet stored (a batch cut short by a kill is answered again whole); `done` grows with what is appended, so two
    shards answering the same full-cache sample store it once."""
    def keep(lines: list[dict]) -> None:
        fresh = [RulerRecord.from_dict({**line, "dtype": dtype}).to_dict() for line in lines if line["key"] not in done]
        store.append(fresh)
        done.update(line["key"] for line in fresh)

    return keep
