"""A sweep task with a record kind of its own is one class and one registration line: its trials say what they
are (`"record": "trial"`), so the schema reads them back and the report draws them with nothing added in
`records/` or `report/`; a line of a kind nobody wrote that way is still refused."""

from __future__ import annotations

import pytest

from kvevict.ab.sweep_tasks.base import SweepTask
from kvevict.errors import KvevictError
from kvevict.loading.models import load_tokenizer
from kvevict.records import schema
from kvevict.records.store import ResultStore
from kvevict.report.html import render


class Tally(SweepTask):
    """A toy task: one trial per policy, the stream's length and a list (which a table cell cannot hold)."""

    kind = "tally"

    def wanted(self, config):
        return True

    def signature(self, config):
        return f"tally-done|{config.tokens}"

    def run(self, job):
        keep = self.keeper(job)
        for policy in self.policies(job.config):
            keep({"policy": policy, "budget": job.config.budgets[0], "trial": 0, "tokens": int(job.tokens.numel()),
                  "spans": [0, int(job.tokens.numel())]})
        self.close(job)


def test_a_task_registered_by_one_line_is_written_read_back_and_drawn(tiny, tmp_path, monkeypatch):
    from kvevict.ab import SweepConfig, run_sweep
    from kvevict.ab.sweep_tasks import registry

    monkeypatch.setattr(registry, "SWEEP_TASKS", (*registry.SWEEP_TASKS, Tally()))  # the one registration line
    tokenizer = load_tokenizer("smollm2-135m")
    tiny.resize_token_embeddings(len(tokenizer))
    config = SweepConfig(tokens=120, budgets=[32], policies=["window"], oracle_stride=0, out=str(tmp_path), name="t")
    run_sweep(config, model=tiny, tokenizer=tokenizer, progress=False)
    records = schema.load(ResultStore(tmp_path / "t" / "results.jsonl").records())
    tallied = [r for r in records if r.kind == "tally"]
    assert all(isinstance(r, schema.TaskRecord) for r in tallied)
    assert [(r.fields["policy"], r.fields["tokens"], r.fields["spans"]) for r in tallied] == [
        ("full", 120, [0, 120]), ("window", 120, [0, 120])]
    assert all(r.to_dict()["record"] == "trial" and "record" not in r.fields for r in tallied)
    page = render(records, {"name": "t"}, tmp_path / "report.html").read_text()
    assert "<h3>tally</h3>" in page
    table = page[page.index('<table id="trials-tally"'):]
    table = table[: table.index("</table>")]
    assert table.index('<th class="left">policy</th><th>budget</th>') < table.index("<th>tokens</th>")
    assert '<td class="left">window</td><td>32</td>' in table
    assert "spans" not in table and table.count("<tr>") == 1 + 2 and table.count("<td>120</td>") == 2


def test_a_line_of_a_kind_nobody_wrote_as_a_trial_is_refused_in_one_line():
    line = {"key": "tally|full|32|None|None|0", "kind": "tally", "tokens": 120}
    with pytest.raises(KvevictError, match="kind 'tally'.*does not know") as refused:
        schema.from_dict(line)
    assert "\n" not in str(refused.value)
    read = schema.from_dict({**line, "record": "trial"})
    assert isinstance(read, schema.TaskRecord) and read.fields == {"tokens": 120}
    assert read.to_dict() == {**line, "record": "trial"}  # written back as it was read


def test_the_built_in_trials_are_written_as_before():
    """Needle and generation lines keep their bytes: no marker, as every record file holds them."""
    needle = schema.TaskRecord("needle|full|32|64|0.5|0", "needle", 0, {"hit": True})
    assert needle.to_dict() == {"hit": True, "key": "needle|full|32|64|0.5|0", "kind": "needle", "seed": 0}
