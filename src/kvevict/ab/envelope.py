"""`kvevict envelope`'s search: per configuration, the smallest budget inside the tolerance.

Each configuration (a policy spec) is bisected in log budget between a floor and the
stream's length (`bisection.step`). A probe is one streaming-perplexity cell, measured
exactly as `kvevict ab` measures it (`worker.Worker`: the same stream, the full-cache
reference computed once, KV bytes from the cache's `memory()`), and written as a
`PplRecord` to `results.jsonl` as soon as its batch finishes. Each probe is judged
by the tolerance rule (`report.envelope.judge_probe`), so the search and the report
decide alike.

Each step asks every unfinished configuration for its next budget. The cache stores one
budget for all rows of a batch, so the configurations that want the same budget run as
rows of one stream, and different budgets run back to back, all against the one
full-cache reference. A rerun replays every search from the recorded probes and
measures only what is missing: an interrupted search loses nothing.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

from ..capacity import KvShape, shape_of
from ..defaults import DEFAULT_CHUNK
from ..errors import KvevictError
from ..loading.dtypes import dtype_name
from ..policies import check_policy, shared_batches
from ..position_modes import DEFAULT_POSITIONS
from ..progress import bars
from ..records.schema import PplRecord, load, ppl_records
from ..records.store import ResultStore
from ..report.envelope import judge_probe, tolerance_of
from .bisection import Bracket, step
from .executors import WorkerSpec
from .folder import open_run_folder
from .plan import Cell, SweepConfig, canonical, run_folder
from .worker import Batch, Worker


@dataclass
class EnvelopeConfig:
    """One envelope search: the stream it is measured on, the configurations, the bracket and the tolerance."""

    model: str = "smollm2-135m"
    dtype: str = "float32"  # what the model and its KV cache are held in: the bytes are counted in it
    text: str = "pg-essays"
    tokens: int = 4096
    policies: list[str] = field(default_factory=lambda: ["window", "streamingllm", "h2o", "snapkv"])
    floor: int = 64
    resolution: float = 1.1
    max_ppl_ratio: float | None = 1.05
    max_kl: float | None = None
    positions: str = DEFAULT_POSITIONS
    chunk: int = DEFAULT_CHUNK
    seed: int = 0
    name: str = "envelope"
    out: str = "runs"

    def sweep(self) -> SweepConfig:
        """The A/B settings a probe is measured under (no oracle: the envelope compares with the full cache)."""
        return SweepConfig(model=self.model, dtype=self.dtype, text=self.text, tokens=self.tokens, budgets=[self.floor],
                           policies=list(self.policies), oracle_stride=0, positions=self.positions,
                           chunk=self.chunk, seed=self.seed, name=self.name, out=self.out)

    def bracket(self) -> Bracket:
        return Bracket(self.floor, self.tokens, self.resolution).check()

    def tolerance(self):
        """The decision rule's `Tolerance` (one line naming the fix for a bad value)."""
        return tolerance_of(self.max_ppl_ratio, self.max_kl)


def configurations(config: EnvelopeConfig) -> list[Cell]:
    """The configurations searched, each checked at the floor (the smallest budget a search probes),
    before any model work. The full cache is the reference, not a configuration."""
    if not config.policies:
        raise KvevictError("--policies is empty: give comma-separated specs such as window,streamingllm,h2o")
    config.bracket()
    config.tolerance()
    run_folder(config.out, config.name)
    cells, seen = [], set()
    for label in config.policies:
        if check_policy(label, config.floor, config.positions).unbounded:
            raise KvevictError(f"'{label}' never evicts: the full cache is the reference every probe is judged "
                               "against; leave it out of --policies")
        spec = canonical(label, config.seed)
        if spec not in seen:
            seen.add(spec)
            cells.append(Cell("policy", spec, label, None))
    return cells


def next_probes(config: EnvelopeConfig, cells: list[Cell], records: list[PplRecord]) -> list[Batch]:
    """The probes every unfinished search asks for next, as batches: one per budget (policies that
    declare `own_batch` alone), in ascending budget."""
    full = next((r for r in records if r.kind == "full"), None)
    if full is None:
        return [Batch("full", None, [Cell("full", "full", "full", None)])]
    tolerance, bracket = config.tolerance(), config.bracket()
    wanted: dict[int, list[Cell]] = defaultdict(list)
    for cell in cells:
        probed = {r.budget: judge_probe(r, full, tolerance).outcome == "inside"
                  for r in records if r.kind == "policy" and r.policy == cell.spec}
        budget = step(bracket, probed).next
        if budget is not None:
            wanted[budget].append(Cell("policy", cell.spec, cell.label, budget))
    out = []
    for budget in sorted(wanted):
        for specs in shared_batches([c.spec for c in wanted[budget]]):
            out.append(Batch("rows", budget, [c for c in wanted[budget] if c.spec in specs]))
    return out


def kv_shape(model) -> KvShape:
    """The loaded model's KV shape, in the dtype its cache stores (its parameters')."""
    return shape_of(model.config, next(model.parameters()).element_size())


def run_envelope(
    config: EnvelopeConfig, model=None, tokenizer=None, progress: bool = True, allow_download: bool = False,
    device: str = "cpu", on_batch: Callable[[Batch], None] | None = None, executor=None,
) -> tuple[ResultStore, list[PplRecord]]:
    """Search every configuration to its resolution; returns the store and the run's perplexity records.

    `model`/`tokenizer` skip loading `config.model` (tests pass a tiny model); the model is
    loaded only when a probe is missing, so a finished search redraws without it.
    `on_batch` is told of each batch before it runs. With an `executor` (Ray's) the budgets of a step run
    on its workers, one batch each, each worker computing the full-cache reference once (`_rows_on`); the
    full cache's own record is measured here, where the model's KV shape is read. The steps stay in order:
    each waits for the judgements of the one before."""
    cells = configurations(config)
    if model is not None and dtype_name(model.dtype) != config.dtype:
        raise KvevictError(f"the model given is held in {model.dtype}, the search says dtype '{config.dtype}': "
                           f"pass EnvelopeConfig(dtype='{dtype_name(model.dtype)}') so its records name what ran")
    sweep = config.sweep()
    store = open_run_folder(sweep.folder, {**sweep.identity(), "search": "envelope"}, asdict(config),
                            "envelope probes")
    with executor.opened() if executor is not None else nullcontext():
        return _search(config, cells, store, model, tokenizer, progress, allow_download, device, on_batch, executor)


def _search(config, cells, store, model, tokenizer, progress, allow_download, device, on_batch,
            executor) -> tuple[ResultStore, list[PplRecord]]:
    """Step after step until every search is done (`run_envelope`)."""
    worker: Worker | None = None
    while True:
        records = ppl_records(load(store.records()))
        todo = next_probes(config, cells, records)
        if not todo:
            return store, records
        if executor is not None and todo[0].kind != "full":  # a step of budgets: on the executor's workers
            _rows_on(executor, WorkerSpec(config.sweep(), allow_download, model, tokenizer, device), todo, store,
                     progress, on_batch)
            continue
        worker = worker or Worker(config.sweep(), model, tokenizer, allow_download, device)
        for batch in todo:
            if on_batch is not None:
                on_batch(batch)
            lines = worker.run(batch, progress)
            if batch.kind == "full":  # what one cached token costs, for the capacity arithmetic of a redraw
                weights = sum(p.numel() * p.element_size() for p in worker.model.parameters())
                lines = [{**line, "kv_shape": kv_shape(worker.model).as_dict(), "weight_bytes": weights}
                         for line in lines]
            store.append(lines)


def _rows_on(executor, spec: WorkerSpec, todo: list[Batch], store: ResultStore, progress: bool,
             on_batch: Callable[[Batch], None] | None) -> None:
    """One step's batches on `executor`, each appended here as it finishes; a batch given up on stops the search
    in one line (what finished is kept: a rerun continues)."""
    for batch in todo:
        if on_batch is not None:
            on_batch(batch)
    before = len(executor.failed)
    with bars(progress) as bar:
        executor.run(spec, todo, store.append, bar)
    if len(executor.failed) > before:
        batch, reason = executor.failed[before]
        raise KvevictError(f"{batch.name} failed on the executor ({reason}): rerun the same command to continue "
                           "the search")
