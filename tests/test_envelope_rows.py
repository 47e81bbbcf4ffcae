"""The envelope's rows read what a configuration is from its policy (`parse_policy`), not from its spec's text."""

import math

import numpy as np

from kvevict.records.schema import PplRecord
from kvevict.report.envelope import envelope_rows, envelope_verdict, tolerance_of

WINDOWS = 40


def _curve(nll: float, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"start": 16 * i, "end": 16 * i + 15, "n": 16, "ppl": math.exp(nll + rng.normal(0, 0.002))}
            for i in range(WINDOWS)]


def _row(kind: str, spec: str, budget: int | None, bytes_bf16: int, seed: int) -> PplRecord:
    return PplRecord(key=f"{kind}|{spec}|{budget}", kind=kind, policy=spec, budget=budget, ppl=math.exp(2.0),
                     nll_mean=2.0, curve=_curve(2.0, seed), kv_bytes=bytes_bf16, full_kv_bytes=1000,
                     kv_bytes_bf16=bytes_bf16, full_kv_bytes_bf16=1000)


def test_a_storage_form_behind_a_sink_wrapper_is_no_eviction_only_configuration():
    """`sink4+q8+window` quantizes what it keeps although its spec does not start with the form."""
    records = [_row("full", "full", None, 1000, 0), _row("policy", "sink4+q8+window", 16, 100, 1),
               _row("policy", "window", 32, 400, 2)]
    tolerance = tolerance_of(1.05, None)
    full, rows = envelope_rows(records, tolerance)
    assert [r.eviction_only for r in rows] == [False, True]
    assert all(r.smallest is not None for r in rows)
    sentence = envelope_verdict(full, rows, tolerance)
    assert "the cheapest configuration is sink4+q8+window at 16 entries" in sentence
    assert "the cheapest eviction-only one is window at 32 entries" in sentence
