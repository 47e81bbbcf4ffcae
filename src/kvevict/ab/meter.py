"""What one batch of a sweep costs: wall seconds and the process's peak memory while it ran.

Peak memory is the resident set's high-water mark of the process running the batch (a
local sweep's process, or a Ray worker). On Linux the mark is reset before each batch
(`/proc/self/clear_refs`, value 5), so each batch gets its own peak, not the largest of
every batch before it; where that is not possible the process-lifetime peak
(`getrusage`) is recorded and the record says so (`peak_mb_scope`). On a CUDA device the
peak of memory allocated by torch is recorded beside it.
"""

from __future__ import annotations

import re
import resource
import sys
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
    peak_mb_scope: str = "batch"  # "batch": reset before it; "process": the process's lifetime peak
    device_peak_mb: float | None = None

    def fields(self, tokens: int) -> dict:
        """The record fields of a batch that read `tokens` stream tokens (tokens/s is per row of the batch)."""
        data = {"seconds": self.seconds, "tokens_per_s": tokens / self.seconds if self.seconds > 0 else None,
                "peak_mb": self.peak_mb, "peak_mb_scope": self.peak_mb_scope}
        if self.device_peak_mb is not None:
            data["device_peak_mb"] = self.device_peak_mb
        return data


def _hwm_mb() -> float | None:
    try:
        found = re.search(r"VmHWM:\s+(\d+)\s+kB", STATUS.read_text())
    except OSError:
        return None
    return int(found.group(1)) / 1024 if found else None


def _reset_hwm() -> bool:
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


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
    cost = Cost()
    start = time.perf_counter()
    try:
        yield cost
    finally:
        cost.seconds = time.perf_counter() - start
        hwm = _hwm_mb() if reset else None
        cost.peak_mb, cost.peak_mb_scope = (hwm, "batch") if hwm is not None else (_lifetime_peak_mb(), "process")
        if cuda:
            cost.device_peak_mb = torch.cuda.max_memory_allocated(device) / 2**20
