"""The report: typed records that round-trip results.jsonl, one column spec, figures checked by what they draw,
sections registered in report/, and a report package that never imports the harness."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvevict.records.schema import DoneMarker, PplRecord, SinkMapRecord, TaskRecord, cell_key, from_dict, load
from kvevict.records.store import ResultStore
from kvevict.report import plots
from kvevict.report.columns import MEAN_KEPT, Table
from kvevict.report.html import render
from kvevict.report.sections import SECTIONS
from kvevict.report.tables import BYTES_COLUMNS, COST_COLUMNS, SUMMARY, sinks_table, summary_rows, summary_table

from support import close, series

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"


def lines(name: str) -> list[dict]:
    return ResultStore(RESULTS / f"{name}-results.jsonl").records()


@pytest.fixture(scope="module")
def demo() -> list[PplRecord]:
    records = load(lines("demo"))
    assert all(isinstance(r, PplRecord) for r in records) and len(records) == 31
    return records


# --- records ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["demo", "baselines-4000"])
def test_old_results_round_trip_exactly(name):
    for line in lines(name):
        record = from_dict(line)
        assert isinstance(record, PplRecord)
        # same keys, same values: an old run folder resumes and redraws; only the batch time has its new name
        renamed = {("batch_seconds" if k == "seconds" else k): v for k, v in line.items()}
        assert record.to_dict() == renamed
        assert json.dumps(record.to_dict(), sort_keys=True) == json.dumps(renamed, sort_keys=True)
        assert from_dict(record.to_dict()) == record


def test_every_kind_of_line_round_trips():
    full = {"key": "full|full|None", "kind": "full", "policy": "full", "label": "full", "budget": None, "ppl": 24.6,
            "positions": "original", "n_predictions": 799, "curve": [], "a_future_key": [1, 2]}
    needle = {"key": "needle|h2o|32|200|0.5|0", "kind": "needle", "seed": 3, "policy": "h2o", "budget": 32,
              "passkey": "12345", "hit": True, "answer": "12345"}
    generation = {"key": "generation|full|full|120|None|1", "kind": "generation", "seed": 0, "policy": "full",
                  "budget": "full", "recalled": False}
    sinkmap = {"key": "sinkmap-done|300", "kind": "sinkmap", "map": {"k": 8, "sinks": []}, "model": "m"}
    done = {"key": "needle-done|[200]|[0.5]|1|[32]", "kind": "needle-done"}
    kinds = [PplRecord, TaskRecord, TaskRecord, SinkMapRecord, DoneMarker]
    for line, kind in zip([full, needle, generation, sinkmap, done], kinds):
        record = from_dict(line)
        assert type(record) is kind and record.to_dict() == line
    assert from_dict(full).extra == {"a_future_key": [1, 2]}
    assert "kl_to_full" not in from_dict(full).to_dict()  # absent optional keys stay absent
    assert from_dict(needle).fields["passkey"] == "12345" and from_dict(needle).seed == 3


def test_cell_key_is_what_the_store_holds(demo):
    assert {r.key for r in demo} == {cell_key(r.kind, r.policy, r.budget) for r in demo}


# --- tables: one column spec, three renderings ------------------------------------------------


def test_old_run_folder_redraws_the_readme_demo_table(tmp_path, demo):
    """`kvevict report --markdown` on the committed demo results prints a row per record, with the record's
    own numbers (recomputed here from the JSON lines, not copied from anywhere)."""
    from support import cli

    run = tmp_path / "demo"
    run.mkdir()
    (run / "results.jsonl").write_text((RESULTS / "demo-2000-results.jsonl").read_text())
    result = cli("report", str(run), "--markdown")
    assert result.exit_code == 0, result.output
    printed = result.stdout.splitlines()
    raw = [json.loads(line) for line in (RESULTS / "demo-2000-results.jsonl").read_text().splitlines()]
    raw = [line for line in raw if line["kind"] in ("full", "oracle", "policy", "sinks")]  # the RULER answers aside
    full = next(line["ppl"] for line in raw if line["kind"] == "full")
    for line in raw:
        if line["kind"] == "sinks" and any(o["kind"] == "policy" and o["policy"] == line["policy"]
                                           and o["budget"] == line["budget"] for o in raw):
            continue  # shown once, as its policy row
        budget = "-" if line["budget"] is None else str(line["budget"])
        ppl = f"{line['ppl']:.2f}"
        if line["kind"] == "oracle":  # re-computed predictions: those past the first `budget`
            recomputed = line["n_predictions"] - min(line["budget"], line["tokens"] - 1)
            ppl = ppl if recomputed >= 30 else f"n too small ({recomputed})"
        start = f"| {line.get('label') or line['policy']} | {budget} | {ppl} | "
        row = next((p for p in printed if p.startswith(start)), None)
        assert row is not None, start
        ratio = line["ppl"] / line.get("full_ppl_same_tokens", full)
        if "kl_to_full" in line and not ppl.startswith("n too small"):
            assert f" | {ratio:.2f} | {line['kl_to_full']:.3f} | " in row
    assert printed[-1] == str((run / "report.html").resolve())
    eight = {line["budget"]: line["ppl"] for line in raw if line["policy"] == "sink8+window"}
    assert f"| sink8+window | {eight[64]:.2f} | {eight[128]:.2f} | {eight[256]:.2f} |" in printed  # the sinks table


def test_one_column_spec_feeds_markdown_html_and_terminal(demo):
    from kvevict.cli.tables import layout
    from kvevict.report.markup import table_html

    table = summary_table(demo)
    # the demo records predate cost measurement, mean_kept and bf16 bytes: those columns are left out, the rest keep
    # their order
    spec = [c for c in SUMMARY if c.header not in (*COST_COLUMNS, MEAN_KEPT, *BYTES_COLUMNS)]
    assert len(spec) == len(SUMMARY) - 5
    assert table.headers == [c.header for c in spec] and table.aligns[0] == "left"
    markdown = table.markdown().splitlines()
    assert markdown[0] == "| " + " | ".join(c.header for c in spec) + " |"
    full = next(r for r in demo if r.kind == "full")
    cells = markdown[2].strip("| ").split(" | ")
    assert cells[:3] == ["full", "-", f"{full.ppl:.2f}"] and cells[4:] == [
        "1.00", "0.000", "1.000", "0.00", str(full.max_kept), f"{full.batch_seconds:.1f}"]
    low, high = map(float, cells[3].strip("[]").split(", "))  # the bootstrap interval holds the point estimate
    assert low < full.ppl < high
    page = table_html(table, "summary")
    assert page.count("<tr>") == 1 + len(table.rows) and '<th class="left">policy</th>' in page
    worst = max(r.ppl for r in demo)
    assert f"<td>{worst:.2f}</td>" in page  # a number, right aligned (no class)
    assert layout(table, None).shown == list(range(len(spec)))


def test_sinks_table_orders_rows_by_declared_pins(demo):
    table = sinks_table(demo)
    assert [row[0] for row in table.rows] == ["window", "sink1+window", "sink2+window", "sink4+window", "sink8+window"]
    assert table.headers == ["policy", "budget 64", "budget 128", "budget 256"]
    assert table.rows[0][1:] == ["126.96", "59.40", "46.42"]


# --- the terminal table: never a truncated number ----------------------------------------------


def _printed_rows(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("│").split("│")] for line in text.splitlines() if line.startswith("│")]


def test_result_table_never_truncates_numbers_at_80_columns(demo, monkeypatch, capsys):
    from kvevict.cli.tables import show

    monkeypatch.setenv("COLUMNS", "80")
    table = summary_table(demo)
    show(table, "kvevict A/B: smollm2-135m on pg-essays, 800 tokens, original")
    out, err = capsys.readouterr()
    assert "…" not in out and all(len(line) <= 80 for line in out.splitlines())
    header = " ".join(line for line in out.splitlines() if line.startswith("┃"))
    for word in ("policy", "budget", "ppl", "KL", "top-1", "agree", "sink", "kept"):
        assert word in header
    left_out = err.split("left out ")[1].split(" (")[0].split(", ") if "left out" in err else []
    shown = [h for h in table.headers if h not in left_out]
    printed = _printed_rows(out)
    assert printed == [[row[table.headers.index(h)] for h in shown] for row in table.rows]
    assert f"{max(r.ppl for r in demo):.2f}" in out and len(err.strip().splitlines()) == 1


def test_narrow_terminal_drops_columns_in_the_documented_order(demo, monkeypatch, capsys):
    from kvevict.cli.tables import layout, show

    table = summary_table(demo)
    order = [layout(table, width).dropped for width in (140, 100, 80, 70, 60, 50, 40, 20)]
    assert order[0] == []
    documented = ["ppl 95% CI", "batch seconds", "kept", "top-1 agree", "sink loss", "KL to full", "ppl / full"]
    for dropped in order:
        assert dropped == documented[: len(dropped)]
    assert order[-1] == documented  # policy, budget and ppl are never dropped ...
    monkeypatch.setenv("COLUMNS", "20")
    show(table, "narrow")
    printed = _printed_rows(capsys.readouterr().out)
    # ... and keep their numbers whole even when that is wider than the terminal
    assert printed == [row[:3] for row in table.rows]


def test_mean_kept_is_a_column_when_records_carry_it(demo):
    """Records written before `mean_kept` get no such column (nothing to show); records that carry it
    show it right after "kept", whole entries, and a narrow terminal leaves it out right after "kept"."""
    from dataclasses import replace

    from kvevict.cli.tables import layout

    assert "mean kept" not in summary_table(demo).headers
    held = [replace(r, mean_kept=None if r.max_kept is None else r.max_kept * 0.75) for r in demo]
    table = summary_table(held)
    at = table.headers.index("mean kept")
    assert table.headers[at - 1] == "kept"
    for row, source in zip(table.rows, summary_rows(held)):
        expected = source.record.mean_kept
        assert row[at] == ("-" if expected is None else str(round(expected)))
    assert any(row[at] != "-" for row in table.rows)
    order = [layout(table, width).dropped for width in (160, 120, 100, 90, 80, 70, 60, 50, 40, 20)]
    documented = ["ppl 95% CI", "batch seconds", "kept", "mean kept", "top-1 agree", "sink loss", "KL to full",
                  "ppl / full"]
    for dropped in order:
        assert dropped == documented[: len(dropped)]
    assert order[-1] == documented


def test_piped_result_table_keeps_every_column(demo, monkeypatch, capsys):
    from kvevict.cli.tables import show

    monkeypatch.delenv("COLUMNS", raising=False)  # capsys is not a terminal: a pipe or a file
    table = summary_table(demo)
    show(table, "piped")
    out, err = capsys.readouterr()
    assert _printed_rows(out) == table.rows and err == ""
    head = [line for line in out.splitlines() if line.startswith("┃")]
    assert len(head) == 1 and all(h in head[0] for h in table.headers)  # every header on one line


def test_names_fold_rather_than_lose_characters(monkeypatch, capsys):
    from kvevict.cli.tables import show

    monkeypatch.setenv("COLUMNS", "40")
    name = "sink4+snapkv:window=32,kernel=7,pooling=max"
    show(Table(["policy", "ppl"], [[name, "1234.56"]]), "t")
    out = capsys.readouterr().out
    assert all(len(line) <= 40 for line in out.splitlines())
    assert "".join(row[0] for row in _printed_rows(out)) == name and "1234.56" in out


# --- figures: what is drawn ----------------------------------------------------------------------


def test_ppl_vs_position_draws_one_panel_per_budget_with_every_policy(demo):
    fig = plots.ppl_vs_position(demo)
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == ["budget 64", "budget 128", "budget 256"]
    full = next(r for r in demo if r.kind == "full")
    for ax, budget in zip(axes, (64, 128, 256)):
        drawn = series(ax)
        policies = [r for r in demo if r.kind == "policy" and r.budget == budget]
        assert set(drawn) == {"full"} | {r.name for r in policies}  # no oracle, no sink-sweep rows
        for r in [full, *policies]:
            assert drawn[r.name] == ([p["end"] for p in r.curve], [p["ppl"] for p in r.curve])
        assert ax.get_yscale() == "log" and ax.get_xlabel() == "token position"
    close(fig)


def test_ppl_vs_position_has_a_readable_legend_at_every_budget(demo):
    # one panel lacks a policy, so a colour cycle restarted per panel would shift the others' colours
    first = min(r.budget for r in demo if r.budget is not None)
    fig = plots.ppl_vs_position([r for r in demo if not (r.name == "h2o" and r.budget == first)])
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    colours: dict[str, set] = {}
    for ax in fig.axes:
        legend = ax.get_legend()
        assert legend is not None, ax.get_title()
        assert [t.get_text() for t in legend.get_texts()] == [line.get_label() for line in ax.get_lines()
                                                              if not line.get_label().startswith("_")]
        assert all(t.get_fontsize() >= 8 for t in legend.get_texts())
        # below the plot area: it hides no curve
        assert legend.get_window_extent(renderer).y1 <= ax.get_window_extent(renderer).y0
        for line in ax.get_lines():
            colours.setdefault(line.get_label(), set()).add(line.get_color() if isinstance(line.get_color(), str)
                                                            else tuple(line.get_color()))
    assert all(len(c) == 1 for c in colours.values()), colours  # one colour per policy in every panel
    close(fig)


def test_ppl_vs_budget_draws_each_policy_over_the_budgets(demo):
    fig = plots.ppl_vs_budget(demo)
    (ax,) = fig.axes
    drawn = series(ax)
    assert set(drawn) == {"oracle", "h2o", "snapkv", "streamingllm", "window", "full cache"}
    window = sorted((r.budget, r.ppl) for r in demo if r.kind == "policy" and r.name == "window")
    assert drawn["window"] == ([b for b, _ in window], [p for _, p in window])
    full = next(r.ppl for r in demo if r.kind == "full")
    assert drawn["full cache"][1] == [full, full]
    assert ax.get_xlabel() == "budget (entries per layer and KV head)" and ax.get_ylabel() == "streaming perplexity"
    close(fig)


def test_ppl_vs_sinks_places_rows_by_their_declared_sink_count(demo):
    fig = plots.ppl_vs_sinks(demo)
    (ax,) = fig.axes
    drawn = series(ax)
    assert set(drawn) == {"budget 64", "budget 128", "budget 256"}
    xs, ys = drawn["budget 64"]
    assert xs == [0, 1, 2, 4, 8]
    by_label = {r.name: r.ppl for r in demo if r.kind == "sinks" and r.budget == 64}
    assert ys == [by_label[k] for k in ("window", "sink1+window", "sink2+window", "sink4+window", "sink8+window")]
    close(fig)
    assert plots.ppl_vs_sinks([r for r in demo if r.kind != "sinks"]) is None


def test_sink_loss_maps_follow_what_the_policy_declares(demo, monkeypatch):
    """Panels for policies that declare `needs_attention` or `reads_keys`, whatever their names say."""
    from kvevict.policies import registry
    from kvevict.policies.window import Window

    class NotH2O(Window):  # a name with "h2o" in it that does not steer by attention
        def spec(self) -> str:
            return "noth2o"

    monkeypatch.setitem(registry.REGISTRY, "noth2o", NotH2O)
    h2o = next(r for r in demo if r.kind == "policy" and r.name == "h2o" and r.budget == 64)
    extra = [
        PplRecord.from_dict({**h2o.to_dict(), "key": "policy|noth2o|64", "policy": "noth2o", "label": "noth2o"}),
        PplRecord.from_dict({**h2o.to_dict(), "key": "policy|sinkauto4+window|64", "policy": "sinkauto4+window",
                             "label": "sinkauto+window"}),
        PplRecord.from_dict({**h2o.to_dict(), "key": "policy|knorm|64", "policy": "knorm", "label": "knorm"}),
    ]
    fig = plots.sink_loss_heatmaps(demo + extra)
    titles = [ax.get_title().split("\n")[0] for ax in fig.axes if ax.get_title()]
    expected = sorted(
        [(r.name, r.budget) for r in demo if r.kind == "policy" and r.name in ("h2o", "snapkv")]
        + [("sinkauto+window", 64), ("knorm", 64)]
    )
    assert titles == [name for name, _ in expected]
    panel = fig.axes[titles.index("h2o")]
    lost = panel.images[0].get_array()
    assert lost.shape == (len(h2o.sink_lost_at), len(h2o.sink_lost_at[0]))
    close(fig)


# --- sections and layering --------------------------------------------------------------------------


def test_sections_are_registered_in_report_and_render_task_records(tmp_path, demo):
    names = [s.__name__ for s in SECTIONS]
    assert names[:3] == ["decision", "perplexity", "sinks"]
    assert names[-5:] == ["needle", "generation", "sink_map", "ruler", "other_trials"]
    trials = [
        TaskRecord(f"needle|{p}|{b}|200|0.5|{t}", "needle", 0,
                   {"policy": p, "budget": b, "length": 200, "depth": 0.5, "trial": t, "hit": t == 0,
                    "budget_tokens": None if b == "full" else 32})
        for p, b in (("full", "full"), ("h2o", 32)) for t in (0, 1)
    ] + [
        TaskRecord(f"generation|{p}|{b}|120|None|0", "generation", 0,
                   {"policy": p, "budget": b, "repetition": 0.25, "recalled": True, "output_tokens": 9})
        for p, b in (("full", "full"), ("window", 32))
    ]
    share = [[[0.5, 0.1], [0.4, 0.2]]] * 3
    measured = {"share": share, "position_mean": [0.4, 0.1, 0.01], "tokens": ["a", "b"],
                "sinks": [{"position": 0, "token": "<s>", "mean_share": 0.4}]}
    sinkmap = SinkMapRecord("sinkmap-done|800", measured, "m")
    page = render(demo + trials + [sinkmap], {"name": "t"}, tmp_path / "report.html").read_text()
    for heading in ("Streaming perplexity", "Attention sinks: perplexity", "Pass-key retrieval",
                    "Generation failure modes", "Attention-sink map"):
        assert f"<h2>{heading}" in page
    assert '<td class="left">h2o</td><td>32</td><td>200</td><td>0.5</td><td>0.50</td><td>2</td>' in page
    assert "positions acting as sinks: &lt;s&gt;@0" in page
    assert page.count("data:image/png;base64,") == 4 + 2 + 1 + 1  # ppl figures, needle per policy, generation, map
    bare = render(demo, {"name": "t"}, tmp_path / "bare.html").read_text()
    assert "Pass-key retrieval" not in bare and "Attention-sink map" not in bare


HARNESS = ("kvevict.ab", "kvevict.cli", "kvevict.sweep", "kvevict.extras")


def _imports(path: Path) -> set[str]:
    """Absolute names of the kvevict modules a report module imports (relative imports resolved)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = "kvevict.report" if node.level == 1 else "kvevict" if node.level == 2 else ""
            module = ".".join(filter(None, [base, node.module or ""]))
            names.add(module)
            names |= {f"{module}.{alias.name}" for alias in node.names}
    return names


def test_report_never_imports_the_harness():
    files = sorted((ROOT / "src" / "kvevict" / "report").glob("*.py"))
    assert len(files) >= 8
    for path in files:
        bad = {name for name in _imports(path) if name.startswith(HARNESS) or name in ("kvevict.ab", "kvevict.cli")}
        assert not bad, f"{path.name} imports the harness: {sorted(bad)}"
    probe = "import sys, kvevict.report.html, kvevict.report.sections; print(sorted(m for m in sys.modules if " \
            f"m.startswith({HARNESS!r})))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "[]"


def test_the_report_ab_writes_is_the_report_that_report_redraws(tmp_path, tiny_dir):
    """`kvevict ab` and `kvevict report` draw from the same recorded run metadata (stream start included)."""
    import re

    from support import cli
    from test_ab import TEXT

    text_file = tmp_path / "t.txt"
    text_file.write_text(TEXT)
    result = cli("ab", "--model", str(tiny_dir), "--text", str(text_file), "--tokens", "120", "--budgets", "16",
                 "--policies", "window,h2o", "--oracle-stride", "0", "--name", "same", "--out", str(tmp_path))
    assert result.exit_code == 0, result.stderr
    written = (tmp_path / "same" / "report.html").read_text()
    assert "stream start not recorded" not in written
    redraw = tmp_path / "redrawn.html"
    result = cli("report", str(tmp_path / "same"), "--out", str(redraw))
    assert result.exit_code == 0, result.stderr

    def stamp(page: str) -> str:
        return re.sub(r"generated \d{4}-\d\d-\d\d \d\d:\d\d UTC", "generated", page)

    assert stamp(written) == stamp(redraw.read_text())


def test_a_line_of_unknown_kind_is_refused(tmp_path):
    from support import cli, one_line_error

    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "results.jsonl").write_text(json.dumps({"key": "x|1", "kind": "mystery", "hit": 1}) + "\n")
    result = cli("report", str(folder))
    one_line_error(result.exit_code, result.stderr, "kind 'mystery'", "remove the line")
