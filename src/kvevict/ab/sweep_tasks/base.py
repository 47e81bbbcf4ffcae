"""What a task inside a sweep is: when it runs, the settings it depends on, how it runs, what it records.

A task (needle, generation, RULER, sink map) runs after the sweep's perplexity cells, in
the same process, on the sweep's policies and budgets. Each declares its record `kind`
(what `results.jsonl` lines it writes are), its `record` type (`records.schema`), the
report `section` that draws them (a function of `report.sections`, in `SECTIONS`; a task
of its own leaves it empty and its trials, which say they are trials, are drawn as a table
by `report.trials`), and its `signature`: the key of the marker that closes it, which holds every setting its
records depend on, so a rerun with other settings runs it again and a rerun with the
same skips it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...policies import is_full_cache
from ...records.schema import DoneMarker, TaskRecord
from ...records.store import ResultStore
from ..plan import SweepConfig


@dataclass
class Job:
    """What a task runs with: the sweep, its loaded model, the stream's tokens, the store and what it holds."""

    config: SweepConfig
    model: object
    tokenizer: object
    tokens: object  # the sweep's stream `[T]`
    store: ResultStore
    done: set[str]  # record keys already stored
    progress: object  # the sweep's progress bars


class SweepTask:
    """One task of a sweep; subclasses set the declarations and write `wanted`, `signature` and `run`."""

    kind: str = ""  # the kind of its records
    record: type = TaskRecord  # the record type of its lines
    section: str = ""  # the `report.sections` function that draws its records

    def wanted(self, config: SweepConfig) -> bool:
        """Whether the sweep asks for this task."""
        raise NotImplementedError

    def signature(self, config: SweepConfig) -> str:
        """The key of the record that closes the task: every setting its records depend on."""
        raise NotImplementedError

    def run(self, job: Job) -> None:
        """Run the task, appending each record to `job.store` as it finishes, and close it."""
        raise NotImplementedError

    def close(self, job: Job) -> None:
        """The done marker: a rerun with the same settings skips the task."""
        job.store.append([DoneMarker(self.signature(job.config), f"{self.kind}-done").to_dict()])

    def trial_fields(self, trial: dict) -> dict:
        """A trial's fields as its record keeps them (`TaskRecord.fields`), its own `key` left out."""
        return {k: v for k, v in trial.items() if k != "key"}

    def keeper(self, job: Job) -> Callable[[dict], None]:
        """Appends each finished trial to the store as a `TaskRecord`, unless an interrupted earlier run
        already did."""

        def keep(trial: dict) -> None:
            key = (f"{self.kind}|{trial['policy']}|{trial['budget']}|{trial.get('length')}|{trial.get('depth')}|"
                   f"{trial['trial']}")
            if key in job.done:
                return
            fields = self.trial_fields(trial) | {"dtype": job.config.dtype}
            job.store.append([TaskRecord(key, self.kind, job.config.seed, fields).to_dict()])

        return keep

    @staticmethod
    def policies(config: SweepConfig) -> list[str]:
        """The full cache first, then the sweep's bounded policies."""
        return ["full"] + [p for p in config.policies if not is_full_cache(p)]
