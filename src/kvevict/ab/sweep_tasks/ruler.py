"""RULER tasks inside a sweep (`kvevict ab --ruler TASKS`): the grid at the sweep's policies and budgets."""

from __future__ import annotations

from ...eval.needle import max_positions
from ...eval.ruler.grid import run_grid
from ...records.schema import RulerRecord
from ..plan import SweepConfig, ruler_grid
from .base import Job, SweepTask


class Ruler(SweepTask):
    kind = "ruler"
    record = RulerRecord
    section = "ruler"

    def wanted(self, config: SweepConfig) -> bool:
        return bool(config.ruler)

    def signature(self, config: SweepConfig) -> str:
        return (f"ruler-done|{config.ruler}|{config.ruler_length}|{config.ruler_samples}|{config.ruler_protocol}|"
                f"{config.budgets}")

    def run(self, job: Job) -> None:
        def keep_answers(lines: list[dict]) -> None:
            job.store.append([RulerRecord.from_dict({**line, "dtype": job.config.dtype}).to_dict()
                              for line in lines if line["key"] not in job.done])

        run_grid(job.model, job.tokenizer, ruler_grid(job.config), job.done, keep_answers, max_positions(job.model))
        self.close(job)
