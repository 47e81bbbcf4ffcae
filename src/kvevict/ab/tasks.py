"""Protocols beyond perplexity inside an A/B sweep: needle, generation, sink map, RULER tasks.

`kvevict ab --needle 1000 --generation --sink-map` adds them to the same run folder:
every trial's record goes to `results.jsonl` as it finishes (kind `needle`,
`generation`, `sinkmap`, `ruler`), a `*-done` marker closes a finished task so a rerun
skips it, and the report draws a section for each. Each task is an object of
`sweep_tasks/` (`registry.SWEEP_TASKS`); the protocols themselves live in `eval/`. This
module runs the ones a sweep asks for.
"""

from __future__ import annotations

from ..records.store import ResultStore
from .plan import SweepConfig
from .sweep_tasks import registry
from .sweep_tasks.base import Job


def kinds() -> tuple[str, ...]:
    """The kinds of the records the tasks write."""
    return tuple(task.kind for task in registry.SWEEP_TASKS)


def pending(config: SweepConfig, done: set[str]) -> list[str]:
    """The tasks this sweep asks for that have no done marker yet, by kind."""
    return [t.kind for t in registry.SWEEP_TASKS if t.wanted(config) and t.signature(config) not in done]


def run(config: SweepConfig, model, tokenizer, tokens, store: ResultStore, wanted: list[str], progress) -> None:
    """Run the tasks of the kinds `wanted` (`pending`), in the registry's order, each record appended as it
    finishes."""
    job = Job(config, model, tokenizer, tokens, store, store.done(), progress)
    for task in registry.SWEEP_TASKS:
        if task.kind in wanted:
            task.run(job)
