"""RULER cells at equal bytes: fewer entries against fewer bits per entry, on the same answers.

The perplexity side has `kv_bytes.equal_bytes`; this is its counterpart for tasks. Each RULER
answer records the KV bytes its cache held once the context was compressed (`kv_bytes_bf16`).
Within one protocol, task and length, the cells (a policy at a budget, and the full cache) whose
mean bf16 bytes lie within `kv_bytes.EQUAL_BYTES` of each other form a group, kept where it holds
more than one storage width (at one width equal bytes are equal entries, which the verdict per
budget already compares). In a group the cell with the most answers right leads; every other is
set against it on the answers both gave, with the paired 95% interval of the accuracy difference
(`tolerance.drop_interval`, the verdict's interval for paired answers). The leader is named ahead
*beyond the noise* only where every other cell's interval lies wholly above 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..records.schema import RulerRecord
from ..stats.tolerance import drop_interval
from .kv_bytes import EQUAL_BYTES, mib
from .ruler import where_label
from .traits import kv_width

LEVEL = 0.95


@dataclass(frozen=True)
class TaskCell:
    """One policy at one budget on one protocol, task and length: its scores by answer, its mean bf16 bytes."""

    policy: str
    budget: str
    scores: dict[tuple, float]  # (sample, question) -> score
    bf16: float

    @property
    def name(self) -> str:
        return "full cache" if self.budget == "full" else f"{self.policy} at {self.budget}"

    @property
    def accuracy(self) -> float:
        return sum(self.scores.values()) / len(self.scores)


@dataclass(frozen=True)
class Behind:
    """A cell against its group's leader on the answers both gave: the leader's accuracy minus its own, in [0, 1],
    with the paired interval (`low` > 0: behind beyond the noise)."""

    cell: TaskCell
    n: int
    difference: float
    low: float
    high: float


@dataclass(frozen=True)
class TaskEqualBytes:
    """A group of cells at equal bytes on `where` (protocol, task@length): the `leader` and the rest against it."""

    where: str
    leader: TaskCell
    others: list[Behind]

    def sentence(self) -> str:
        """`At equal bytes on agnostic niah_single_1@2048, 1.41-1.44 MiB per sequence (bf16): most right q4+tova at
        1638 (1.00), beyond the noise; against it: tova at 512 -0.45 [-0.66, -0.24] (n=20), ...`."""
        sizes = sorted({mib(c.bf16) for c in (self.leader, *(b.cell for b in self.others))}, key=float)
        span = sizes[0] if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
        close = [b.cell.name for b in self.others if b.low <= 0]
        head = (f"At equal bytes on {self.where}, {span} MiB per sequence (bf16): most right {self.leader.name} "
                f"({self.leader.accuracy:.2f})")
        head += ", beyond the noise" if not close else f", not told apart from {', '.join(close)}"
        parts = [f"{b.cell.name} {-b.difference:+.2f} [{-b.high:+.2f}, {-b.low:+.2f}] (n={b.n})" for b in self.others]
        return head + "; accuracy against it: " + ", ".join(parts) + "."


def task_equal_bytes(records: Sequence[RulerRecord], within: float = EQUAL_BYTES) -> list[TaskEqualBytes]:
    """The groups of RULER cells at equal bf16 bytes (module docstring), per protocol, task and length, smallest
    bytes first. Cells without a byte figure on every answer (records written before it) are left out."""
    by_where: dict[str, dict[tuple[str, str], list[RulerRecord]]] = {}
    for r in records:
        label = f"{r.shape} {where_label(r.task, r.cell_length)}"
        by_where.setdefault(label, {}).setdefault((r.policy, r.budget), []).append(r)
    found = []
    for where, cells in by_where.items():
        sized = sorted((c for c in (_cell(key, rows) for key, rows in cells.items()) if c is not None),
                       key=lambda c: c.bf16)
        i = 0
        while i < len(sized):
            j = i
            while j + 1 < len(sized) and sized[j + 1].bf16 <= sized[i].bf16 * (1 + within):
                j += 1
            group = sized[i : j + 1]
            if len({kv_width(c.policy) if c.budget != "full" else None for c in group}) > 1:
                found.append(_compared(where, group))
            i = j + 1
    return found


def _cell(key: tuple[str, str], rows: list[RulerRecord]) -> TaskCell | None:
    sizes = [r.kv_bytes_bf16 for r in rows]
    if None in sizes:
        return None
    return TaskCell(key[0], key[1], {(r.sample, r.question): float(r.score) for r in rows}, sum(sizes) / len(sizes))


def _compared(where: str, group: list[TaskCell]) -> TaskEqualBytes:
    leader = max(group, key=lambda c: (c.accuracy, -c.bf16))
    others = []
    for cell in sorted((c for c in group if c is not leader), key=lambda c: -c.accuracy):
        shared = sorted(set(cell.scores) & set(leader.scores))
        if not shared:
            continue
        mine = np.array([cell.scores[u] for u in shared])
        best = np.array([leader.scores[u] for u in shared])
        low, high = drop_interval(mine, best, LEVEL)
        others.append(Behind(cell, len(shared), float((best - mine).mean()), low, high))
    return TaskEqualBytes(where, leader, others)
