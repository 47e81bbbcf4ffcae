"""What one batch of a sweep costs: wall seconds and the process's peak memory while it ran.

Peak memory is the resident set's high-water mark of the process running the batch (a
local sweep's process, or a Ray worker). On Linux the mark is reset before each batch
(`/proc/self/clear_refs`, value 5), so each batch gets its own peak, not the largest of
every batch before it. Some kernels and sandboxes accept the write and keep the old mark,
so the reset is checked (after it the mark must equal the resident set); where it did not
take, a thread samples the resident set every few milliseconds while the batch runs
(`peak_mb_scope` "sampled": it can miss a spike shorter than the interval). Without
`/proc` the process-lifetime peak (`getrusage`) is recorded, marked "process". On a CUDA
device the peak of memory allocated by torch is recorded beside it.
"""

from __future__ import annotations

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
        data = {"seconds": self.seconds, "tokens_per_s": tokens / self.seconds if self.seconds > 0 else None,
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


def _reset_hwm() -> bool:
    """Reset the high-water mark; True only if it took (the mark now equals the resident set)."""
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        return False
    now = _status_mb()
    return now is not None and now[0] - now[1] <= 2.0


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
