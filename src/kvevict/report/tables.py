"""Tables of a sweep: the same rows feed the terminal summary and the HTML report."""

from __future__ import annotations

KIND_ORDER = {"full": 0, "oracle": 1, "policy": 2, "sinks": 3}
COLUMNS = ["policy", "budget", "ppl", "ppl / full", "KL to full", "top-1 agree", "sink loss", "kept", "seconds"]


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def summary_rows(records: list[dict]) -> list[list[str]]:
    """Full cache first, then per budget the oracle and every policy."""
    records = [r for r in records if r.get("kind") in KIND_ORDER]
    full = next((r for r in records if r["kind"] == "full"), None)
    base = full["ppl"] if full else None
    unique = {}
    for r in records:
        if r["kind"] == "sinks" and any(
            o["kind"] == "policy" and o["policy"] == r["policy"] and o["budget"] == r["budget"] for o in records
        ):
            continue  # the same row is already in the policy table
        unique[r["key"]] = r
    ordered = sorted(
        unique.values(), key=lambda r: (r["budget"] or 0, KIND_ORDER[r["kind"]], r.get("label") or r["policy"])
    )
    rows = []
    for r in ordered:
        rows.append(
            [
                r.get("label") or r["policy"],
                _fmt(r["budget"]),
                _fmt(r["ppl"]),
                _fmt(r["ppl"] / (r.get("full_ppl_same_tokens") or base) if base else None),
                _fmt(r.get("kl_to_full"), 3),
                _fmt(r.get("top1_agreement"), 3),
                _fmt(r.get("sink_loss")),
                _fmt(r.get("max_kept")),
                _fmt(r.get("seconds"), 1),
            ]
        )
    return rows


def sinks_table(records: list[dict]) -> tuple[list[str], list[list[str]]] | None:
    """StreamingLLM's sink-count table: rows = pinned sinks, columns = budgets, cells = PPL."""
    rows = [r for r in records if r["kind"] == "sinks"]
    if not rows:
        return None
    budgets = sorted({r["budget"] for r in rows})
    labels = sorted({r["label"] for r in rows}, key=lambda s: 0 if s == "window" else int(s[4 : s.index("+")]))
    header = ["policy"] + [f"budget {b}" for b in budgets]
    body = []
    for label in labels:
        line = [label]
        for b in budgets:
            match = next((r for r in rows if r["label"] == label and r["budget"] == b), None)
            line.append(_fmt(match["ppl"]) if match else "-")
        body.append(line)
    return header, body


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
