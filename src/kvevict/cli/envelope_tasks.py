"""`kvevict envelope --tasks`: the task half of the envelope command (one search per task and length).

Checked whole before the model loads; then each search runs to its resolution, its table,
verdict and cost printed as it ends. The search itself is `ab.task_envelope`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .common import print_json
from .tables import show


@dataclass
class TaskOptions:
    """The options of a task search, as `kvevict envelope` received them."""

    model: str
    dtype: str
    tasks: list[str]
    lengths: list[int]
    protocol: str
    policies: list[str]
    floor: int
    resolution: float
    max_accuracy_drop: float
    min_accuracy_ratio: float | None
    start: int
    cap: int
    seed: int
    positions: str
    text: str
    name: str
    out: str
    max_new_tokens: int | None = None  # None: RULER's answer length of the task


def task_configs(options: TaskOptions) -> list:
    """One `TaskEnvelopeConfig` per task and length, each checked (one line naming the fix on bad input)."""
    from ..ab.task_envelope import TaskEnvelopeConfig

    several = len(options.tasks) * len(options.lengths) > 1
    configs = [TaskEnvelopeConfig(
        model=options.model, dtype=options.dtype, task=task, length=length, protocol=options.protocol,
        policies=list(options.policies), floor=options.floor, resolution=options.resolution,
        max_accuracy_drop=options.max_accuracy_drop, min_accuracy_ratio=options.min_accuracy_ratio,
        start=options.start, cap=options.cap, seed=options.seed,
        positions=options.positions, text=options.text,
        name=f"{options.name}-{task}-{length}" if several else options.name, out=options.out,
        max_new_tokens=options.max_new_tokens,
    ) for task in options.tasks for length in options.lengths]
    for config in configs:
        config.check()
    return configs


def run_tasks(options: TaskOptions, allow_download: bool, device: str, executor=None, as_json: bool = False) -> None:
    """Every task search, one after another on one loaded model; a table, a verdict and the cost of each. With an
    `executor` (Ray's) each step's samples are answered on its workers; `as_json`: every search's result also as
    one JSON object on the last line."""
    from ..ab.ruler import max_positions
    from ..ab.task_envelope import context_top, run_task_envelope
    from ..loading import load_model
    from ..report import as_json as to_json
    from ..report.task_envelope import fixed_n_cost, search_cost, task_envelope_table, task_rows, task_verdict

    configs, found = task_configs(options), []
    model, tokenizer = load_model(options.model, device=device, allow_download=allow_download, dtype=options.dtype)
    for config in configs:
        specs = config.check()
        store, records = run_task_envelope(config, model, tokenizer, on_step=_say_round(config), executor=executor,
                                           allow_download=allow_download, device=device)
        context = context_top(config, tokenizer, max_positions(model))
        rows = task_rows(specs, dict(zip(specs, config.policies)), config.looks(), config.tolerance(), records,
                         context)
        show(task_envelope_table(rows), f"kvevict envelope: {config.model} ({config.dtype}) on {config.task}, "
                                        f"{config.length} tokens, {config.protocol}")
        sentence = task_verdict(rows, config.tolerance(), config.task, config.length)
        print(sentence)
        found.append({**to_json.task_envelope(config.task, config.length, config.protocol, rows, sentence),
                      "records": str(store.path)})
        answers, seconds = search_cost(records)
        print(f"cost: {answers} answers ({seconds:.0f} s of answering); a grid of the same cells at a fixed "
              f"n = {config.cap} would take {fixed_n_cost(records, config.cap)} answers. Records: {store.path}")
    if as_json:
        print_json({"model": options.model, "dtype": options.dtype, "envelopes": found})


def _say_round(config):
    from .common import err

    def say(wanted: dict) -> None:
        asks = "; ".join(f"{', '.join(specs)} at {budget} entries, {samples} samples"
                         for (budget, samples), specs in sorted(wanted.items()))
        err.print(f"{config.task} at {config.length}: {asks}", markup=False, highlight=False)

    return say
