"""`kvevict ruler`: RULER's long-context tasks (or a user's QA file) per policy, budget and protocol.

Everything that can be refused is refused before the model loads (tasks, samples,
protocol, budgets, the QA file, the run folder); the length against the model's context
and the budget against each prompt are checked as soon as they are known, before any
answer. Results go to OUT/NAME like a sweep's, and a rerun resumes.
"""

from __future__ import annotations

import typer

from ..errors import KvevictError
from .common import (
    DEVICE_HELP,
    DOWNLOAD_HELP,
    DTYPE_HELP,
    MODEL_HELP,
    POSITIONS_HELP,
    address_option,
    answer_cap,
    check_device,
    check_dtype,
    err,
    executor_option,
    max_accuracy_drop_option,
    max_kl_option,
    max_new_tokens_option,
    max_ppl_ratio_option,
    min_accuracy_ratio_option,
    one_line_errors,
    parse_numbers,
    print_json,
    remote_executor,
    retries_option,
    settle_specs,
    split_specs,
    tolerance_from,
    workers_option,
)
from .tables import show

#: seeded samples per RULER task and length unless --samples says otherwise (a --qa file: every line)
RULER_SAMPLES = 10


@one_line_errors
def ruler(
    tasks: str = typer.Option("niah_single_1,niah_single_2,niah_multikey_1",
                              help="RULER tasks (comma-separated), 'niah' for the 8 needle tasks, 'all' (RULER's "
                                   "11), or 'conversation' (a chat: facts and a system rule early, questions late)"),
    lengths: str = typer.Option("1000", help="prompt lengths in the model's tokens, answer included"),
    samples: int | None = typer.Option(None, show_default=False, help=f"seeded samples per task and length (default "
                                       f"{RULER_SAMPLES}); with --qa the file's first N lines (default: every line)"),
    policies: str = typer.Option("window,streamingllm,h2o,snapkv", help="comma-separated specs; full runs first"),
    budgets: str = typer.Option("50%,25%", help="entries or shares of the compressed context"),
    protocol: str = typer.Option("agnostic", help="agnostic | aware | stream | multi"),
    form: str = typer.Option("requests", help="multi only: requests (each from the compressed context) | turns | "
                                             "aware-requests (the first question compressed with the context)"),
    qa: str = typer.Option("", help="a JSONL file of {context, question, answers[, answer_prefix]} instead of tasks"),
    name: str = typer.Option("ruler", help="run name, one folder name: results go to OUT/NAME"),
    out_dir: str = typer.Option("runs", "--out", help="output folder"),
    model: str = typer.Option("smollm2-135m", help=MODEL_HELP),
    text: str = typer.Option("pg-essays", help="essay haystack: embedded name, .txt file, folder or .jsonl"),
    seed: int = typer.Option(0, help="seed of every sample"),
    positions: str | None = typer.Option(None, show_default=False, help=POSITIONS_HELP),
    max_new_tokens: int = max_new_tokens_option(),
    as_json: bool = typer.Option(False, "--json", help="print {'cells': [...]} as the last line"),
    allow_download: bool = typer.Option(False, "--allow-download", help=DOWNLOAD_HELP),
    device: str = typer.Option("cpu", help=DEVICE_HELP),
    max_ppl_ratio: float | None = max_ppl_ratio_option(),
    max_accuracy_drop: float | None = max_accuracy_drop_option(),
    min_accuracy_ratio: float | None = min_accuracy_ratio_option(),
    max_kl: float | None = max_kl_option(),
    dtype: str | None = typer.Option(None, help=DTYPE_HELP),
    executor: str = executor_option(),
    address: str = address_option(),
    workers: int = workers_option(),
    retries: int = retries_option(),
) -> None:
    """RULER's tasks, offline: accuracy per task, policy, budget and protocol, with 95% intervals."""
    from ..ab.ruler import RulerRun, run_ruler

    check_device(device)
    tolerance = tolerance_from(max_ppl_ratio, max_accuracy_drop, max_kl, min_accuracy_ratio=min_accuracy_ratio)
    check_dtype(dtype)
    runner = remote_executor(executor, address, workers, retries)  # samples shared out across its workers
    grid = _grid(tasks, lengths, samples, policies, budgets, protocol, form, qa, seed, positions, text, max_new_tokens)
    from ..loading import load_model
    from ..loading.models import model_dtype

    run = RulerRun(name, out_dir, model, grid, qa or None, model_dtype(model, dtype, device, allow_download))
    _ = run.folder  # a bad --name is refused before the model loads
    lm, tokenizer = load_model(model, device=device, allow_download=allow_download, dtype=run.dtype)
    grid.policies, _ = settle_specs(grid.policies, None, grid.positions, tokenizer)
    records = run_ruler(run, lm, tokenizer, executor=runner, allow_download=allow_download, device=device)
    if not getattr(tokenizer, "chat_template", None):  # after the run: a refusal stays one line
        err.print(f"note: '{model}' has no chat template; RULER's plain template was used")
    _show_run(run, records, tolerance, as_json)
    _failed(runner)


def _grid(tasks: str, lengths: str, samples: int | None, policies: str, budgets: str, protocol: str, form: str,
          qa: str, seed: int, positions: str | None, text: str, max_new_tokens: int):
    """The command's `RulerGrid`, checked: everything refused before the model loads."""
    from ..eval.ruler.grid import RulerGrid
    from ..eval.ruler.qa import QaFile, load_qa
    from ..eval.ruler.registry import parse_tasks
    from ..policies.budget import parse_budget

    specs = split_specs(policies)
    if not specs:
        raise KvevictError("--policies is empty: give comma-separated specs such as window,h2o,snapkv")
    specs, positions = settle_specs(specs, None, positions)
    rows = tuple(load_qa(qa)) if qa else ()
    grid = RulerGrid(
        tasks=parse_tasks(tasks) if not qa else ["qa"],
        lengths=parse_numbers(lengths, "--lengths", int, "ints") if not qa else [0],
        samples=samples if samples is not None else (len(rows) if qa else RULER_SAMPLES), policies=specs,
        budgets=[parse_budget(b) for b in split_specs(budgets)],
        protocol=protocol, form=form, seed=seed, positions=positions, text=text,
        qa=QaFile(rows) if qa else None, max_new_tokens=answer_cap(max_new_tokens),
    )
    grid.check()
    return grid


def _show_run(run, records: list, tolerance, as_json: bool) -> None:
    """The report page, then the tables, the equal-bytes groups and the verdict (or `--json`'s line)."""
    from ..records.schema import ruler_records
    from ..report import ruler as ruler_report
    from ..report.html import render
    from ..report.runs import record_tolerance
    from ..report.task_bytes import task_equal_bytes
    from ..report.verdict import verdict
    from ..report.verdict_text import sentence

    config = {**run.config(), **record_tolerance(run.folder, tolerance.as_dict())}
    path = render(records, config, run.folder / "report.html")
    cells = ruler_report.cells(ruler_records(records))
    if as_json:
        print_json({"cells": [vars(c) for c in cells], "report": str(path)})
        return
    show(ruler_report.ruler_table(cells), f"RULER, {run.model} ({run.dtype}; {path})")
    held = ruler_report.bytes_table(cells)
    if held is not None:
        show(held, "KV bytes per sequence once the context was compressed (MiB at bf16)")
        for group in task_equal_bytes(ruler_records(records)):  # fewer entries against fewer bits, same memory
            print(group.sentence())
    print(f"tolerance: {tolerance.describe()}")
    for found in verdict(records, tolerance):  # the report's verdict, drawn from the same records
        print(sentence(found))


def _failed(runner) -> None:
    """Name the samples a Ray executor gave up on, and exit 1: a rerun answers them."""
    if runner is None or not runner.failed:
        return
    for item, reason in runner.failed:
        err.print(f"failed: {item.name}: {reason}; rerun the same command to finish it", markup=False,
                  highlight=False, soft_wrap=True)
    raise typer.Exit(1)
