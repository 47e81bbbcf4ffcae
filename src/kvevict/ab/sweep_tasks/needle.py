"""The pass-key needle inside a sweep (`kvevict ab --needle LENGTHS`): `eval.needle.run_needle`, one record a trial."""

from __future__ import annotations

from ...eval.needle import run_needle
from ..plan import SweepConfig
from .base import Job, SweepTask


class Needle(SweepTask):
    kind = "needle"
    section = "needle"

    def wanted(self, config: SweepConfig) -> bool:
        return bool(config.needle)

    def signature(self, config: SweepConfig) -> str:
        return f"needle-done|{config.needle}|{config.needle_depths}|{config.needle_trials}|{config.budgets}"

    def trial_fields(self, trial: dict) -> dict:
        # the needle's own "key" is the pass key; "key" names the trial
        return super().trial_fields(trial) | {"passkey": trial["key"]}

    def run(self, job: Job) -> None:
        c = job.config
        run_needle(job.model, job.tokenizer, lengths=c.needle, depths=c.needle_depths, trials=c.needle_trials,
                   policies=self.policies(c), budgets=c.budgets, seed=c.seed, text=c.text, positions=c.positions,
                   progress=job.progress, on_record=self.keeper(job))
        self.close(job)
