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

from ..errors import KvevictError
from .plan import SweepConfig
from .worker import Batch, Worker

#: `--executor` values
EXECUTORS = ("local", "ray")


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


def make_executor(name: str, address: str | None = None, workers: int = 2, retries: int = 2,
                  allow_download: bool = False) -> Executor:
    """The executor `--executor NAME` asks for, checked before any work: Ray's absence and an
    unreachable `address` are one line each, not a hang or a traceback."""
    if name not in EXECUTORS:
        raise KvevictError(f"--executor must be one of {', '.join(EXECUTORS)}, got '{name}'")
    if workers < 1:
        raise KvevictError(f"--workers must be at least 1, got {workers}")
    if retries < 0:
        raise KvevictError(f"--retries must be 0 or more, got {retries}")
    if name == "local":
        if address:
            raise KvevictError("--address is for --executor ray: drop it, or add --executor ray")
        return LocalExecutor()
    from .ray_executor import RayExecutor, check_reachable, import_ray

    import_ray()
    if address:
        check_reachable(address)
    return RayExecutor(address=address, workers=workers, retries=retries, allow_download=allow_download)
