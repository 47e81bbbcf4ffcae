"""The envelope of a search's probes: per configuration the smallest budget inside the tolerance.

Every probe is judged by the tolerance rule (`tolerance`: the whole paired 95% interval
of the difference from the full cache inside the stated limit, else outside or
undecided), here and in the search itself (`ab/envelope.py` calls `judge_probe`), so
what the search decided and what the report shows are the same decision. The rest is
read off the probes: the smallest budget judged inside, the largest budget below it
judged not inside (the first that fails), and their KV bytes as the cache counted
them (`memory()` at the end of the stream: entries actually held, in the loaded dtype).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import KvevictError
from ..records.schema import PplRecord
from ..stats.judge import Measured, judge
from ..stats.tolerance import Judgement, Tolerance, judge_ppl
from ..stats.uncertainty import blocks
from .columns import Column, Table, number
from .traits import kv_width


def tolerance_of(max_ppl_ratio: float | None, max_kl: float | None) -> Tolerance:
    """The rule's tolerance: perplexity always (the search is on a stream), KL too when given; every value
    checked by `Tolerance` itself (one line naming the fix)."""
    if max_ppl_ratio is None:
        raise KvevictError("give --max-ppl-ratio (e.g. 1.05: PPL within 5% of the full cache); --max-kl adds KL")
    return Tolerance(max_ppl_ratio=max_ppl_ratio, max_kl=max_kl)


def judge_probe(probe: PplRecord, full: PplRecord, tolerance: Tolerance) -> Judgement:
    """One probe against the full cache on every metric the tolerance bounds (PPL ratio; KL when set): inside
    only when inside on all of them, outside when outside on any; the judgement returned is the one that
    decided."""
    found = judge(Measured(blocks(probe.curve, "ppl"), blocks(probe.kl_curve, "kl"), stream=True),
                  Measured(blocks(full.curve, "ppl")), tolerance)
    if found.missing:
        raise KvevictError(f"the probe of {probe.name} at budget {probe.budget} holds no curve to judge: "
                           "remove its line from results.jsonl and rerun to measure it again")
    return found.deciding


@dataclass(frozen=True)
class Probe:
    """One measured budget of one configuration, with its judgement."""

    record: PplRecord
    judgement: Judgement

    @property
    def budget(self) -> int:
        return int(self.record.budget)

    @property
    def inside(self) -> bool:
        return self.judgement.outcome == "inside"

    @property
    def share(self) -> float | None:
        """KV bytes held over a full cache's bytes for the same stream."""
        r = self.record
        return r.kv_bytes / r.full_kv_bytes if r.kv_bytes is not None and r.full_kv_bytes else None

    @property
    def share_bf16(self) -> float | None:
        """The same share with every float at 2 bytes, as on an accelerator: a float32 run's quantized cache
        keeps float32 scales and zero points, so its share held understates what it costs beside a bf16 cache."""
        r = self.record
        return r.kv_bytes_bf16 / r.full_kv_bytes_bf16 if r.kv_bytes_bf16 is not None and r.full_kv_bytes_bf16 else None

    @property
    def cost(self) -> int:
        """What the verdict ranks by: the bytes at bf16 where recorded (widths compare as deployed), else held."""
        r = self.record
        return r.kv_bytes_bf16 if r.kv_bytes_bf16 is not None else (r.kv_bytes or 0)


@dataclass(frozen=True)
class EnvelopeRow:
    """One configuration's probes (by budget), the smallest inside and the first below it that fails."""

    name: str
    spec: str
    probes: tuple[Probe, ...]

    @property
    def smallest(self) -> Probe | None:
        return min((p for p in self.probes if p.inside), key=lambda p: p.budget, default=None)

    @property
    def failing(self) -> Probe | None:
        top = self.smallest.budget if self.smallest is not None else math.inf
        return max((p for p in self.probes if not p.inside and p.budget < top), key=lambda p: p.budget, default=None)

    @property
    def eviction_only(self) -> bool:
        """The configuration holds its entries at full width (no storage form, as its policy declares)."""
        return kv_width(self.spec) is None


def envelope_rows(records: list[PplRecord], tolerance: Tolerance) -> tuple[PplRecord | None, list[EnvelopeRow]]:
    """The full-cache record and one row per configuration found among the probes, in first-seen order."""
    full = next((r for r in records if r.kind == "full"), None)
    if full is None:
        return None, []
    by_spec: dict[str, list[PplRecord]] = {}
    for r in records:
        if r.kind == "policy" and r.budget is not None:
            by_spec.setdefault(r.policy, []).append(r)
    rows = []
    for spec, probes in by_spec.items():
        judged = tuple(Probe(r, judge_probe(r, full, tolerance)) for r in sorted(probes, key=lambda r: r.budget))
        rows.append(EnvelopeRow(probes[0].name, spec, judged))
    return full, rows


def mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.2f} MiB"


def quality(probe: Probe | None) -> str:
    """A judgement's estimate and interval, e.g. `1.031 [1.012, 1.049]`."""
    if probe is None:
        return "-"
    j = probe.judgement
    return f"{j.estimate:.3f} [{j.low:.3f}, {j.high:.3f}]"


def _share(probe: Probe | None, bf16: bool = False) -> str:
    share = None if probe is None else probe.share_bf16 if bf16 else probe.share
    return "-" if share is None else f"{100 * share:.1f}%"


ENVELOPE: list[Column[EnvelopeRow]] = [
    Column("configuration", lambda r: r.name, "left"),
    Column("smallest inside", lambda r: number(r.smallest and r.smallest.budget)),
    Column("KV bytes", lambda r: mib(r.smallest and r.smallest.record.kv_bytes)),
    Column("of full", lambda r: _share(r.smallest)),
    Column("of full bf16", lambda r: _share(r.smallest, bf16=True), drop=5),
    Column("quality there [95%]", lambda r: quality(r.smallest)),
    Column("first failing", lambda r: number(r.failing and r.failing.budget), drop=2),
    Column("quality there [95%] ", lambda r: quality(r.failing), drop=1),
    Column("outcome there", lambda r: r.failing.judgement.outcome if r.failing else "-", drop=3),
    Column("probes", lambda r: str(len(r.probes)), drop=4),
]


def envelope_table(rows: list[EnvelopeRow]) -> Table:
    """The envelope: configuration -> smallest budget inside, its bytes and share, quality, the first failure."""
    return Table.of(ENVELOPE, rows)


def _describe(row: EnvelopeRow, full: PplRecord) -> str:
    p = row.smallest
    bf16 = "" if p.share_bf16 is None else f", {_share(p, bf16=True)} at bf16"
    return (f"{row.name} at {p.budget} entries ({mib(p.record.kv_bytes)}, {_share(p)} of the full cache's "
            f"{mib(p.record.full_kv_bytes)}{bf16}; {p.judgement.metric} {quality(p)})")


def envelope_verdict(full: PplRecord | None, rows: list[EnvelopeRow], tolerance: Tolerance) -> str:
    """The sentence: the cheapest configuration inside the tolerance (by KV bytes at bf16, `Probe.cost`) and the
    cheapest eviction-only one; or that none is inside below the stream's length, naming the closest."""
    limit = describe_tolerance(tolerance)
    if full is None or not rows:
        return "Nothing measured yet: rerun the same command to continue the search."
    unsound = unsound_reference(full, rows, tolerance)
    if unsound is not None:
        return unsound
    inside = sorted((r for r in rows if r.smallest is not None), key=lambda r: r.smallest.cost)
    if not inside:
        probes = [p for r in rows for p in r.probes]
        best = min(probes, key=lambda p: p.judgement.high)
        return (f"No configuration is within tolerance ({limit}) below the full length of {full.tokens} tokens; "
                f"the closest is {best.record.name} at {best.budget} entries ({best.judgement.metric} "
                f"{quality(best)}, {best.judgement.outcome}).")
    sentence = f"Within tolerance ({limit}), the cheapest configuration is {_describe(inside[0], full)}"
    evicting = [r for r in inside if r.eviction_only]
    if evicting and evicting[0] is inside[0]:
        return sentence + "; it is also the cheapest eviction-only one."
    if evicting:
        return sentence + f"; the cheapest eviction-only one is {_describe(evicting[0], full)}."
    return sentence + "; no eviction-only configuration is within tolerance."


def unsound_reference(full: PplRecord, rows: list[EnvelopeRow], tolerance: Tolerance) -> str | None:
    """Undecided, and why, where some probe's whole paired PPL interval lies below the full cache's (ratio < 1):
    the full cache is then not the better model (a stream past the positions the model was trained on degrades
    it), so being within a tolerance of it shows nothing safe. None where the full cache is a sound reference.
    The same test as the A/B verdict's (`verdict.Unsound`), on the envelope's probes."""
    reference = blocks(full.curve, "ppl")
    better = []
    for row in rows:
        for p in row.probes:
            found = judge_ppl(blocks(p.record.curve, "ppl"), reference, tolerance)
            if found is not None and found.high < 1:
                better.append((row, p, found))
    if not better:
        return None
    row, p, found = min(better, key=lambda b: b[2].high)
    names = sorted({b[0].name for b in better})
    return (f"Undecided: the full cache is not a sound reference on this stream ({', '.join(names)} "
            f"{'is' if len(names) == 1 else 'are'} wholly better than it, e.g. {row.name} at {p.budget} entries: "
            f"PPL {p.record.ppl:.2f} against {full.ppl:.2f}, ratio {found.estimate:.3f} [{found.low:.3f}, "
            f"{found.high:.3f}]). A stream past the positions the model was trained on degrades the full cache "
            f"itself, so a budget within a tolerance of it is not shown safe: search a length the model was "
            f"trained on.")


def describe_tolerance(tolerance: Tolerance) -> str:
    """The tolerance in words, as the report states it."""
    parts = [f"PPL within {100 * (tolerance.max_ppl_ratio - 1):.4g}% of the full cache"]
    if tolerance.max_kl is not None:
        parts.append(f"KL(full || policy) at most {tolerance.max_kl:g} nats")
    level = round(100 * tolerance.confidence)
    return " and ".join(parts) + f", the whole paired {level}% interval"


def lengths_table(per_length: dict[int, list[EnvelopeRow]]) -> Table:
    """Context length as a second axis: per configuration, the smallest budget inside at each length (with its
    share of that length's full cache), `none` where no budget below the length was inside."""
    lengths = sorted(per_length)
    names = list(dict.fromkeys(r.name for rows in per_length.values() for r in rows))

    def cell(name: str, length: int) -> str:
        row = next((r for r in per_length[length] if r.name == name), None)
        if row is None:
            return "-"
        return "none" if row.smallest is None else f"{row.smallest.budget} ({_share(row.smallest)})"

    return Table(["configuration"] + [f"{n} tokens" for n in lengths],
                 [[name] + [cell(name, n) for n in lengths] for name in names])
