"""The attention-sink map inside a sweep (`kvevict ab --sink-map`): one record, which is its own done marker."""

from __future__ import annotations

from ...eval.sinkmap import sink_map
from ...records.schema import SinkMapRecord
from ..plan import SweepConfig
from .base import Job, SweepTask


class SinkMap(SweepTask):
    kind = "sinkmap"
    record = SinkMapRecord
    section = "sink_map"

    def wanted(self, config: SweepConfig) -> bool:
        return config.sink_map

    def signature(self, config: SweepConfig) -> str:
        return f"sinkmap-done|{config.tokens}"

    def run(self, job: Job) -> None:
        result = sink_map(job.model, job.tokenizer, job.tokens[: min(1024, job.tokens.numel())])
        job.store.append([SinkMapRecord(self.signature(job.config), result.to_dict(), job.config.model).to_dict()])
