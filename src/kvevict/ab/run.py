"""Running a sweep: the run folder, one batch per budget, results appended as they finish, resume.

Cells that share a budget run as rows of one batch through one `EvictingCache`, so the
weights are read once per decode step for all of them. The exception is a policy that
gives each layer its own budget (`pyramidkv`): a layer stores one budget for all rows,
so it runs in a batch of its own (`policies.shared_batches`). Each finished batch is appended
to `results.jsonl` atomically (see `report.store`); rerunning the same command skips
finished cells. `run.json` pins what the cells were measured on, so a rerun with
another model, text or length cannot mix results.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import torch

from ..data import load_tokens
from ..errors import KvevictError
from ..eval.oracle import recompute_oracle
from ..eval.streaming import RowResult, compare, full_reference
from ..models import load_model
from ..policies import shared_batches
from ..progress import bars
from ..report.records import PplRecord, Record, load
from ..report.store import ResultStore
from . import tasks
from .plan import Cell, SweepConfig, plan

#: predictions per point of the PPL-vs-position curve: the stream is cut in this many windows
CURVE_POINTS = 40


def prepare_folder(config: SweepConfig) -> ResultStore:
    """Create the run folder, check it is writable and belongs to the same experiment."""
    folder = config.folder
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".write-probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise KvevictError(f"cannot write to '{folder}' ({exc.strerror}): choose a writable --out folder") from None
    meta = folder / "run.json"
    if meta.exists():
        before = json.loads(meta.read_text()).get("identity", {})
        if before and before != config.identity():
            raise KvevictError(
                f"'{folder}' holds results for {before}, not {config.identity()}: use another --name to start fresh"
            )
    meta.write_text(json.dumps({"identity": config.identity(), "config": asdict(config)}, indent=2))
    return ResultStore(folder / "results.jsonl")


def ppl_record(cell: Cell, result: RowResult, config: SweepConfig) -> PplRecord:
    """The record of one finished cell: the row's summary, its curve, and what it was measured on."""
    data = result.summary()
    width = max(1, result.nll.numel() // CURVE_POINTS)
    data.update(
        key=cell.key,
        kind=cell.kind,
        policy=cell.spec,
        label=cell.label,
        budget=cell.budget,
        seed=config.seed,
        # the full cache and the oracle hold every position they see: the mode does not apply to them
        positions=config.positions if cell.kind in ("policy", "sinks") else "original",
        curve=result.ppl_windows(width),
        sink_lost_at=result.sink_lost_at,
        layer_budgets=result.layer_budgets,
        **{k: v for k, v in config.identity().items() if k != "positions"},
    )
    return PplRecord.from_dict(data)


def run_sweep(
    config: SweepConfig, model=None, tokenizer=None, progress: bool = True, allow_download: bool = False
) -> tuple[ResultStore, list[Record]]:
    """Run every unfinished cell; returns the store and the run's records (typed).

    `model`/`tokenizer` skip loading `config.model` (tests pass a tiny model);
    `allow_download` lets `load_model` fetch an HF id that is not in the local cache.
    """
    cells = plan(config)
    store = prepare_folder(config)
    done = store.done()
    todo = [c for c in cells if c.key not in done]
    task_kinds = tasks.pending(config, done)
    if (todo or task_kinds) and model is None:
        model, tokenizer = load_model(config.model, allow_download=allow_download)
    if todo:
        tokens, _ = load_tokens(config.text, tokenizer, config.tokens)
        torch.manual_seed(config.seed)
        with bars(progress) as bar:
            sweep_task = bar.add_task(f"sweep {config.name}: cells", total=len(cells), completed=len(cells) - len(todo))
            reference = full_reference(model, tokens, bar)
            full = next((c for c in todo if c.kind == "full"), None)
            if full is not None:
                store.append([ppl_record(full, reference.result, config).to_dict()])
                bar.advance(sweep_task)
            for budget in config.budgets:
                rows = [c for c in todo if c.budget == budget and c.kind in ("policy", "sinks")]
                # one batch per budget; a per-layer-budget policy (pyramidkv) runs in its own
                for specs in shared_batches(list(dict.fromkeys(c.spec for c in rows))):
                    results, _ = compare(
                        model, tokens, specs, budget, config.positions, reference=reference, progress=bar,
                        chunk=config.chunk,
                        label=f"budget {budget}: {len(specs)} policies",
                    )
                    by_spec = {r.policy: r for r in results}
                    batch = [c for c in rows if c.spec in by_spec]
                    store.append([ppl_record(c, by_spec[c.spec], config).to_dict() for c in batch])
                    bar.advance(sweep_task, len(batch))
                oracle = next((c for c in todo if c.budget == budget and c.kind == "oracle"), None)
                if oracle is not None:
                    result = recompute_oracle(model, tokens, budget, config.oracle_stride, reference, bar)
                    store.append([ppl_record(oracle, result, config).to_dict()])
                    bar.advance(sweep_task)
    if task_kinds:
        tokens, _ = load_tokens(config.text, tokenizer, config.tokens)
        with bars(progress) as bar:
            tasks.run(config, model, tokenizer, tokens, store, task_kinds, bar)
    wanted = {c.key for c in cells}
    records = load(store.records())
    # this plan's cells (an older plan's rows in the same folder are not this run's) and the task trials
    return store, [r for r in records if r.key in wanted or r.kind in tasks.KINDS]
