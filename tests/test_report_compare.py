"""`kvevict report RUN RUN`: two run folders of hand-made records side by side in one HTML report and one
Markdown text; every number checked against the records' values written in this file."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from kvevict.records.schema import PplRecord, TaskRecord
from kvevict.records.store import ResultStore

from support import cli, one_line_error

# run A: 2 layers x 2 KV heads, with a needle test; run B: 3 layers x 2 KV heads, no needle test
A_FULL, B_FULL = 20.0, 10.0
A_ROWS = {("window", 8): (50.0, 4), ("sink4+window", 8): (22.0, 0), ("h2o", 8): (20.4, 1)}  # ppl, heads lost
B_ROWS = {("window", 8): (30.0, 4), ("sink4+window", 8): (11.0, 0), ("h2o", 16): (10.5, 0)}
A_HEADS, B_HEADS = (2, 2), (3, 2)
# pass-key hits per (policy, budget) as the needle protocol writes them: `full` for the full cache, else the entries
A_NEEDLE = {("full", "full"): [1, 1], ("window", 8): [0, 1], ("sink4+window", 8): [1, 1], ("h2o", 8): [1, 1, 0]}


def _flat(ppl: float) -> list[dict]:
    """20 windows of 10 predictions, each at `ppl`: the paired PPL ratio of two such rows is exactly theirs."""
    return [{"start": 1 + 10 * i, "end": 10 * (i + 1), "n": 10, "ppl": ppl} for i in range(20)]


def _row(name: str, budget: int, ppl: float, lost: int, heads: tuple[int, int]) -> PplRecord:
    layers, kv = heads
    flat = [5] * lost + [-1] * (layers * kv - lost)
    return PplRecord(f"policy|{name}|{budget}", "policy", name, budget, ppl, label=name, sink_loss=lost / len(flat),
                     sink_lost_at=[flat[i * kv:(i + 1) * kv] for i in range(layers)], curve=_flat(ppl))


def _run(folder: Path, model: str, text: str, tokens: int, full: float, rows: dict, heads, needle=None,
         start: str = "", tolerance: dict | None = None) -> Path:
    folder.mkdir()
    records = [PplRecord("full|full|None", "full", "full", None, full, label="full", curve=_flat(full))]
    records += [_row(name, budget, ppl, lost, heads) for (name, budget), (ppl, lost) in rows.items()]
    for (policy, budget), hits in (needle or {}).items():
        records += [TaskRecord(f"needle|{policy}|{budget}|{i}", "needle", 0, {
            "policy": policy, "budget": budget, "hit": h, "length": 100, "depth": 0.5, "trial": i,
            "budget_tokens": None if budget == "full" else budget})
            for i, h in enumerate(hits)]
    ResultStore(folder / "results.jsonl").append([r.to_dict() for r in records])
    config = {"model": model, "text": text, "tokens": tokens, "positions": "original", "seed": 0, "name": folder.name,
              "stream_start": start, **({"tolerance": tolerance} if tolerance else {})}
    (folder / "run.json").write_text(json.dumps({"config": config}))
    return folder


@pytest.fixture
def two_runs(tmp_path) -> tuple[Path, Path]:
    a = _run(tmp_path / "claims-a", "model-a", "pg-essays", 400, A_FULL, A_ROWS, A_HEADS, A_NEEDLE, start="<bos>")
    b = _run(tmp_path / "claims-b", "model-b", "other.txt", 800, B_FULL, B_ROWS, B_HEADS,
             tolerance={"max_ppl_ratio": 1.2})
    return a, b


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def expected_rows() -> list[list[str]]:
    """The side-by-side rows written from the constants above: full first, then by budget and name."""
    keys = [("full", None)] + sorted(set(A_ROWS) | set(B_ROWS), key=lambda k: (k[1], k[0]))
    out = []
    for name, budget in keys:
        line = [name, "-" if budget is None else str(budget)]
        for rows, full, (layers, kv), needle in ((A_ROWS, A_FULL, A_HEADS, A_NEEDLE), (B_ROWS, B_FULL, B_HEADS, None)):
            if name == "full":
                ppl, share = full, None
            elif (name, budget) in rows:
                ppl, lost = rows[(name, budget)]
                share = lost / (layers * kv)
            else:
                line += ["-"] * (4 if needle else 3)
                continue
            line += [_cell(ppl), _cell(ppl / full), _cell(share)]
            if needle:
                hits = needle.get((name, "full" if budget is None else budget))
                line.append(_cell(sum(hits) / len(hits) if hits else None))
        out.append(line)
    return out


HEADERS = ["policy", "budget", "model-a ppl", "model-a ppl / full", "model-a sink loss", "model-a pass-key",
           "model-b ppl", "model-b ppl / full", "model-b sink loss"]
SENTENCES = {
    # run A, the default tolerance: h2o's PPL ratio 20.4 / 20 = 1.02 is inside 5%, but its 2 pass-key trials paired
    # with the full cache's agree, and 2 trials cannot resolve 5 points: ± 1.96 sqrt(2) / (2 + 2) = ± 0.69; 54 agreeing
    # trials would (1.96 sqrt(2) / 56 < 0.05); 22 / 20 and 50 / 20 are outside
    "model-a": ["At budget 8 nothing is shown inside the tolerance yet; undecided: h2o (PPL: PPL ratio 1.020 "
                "[1.020, 1.020] ≤ 1.050; pass-key: accuracy drop +0.00 [-0.69, +0.69] vs +0.05): about 52 more "
                "pass-key trials would decide its pass-key; avoid sink4+window, window (collapsed) (outside the "
                "tolerance)."],
    # run B recorded a 20% tolerance in its run.json: 11 / 10 and 10.5 / 10 are inside, 30 / 10 collapsed
    "model-b": ["At budget 8 ship sink4+window (PPL 11.00 [11.00, 11.00] vs 10.00 full; PPL: PPL ratio 1.100 "
                "[1.100, 1.100] ≤ 1.200): inside the tolerance; avoid window (collapsed) (outside the tolerance).",
                "At budget 16 ship h2o (PPL 10.50 [10.50, 10.50] vs 10.00 full; PPL: PPL ratio 1.050 [1.050, 1.050] "
                "≤ 1.200): inside the tolerance."],
}


class _Tables(HTMLParser):
    """Cells of every <table> by id, and the text of every <h2>."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.h2: list[str] = []
        self._table = self._tag = None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self._table = dict(attrs).get("id")
            self.tables.setdefault(self._table, [])
        elif tag == "tr" and self._table:
            self.tables[self._table].append([])
        self._tag = tag

    def handle_endtag(self, tag):
        if tag == "table":
            self._table = None
        self._tag = None

    def handle_data(self, data):
        if self._tag in ("td", "th") and self._table:
            self.tables[self._table][-1].append(data)
        elif self._tag == "h2":
            self.h2.append(data)


def test_two_runs_side_by_side_in_one_html_report(two_runs, tmp_path):
    out = tmp_path / "both.html"
    result = cli("report", *map(str, two_runs), "--out", str(out))
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == str(out.resolve())
    page = out.read_text()
    parsed = _Tables()
    parsed.feed(page)
    table = parsed.tables["compare"]
    assert table[0] == HEADERS
    assert table[1:] == expected_rows()
    # the header says what each run was measured on, and that they differ
    assert "model-a: " in page and "text pg-essays · 400 tokens · positions original · seed 0" in page
    assert "text other.txt · 800 tokens · positions original · seed 0" in page
    assert "measured on different text" in page
    # the verdicts, in run order, then each run's own sections under its name
    assert parsed.h2 == ["Side by side", "Verdict: model-a", "Verdict: model-b", "model-a", "model-b"]
    verdict_a, verdict_b = page.index("<h2>Verdict: model-a</h2>"), page.index("<h2>Verdict: model-b</h2>")
    section_a, section_b = page.index("<h2>model-a</h2>"), page.index("<h2>model-b</h2>")
    for sentence in SENTENCES["model-a"]:
        assert verdict_a < page.index(sentence) < verdict_b
    for sentence in SENTENCES["model-b"]:
        assert verdict_b < page.index(sentence) < section_a
    assert all(page.count(s) == 1 for s in SENTENCES["model-a"] + SENTENCES["model-b"])  # not repeated per run
    # run B's own summary table is under its heading: its sink4+window row at PPL 11.00
    summaries = [m.start() for m in re.finditer('<table id="summary"', page)]
    assert len(summaries) == 2 and section_a < summaries[0] < section_b < summaries[1]
    assert "<td>11.00</td>" in page[summaries[1]:] and "<td>11.00</td>" not in page[summaries[0]:section_b]
    assert page.count("<h3>Pass-key retrieval") == 1  # only run A holds a needle test


def test_two_runs_as_markdown(two_runs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --out: report-compare.html in the current folder
    result = cli("report", *map(str, two_runs), "--markdown")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == str((tmp_path / "report-compare.html").resolve())
    assert (tmp_path / "report-compare.html").exists()
    assert lines[0] == "## Side by side"
    assert (f"- model-a: `{two_runs[0]}`, text pg-essays · 400 tokens · positions original · seed 0 · "
            "stream starts with <bos>") in lines
    assert (f"- model-b: `{two_runs[1]}`, text other.txt · 800 tokens · positions original · seed 0 · "
            "no BOS (text from token 0)") in lines
    start = lines.index("| " + " | ".join(HEADERS) + " |")
    rows = expected_rows()
    assert lines[start + 2:start + 2 + len(rows)] == ["| " + " | ".join(r) + " |" for r in rows]
    heads = [i for i, line in enumerate(lines) if line.startswith("## ")]
    assert [lines[i] for i in heads] == ["## Side by side", "## Verdict: model-a", "## Verdict: model-b"]
    assert f"**Budget 8.** {SENTENCES['model-a'][0]}" in lines[heads[1]:heads[2]]
    assert f"**Budget 16.** {SENTENCES['model-b'][1]}" in lines[heads[2]:]
    # each run's own summary table follows its verdict: run B's holds h2o at budget 16, run A's does not
    assert any(line.startswith("| h2o | 16 | 10.50 |") for line in lines[heads[2]:])
    assert not any(line.startswith("| h2o | 16 |") for line in lines[heads[1]:heads[2]])


def test_runs_of_one_model_are_told_apart_by_folder(two_runs, tmp_path):
    """Two runs of one model (say positions original and cache): each column group names its folder, and each
    shows its own pass-key accuracy (the second run tested only h2o, and hit every time)."""
    a = two_runs[0]
    again = _run(tmp_path / "claims-a-cache", "model-a", "pg-essays", 400, A_FULL, A_ROWS, A_HEADS,
                 {("h2o", 8): [1, 1]})
    result = cli("report", str(a), str(again), "--markdown", "--out", str(tmp_path / "same.html"))
    assert result.exit_code == 0, result.stderr
    assert f"| policy | budget | model-a ({a}) ppl |" in result.stdout
    assert f"model-a ({again}) pass-key |" in result.stdout
    assert "| full | - | 20.00 | 1.00 | - | 1.00 | 20.00 | 1.00 | - | - |" in result.stdout
    assert "| h2o | 8 | 20.40 | 1.02 | 0.25 | 0.67 | 20.40 | 1.02 | 0.25 | 1.00 |" in result.stdout


def test_bad_run_folders_are_one_line_errors(two_runs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may land in the checkout, even if a check is missing
    a = str(two_runs[0])
    result = cli("report", a, str(tmp_path / "nope"))
    one_line_error(result.exit_code, result.stderr, f"no results.jsonl in '{tmp_path / 'nope'}'", "OUT/NAME")
    result = cli("report", a, a)
    one_line_error(result.exit_code, result.stderr, f"run folder '{a}' is given twice")
    result = cli("report", a, str(two_runs[1]), "--out", str(tmp_path / "missing" / "r.html"))
    one_line_error(result.exit_code, result.stderr, "--out", "does not exist")
    assert not (tmp_path / "missing").exists()
    result = cli("report", a, str(two_runs[1]), "--out", str(tmp_path))
    one_line_error(result.exit_code, result.stderr, f"--out '{tmp_path}' is a folder", "report-compare.html")
