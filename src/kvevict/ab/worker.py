"""One unit of a sweep's work (`Batch`) and what runs it (`Worker`), in any process.

A sweep's cells are grouped into batches the way they run best: the full cache alone,
the policies of one budget as rows of one forward, the recompute oracle of one budget.
A `Worker` holds the model, the token stream and the full-cache reference (computed
once, on first need) and turns a batch into the records of its cells. The local
executor runs one worker in the driver; the Ray executor runs one per Ray actor, each
loading the model once and keeping it. Both return the same records for the same
batch: the numbers depend only on the model, the stream and the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data import load_tokens
from ..eval.oracle import recompute_oracle
from ..eval.row_result import RowResult
from ..eval.streaming import Reference, compare, full_reference
from ..loading import load_model
from ..policies import shared_batches
from ..position_modes import DEFAULT_POSITIONS
from ..records.schema import PplRecord
from .meter import Cost, measure
from .plan import Cell, SweepConfig

#: predictions per point of the PPL-vs-position curve: the stream is cut in this many windows
CURVE_POINTS = 40


@dataclass
class Batch:
    """Cells that run together: `kind` is `full`, `rows` (the policies of one budget) or `oracle`."""

    kind: str
    budget: int | None
    cells: list[Cell]

    @property
    def name(self) -> str:
        return "full cache" if self.kind == "full" else f"budget {self.budget}: {self.kind}"


def batches(config: SweepConfig, todo: list[Cell]) -> list[Batch]:
    """The unfinished cells as batches, in the order a local run takes them: the full cache,
    then per budget its policy rows and its oracle."""
    out = [Batch("full", None, [c]) for c in todo if c.kind == "full"]
    for budget in config.budgets:
        rows = [c for c in todo if c.budget == budget and c.kind in ("policy", "sinks")]
        # one batch per budget; a policy that declares `own_batch` (pyramidkv, adakv:P) runs in its own
        for specs in shared_batches(list(dict.fromkeys(c.spec for c in rows))):
            out.append(Batch("rows", budget, [c for c in rows if c.spec in specs]))
        out += [Batch("oracle", budget, [c]) for c in todo if c.budget == budget and c.kind == "oracle"]
    return out


def ppl_record(cell: Cell, result: RowResult, config: SweepConfig, cost: Cost, tokens: int) -> PplRecord:
    """The record of one finished cell, field by field: the row's measurements, its curves, what it was
    measured on and what its batch cost."""
    width = max(1, result.nll.numel() // CURVE_POINTS)
    memory = result.memory or {}
    identity = config.identity()
    return PplRecord(
        key=cell.key, kind=cell.kind, policy=cell.spec, budget=cell.budget, ppl=result.ppl, label=cell.label,
        # the full cache and the oracle hold every position they see: the mode does not apply to them
        positions=config.positions if cell.kind in ("policy", "sinks") else DEFAULT_POSITIONS,
        n_predictions=result.n_predictions, nll_mean=result.nll_mean, max_kept=result.max_kept,
        sink_evicted=result.pinned_sink_evicted, first_token_evicted=result.first_token_evicted,
        sink_loss=result.sink_loss, seed=config.seed,
        curve=result.ppl_windows(width), kl_curve=result.kl_windows(width) or None,
        sink_lost_at=result.sink_lost_at, sliding_window=result.sliding_window,
        model=identity["model"], dtype=identity["dtype"], text=identity["text"], tokens=identity["tokens"],
        full_ppl_same_tokens=result.full_ppl_same_tokens, kl_to_full=result.kl_to_full,
        top1_agreement=result.top1_agreement, mean_kept=result.mean_kept,
        layer_budgets=result.layer_budgets, held_per_layer_kind=memory.get("held"),
        kv_bytes=memory.get("kv_bytes"), full_kv_bytes=memory.get("full_kv_bytes"),
        kv_bytes_bf16=memory.get("kv_bytes_bf16"), full_kv_bytes_bf16=memory.get("full_kv_bytes_bf16"),
        held_per_head=memory.get("held_per_head"),
        **cost.fields(tokens),
    )


class Worker:
    """Runs batches of one sweep: the model, the stream and the full-cache reference, loaded once.

    `model`/`tokenizer` skip loading `config.model` (tests pass a tiny model). The model
    is loaded on the first batch, so a bad model name surfaces as that batch's error.
    """

    def __init__(
        self, config: SweepConfig, model=None, tokenizer=None, allow_download: bool = False, device: str = "cpu"
    ) -> None:
        self.config, self.model, self.tokenizer = config, model, tokenizer
        self.allow_download = allow_download
        self.device = device
        self.tokens: torch.Tensor | None = None
        self._reference: tuple[Reference, Cost] | None = None

    def _load(self) -> None:
        if self.model is None:
            self.model, self.tokenizer = load_model(
                self.config.model, device=self.device, allow_download=self.allow_download, dtype=self.config.dtype
            )
        if self.tokens is None:
            self.tokens, _ = load_tokens(self.config.text, self.tokenizer, self.config.tokens)

    def reference(self, progress=False) -> tuple[Reference, Cost]:
        """The full cache over the stream and what computing it cost, once per worker."""
        if self._reference is None:
            self._load()
            with measure(self.model.device) as cost:
                reference = full_reference(self.model, self.tokens, progress)
            self._reference = (reference, cost)
        return self._reference

    def run(self, batch: Batch, progress=False) -> list[dict]:
        """The records (as JSON objects) of every cell of `batch`."""
        self._load()
        config, tokens = self.config, self.tokens
        reference, reference_cost = self.reference(progress)
        if batch.kind == "full":
            return [ppl_record(batch.cells[0], reference.result, config, reference_cost, tokens.numel()).to_dict()]
        torch.manual_seed(config.seed)
        with measure(self.model.device) as cost:
            if batch.kind == "oracle":
                found = {"oracle": recompute_oracle(self.model, tokens, batch.budget, config.oracle_stride, reference,
                                                    progress)}
            else:
                specs = list(dict.fromkeys(c.spec for c in batch.cells))
                results, _ = compare(
                    self.model, tokens, specs, batch.budget, config.positions, reference=reference,
                    progress=progress, chunk=config.chunk, label=f"budget {batch.budget}: {len(specs)} policies",
                )
                found = {r.policy: r for r in results}
        return [ppl_record(c, found[c.spec], config, cost, tokens.numel()).to_dict() for c in batch.cells]
