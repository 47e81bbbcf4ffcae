"""Progress bars on stderr, so `--json` output on stdout stays machine-readable."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

_console = Console(stderr=True)


class _Silent:
    def add_task(self, *args, **kwargs) -> int:
        return 0

    def advance(self, *args, **kwargs) -> None:
        pass

    def update(self, *args, **kwargs) -> None:
        pass

    def remove_task(self, *args, **kwargs) -> None:
        pass


@contextmanager
def bars(enabled: bool | Progress | _Silent = True) -> Iterator[Progress | _Silent]:
    """A rich Progress on stderr (or a no-op stand-in when disabled).

    Passing an existing Progress reuses it, so nested protocols add their bars to the
    caller's display (one bar for the sweep, one for the current cell).
    """
    if isinstance(enabled, (Progress, _Silent)):
        yield enabled
        return
    if not enabled:
        yield _Silent()
        return
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=_console,
        transient=False,
    )
    with progress:
        yield progress
