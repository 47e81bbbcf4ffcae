"""What one batch of a sweep costs: wall seconds and the process's peak memory while it ran.

Peak memory is the resident set's high-water mark of the process running the batch (a
local sweep's process, or a Ray worker). On Linux the mark is reset before each batch
(`/proc/self/clear_refs`, value 5), so each batch gets its own peak, not the largest of
every batch before it.

Some kernels and sandboxes accept the write and keep the old mark, and "after the write
the mark equals the resident set" cannot tell a reset that took from a process that
simply stands at its peak (an allocator that keeps freed memory keeps it resident). So
the reset is *proved* on every use: a probe maps `PROBE_MB` of anonymous memory, touches
it and unmaps it (the kernel takes it back whatever the allocator does), which leaves
the mark at least `PROBE_MB` above the resident set; only a reset that brings the mark
back down to the resident set counts. Where the gap does not appear or does not close,
a thread samples the resident set every few milliseconds while the batch runs
(`peak_mb_scope` "sampled": it can miss a spike shorter than the interval). Without
`/proc` the process-lifetime peak (`getrusage`) is recorded, marked "process". On a CUDA
device the peak of memory allocated by torch is recorded beside it.
"""

from __future__ import annotations

import mmap
import re
import resource
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


@dataclass
class Cost:
    """Filled in when the measured block ends."""

    seconds: float = 0.0
    peak_mb: float = 0.0
    peak_mb_scope: str = "batch"  # "batch": mark reset before it; "sampled": polled during it; "process": lifetime
    device_peak_mb: float | None = None

    def fields(self, tokens: int) -> dict:
        """The record fields of a batch that read `tokens` stream tokens (tokens/s is per row of the batch)."""
        data = {"batch_seconds": self.seconds, "tokens_per_s": tokens / self.seconds if self.seconds > 0 else None,
                "peak_mb": self.peak_mb, "peak_mb_scope": self.peak_mb_scope}
        if self.device_peak_mb is not None:
            data["device_peak_mb"] = self.device_peak_mb
        return data


SAMPLE_SECONDS = 0.005


def _status_mb() -> tuple[float, float] | None:
    """(high-water mark, resident set) in MiB, read together from one `/proc/self/status`."""
    try:
        text = STATUS.read_text()
    except OSError:
        return None
    hwm, rss = re.search(r"VmHWM:\s+(\d+)\s+kB", text), re.search(r"VmRSS:\s+(\d+)\s+kB", text)
    return (int(hwm.group(1)) / 1024, int(rss.group(1)) / 1024) if hwm and rss else None


#: the probe's mapping: the gap it opens between the mark and the resident set must close on a reset
PROBE_MB = 32


def _open_gap() -> bool:
    """Raise the mark `PROBE_MB` above the resident set; True if the gap is there to see."""
    size = PROBE_MB * 2**20
    block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        step = mmap.PAGESIZE
        for offset in range(0, size, step):  # touch every page: resident now
            block[offset] = 1
    finally:
        block.close()  # munmap: resident no more, but the mark remembers it
    now = _status_mb()
    return now is not None and now[0] - now[1] >= PROBE_MB / 2


def _reset_hwm() -> bool:
    """Reset the high-water mark; True only if the reset is proved to have moved the mark down."""
    if not _open_gap():
        return False  # the mark does not show the probe: nothing this process can prove
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        return False
    now = _status_mb()
    return now is not None and now[0] - now[1] < PROBE_MB / 4


class _RssSampler:
    """Largest resident set seen while running: polls `/proc/self/status` from a daemon thread."""

    def __init__(self):
        now = _status_mb()
        self.peak = now[1] if now else 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            now = _status_mb()
            if now:
                self.peak = max(self.peak, now[1])

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        now = _status_mb()
        return max(self.peak, now[1]) if now else self.peak


def _lifetime_peak_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, kB on Linux


@contextmanager
def measure(device=None) -> Iterator[Cost]:
    """Time the block and take its peak memory; `device` a torch device whose peak to record too."""
    import torch

    cuda = device is not None and torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    reset = _reset_hwm()
    sampler = None if reset or _status_mb() is None else _RssSampler()
    cost = Cost()
    start = time.perf_counter()
    try:
        yield cost
    finally:
        cost.seconds = time.perf_counter() - start
        if reset:
            cost.peak_mb, cost.peak_mb_scope = _status_mb()[0], "batch"
        elif sampler is not None:
            cost.peak_mb, cost.peak_mb_scope = sampler.stop(), "sampled"
        else:
            cost.peak_mb, cost.peak_mb_scope = _lifetime_peak_mb(), "process"
        if cuda:
            cost.device_peak_mb = torch.cuda.max_memory_allocated(device) / 2**20
