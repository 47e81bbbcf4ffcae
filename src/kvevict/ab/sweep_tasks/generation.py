"""Free generation inside a sweep (`kvevict ab --generation`): `eval.generation.run_generation`, one record a trial."""

from __future__ import annotations

from ...eval.generation import run_generation
from ..plan import SweepConfig
from .base import Job, SweepTask


class Generation(SweepTask):
    kind = "generation"
    section = "generation"

    def wanted(self, config: SweepConfig) -> bool:
        return config.generation

    def signature(self, config: SweepConfig) -> str:
        return f"generation-done|{config.generation_length}|{config.budgets}"

    def run(self, job: Job) -> None:
        c = job.config
        run_generation(job.model, job.tokenizer, policies=self.policies(c), budgets=c.budgets,
                       length=c.generation_length, seed=c.seed, text=c.text, positions=c.positions,
                       progress=job.progress, on_record=self.keeper(job))
        self.close(job)
