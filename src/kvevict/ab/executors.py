"""Executors: what runs a sweep's batches. `local` runs them in this process; `ray` on Ray workers.

An executor takes the batches (`worker.Batch`) and a `WorkerSpec` (what builds the
`Worker` that runs them), runs them, and calls `finished(lines)` with each batch's
records as soon as it is done; the driver alone appends them to `results.jsonl`. A
batch the executor gives up on is listed in `failed` with the reason; its cells stay
unfinished, so a rerun of the same command runs them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from .plan import SweepConfig
from .worker import Batch, Worker


@dataclass(frozen=True)
class WorkerSpec:
    """What builds a sweep's `Worker`, wherever it runs: the sweep, whether its model may be
    downloaded, and the model the driver already loaded (for an executor that runs in this
    process; `portable()` leaves it out for one that builds workers elsewhere)."""

    config: SweepConfig
    allow_download: bool = False
    model: Any = field(default=None, repr=False)
    tokenizer: Any = field(default=None, repr=False)
    device: str = "cpu"  # where a worker that loads the model puts it

    def build(self) -> Worker:
        """A worker; it loads the model on its first batch unless this spec carries one."""
        return Worker(self.config, self.model, self.tokenizer, self.allow_download, self.device)

    def portable(self) -> WorkerSpec:
        """This spec without the driver's model, to ship to another process (which loads its own)."""
        return replace(self, model=None, tokenizer=None)


@dataclass
class Executor:
    """The interface: `run` every batch, report each finished one, list the ones given up on."""

    failed: list[tuple[Batch, str]] = field(default_factory=list)
    #: runs in this process with the driver's model (the driver loads it once for cells and tasks)
    in_process: bool = True

    @contextmanager
    def opened(self) -> Iterator[None]:
        """What must be up before the first batch (a Ray connection). The sweep opens it
        before showing any progress, so a failure to connect is one line, not a bar and a line."""
        yield

    def run(self, spec: WorkerSpec, todo: list[Batch], finished: Callable[[list[dict]], None], progress) -> None:
        """Run every batch of `todo` on workers `spec` builds; `finished(lines)` after each one."""
        raise NotImplementedError


@dataclass
class LocalExecutor(Executor):
    """Every batch in this process, in order, through one worker (one model, one full-cache reference)."""

    def run(self, spec, todo, finished, progress) -> None:
        runner = spec.build()
        runner.reference(progress)
        for batch in todo:
            finished(runner.run(batch, progress))
