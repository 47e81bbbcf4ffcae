"""Running a sweep: the run folder, batches handed to an executor, results appended as they finish, resume.

Cells that share a budget run as rows of one batch (`worker.Batch`), so the weights
are read once per decode step for all of them; a policy that declares `own_batch` (a
budget per layer, `pyramidkv`, or per head, `adakv:P`) runs in a batch of its own
(`policies.shared_batches`). An executor runs the batches (in this
process, or on Ray workers, see `executors`) and hands each finished batch back; only
this process appends to `results.jsonl`, atomically (see `records.store`). Rerunning the
same command skips finished cells. `run.json` pins what the cells were measured on, so
a rerun with another model, text or length cannot mix results.
"""

from __future__ import annotations

import json
from dataclasses import asdict

from ..data import load_tokens, stream_start
from ..errors import KvevictError
from ..eval.oracle import oracle_undefined
from ..files import atomic_write
from ..loading import load_config, load_model, load_tokenizer
from ..loading.dtypes import dtype_name
from ..progress import bars
from ..records.schema import Record, load
from ..records.store import ResultStore
from . import tasks
from .executors import Executor, LocalExecutor, WorkerSpec
from .folder import open_run_folder
from .plan import SweepConfig, plan, settle
from .worker import batches


def prepare_folder(config: SweepConfig) -> ResultStore:
    """The sweep's run folder (see `open_run_folder`)."""
    return open_run_folder(config.folder, config.identity(), asdict(config))


def record_stream_start(config: SweepConfig, tokenizer) -> None:
    """Write into `run.json` what the stream starts with before the text (`data.stream_start`:
    Gemma's BOS, nothing for SmolLM2), so a result says how its model's text was tokenised."""
    meta = config.folder / "run.json"
    data = json.loads(meta.read_text())
    ids = stream_start(tokenizer)
    data["config"]["stream_start"] = tokenizer.decode(ids) if ids else ""
    data["config"]["stream_start_ids"] = ids
    atomic_write(meta, json.dumps(data, indent=2))


def settle_for(config: SweepConfig, model, tokenizer, allow_download: bool = False) -> SweepConfig:
    """`config` settled (`plan.settle`) for its model: whether the tokenizer adds BOS, and whether the
    recompute oracle is defined there, read off the loaded model or else its config (no weights)."""
    undefined = None
    if config.oracle_stride != 0:
        undefined = oracle_undefined(model if model is not None else load_config(config.model, allow_download))
    return settle(config, bool(stream_start(tokenizer)), undefined)


def run_sweep(
    config: SweepConfig, model=None, tokenizer=None, progress: bool = True, allow_download: bool = False,
    executor: Executor | None = None, device: str = "cpu",
) -> tuple[ResultStore, list[Record]]:
    """Run every unfinished cell; returns the store and the run's records (typed).

    `model`/`tokenizer` skip loading `config.model` (tests pass a tiny model);
    `allow_download` lets `load_model` fetch an HF id that is not in the local cache.
    `executor` runs the batches (default: `LocalExecutor`, in this process); cells it
    gave up on are in `executor.failed`, and a rerun of the same sweep runs them again.
    `device`: where a model this run loads goes (`cpu`, `cuda`); a given `model` stays where it is.
    """
    executor = executor or LocalExecutor()
    if model is not None and dtype_name(model.dtype) != config.dtype:
        raise KvevictError(f"the model given is held in {model.dtype}, the sweep says dtype '{config.dtype}': "
                           f"pass SweepConfig(dtype='{dtype_name(model.dtype)}') so its records name what ran")
    plan(config)  # every spec, budget and the run name, before anything is read
    tokenizer = tokenizer or load_tokenizer(config.model, allow_download)
    config = settle_for(config, model, tokenizer, allow_download)
    cells = plan(config)
    store = prepare_folder(config)
    done = store.done()
    todo = batches(config, [c for c in cells if c.key not in done])
    task_kinds = tasks.pending(config, done)
    if model is None and todo and executor.in_process:  # one model for the cells and the tasks
        model, tokenizer = load_model(config.model, device=device, allow_download=allow_download, dtype=config.dtype)
    record_stream_start(config, tokenizer)
    if todo:
        with executor.opened(), bars(progress) as bar:
            sweep_task = bar.add_task(f"sweep {config.name}: cells", total=len(cells),
                                      completed=len(cells) - sum(len(b.cells) for b in todo))

            def finished(lines: list[dict]) -> None:
                store.append(lines)
                bar.advance(sweep_task, len(lines))

            executor.run(WorkerSpec(config, allow_download, model, tokenizer, device), todo, finished, bar)
    if task_kinds:  # the protocols beyond perplexity run in this process, whatever the executor
        if model is None:
            model, tokenizer = load_model(config.model, device=device, allow_download=allow_download,
                                          dtype=config.dtype)
        tokens, _ = load_tokens(config.text, tokenizer, config.tokens)
        with bars(progress) as bar:
            tasks.run(config, model, tokenizer, tokens, store, task_kinds, bar)
    wanted = {c.key for c in cells}
    records = load(store.records())
    # this plan's cells (an older plan's rows in the same folder are not this run's) and the task trials
    return store, [r for r in records if r.key in wanted or r.kind in tasks.kinds()]
