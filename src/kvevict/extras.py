"""Protocols beyond perplexity inside an A/B sweep: needle, generation, sink map.

`kvevict ab --needle 1000 --generation --sink-map` adds them to the same run folder:
every trial's record goes to `results.jsonl` as it finishes (kind `needle`,
`generation`, `sinkmap`), a `*-done` marker closes a finished protocol so a rerun skips
it, and the report grows a section for each. The protocols themselves live in `eval/`;
this module only wires them to the sweep's policies, budgets and store.
"""

from __future__ import annotations

import html

from .report import html as report_html
from .report import task_plots
from .report.html import image_html, table_html

KINDS = ("needle", "generation", "sinkmap")


def wanted(config) -> bool:
    return bool(config.needle or config.generation or config.sink_map)


def _signature(kind: str, config) -> str:
    if kind == "needle":
        return f"needle-done|{config.needle}|{config.needle_depths}|{config.needle_trials}|{config.budgets}"
    if kind == "generation":
        return f"generation-done|{config.generation_length}|{config.budgets}"
    return f"sinkmap-done|{config.tokens}"


def pending(config, done: set[str]) -> list[str]:
    kinds = [k for k, on in (("needle", config.needle), ("generation", config.generation),
                             ("sinkmap", config.sink_map)) if on]
    return [k for k in kinds if _signature(k, config) not in done]


def _policies(config) -> list[str]:
    return ["full"] + [p for p in config.policies if p.strip().lower() != "full"]


def run(config, model, tokenizer, tokens, store, kinds: list[str], progress) -> None:
    """Run the protocols in `kinds`, appending each record to `store` as it finishes."""
    from .eval.generation import run_generation
    from .eval.needle import run_needle
    from .eval.sinkmap import sink_map

    done = store.done()

    def keep(kind: str):
        def on_record(record: dict) -> None:
            key = f"{kind}|{record['policy']}|{record['budget']}|{record.get('length')}|{record.get('depth')}|" \
                  f"{record['trial']}"
            if key not in done:
                # the needle's own "key" is the pass key: keep it as "passkey", "key" names the cell
                extra = {"passkey": record["key"]} if kind == "needle" else {}
                store.append([{**record, **extra, "key": key, "kind": kind, "seed": config.seed}])
        return on_record

    if "needle" in kinds:
        run_needle(model, tokenizer, lengths=config.needle, depths=config.needle_depths, trials=config.needle_trials,
                   policies=_policies(config), budgets=config.budgets, seed=config.seed, text=config.text,
                   positions=config.positions, progress=progress, on_record=keep("needle"))
        store.append([{"key": _signature("needle", config), "kind": "needle-done"}])
    if "generation" in kinds:
        run_generation(model, tokenizer, policies=_policies(config), budgets=config.budgets,
                       length=config.generation_length, seed=config.seed, text=config.text,
                       positions=config.positions, progress=progress, on_record=keep("generation"))
        store.append([{"key": _signature("generation", config), "kind": "generation-done"}])
    if "sinkmap" in kinds:
        result = sink_map(model, tokenizer, tokens[: min(1024, tokens.numel())])
        store.append([{"key": _signature("sinkmap", config), "kind": "sinkmap", "map": result.to_dict(),
                       "model": config.model}])


def needle_section(records: list[dict]) -> tuple[str, str] | None:
    from .eval.needle import NeedleResult

    trials = [r for r in records if r.get("kind") == "needle"]
    if not trials:
        return None
    cells = NeedleResult(records=trials).cells()
    rows = [[c["policy"], str(c["budget"]), str(c["length"]), f"{c['depth']:g}", f"{c['accuracy']:.2f}",
             str(c["trials"])] for c in sorted(cells, key=lambda c: (c["policy"], str(c["budget"]), c["length"],
                                                                     c["depth"]))]
    parts = [table_html(["policy", "budget", "length", "depth", "accuracy", "trials"], rows, "needle")]
    parts += [image_html(png, title) for title, png in task_plots.needle_heatmaps(cells)]
    return "Pass-key retrieval (needle in the essays)", "".join(parts)


def generation_section(records: list[dict]) -> tuple[str, str] | None:
    from .eval.generation import GenerationResult

    trials = [r for r in records if r.get("kind") == "generation"]
    if not trials:
        return None
    rows = GenerationResult(records=trials).summary()
    table = task_plots.generation_table(rows)
    body = table_html(table[0], table[1:], "generation") + image_html(task_plots.generation_figure(rows), "generation")
    return "Generation failure modes: repetition and recall", body


def sinkmap_section(records: list[dict]) -> tuple[str, str] | None:
    found = next((r for r in records if r.get("kind") == "sinkmap"), None)
    if found is None:
        return None
    data = dict(found["map"], model=found.get("model", ""))
    sinks = ", ".join(f"{html.escape(s['token'])}@{s['position']}" for s in data.get("sinks", [])) or "none"
    return "Attention-sink map", f"<p>positions acting as sinks: {sinks}</p>" + image_html(
        task_plots.sink_map_figure(data), "sink map"
    )


for _section in (needle_section, generation_section, sinkmap_section):
    if _section not in report_html.SECTIONS:
        report_html.SECTIONS.append(_section)
