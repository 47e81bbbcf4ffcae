"""Executors: what runs a sweep's batches. `local` runs them in this process; `ray` on Ray workers.

An executor takes the batches (`worker.Batch`), runs them, and calls `finished(lines)`
with each batch's records as soon as it is done; the driver alone appends them to
`results.jsonl`. A batch the executor gives up on is listed in `failed` with the
reason; its cells stay unfinished, so a rerun of the same command runs them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from .plan import SweepConfig
from .worker import Batch, Worker


@dataclass
class Executor:
    """The interface: `run` every batch, report each finished one, list the ones given up on."""

    failed: list[tuple[Batch, str]] = field(default_factory=list)
    #: runs in this process with the driver's model (the driver loads it once for cells and tasks)
    in_process: bool = True

    @contextmanager
    def session(self) -> Iterator[None]:
        """What must be up before the first batch (a Ray connection). The sweep opens it
        before showing any progress, so a failure to connect is one line, not a bar and a line."""
        yield

    def run(self, config: SweepConfig, todo: list[Batch], worker: Callable[[], Worker],
            finished: Callable[[list[dict]], None], progress) -> None:
        raise NotImplementedError


@dataclass
class LocalExecutor(Executor):
    """Every batch in this process, in order, through one worker (one model, one full-cache reference)."""

    def run(self, config, todo, worker, finished, progress) -> None:
        runner = worker()
        runner.reference(progress)
        for batch in todo:
            finished(runner.run(batch, progress))
