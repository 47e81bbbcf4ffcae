"""The tables of a run, declared once as column specs: the terminal, the HTML report and Markdown show the same.

`SUMMARY` is the A/B summary (`kvevict ab`, the report's first table, `kvevict report
--markdown`). Its `drop` numbers are the documented order in which a narrow terminal
leaves columns out: peak MB, ppl 95% CI, tokens/s, batch seconds, kept, mean kept, top-1
agree, sink loss, KL to full, ppl / full, KV MiB/seq, KV MiB/seq bf16; policy, budget and
ppl always stay. The KV bytes per sequence, as held and at bf16 (`kv_bytes`), are shown
where the records carry the bf16 figure. "kept" is the
most a layer held, "mean kept" what it held on average (`MEAN_KEPT`, shown when the records
carry it: run folders written before it lack the figure). An oracle row
with fewer than `MIN_ORACLE_PREDICTIONS` re-computed predictions shows "n too small".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..records.schema import PplRecord
from ..stats.uncertainty import blocks, mean_interval
from . import traits
from .columns import KV_BF16, KV_HELD, MEAN_KEPT, Column, Table, mean_kept, number
from .kv_bytes import RowBytes, mib, row_bytes

KIND_ORDER = {"full": 0, "oracle": 1, "policy": 2, "sinks": 3}


@dataclass(frozen=True)
class SummaryRow:
    """One row of the summary: a perplexity cell, the full cache's PPL to compare it with, and its KV bytes per
    sequence (`kv_bytes.row_bytes`)."""

    record: PplRecord
    full_ppl: float | None
    kv: RowBytes = RowBytes(None, None)

    @property
    def ppl_over_full(self) -> float | None:
        # the oracle scores a strided sample: it is compared with the full cache on those same tokens
        if not self.full_ppl:
            return None
        return self.record.ppl / (self.record.full_ppl_same_tokens or self.full_ppl)


def ppl_text(r: PplRecord) -> str:
    """A row's PPL as every table shows it: "n too small (k)" for an oracle of too few re-computed predictions."""
    return number(r.ppl) if r.enough else f"n too small ({r.recomputed})"


def _ppl_interval(s: SummaryRow) -> str:
    found = blocks(s.record.curve, "ppl") if s.record.enough else None
    return "-" if found is None else mean_interval(found, exp=True).text()


def _when_enough(value, digits: int = 2):
    return lambda s: number(value(s) if s.record.enough else None, digits)


SUMMARY: list[Column[SummaryRow]] = [
    Column("policy", lambda s: s.record.name, align="left"),
    Column("budget", lambda s: number(s.record.budget)),
    Column("ppl", lambda s: ppl_text(s.record)),
    Column("ppl 95% CI", _ppl_interval, drop=0),
    Column("ppl / full", _when_enough(lambda s: s.ppl_over_full), drop=7),
    Column("KL to full", _when_enough(lambda s: s.record.kl_to_full, 3), drop=6),
    Column("top-1 agree", _when_enough(lambda s: s.record.top1_agreement, 3), drop=4),
    Column("sink loss", lambda s: number(s.record.sink_share), drop=5),
    Column("kept", lambda s: number(s.record.max_kept), drop=3),
    Column(MEAN_KEPT, lambda s: mean_kept(s.record.mean_kept), drop=3),  # left out right after "kept"
    Column(KV_HELD, lambda s: mib(s.kv.held), drop=8),
    Column(KV_BF16, lambda s: mib(s.kv.bf16), drop=9),
    Column("batch seconds", lambda s: number(s.record.batch_seconds, 1), drop=2),
    Column("tokens/s", lambda s: number(s.record.tokens_per_s, 0), drop=1),
    Column("peak MB", lambda s: number(s.record.peak_mb, 0), drop=-1),
]
#: what a cell cost, recorded since timing and memory joined the records: left out for older run folders
COST_COLUMNS = ("tokens/s", "peak MB")
#: KV bytes per sequence, shown where the records carry the bf16 figure (older run folders lack it)
BYTES_COLUMNS = (KV_HELD, KV_BF16)


def summary_rows(records: Sequence[PplRecord]) -> list[SummaryRow]:
    """Full cache first, then per budget the oracle and every policy (a sink-sweep row that
    repeats a policy row at the same budget is shown once)."""
    records = [r for r in records if r.kind in KIND_ORDER]
    full = next((r for r in records if r.kind == "full"), None)
    base = full.ppl if full else None
    unique: dict[str, PplRecord] = {}
    for r in records:
        if r.kind == "sinks" and any(
            o.kind == "policy" and o.policy == r.policy and o.budget == r.budget for o in records
        ):
            continue
        unique[r.key] = r
    ordered = sorted(unique.values(), key=lambda r: (r.budget or 0, KIND_ORDER[r.kind], r.name))
    return [SummaryRow(r, base, row_bytes(r, records)) for r in ordered]


def summary_table(records: Sequence[PplRecord]) -> Table:
    rows = summary_rows(records)
    measured = any(r.record.peak_mb is not None for r in rows)
    held = any(r.record.mean_kept is not None for r in rows)
    sized = any(r.kv.bf16 is not None for r in rows)
    return Table.of(
        [c for c in SUMMARY if (measured or c.header not in COST_COLUMNS) and (held or c.header != MEAN_KEPT)
         and (sized or c.header not in BYTES_COLUMNS)], rows
    )


def sinks_table(records: Sequence[PplRecord]) -> Table | None:
    """StreamingLLM's sink-count table: rows = pinned sinks, columns = budgets, cells = PPL."""
    rows = [r for r in records if r.kind == "sinks"]
    if not rows:
        return None
    budgets = sorted({r.budget for r in rows})
    pinned = {r.name: traits.pinned(r.policy) for r in rows}
    labels = sorted(pinned, key=lambda label: pinned[label])
    body = []
    for label in labels:
        line = [label]
        for b in budgets:
            match = next((r for r in rows if r.name == label and r.budget == b), None)
            line.append(number(match.ppl) if match else "-")
        body.append(line)
    return Table(["policy"] + [f"budget {b}" for b in budgets], body)


def layer_budget_table(records: Sequence[PplRecord]) -> Table | None:
    """Entries each layer kept, for rows whose policy gives layers their own budget (pyramidkv):
    one row per (policy, budget), one column per layer, bottom layer first."""
    rows = sorted((r for r in records if r.layer_budgets), key=lambda r: (r.budget or 0, r.name))
    if not rows:
        return None
    layers = max(len(r.layer_budgets) for r in rows)
    body = [[r.name, number(r.budget), *(str(b) for b in r.layer_budgets)] for r in rows]
    return Table(["policy", "budget", *(f"L{i}" for i in range(layers))], body)


def budget_order(budget: object) -> tuple:
    """full first, then percentages and entry counts from the largest down."""
    text = str(budget)
    if text == "full":
        return (0, 0.0)
    value = float(text.rstrip("%"))
    return (1 if text.endswith("%") else 2, -value)


GENERATION: list[Column[dict]] = [
    Column("policy", lambda r: r["policy"], align="left"),
    Column("budget", lambda r: str(r["budget"])),
    Column("repetition", lambda r: f"{r['repetition']:.3f}"),
    Column("recall", lambda r: f"{r['recall']:.2f}"),
    Column("output tokens", lambda r: f"{r['output_tokens']:.1f}"),
    Column("trials", lambda r: str(r["trials"])),
]


def generation_table(rows: Sequence[dict]) -> Table:
    """The generation summary (`GenerationResult.summary()` rows)."""
    return Table.of(GENERATION, rows)


NEEDLE: list[Column[dict]] = [
    Column("policy", lambda c: c["policy"], align="left"),
    Column("budget", lambda c: str(c["budget"])),
    Column("length", lambda c: str(c["length"])),
    Column("depth", lambda c: f"{c['depth']:g}"),
    Column("accuracy", lambda c: f"{c['accuracy']:.2f}"),
    Column("trials", lambda c: str(c["trials"])),
    Column(KV_BF16, lambda c: mib(c.get("kv_bytes_bf16"))),
]


def needle_table(cells: Sequence[dict]) -> Table:
    """The needle cells (`NeedleResult.cells()`), one line each, sorted by policy, budget, length, depth."""
    ordered = sorted(cells, key=lambda c: (c["policy"], str(c["budget"]), c["length"], c["depth"]))
    return Table.of(NEEDLE, ordered)


def needle_grid(cells: Sequence[dict]) -> Table:
    """The needle cells as a grid: rows = policy at budget, columns = length@depth, entries = accuracy; the last
    column the KV MiB per sequence at bf16 each row's cache held once compressed (per length, shortest first,
    where the row spans several)."""
    columns = sorted({(c["length"], c["depth"]) for c in cells})
    rows: dict[tuple, dict] = {}
    held: dict[tuple, dict[int, list]] = {}
    for c in cells:
        rows.setdefault((c["policy"], str(c["budget"])), {})[(c["length"], c["depth"])] = c["accuracy"]
        held.setdefault((c["policy"], str(c["budget"])), {}).setdefault(c["length"], []).append(c.get("kv_bytes_bf16"))
    body = []
    for key, values in rows.items():
        entries = [f"{values[col]:.2f}" if col in values else "-" for col in columns]
        body.append([*key, *entries, f"{sum(values.values()) / len(values):.2f}", _held_mib(held[key])])
    return Table(["policy", "budget", *[f"{n}@{d:g}" for n, d in columns], "mean", "KV MiB/seq bf16"], body)


def _held_mib(by_length: dict[int, list]) -> str:
    """`1.25` or, over several lengths, `0.62 / 1.25 / 2.5`; `-` where a cell holds no byte figure."""
    means = []
    for length in sorted(by_length):
        sizes = by_length[length]
        if None in sizes:
            return "-"
        means.append(sum(sizes) / len(sizes))
    return " / ".join(mib(m) for m in means)


def needle_markdown(cells: Sequence[dict]) -> str:
    """The needle grid as a Markdown table: one row per policy and budget, one column per length and depth,
    cells as hits/trials (for the README and docs, regenerated from `--save` JSON)."""
    columns = sorted({(c["length"], c["depth"]) for c in cells})
    rows: dict[tuple, dict] = {}
    for c in cells:
        rows.setdefault((c["policy"], str(c["budget"])), {})[(c["length"], c["depth"])] = c
    body = []
    for (policy, budget), found in sorted(rows.items(), key=lambda kv: (budget_order(kv[0][1]), kv[0][0])):
        hits = {col: round(c["accuracy"] * c["trials"]) for col, c in found.items()}
        entries = [f"{hits[col]}/{found[col]['trials']}" if col in found else "-" for col in columns]
        total = f"{sum(hits.values())}/{sum(c['trials'] for c in found.values())}"
        body.append([policy, budget, *entries, total])
    return Table(["policy", "budget", *[f"{n} @ {d:g}" for n, d in columns], "all"], body).markdown()
