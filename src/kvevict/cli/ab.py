"""`kvevict ab`, `kvevict demo` and `kvevict report`: run a sweep, or redraw its report from the results.

The harness and the report are imported inside the commands: they pull in torch and
matplotlib, which `kvevict --help` and a mistyped option should not wait for.
"""

from __future__ import annotations

from pathlib import Path

import typer

from ..defaults import DEFAULT_CHUNK, DEFAULT_ORACLE_STRIDE
from ..errors import KvevictError
from .common import (
    CHUNK_HELP,
    DEVICE_HELP,
    DOWNLOAD_HELP,
    DTYPE_HELP,
    MODEL_HELP,
    POSITIONS_HELP,
    address_option,
    check_device,
    check_dtype,
    check_positions,
    err,
    executor_option,
    max_accuracy_drop_option,
    max_kl_option,
    max_ppl_ratio_option,
    min_accuracy_ratio_option,
    one_line_errors,
    parse_chunk,
    parse_floats,
    parse_ints,
    print_json,
    retries_option,
    split_specs,
    tolerance_from,
    workers_option,
)
from .tables import show

#: where `kvevict report RUN RUN ...` writes the side-by-side report unless `--out` says otherwise
COMPARE_REPORT = "report-compare.html"

#: The default A/B that `make demo` runs: sized to finish in under 10 minutes on 2 cores.
DEMO = dict(tokens=2000, budgets=[64, 128, 256], policies=["window", "streamingllm", "h2o", "snapkv"],
            sinks=[0, 1, 2, 4, 8], oracle_stride=48, name="demo",
            # one small RULER panel: 2 samples of niah_single_1 at 500 tokens, 12.7 s on SmolLM2 (docs/tasks.md)
            ruler=["niah_single_1"], ruler_length=500, ruler_samples=2)


def run_ab(config, allow_download: bool = False, executor=None, device: str = "cpu", tolerance=None,
           as_json: bool = False) -> None:
    """Plan, validate, run and report one sweep (a `SweepConfig`); prints the summary and the report path.

    Batches an `executor` gave up on are named on stderr after the summary, and the
    command exits with code 1 (after writing the report): a rerun finishes them. `device`: where the
    model runs (checked before anything loads); `tolerance`: what the verdict judges by (default `Tolerance()`),
    recorded in `run.json`; `as_json`: the result also as one JSON object on the last line."""
    from ..ab import run_sweep
    from ..ab.executors import LocalExecutor
    from ..records.schema import ppl_records
    from ..report.kv_bytes import equal_bytes
    from ..report.runs import load_run, record_tolerance
    from ..report.tables import summary_table
    from ..report.verdict import verdict
    from ..report.verdict_text import sentence
    from ..stats.tolerance import Tolerance

    check_device(device)
    if config.positions is not None:
        check_positions(config.positions)
    tolerance = tolerance or Tolerance()
    executor = executor or LocalExecutor()
    # run_sweep checks every spec, budget and the run name (plan) before any model is loaded
    run_sweep(config, allow_download=allow_download, executor=executor, device=device)
    # the report, the table and the sentences are drawn from the run folder, exactly as `kvevict report` draws them
    record_tolerance(config.folder, tolerance.as_dict())
    run = load_run(config.folder)
    records = run.records
    report = _render_run(run, config.folder / "report.html")
    title = (f"kvevict A/B: {config.model} ({config.dtype}) on {config.text}, {config.tokens} tokens, "
             f"{run.config.get('positions')}")
    show(summary_table(ppl_records(records)), title)
    print(f"tolerance: {tolerance.describe()}")
    verdicts = verdict(records, tolerance)
    for found in verdicts:
        print(sentence(found))
    groups = equal_bytes(ppl_records(records))
    for group in groups:  # rows of different KV widths at the same memory
        print(group.sentence())
    for note in run.notes():
        print(f"Note: {note}.")
    for batch, reason in executor.failed:
        cells = ", ".join(c.label for c in batch.cells)
        err.print(f"failed: {batch.name} ({cells}): {reason}; rerun the same command to finish it",
                  markup=False, highlight=False, soft_wrap=True)
    print(report.resolve())
    if as_json:
        from ..report import as_json as to_json

        print_json({"model": config.model, "dtype": config.dtype, "tokens": config.tokens,
                    "tolerance": tolerance.as_dict(), "rows": to_json.ppl_rows(ppl_records(records)),
                    "verdict": to_json.verdicts(verdicts), "equal_bytes": [g.sentence() for g in groups],
                    "failed": [batch.name for batch, _ in executor.failed], "report": str(report.resolve())})
    if executor.failed:
        raise typer.Exit(1)


def _note_skipped(run) -> None:
    if run.skipped_lines:
        err.print(f"note: skipped {run.skipped_lines} unreadable line(s) in {run.folder / 'results.jsonl'}",
                  markup=False, highlight=False)


def _render_run(run, path: Path) -> Path:
    """One run folder's HTML report (`kvevict ab` and `kvevict report` both draw it here, from the folder)."""
    from ..report.html import render

    _note_skipped(run)
    return render(run.records, run.config, path)


def _ruler_tasks(text: str) -> list[str]:
    from ..eval.ruler.registry import parse_tasks

    return parse_tasks(text) if text.strip() else []


@one_line_errors
def ab(
    model: str = typer.Option("smollm2-135m", help=MODEL_HELP),
    text: str = typer.Option("pg-essays", help="embedded name, .txt file, folder or .jsonl"),
    tokens: int = typer.Option(2000, help="stream length"),
    budgets: str = typer.Option("64,128,256", help="comma-separated budgets"),
    policies: str = typer.Option("window,streamingllm,h2o,snapkv", help="comma-separated policy specs"),
    sinks: str = typer.Option("", help="sink counts K: adds sinkK+window at each budget, e.g. 0,1,2,4,8"),
    oracle_stride: int | None = typer.Option(
        None, show_default=False,
        help=f"the recompute oracle scores every K-th token (default {DEFAULT_ORACLE_STRIDE}; 0: no oracle). "
        "Where it is not defined (hybrid models such as gemma3-270m) the default leaves it out "
        "and the report says why; a stride given there is refused"),
    positions: str | None = typer.Option(None, show_default=False, help=POSITIONS_HELP),
    chunk: str = typer.Option(str(DEFAULT_CHUNK), help=CHUNK_HELP),
    seed: int = typer.Option(0, help="seed of random policies (recorded in every result)"),
    name: str = typer.Option("ab", help="run name, one folder name: results go to OUT/NAME"),
    out_dir: str = typer.Option("runs", "--out", help="output folder"),
    needle: str = typer.Option("", help="also run pass-key retrieval at these haystack lengths, e.g. 1000,2000"),
    needle_depths: str = typer.Option("0.1,0.5,0.9", help="needle depths in [0, 1]"),
    needle_trials: int = typer.Option(2, help="seeded needle trials per length and depth"),
    generation: bool = typer.Option(False, help="also measure repetition and recall of greedy generation"),
    sink_map: bool = typer.Option(False, "--sink-map", help="also draw the model's attention-sink map"),
    ruler: str = typer.Option("", help="also run these RULER tasks at the sweep's budgets, e.g. niah_single_1,vt"),
    ruler_length: int = typer.Option(1000, help="--ruler: prompt length in tokens, answer included"),
    ruler_samples: int = typer.Option(5, help="--ruler: seeded samples per task"),
    ruler_protocol: str = typer.Option("agnostic", help="--ruler: agnostic | aware | stream | multi"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object as the last line"),
    allow_download: bool = typer.Option(False, "--allow-download", help=DOWNLOAD_HELP),
    executor: str = executor_option(),
    address: str = address_option(),
    workers: int = workers_option(),
    retries: int = retries_option(),
    device: str = typer.Option("cpu", help=DEVICE_HELP),
    max_ppl_ratio: float | None = max_ppl_ratio_option(),
    max_accuracy_drop: float | None = max_accuracy_drop_option(),
    min_accuracy_ratio: float | None = min_accuracy_ratio_option(),
    max_kl: float | None = max_kl_option(),
    dtype: str | None = typer.Option(None, help=DTYPE_HELP),
) -> None:
    """A/B test policies side by side: resumable results.jsonl, a summary table and an HTML report."""
    from ..ab import SweepConfig
    from ..integrations.executor_choice import make_executor
    from ..loading.models import model_dtype

    check_device(device)  # before the dtype: on cuda the default is read from the checkpoint
    tolerance = tolerance_from(max_ppl_ratio, max_accuracy_drop, max_kl, min_accuracy_ratio=min_accuracy_ratio)
    config = SweepConfig(
        model=model, dtype=model_dtype(model, check_dtype(dtype), device, allow_download), text=text,
        tokens=tokens, budgets=parse_ints(budgets, "--budgets"), policies=split_specs(policies),
        sinks=parse_ints(sinks, "--sinks"), oracle_stride=oracle_stride, positions=positions, chunk=parse_chunk(chunk),
        seed=seed, name=name, out=out_dir,
        needle=parse_ints(needle, "--needle"), needle_depths=parse_floats(needle_depths, "--needle-depths"),
        needle_trials=needle_trials, generation=generation, sink_map=sink_map,
        ruler=_ruler_tasks(ruler), ruler_length=ruler_length, ruler_samples=ruler_samples,
        ruler_protocol=ruler_protocol,
    )
    run_ab(config, allow_download, make_executor(executor, address or None, workers, retries), device, tolerance,
           as_json)


@one_line_errors
def report(
    runs: list[str] = typer.Argument(..., help="run folders OUT/NAME written by `kvevict ab`; several: side by side"),
    out: str = typer.Option("", "--out", help="where the HTML goes (default: RUN/report.html for one run, "
                            f"./{COMPARE_REPORT} for several)"),
    markdown: bool = typer.Option(False, "--markdown", help="print the tables as Markdown"),
    max_ppl_ratio: float | None = max_ppl_ratio_option(),
    max_accuracy_drop: float | None = max_accuracy_drop_option(),
    min_accuracy_ratio: float | None = min_accuracy_ratio_option(),
    max_kl: float | None = max_kl_option(),
) -> None:
    """Redraw a run's HTML report from its results.jsonl (no model needed); several runs go in one report."""
    from ..report.html import render_compare
    from ..report.markdown import compare_markdown, run_markdown
    from ..report.runs import load_run

    seen = [Path(r).resolve() for r in runs]
    twice = next((r for r, p in zip(runs, seen) if seen.count(p) > 1), None)
    if twice is not None:
        raise KvevictError(f"run folder '{twice}' is given twice: name each run once")
    target = Path(out) if out else None
    if target is not None and not target.parent.is_dir():
        raise KvevictError(f"--out '{out}': folder '{target.parent}' does not exist; create it or give another path")
    if target is not None and target.is_dir():
        raise KvevictError(f"--out '{out}' is a folder: give a file path, e.g. {target / COMPARE_REPORT}")
    loaded = [load_run(r) for r in runs]
    given = (max_ppl_ratio, max_accuracy_drop, max_kl)
    ratio = {"min_accuracy_ratio": min_accuracy_ratio}
    tolerance_from(*given, **ratio)  # an impossible tolerance is refused before anything is drawn
    if any(x is not None for x in (*given, min_accuracy_ratio)):  # the options override what each run recorded,
        for run in loaded:  # for this drawing only
            run.config = {**run.config,
                          "tolerance": tolerance_from(*given, run.config.get("tolerance"), **ratio).as_dict()}
    if len(loaded) == 1:
        run = loaded[0]
        path = _render_run(run, target or run.folder / "report.html")
        text = run_markdown(run.records, tolerance=tolerance_from(*given, run.config.get("tolerance"), **ratio),
                            notes=run.notes())
    else:
        for run in loaded:
            _note_skipped(run)
        path = render_compare(loaded, target or Path(COMPARE_REPORT))
        text = compare_markdown(loaded)
    if markdown:
        print(text)
    print(path.resolve())


@one_line_errors
def demo(
    out_dir: str = typer.Option("runs", "--out", help="where results go"),
    device: str = typer.Option("cpu", help=DEVICE_HELP),
    max_ppl_ratio: float | None = max_ppl_ratio_option(),
    max_accuracy_drop: float | None = max_accuracy_drop_option(),
    min_accuracy_ratio: float | None = min_accuracy_ratio_option(),
    max_kl: float | None = max_kl_option(),
    dtype: str | None = typer.Option(None, help=DTYPE_HELP),
) -> None:
    """The main job: a default A/B on the embedded model and text."""
    from ..ab import SweepConfig
    from ..loading.models import model_dtype

    check_device(device)
    tolerance = tolerance_from(max_ppl_ratio, max_accuracy_drop, max_kl, min_accuracy_ratio=min_accuracy_ratio)
    run_ab(SweepConfig(out=out_dir, dtype=model_dtype(SweepConfig.model, check_dtype(dtype), device), **DEMO),
           device=device, tolerance=tolerance)
