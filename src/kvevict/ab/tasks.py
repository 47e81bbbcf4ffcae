"""Protocols beyond perplexity inside an A/B sweep: needle, generation, sink map, RULER tasks.

`kvevict ab --needle 1000 --generation --sink-map` adds them to the same run folder:
every trial's record goes to `results.jsonl` as it finishes (kind `needle`,
`generation`, `sinkmap`), a `*-done` marker closes a finished protocol so a rerun skips
it, and the report draws a section for each. The protocols themselves live in `eval/`;
this module only wires them to the sweep's policies, budgets and store.
"""

from __future__ import annotations

from collections.abc import Callable

from ..eval.generation import run_generation
from ..eval.needle import run_needle
from ..eval.ruler.grid import run_grid
from ..eval.sinkmap import sink_map
from ..policies import is_full_cache
from ..records.schema import DoneMarker, RulerRecord, SinkMapRecord, TaskRecord
from ..records.store import ResultStore
from .plan import SweepConfig, ruler_grid
from .ruler import max_positions

KINDS = ("needle", "generation", "sinkmap", "ruler")


def _signature(kind: str, config: SweepConfig) -> str:
    """The done marker's key: a rerun with other task settings runs the protocol again."""
    if kind == "needle":
        return f"needle-done|{config.needle}|{config.needle_depths}|{config.needle_trials}|{config.budgets}"
    if kind == "generation":
        return f"generation-done|{config.generation_length}|{config.budgets}"
    if kind == "ruler":
        return (f"ruler-done|{config.ruler}|{config.ruler_length}|{config.ruler_samples}|{config.ruler_protocol}|"
                f"{config.budgets}")
    return f"sinkmap-done|{config.tokens}"


def pending(config: SweepConfig, done: set[str]) -> list[str]:
    """The protocols this sweep asks for that have no done marker yet."""
    kinds = [k for k, on in (("needle", config.needle), ("generation", config.generation),
                             ("sinkmap", config.sink_map), ("ruler", bool(config.ruler))) if on]
    return [k for k in kinds if _signature(k, config) not in done]


def _policies(config: SweepConfig) -> list[str]:
    return ["full"] + [p for p in config.policies if not is_full_cache(p)]


def _keeper(kind: str, config: SweepConfig, store: ResultStore, done: set[str]) -> Callable[[dict], None]:
    """Appends each finished trial to the store, unless an interrupted earlier run already did."""

    def keep(trial: dict) -> None:
        key = f"{kind}|{trial['policy']}|{trial['budget']}|{trial.get('length')}|{trial.get('depth')}|{trial['trial']}"
        if key in done:
            return
        fields = {k: v for k, v in trial.items() if k != "key"} | {"dtype": config.dtype}
        if kind == "needle":
            fields["passkey"] = trial["key"]  # the needle's own "key" is the pass key; "key" names the trial
        store.append([TaskRecord(key, kind, config.seed, fields).to_dict()])

    return keep


def run(config: SweepConfig, model, tokenizer, tokens, store: ResultStore, kinds: list[str], progress) -> None:
    """Run the protocols in `kinds`, appending each record to `store` as it finishes."""
    done = store.done()
    if "needle" in kinds:
        run_needle(model, tokenizer, lengths=config.needle, depths=config.needle_depths, trials=config.needle_trials,
                   policies=_policies(config), budgets=config.budgets, seed=config.seed, text=config.text,
                   positions=config.positions, progress=progress, on_record=_keeper("needle", config, store, done))
        store.append([DoneMarker(_signature("needle", config), "needle-done").to_dict()])
    if "generation" in kinds:
        run_generation(model, tokenizer, policies=_policies(config), budgets=config.budgets,
                       length=config.generation_length, seed=config.seed, text=config.text,
                       positions=config.positions, progress=progress,
                       on_record=_keeper("generation", config, store, done))
        store.append([DoneMarker(_signature("generation", config), "generation-done").to_dict()])
    if "ruler" in kinds:
        def keep_answers(lines: list[dict]) -> None:
            store.append([RulerRecord.from_dict({**line, "dtype": config.dtype}).to_dict()
                          for line in lines if line["key"] not in done])

        run_grid(model, tokenizer, ruler_grid(config), done, keep_answers, max_positions(model))
        store.append([DoneMarker(_signature("ruler", config), "ruler-done").to_dict()])
    if "sinkmap" in kinds:
        result = sink_map(model, tokenizer, tokens[: min(1024, tokens.numel())])
        store.append([SinkMapRecord(_signature("sinkmap", config), result.to_dict(), config.model).to_dict()])
