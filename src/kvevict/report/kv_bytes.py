"""KV bytes per sequence in every table, and which rows hold equal bytes.

Two levers cut KV memory: fewer entries (a smaller budget) and fewer bits per entry
(`q8+`, `q4+`, `q2+`, see docs/quantization.md). At one budget, rows of different widths
hold different bytes; at different budgets, rows can hold the same bytes (`q4+h2o` at
3276 entries and `h2o` at 1024 on SmolLM2). So every table shows a row's KV bytes per
sequence twice: as held (the run's dtype: float32 on a CPU) and at bf16 (every float at
2 bytes: what the same entries, codes, scales and zero points take on an accelerator,
where the ratio means what it would in deployment). And the report groups the rows whose
bf16 bytes lie within `EQUAL_BYTES` of each other, across budgets and widths: the rows to
compare at equal memory. Inside a group each row's PPL is set against the lowest one's,
paired over the same blocks of tokens (`uncertainty.paired_difference`): a row is named
lowest beyond the noise only where every other row's interval lies wholly above it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..records.schema import PplRecord
from ..stats.uncertainty import Interval, blocks, paired_difference
from .traits import kv_width

#: two rows hold equal bytes when the larger is within this share of the smaller (bf16 bytes per sequence)
EQUAL_BYTES = 0.05
MIB = 2**20


def mib(value: int | None) -> str:
    """A table cell: bytes as MiB to 4 significant digits (a 5% step shows at any size), `-` where the record holds
    no such figure."""
    return "-" if value is None else f"{value / MIB:.4g}"


@dataclass(frozen=True)
class RowBytes:
    """KV bytes per sequence of one row at the end of its stream: `held` in the run's dtype, `bf16` with every
    float at 2 bytes (None: not recorded, run folders written before the figure)."""

    held: int | None
    bf16: int | None


def row_bytes(record: PplRecord, records: Sequence[PplRecord]) -> RowBytes:
    """A row's bytes. The full cache's row runs no evicting cache; it holds every token of the stream, which is
    what the bounded rows of the same run recorded as `full_kv_bytes` (one figure, measured once per cache)."""
    if record.kind == "full":
        other = next((r for r in records if r.full_kv_bytes is not None), None)
        return RowBytes(None, None) if other is None else RowBytes(other.full_kv_bytes, other.full_kv_bytes_bf16)
    return RowBytes(record.kv_bytes, record.kv_bytes_bf16)


def summary_bytes(summaries: Sequence[dict]) -> list[RowBytes]:
    """`row_bytes` of `RowResult.summary()` rows (`kvevict compare`, the full cache's row first)."""
    other = next((s for s in summaries if "full_kv_bytes" in s), {})
    return [
        RowBytes(other.get("full_kv_bytes"), other.get("full_kv_bytes_bf16"))
        if s["budget"] is None and s["policy"] == "full" else RowBytes(s.get("kv_bytes"), s.get("kv_bytes_bf16"))
        for s in summaries
    ]


@dataclass(frozen=True)
class Versus:
    """One row of an equal-bytes group against the group's lowest PPL: `ratio` = its PPL / the lowest's, `interval`
    the paired interval of that ratio (None where the two rows' blocks differ)."""

    record: PplRecord
    bf16: int
    ratio: float
    interval: Interval | None

    @property
    def above(self) -> bool:
        """Worse than the lowest beyond the noise: the whole interval above 1."""
        return self.interval is not None and self.interval.low > 1


@dataclass(frozen=True)
class EqualBytes:
    """Rows within `EQUAL_BYTES` of each other's bf16 bytes, of more than one storage width. `lowest`: the lowest
    PPL; `others`: the rest against it, lowest ratio first."""

    lowest: PplRecord
    lowest_bf16: int
    others: list[Versus]

    @property
    def separated(self) -> bool:
        return all(v.above for v in self.others)

    def sentence(self) -> str:
        """`At equal bytes, 22.49-22.5 MiB per sequence (bf16): lowest PPL q8+h2o at 1820 (24.28), not told apart
        from q8+tova at 1820; PPL against it: q8+tova at 1820 ×1.001 [0.995, 1.008], h2o at 1024 ×1.006 [1.001,
        1.012], ...`."""
        sizes = sorted({mib(b) for b in (self.lowest_bf16, *(v.bf16 for v in self.others))}, key=float)
        span = sizes[0] if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
        head = f"At equal bytes, {span} MiB per sequence (bf16): lowest PPL {_row(self.lowest)} ({self.lowest.ppl:.2f})"
        close = [_row(v.record) for v in self.others if not v.above]
        head += ", beyond the noise" if not close else f", not told apart from {', '.join(close)}"
        parts = [f"{_row(v.record)} ×{v.ratio:.3f}" + (f" {v.interval.text(3)}" if v.interval else " (unpaired)")
                 for v in self.others]
        return head + "; PPL against it: " + ", ".join(parts) + "."


def _row(r: PplRecord) -> str:
    return r.name if r.kind == "full" else f"{r.name} at {r.budget}"


def equal_bytes(records: Sequence[PplRecord], within: float = EQUAL_BYTES) -> list[EqualBytes]:
    """The groups of rows at equal bf16 bytes (module docstring), smallest bytes first.

    Rows are the full cache and every policy row with recorded bytes (the oracle re-computes every token: a
    reference, not a cache one can serve with). Sorted by bf16 bytes, a group starts at its smallest row and takes
    every row up to (1 + `within`) times it, so any two rows of a group are within `within` of each other. A group
    is kept where it holds rows of more than one storage width: at one width equal bytes are equal entries, which
    the verdict per budget already compares."""
    sized = []
    for r in records:
        if r.kind in ("full", "policy", "sinks"):
            size = row_bytes(r, records).bf16
            if size is not None:
                sized.append((size, r))
    sized.sort(key=lambda pair: pair[0])
    found, i = [], 0
    while i < len(sized):
        j = i
        while j + 1 < len(sized) and sized[j + 1][0] <= sized[i][0] * (1 + within):
            j += 1
        group = _unique(sized[i : j + 1])
        if len({_width(r) for _, r in group}) > 1:
            found.append(_compared(group))
        i = j + 1
    return found


def _width(r: PplRecord) -> str | None:
    return None if r.kind == "full" else kv_width(r.policy)


def _unique(group: list[tuple[int, PplRecord]]) -> list[tuple[int, PplRecord]]:
    """A sink-sweep row that repeats a policy row at the same budget is one row (as in the summary table)."""
    seen, out = set(), []
    for size, r in group:
        if (r.policy, r.budget) not in seen:
            seen.add((r.policy, r.budget))
            out.append((size, r))
    return out


def _compared(group: list[tuple[int, PplRecord]]) -> EqualBytes:
    ordered = sorted(group, key=lambda pair: pair[1].ppl)
    size, lowest = ordered[0]
    base = blocks(lowest.curve, "ppl")
    others = []
    for other_size, r in ordered[1:]:
        mine = blocks(r.curve, "ppl")
        found = paired_difference(mine, base) if mine is not None and base is not None else None
        interval = None if found is None else Interval(math.exp(found.low), math.exp(found.high))
        others.append(Versus(r, other_size, r.ppl / lowest.ppl, interval))
    return EqualBytes(lowest, size, others)
