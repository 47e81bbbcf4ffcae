"""RULER cells at equal bytes (`report.task_bytes`): which cells are grouped, who leads, and when it leads beyond
the noise, on records built by hand."""

from __future__ import annotations

import math

from scipy import stats

from kvevict.records.schema import RulerRecord
from kvevict.report.task_bytes import task_equal_bytes


def answers(policy: str, budget: str, right: int, n: int, size: int, task: str = "niah_single_1") -> list:
    """n answers of one cell, the first `right` of them right, each recording `size` bf16 bytes."""
    return [RulerRecord(key=f"{task}|{policy}|{budget}|{i}", task=task, protocol="agnostic", length=2048, sample=i,
                        policy=policy, budget=budget, score=float(i < right), kv_bytes_bf16=size) for i in range(n)]


def test_cells_of_several_widths_at_equal_bytes_are_compared_on_the_same_answers():
    records = (answers("tova", "512", 8, 20, 1_000_000) + answers("q8+tova", "910", 20, 20, 1_020_000)
               + answers("q4+tova", "1638", 19, 20, 1_040_000)
               + answers("h2o", "256", 2, 20, 500_000)  # half the bytes: a group of one, not shown
               + answers("snapkv", "512", 0, 20, 1_000_000, task="niah_multikey_1"))  # one width alone
    [group] = task_equal_bytes(records)
    assert group.where == "agnostic niah_single_1@2048"
    assert group.leader.name == "q8+tova at 910"
    behind = {b.cell.name: b for b in group.others}
    assert set(behind) == {"tova at 512", "q4+tova at 1638"}
    # tova: 12 answers the leader alone got right, none the other way: Bonett and Price's adjusted Wald interval,
    # written out from their formula with pseudo-counts 13 and 1 over n + 2 = 22
    p_lost, p_won = 13 / 22, 1 / 22
    half = stats.norm.ppf(0.975) * math.sqrt((p_lost + p_won - (p_lost - p_won) ** 2) / 22)
    tova = behind["tova at 512"]
    assert tova.difference == 12 / 20 and abs(tova.low - (p_lost - p_won - half)) < 1e-12 and tova.low > 0
    # q4+tova lost one answer: its interval reaches 0, so the leader is not told apart from it
    assert behind["q4+tova at 1638"].low <= 0
    sentence = group.sentence()
    assert "most right q8+tova at 910 (1.00), not told apart from q4+tova at 1638" in sentence
    assert "tova at 512 -0.60" in sentence


def test_a_leader_ahead_of_every_other_cell_is_named_beyond_the_noise():
    records = answers("tova", "512", 4, 30, 1_000_000) + answers("q4+tova", "1638", 28, 30, 1_010_000)
    [group] = task_equal_bytes(records)
    assert "most right q4+tova at 1638 (0.93), beyond the noise" in group.sentence()


def test_records_without_bytes_are_left_out():
    records = answers("tova", "512", 8, 20, 1_000_000) + [
        RulerRecord(**{**vars(r), "kv_bytes_bf16": None}) for r in answers("q8+tova", "910", 20, 20, 1_000_000)]
    assert task_equal_bytes(records) == []
