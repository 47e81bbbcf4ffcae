"""A RULER grid's samples shared out across an executor's workers (`--executor ray` for `kvevict ruler` and
`kvevict envelope --tasks`).

A sample's answers depend on that sample alone (the grid runner keeps nothing between
samples, `eval.ruler.grid`), so a grid splits into shards of one sample each: the grid
restricted to it (`RulerGrid.only`), the full cache and every batch of policies at every
budget. A worker (`GridWorker`, one model per worker, loaded on its first shard) answers a
shard with `run_grid`, skipping the answers already stored, and hands its records back; the
driver alone appends them. The records are the ones a local run writes (the same keys,
answers and scores; only the seconds differ), and a rerun answers only what is missing.

The executors are the sweep's (`executors.Executor`): a `GridSpec` builds a `GridWorker` the
way a `WorkerSpec` builds a sweep's `Worker`, so the Ray executor runs shards unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ..eval.needle import max_positions
from ..eval.ruler.grid import RulerGrid, run_grid
from ..progress import bars


@dataclass(frozen=True)
class Shard:
    """One sample of a grid (`grid.only` holds its index) and the record keys already stored."""

    grid: RulerGrid
    done: frozenset[str] = frozenset()

    @property
    def name(self) -> str:
        g = self.grid
        budgets = ",".join(str(b) for b in g.budgets)
        return f"sample {g.only[0]} of {','.join(g.tasks)} at {budgets}"


def shard(grid: RulerGrid, done: set[str] | frozenset[str] = frozenset()) -> list[Shard]:
    """The grid as one shard per sample index, in a local run's order."""
    stored = frozenset(done)
    return [Shard(replace(grid, only=(index,)), stored) for index in range(grid.samples)]


@dataclass(frozen=True)
class GridSpec:
    """What builds a `GridWorker` wherever it runs: the model to load and how, and the driver's loaded model for an
    executor that runs in this process (`portable()` leaves it out for one that builds workers elsewhere)."""

    model: str
    dtype: str
    allow_download: bool = False
    device: str = "cpu"
    loaded: Any = field(default=None, repr=False)
    tokenizer: Any = field(default=None, repr=False)

    def build(self) -> GridWorker:
        return GridWorker(self)

    def portable(self) -> GridSpec:
        return replace(self, loaded=None, tokenizer=None)


class GridWorker:
    """Answers shards on one model (the spec's, or loaded on the first shard and kept)."""

    def __init__(self, spec: GridSpec) -> None:
        self.spec, self.model, self.tokenizer = spec, spec.loaded, spec.tokenizer

    def reference(self, progress=False) -> None:
        """Nothing to compute before the first shard (the executors' interface asks)."""

    def run(self, item: Shard, progress=False) -> list[dict]:
        """The records (JSON objects, without the dtype the driver adds) of the shard's missing answers."""
        if self.model is None:
            from ..loading import load_model

            self.model, self.tokenizer = load_model(self.spec.model, device=self.spec.device,
                                                    allow_download=self.spec.allow_download, dtype=self.spec.dtype)
        return run_grid(self.model, self.tokenizer, item.grid, item.done, None, max_positions(self.model))


def run_shards(executor, spec: GridSpec, todo: list[Shard], keep: Callable[[list[dict]], None],
               progress: bool = True) -> list[tuple[Shard, str]]:
    """Every shard of `todo` on `executor`'s workers, each finished one's records handed to `keep` in this process;
    returns the shards it gave up on, with the reason (their answers stay missing: a rerun answers them). The
    caller holds the executor open (`executor.opened()`) across calls, so Ray starts once and its
    workers keep their models from one step of a search to the next."""
    before = len(executor.failed)
    with bars(progress) as bar:
        executor.run(spec, todo, keep, bar)
    return executor.failed[before:]
