"""KV bytes per sequence in the tables (as held and at bf16), and the rows the report compares at equal bytes."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvevict.ab.plan import SweepConfig, plan
from kvevict.ab.worker import batches
from kvevict.eval.streaming import compare
from kvevict.records.schema import PplRecord, cell_key
from kvevict.report.kv_bytes import EQUAL_BYTES, equal_bytes
from kvevict.report.tables import summary_table

from conftest import random_tokens
from support import cli

BUDGET = 16
TOKENS = 60


def _per_entry(dim: int, bits: int | None, float_bytes: int, group: int = 8) -> int:
    """Bytes of one entry's key and value, worked out by hand: D floats each, or D*bits/8 code bytes and
    D/group scales and zero points."""
    if bits is None:
        return 2 * dim * float_bytes
    return 2 * (dim * bits // 8 + 2 * (dim // group) * float_bytes)


def test_rows_record_bytes_per_sequence_as_held_and_at_bf16(tiny):
    """Per sequence (each row of a batch on its own), as held in float32 and with floats at 2 bytes; the full cache's
    bf16 bytes are every token at 2 bytes per channel."""
    tokens = random_tokens(TOKENS)
    layers, heads, dim = tiny.config.num_hidden_layers, tiny.config.num_key_value_heads, tiny.config.head_dim
    plain, _ = compare(tiny, tokens, ["sink4+window", "h2o"], BUDGET, reference=False, progress=False)
    quant, _ = compare(tiny, tokens, ["q4:group=8+sink4+window"], BUDGET, reference=False, progress=False)
    cells = layers * heads
    for row, bits in ((plain[0], None), (plain[1], None), (quant[0], 4)):
        s = row.summary()
        assert s["kv_bytes"] == cells * BUDGET * _per_entry(dim, bits, 4)
        assert s["kv_bytes_bf16"] == cells * BUDGET * _per_entry(dim, bits, 2)
        assert s["full_kv_bytes"] == cells * TOKENS * 2 * dim * 4
        assert s["full_kv_bytes_bf16"] == cells * TOKENS * 2 * dim * 2


def _record(policy: str, budget: int | None, bf16: int | None, nll: list[float], kind: str = "policy") -> PplRecord:
    curve = [{"start": 1 + 10 * i, "end": 10 * (i + 1), "n": 10, "ppl": math.exp(x)} for i, x in enumerate(nll)]
    mean = float(np.mean(nll))
    return PplRecord(key=cell_key(kind, policy, budget), kind=kind, policy=policy, budget=budget, ppl=math.exp(mean),
                     n_predictions=10 * len(nll), curve=curve, kv_bytes=None if bf16 is None else 2 * bf16,
                     kv_bytes_bf16=bf16, full_kv_bytes=None if bf16 is None else 2 * 4_000_000,
                     full_kv_bytes_bf16=None if bf16 is None else 4_000_000)


def test_summary_table_shows_bytes_held_and_bf16_and_the_full_rows():
    base = [2.0, 2.2, 1.9, 2.1] * 5
    records = [_record("full", None, None, base, kind="full"),
               _record("h2o", 1024, 3 * 2**20, [x + 0.1 for x in base]),
               _record("q4+h2o", 1024, 2**19, [x + 0.05 for x in base])]
    table = summary_table(records)
    held, bf16 = table.headers.index("KV MiB/seq"), table.headers.index("KV MiB/seq bf16")
    cells = {row[0]: (row[held], row[bf16]) for row in table.rows}
    assert cells["h2o"] == ("6", "3") and cells["q4+h2o"] == ("1", "0.5")
    assert cells["full"] == ("7.629", "3.815")  # 8e6 and 4e6 bytes, the full cache the bounded rows recorded
    # run folders written before the bf16 figure show no empty columns
    old = [PplRecord.from_dict({k: v for k, v in r.to_dict().items() if not k.endswith("bf16")}) for r in records]
    assert "KV MiB/seq" not in summary_table(old).headers


def test_equal_bytes_groups_rows_within_five_percent_across_widths():
    base = [2.0, 2.3, 1.8, 2.1, 2.4, 1.9] * 4
    z = np.random.default_rng(0).standard_normal(len(base))
    noisy = list(np.array(base) + 0.05 + 0.2 * (z - z.mean()))  # 0.03 nats above q8, give or take 0.2 a block
    records = [
        _record("full", None, None, base, kind="full"),
        _record("sink4+window", 1000, 1_000_000, [x + 0.10 for x in base]),
        _record("q8+sink4+window", 1780, 1_040_000, [x + 0.02 for x in base]),
        _record("q4+sink4+window", 3200, 1_049_000, noisy),
        _record("q4+full", 4000, 1_250_000, [x + 0.01 for x in base]),  # 25% more: no partner
        _record("h2o", 500, 500_000, [x + 0.3 for x in base]),
        _record("snapkv", 500, 510_000, [x + 0.2 for x in base]),  # one width: the verdict per budget compares it
        _record("q8+h2o", 890, 536_000, [x + 0.25 for x in base]),  # 7.2% above h2o: not equal bytes
    ]
    groups = equal_bytes(records)
    members = [[g.lowest.policy, *(v.record.policy for v in g.others)] for g in groups]
    assert members == [["q8+sink4+window", "q4+sink4+window", "sink4+window"]]
    # against a pairwise check by hand: every two rows of a group within 5%, of more than one width
    sizes = {r.policy: r.kv_bytes_bf16 for r in records}
    for group in members:
        assert all(max(sizes[a], sizes[b]) <= (1 + EQUAL_BYTES) * min(sizes[a], sizes[b]) for a in group for b in group)
    (group,) = groups
    window = next(v for v in group.others if v.record.policy == "sink4+window")
    # a constant paired difference of 0.08 nats: ratio exp(0.08) with a zero-width interval, beyond the noise
    assert window.ratio == pytest.approx(math.exp(0.08)) and window.above
    assert window.interval.low == pytest.approx(math.exp(0.08)) == pytest.approx(window.interval.high)
    four = next(v for v in group.others if v.record.policy == "q4+sink4+window")
    assert four.ratio == pytest.approx(math.exp(0.03))
    assert four.interval.low < 1 < four.interval.high and not group.separated  # the noisy row is not told apart
    assert "lowest PPL q8+sink4+window at 1780 (" in group.sentence()
    assert "not told apart from q4+sink4+window at 3200;" in group.sentence()


def test_plan_keeps_a_quantized_full_cache_as_a_row_of_its_own_batch():
    """`q4+full` is a row (the full cache at 4 bits); its cache grows, so it runs apart from the bounded q4 rows."""
    config = SweepConfig(tokens=100, budgets=[32], policies=["full", "q4+full", "window", "q4+h2o"], oracle_stride=0)
    cells = plan(config)
    assert [(c.kind, c.label, c.budget) for c in cells] == [
        ("full", "full", None), ("policy", "q4+full", 32), ("policy", "window", 32), ("policy", "q4+h2o", 32)]
    assert sorted([c.label for c in b.cells] for b in batches(config, cells)) == [
        ["full"], ["q4+full"], ["q4+h2o"], ["window"]]


def test_compare_runs_mixed_widths_and_prints_bytes(tiny_dir):
    """`kvevict compare` runs each width in a batch of its own, against one full-cache reference."""
    args = ["compare", "--model", str(tiny_dir), "--tokens", str(TOKENS), "--budget", str(BUDGET), "--policies",
            "sink4+window,q8:group=8+sink4+window,q4:group=8+sink4+window,q4:group=8+full"]
    out = cli(*args, "--json")
    assert out.exit_code == 0, out.stderr
    rows = json.loads(out.stdout.splitlines()[-1])["rows"]
    cells, dim = 2 * 2, 16
    expected = [cells * n * _per_entry(dim, b, 2) for n, b in ((BUDGET, None), (BUDGET, 8), (BUDGET, 4), (TOKENS, 4))]
    assert [r["kv_bytes_bf16"] for r in rows[1:]] == expected
    table = cli(*args, env={"COLUMNS": "250"})
    assert table.exit_code == 0, table.stderr
    assert "KV MiB/seq bf16" in table.stdout.replace("\n", " ") or "bf16" in table.stdout
    full = next(line for line in table.stdout.splitlines() if line.startswith("│ full "))
    assert f"{cells * TOKENS * 2 * dim * 4 / 2**20:.4g}" in full  # the full row's bytes as held


def test_verdict_ships_the_fewest_bytes_where_widths_differ_at_a_budget():
    """At one budget a `q8+full` row holds more than a plain bounded row: where both are inside the tolerance, the
    verdict ships the one holding fewer bytes, though it pins slots (entries alone no longer measure memory)."""
    from kvevict.report.verdict import verdict
    from kvevict.report.verdict_text import sentence

    base = [2.0, 2.3, 1.8, 2.1, 2.4, 1.9] * 4
    records = [_record("full", None, None, base, kind="full"),
               _record("q8+full", 1024, 3_000_000, [x + 0.01 for x in base]),
               _record("sink4+window", 1024, 1_000_000, [x + 0.02 for x in base])]
    (found,) = verdict(records)
    assert found.recommended.name == "sink4+window"
    assert "0.9537 MiB KV per sequence at bf16" in sentence(found)
    # one width at the budget: bytes play no part, the old order holds (no pinned slots first)
    plain = [records[0], _record("window", 1024, 3_000_000, [x + 0.01 for x in base]), records[2]]
    assert verdict(plain)[0].recommended.name == "window"


def test_fp8_and_q8_rows_are_different_widths_at_equal_bytes():
    """Both hold 8 bits per channel, but they are two storage forms: a group of an fp8 row and a q8 row alone is
    a comparison at equal bytes (widths are told apart by the form's label, not its bits)."""
    base = [2.0, 2.3, 1.8, 2.1] * 5
    records = [
        _record("full", None, None, base, kind="full"),
        _record("fp8+h2o", 2048, 1_000_000, [x + 0.02 for x in base]),
        _record("q8+h2o", 1820, 1_010_000, [x + 0.03 for x in base]),
    ]
    members = [[g.lowest.policy, *(v.record.policy for v in g.others)] for g in equal_bytes(records)]
    assert members == [["fp8+h2o", "q8+h2o"]]
