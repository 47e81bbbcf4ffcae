"""Results as JSON: what a command's `--json` prints as its last line, for a script or a CI job to read instead
of scraping a table (the smallest budget found, the policy shipped, what a sequence holds).

Each function reads the same decisions the tables and sentences read (`verdict`'s `BudgetVerdict`,
the envelopes' rows, the capacity rows) and decides nothing. A figure that is not a number (no PPL for
a run of tasks alone) is `null`, so the object is strict JSON.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict

from ..capacity import CapacityRow
from ..records.schema import PplRecord
from ..stats.tolerance import Judgement
from . import verdict_text
from .envelope import EnvelopeRow, Probe
from .task_envelope import Cell, TaskRow
from .verdict import BudgetVerdict


def _number(value: float | None) -> float | None:
    return None if value is None or (isinstance(value, float) and not math.isfinite(value)) else value


def judgement(j: Judgement | None) -> dict | None:
    """A judgement's metric, outcome, estimate and interval, its limit and samples."""
    return None if j is None else {k: _number(v) if isinstance(v, float) else v for k, v in asdict(j).items()}


def ppl_rows(records: Sequence[PplRecord]) -> list[dict]:
    """The A/B summary's rows: per perplexity cell its policy, budget, PPL, KL and KV bytes per sequence."""
    return [{"name": r.name, "policy": r.policy, "kind": r.kind, "budget": r.budget, "ppl": _number(r.ppl),
             "kl_to_full": _number(r.kl_to_full), "kv_bytes": r.kv_bytes, "kv_bytes_bf16": r.kv_bytes_bf16,
             "full_kv_bytes": r.full_kv_bytes, "sink_share": _number(r.sink_share)} for r in records]


def verdicts(found: Sequence[BudgetVerdict]) -> list[dict]:
    """Per budget the policy shipped (None: nothing shown inside), every policy's outcome and judgements, the
    sentence."""
    return [{"budget": v.budget, "recommended": v.recommended.name if v.recommended else None,
             "inside": [c.name for c in v.inside], "undecided": [c.name for c in v.undecided],
             "outside": [c.name for c in v.outside], "collapsed": [c.name for c, _ in v.collapsed],
             "tied": [c.name for c in v.tied],
             "judgements": {c.name: {label: judgement(j) for label, j in c.judgements} for c in v.candidates},
             "sentence": verdict_text.sentence(v)} for v in found]


def _probe(p: Probe | None) -> dict | None:
    if p is None:
        return None
    r = p.record
    return {"budget": p.budget, "kv_bytes": r.kv_bytes, "kv_bytes_bf16": r.kv_bytes_bf16, "share": p.share,
            "share_bf16": p.share_bf16, "judgement": judgement(p.judgement)}


def envelope(tokens: int, full: PplRecord | None, rows: Sequence[EnvelopeRow], sentence: str) -> dict:
    """One PPL envelope: per configuration the smallest budget inside and the first below it that fails."""
    return {"tokens": tokens, "full_ppl": _number(full.ppl) if full else None,
            "full_kv_bytes": full.kv_bytes if full else None, "verdict": sentence,
            "configurations": [{"name": r.name, "spec": r.spec, "eviction_only": r.eviction_only,
                                "smallest": _probe(r.smallest), "failing": _probe(r.failing),
                                "probes": len(r.probes)} for r in rows]}


def capacity(note: str, rows: Sequence[CapacityRow]) -> dict:
    """The capacity arithmetic in words and per configuration its bytes per sequence and sequences that fit."""
    return {"arithmetic": note, "rows": [{"name": r.name, "budget": r.budget, "sequence_bytes": r.sequence_bytes,
                                          "sequences": r.sequences, "share": r.share} for r in rows]}


def _cell(c: Cell | None) -> dict | None:
    if c is None:
        return None
    return {"budget": c.budget, "judgement": judgement(c.judgement), "kv_bytes_bf16": c.kv_bytes_bf16,
            "full_kv_bytes_bf16": c.full_kv_bytes_bf16}


def task_envelope(task: str, length: int, protocol: str, rows: Sequence[TaskRow], sentence: str) -> dict:
    """One task envelope: per configuration the smallest budget shown inside on the task, and the first failing."""
    return {"task": task, "length": length, "protocol": protocol, "verdict": sentence,
            "configurations": [{"name": r.name, "smallest": _cell(r.smallest), "failing": _cell(r.failing),
                                "cells": len(r.cells)} for r in rows]}
