"""Typed records of `results.jsonl`: one dataclass per kind of line, with the JSON keys unchanged.

The store keeps plain JSON objects so that old run folders stay readable by any
version; these classes are how the harness writes them and the report reads them. Each
`from_dict` / `to_dict` pair round-trips a line exactly: keys a class does not declare
are kept in `extra`, and optional keys absent from a line stay absent when it is
written back. A cell's identity is its `key`, `"kind|spec|budget"`, built in one place
(`cell_key`) so that resuming a sweep and redrawing its report agree on it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from ..errors import KvevictError
from ..eval.sink_loss import SinkLoss, sink_loss
from ..position_modes import DEFAULT_POSITIONS

#: kinds of perplexity rows: the full cache, the recompute oracle, a policy, a sink-count sweep row
PPL_KINDS = ("full", "oracle", "policy", "sinks")
#: an oracle row shows a PPL only from this many re-computed predictions on ("n too small" below it)
MIN_ORACLE_PREDICTIONS = 30
#: kinds of per-trial records of the protocols beyond perplexity
TASK_KINDS = ("needle", "generation")
#: what a trial line of any other kind says it is (`"record": "trial"`): a sweep task of its own writes it, so
#: its lines are read back as `TaskRecord`s with no kind listed here (`ab/sweep_tasks/`)
TRIAL = "trial"
#: what a line without a dtype was measured in: every run before the dtype was recorded loaded float32
UNRECORDED_DTYPE = "float32"


def cell_key(kind: str, spec: str, budget: int | None) -> str:
    """The key of one perplexity cell: what `results.jsonl` is resumed by."""
    return f"{kind}|{spec}|{budget}"


def _split(cls, data: dict) -> tuple[dict, dict]:
    """(declared fields, everything else) of a JSON object, for `cls.from_dict`."""
    names = {f.name for f in fields(cls) if f.name != "extra"}
    return {k: v for k, v in data.items() if k in names}, {k: v for k, v in data.items() if k not in names}


def _join(record, optional: tuple[str, ...]) -> dict:
    """The JSON object of `record`: declared fields (optional ones only when set), then `extra`."""
    data = {f.name: getattr(record, f.name) for f in fields(record) if f.name != "extra"}
    for name in optional:
        if data[name] is None:
            del data[name]
    return {**data, **record.extra}


@dataclass
class PplRecord:
    """One perplexity cell of a sweep: the full cache, the oracle, or a policy at a budget.

    `policy` is the canonical spec (what the cell ran), `label` what the user wrote
    (what the tables show). `curve` is the PPL per window along the stream
    (`[{"start", "end", "ppl"}]`); `sink_lost_at` is `[layers][kv_heads]` of the token
    count at which token 0 was evicted (-1: never; a null row: a layer the budget does
    not bound). `sink()` is the one sink-loss figure every table and the verdict show.
    """

    key: str
    kind: str
    policy: str
    budget: int | None
    ppl: float
    label: str | None = None
    positions: str = DEFAULT_POSITIONS
    n_predictions: int = 0
    nll_mean: float | None = None
    max_kept: int | None = None
    #: entries a full-attention layer held on average over the stream's steps (below `max_kept` under
    #: burst eviction: the memory actually saved)
    mean_kept: float | None = None
    sink_evicted: bool | None = None
    first_token_evicted: bool | None = None
    sink_loss: float | None = None
    #: wall seconds of the whole batch the row ran in (the policies of one budget share one batch);
    #: lines written before it had this name call it `seconds`, which meant the same
    batch_seconds: float | None = None
    #: stream tokens per second of the batch the row ran in (every row of a batch reads the stream at once)
    tokens_per_s: float | None = None
    #: peak resident memory (MiB) of the process while the batch ran;
    #: `peak_mb_scope` "batch", "sampled" or "process" (see ab/meter.py)
    peak_mb: float | None = None
    peak_mb_scope: str | None = None
    device_peak_mb: float | None = None
    seed: int | None = None
    curve: list[dict] = field(default_factory=list)
    #: KL(full ‖ policy) over the same windows as `curve` (`[{"start", "end", "n", "kl"}]`)
    kl_curve: list[dict] | None = None
    sink_lost_at: list | None = None
    #: the model's own window when it has sliding-window layers (their rows of `sink_lost_at` are null)
    sliding_window: int | None = None
    model: str | None = None
    #: what the model and its KV cache were held in (`float32`, `bfloat16`, `float16`); absent from lines
    #: written before the dtype was recorded, which were all float32 (`measured_dtype`)
    dtype: str | None = None
    text: str | None = None
    tokens: int | None = None
    #: the full cache's PPL on exactly the tokens this row scored (the oracle scores a sample)
    full_ppl_same_tokens: float | None = None
    kl_to_full: float | None = None
    top1_agreement: float | None = None
    #: entries each layer kept, bottom first, when the policy gives layers their own budget (pyramidkv)
    layer_budgets: list[int] | None = None
    #: at the end of the stream: entries per layer and KV head by layer kind, KV bytes held and what a full
    #: cache holds for the same tokens; `held_per_head` `[layer][KV head]` where heads differ (adakv)
    held_per_layer_kind: dict[str, int] | None = None
    kv_bytes: int | None = None
    full_kv_bytes: int | None = None
    #: `kv_bytes` and `full_kv_bytes` with every float counted at 2 bytes (bf16, the deployment dtype): what
    #: a quantized row's codes, scales and zero points would take on an accelerator
    kv_bytes_bf16: int | None = None
    full_kv_bytes_bf16: int | None = None
    held_per_head: list | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    #: keys written only when they hold a value (older lines, and the full row, lack them)
    OPTIONAL: ClassVar[tuple[str, ...]] = (
        "label", "nll_mean", "max_kept", "mean_kept", "sink_evicted", "first_token_evicted", "sink_loss",
        "batch_seconds", "tokens_per_s", "peak_mb", "peak_mb_scope", "device_peak_mb", "seed",
        "kl_curve", "sink_lost_at", "sliding_window", "model", "dtype", "text", "tokens", "full_ppl_same_tokens",
        "kl_to_full", "top1_agreement",
        "layer_budgets", "held_per_layer_kind", "kv_bytes", "full_kv_bytes", "held_per_head",
        "kv_bytes_bf16", "full_kv_bytes_bf16",
    )

    @classmethod
    def from_dict(cls, data: dict) -> PplRecord:
        if "seconds" in data and "batch_seconds" not in data:  # the older name of the same figure
            data = {("batch_seconds" if k == "seconds" else k): v for k, v in data.items()}
        known, extra = _split(cls, data)
        return cls(**known, extra=extra)

    def to_dict(self) -> dict:
        return _join(self, self.OPTIONAL)

    @property
    def recomputed(self) -> int | None:
        """The oracle's predictions that were re-computed from a bounded window (the rest saw their whole past)."""
        if self.kind != "oracle" or self.budget is None:
            return None
        head = min(self.budget, (self.tokens or self.n_predictions + 1) - 1)
        return max(0, self.n_predictions - head)

    @property
    def enough(self) -> bool:
        """Whether the row has the predictions its figures need (`MIN_ORACLE_PREDICTIONS` for the oracle)."""
        return self.recomputed is None or self.recomputed >= MIN_ORACLE_PREDICTIONS

    @property
    def name(self) -> str:
        """What a table or a legend calls this row: the user's spelling when there is one."""
        return self.label or self.policy

    @property
    def measured_dtype(self) -> str:
        """The dtype the row was measured in: float32 for a line written before dtypes were recorded."""
        return self.dtype or UNRECORDED_DTYPE

    def sink(self) -> SinkLoss | None:
        """The row's sink loss counted from its grid (`eval.sink_loss`); None for a row recorded without one."""
        return sink_loss(self.sink_lost_at)

    @property
    def sink_share(self) -> float | None:
        """The share every table shows: from the grid, or the recorded share of a row without one."""
        found = self.sink()
        return self.sink_loss if found is None else found.share


@dataclass
class TaskRecord:
    """One trial of a protocol beyond perplexity inside a sweep (kind `needle`, `generation`, or a task's own).

    `fields` is the trial's record as the protocol in `eval/` returned it (policy,
    budget, length, hit, output, ...); `key` names the trial, `seed` the sweep's seed.
    """

    key: str
    kind: str
    seed: int | None = None
    fields: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict) -> TaskRecord:
        rest = {k: v for k, v in data.items() if k not in ("key", "kind", "seed", "record")}
        return cls(data["key"], data.get("kind", ""), data.get("seed"), rest)

    def to_dict(self) -> dict:
        """The line; a kind not in `TASK_KINDS` says it is a trial (`TRIAL`), so it is read back without one."""
        data = {**self.fields, "key": self.key, "kind": self.kind}
        if self.seed is not None:
            data["seed"] = self.seed
        if self.kind not in TASK_KINDS:
            data["record"] = TRIAL
        return data


@dataclass
class RulerRecord:
    """One answer of a RULER task (kind `ruler`): a sample, a question of it, a policy at a budget, a protocol.

    `score` is the sample's RULER score in [0, 1] (`metric` "all": the share of `answers`
    found in `output`; "part": any of them); `question` numbers the `multi` protocol's
    questions (0 otherwise) and `form` is its form (`requests`, `turns` or `aware-requests`).
    """

    key: str
    task: str
    protocol: str
    length: int
    sample: int
    policy: str
    budget: str
    score: float
    question: int = 0
    form: str | None = None
    budget_tokens: int | None = None
    metric: str = "all"
    answers: list[str] = field(default_factory=list)
    output: str = ""
    prompt_tokens: int | None = None
    context_tokens: int | None = None
    depths: list[float] = field(default_factory=list)
    kept: int | None = None
    #: KV bytes the row's cache held once the context was compressed (`Compressed.measure`): as held, and with
    #: every float at 2 bytes (bf16); absent from older lines
    kv_bytes: int | None = None
    kv_bytes_bf16: int | None = None
    seconds: float | None = None
    seed: int | None = None
    kind: str = "ruler"
    #: what the model and its KV cache were held in; absent from older lines, which were float32
    dtype: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    OPTIONAL: ClassVar[tuple[str, ...]] = (
        "form", "budget_tokens", "prompt_tokens", "context_tokens", "kept", "kv_bytes", "kv_bytes_bf16", "seconds",
        "seed", "dtype",
    )

    @classmethod
    def from_dict(cls, data: dict) -> RulerRecord:
        known, extra = _split(cls, data)
        return cls(**known, extra=extra)

    def to_dict(self) -> dict:
        return _join(self, self.OPTIONAL)

    @property
    def shape(self) -> str:
        """The protocol as tables name it: `multi-requests`, `multi-turns`, `multi-aware-requests` for multi."""
        return f"multi-{self.form}" if self.protocol == "multi" and self.form else self.protocol

    @property
    def cell_length(self) -> int:
        """The length a cell groups by: the RULER prompt length, or `OWN_LENGTHS` for the lines of a QA file.
        Each QA line runs at its own length, so grouped by it every line would be a cell of one answer, judged
        alone; the file's lines are one task, pooled."""
        return OWN_LENGTHS if self.task == QA_TASK else self.length


#: the task name of a user's QA file (`eval.ruler.qa.QaFile`), and the length its pooled cells carry
QA_TASK = "qa"
OWN_LENGTHS = 0


@dataclass
class SinkMapRecord:
    """The model's attention-sink map measured inside a sweep (`SinkMap.to_dict()` in `map`)."""

    key: str
    map: dict[str, Any]
    model: str = ""
    kind: str = "sinkmap"
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict) -> SinkMapRecord:
        known, extra = _split(cls, data)
        return cls(**known, extra=extra)

    def to_dict(self) -> dict:
        return _join(self, ())


@dataclass
class DoneMarker:
    """Closes a finished protocol (kind `needle-done`, ...): its key says which settings it ran with."""

    key: str
    kind: str

    @classmethod
    def from_dict(cls, data: dict) -> DoneMarker:
        return cls(data["key"], data["kind"])

    def to_dict(self) -> dict:
        return {"key": self.key, "kind": self.kind}


Record = PplRecord | TaskRecord | SinkMapRecord | DoneMarker | RulerRecord


def from_dict(data: dict) -> Record:
    """The typed record of one line of `results.jsonl`; a line of a kind no class declares is an error."""
    kind = data.get("kind")
    if kind in PPL_KINDS:
        return PplRecord.from_dict(data)
    if kind == "sinkmap":
        return SinkMapRecord.from_dict(data)
    if kind == "ruler":
        return RulerRecord.from_dict(data)
    if isinstance(kind, str) and kind.endswith("-done"):
        return DoneMarker.from_dict(data)
    if kind in TASK_KINDS or (isinstance(kind, str) and data.get("record") == TRIAL):
        return TaskRecord.from_dict(data)
    raise KvevictError(
        f"results.jsonl holds a line of kind {kind!r} (key {data.get('key')!r}), which this kvevict does not know "
        f"(known: {', '.join((*PPL_KINDS, *TASK_KINDS, 'sinkmap', 'ruler', '*-done'))}): it was written by another "
        "version; redraw with that version, or remove the line"
    )


def load(lines: Iterable[dict]) -> list[Record]:
    """Typed records of the JSON objects a `ResultStore` read."""
    return [from_dict(line) for line in lines]


def ppl_records(records: Iterable[Record]) -> list[PplRecord]:
    return [r for r in records if isinstance(r, PplRecord)]


def ruler_records(records: Iterable[Record]) -> list[RulerRecord]:
    return [r for r in records if isinstance(r, RulerRecord)]


def task_records(records: Iterable[Record], kind: str) -> list[TaskRecord]:
    return [r for r in records if isinstance(r, TaskRecord) and r.kind == kind]
