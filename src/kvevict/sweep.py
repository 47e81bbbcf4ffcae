"""The A/B sweep: every policy at every budget, side by side, resumable.

A sweep is a set of cells (policy x budget, plus the full cache, the recompute oracle
and the sink-count sweep). Cells that share a budget run as rows of one batch through
one `EvictingCache`, so the weights are read once per decode step for all of them.
Each finished batch is appended to `results.jsonl` atomically (see `report.store`);
rerunning the same command skips finished cells. `run.json` pins what the cells were
measured on, so a rerun with another model, text or length cannot mix results.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .errors import KvevictError
from .eval.oracle import recompute_oracle
from .eval.streaming import RowResult, compare, full_reference
from .policies import parse_policy
from .policies.random_subset import Random
from .progress import bars
from .report.store import ResultStore

#: predictions per point of the PPL-vs-position curve: the stream is cut in this many windows
CURVE_POINTS = 40


@dataclass
class SweepConfig:
    model: str = "smollm2-135m"
    text: str = "pg-essays"
    tokens: int = 2000
    budgets: list[int] = field(default_factory=lambda: [64, 128, 256])
    policies: list[str] = field(default_factory=lambda: ["window", "streamingllm", "h2o", "snapkv"])
    sinks: list[int] = field(default_factory=list)
    oracle_stride: int = 8
    positions: str = "original"
    seed: int = 0
    name: str = "ab"
    out: str = "runs"
    needle: list[int] = field(default_factory=list)  # haystack lengths; empty: no needle test
    needle_depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    needle_trials: int = 2
    generation: bool = False
    generation_length: int = 1000
    sink_map: bool = False

    @property
    def folder(self) -> Path:
        return Path(self.out) / self.name

    def identity(self) -> dict:
        """What the results depend on: a rerun must match it to reuse finished cells."""
        return {"model": self.model, "text": self.text, "tokens": self.tokens, "positions": self.positions}


@dataclass
class Cell:
    kind: str  # full | oracle | policy | sinks
    spec: str  # canonical policy spec
    label: str  # what the user wrote
    budget: int | None

    @property
    def key(self) -> str:
        return f"{self.kind}|{self.spec}|{self.budget}"


def canonical(spec: str, seed: int) -> str:
    policy = parse_policy(spec)
    inner = getattr(policy, "inner", policy)
    if isinstance(inner, Random) and "seed=" not in spec:
        inner.seed = seed
    return policy.spec()


def plan(config: SweepConfig) -> list[Cell]:
    """All cells of the sweep, validated (raises KvevictError before any model work)."""
    if not config.budgets:
        raise KvevictError("--budgets is empty: give comma-separated budgets such as 64,128,256")
    if not config.policies and not config.sinks:
        raise KvevictError("--policies is empty: give comma-separated specs such as window,streamingllm,h2o")
    if config.tokens < 2:
        raise KvevictError(f"need at least 2 tokens to score a prediction, got --tokens {config.tokens}")
    if config.oracle_stride < 1:
        raise KvevictError(f"--oracle-stride must be >= 1, got {config.oracle_stride}")
    cells = [Cell("full", "full", "full", None)]
    for budget in config.budgets:
        if budget < 1:
            raise KvevictError(f"budgets must be positive, got {budget}")
        if budget >= config.tokens:
            raise KvevictError(
                f"budget {budget} is not smaller than the {config.tokens} tokens of the stream: nothing would be "
                "evicted; lower the budget or raise --tokens"
            )
        cells.append(Cell("oracle", "oracle", "oracle", budget))
        seen = set()
        for label in config.policies:
            policy = parse_policy(label)
            if getattr(policy, "unbounded", False):
                continue  # the full cache is always a row of the table
            policy.check_budget(budget)
            spec = canonical(label, config.seed)
            if spec not in seen:
                seen.add(spec)
                cells.append(Cell("policy", spec, label, budget))
        for count in config.sinks:
            if count < 0:
                raise KvevictError(f"--sinks takes counts >= 0, got {count}")
            label = "window" if count == 0 else f"sink{count}+window"
            parse_policy(label).check_budget(budget)
            cells.append(Cell("sinks", canonical(label, config.seed), label, budget))
    if config.needle:
        from .eval.needle import check_grid

        check_grid(config.needle, config.needle_depths, config.needle_trials)
        if max(config.budgets) >= min(config.needle):
            raise KvevictError(
                f"--needle length {min(config.needle)} must exceed every budget (largest {max(config.budgets)}): "
                "a budget at least as long as the haystack compresses nothing"
            )
    if config.generation and max(config.budgets) >= config.generation_length:
        raise KvevictError(
            f"the generation prompt ({config.generation_length} tokens) must exceed every budget "
            f"(largest {max(config.budgets)})"
        )
    return cells


def prepare_folder(config: SweepConfig) -> ResultStore:
    """Create the run folder, check it is writable and belongs to the same experiment."""
    folder = config.folder
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".write-probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise KvevictError(f"cannot write to '{folder}' ({exc.strerror}): choose a writable --out folder") from None
    meta = folder / "run.json"
    if meta.exists():
        before = json.loads(meta.read_text()).get("identity", {})
        if before and before != config.identity():
            raise KvevictError(
                f"'{folder}' holds results for {before}, not {config.identity()}: use another --name to start fresh"
            )
    meta.write_text(json.dumps({"identity": config.identity(), "config": asdict(config)}, indent=2))
    return ResultStore(folder / "results.jsonl")


def record(cell: Cell, result: RowResult, config: SweepConfig) -> dict:
    data = result.summary()
    width = max(1, result.nll.numel() // CURVE_POINTS)
    data.update(
        key=cell.key,
        kind=cell.kind,
        policy=cell.spec,
        label=cell.label,
        budget=cell.budget,
        seed=config.seed,
        positions=config.positions if cell.kind in ("policy", "sinks") else "original",
        curve=result.ppl_windows(width),
        sink_lost_at=result.sink_lost_at,
        **{k: v for k, v in config.identity().items() if k != "positions"},
    )
    return data


def run_sweep(config: SweepConfig, model=None, tokenizer=None, progress=True) -> tuple[ResultStore, list[dict]]:
    """Run every unfinished cell; returns the store and all its records."""
    from . import extras
    from .data import load_tokens
    from .models import load_model

    cells = plan(config)
    store = prepare_folder(config)
    done = store.done()
    todo = [c for c in cells if c.key not in done]
    extra_kinds = extras.pending(config, done)
    if extra_kinds and model is None:
        model, tokenizer = load_model(config.model)
    if todo:
        if model is None:
            model, tokenizer = load_model(config.model)
        tokens, _ = load_tokens(config.text, tokenizer, config.tokens)
        torch.manual_seed(config.seed)
        with bars(progress) as bar:
            sweep_task = bar.add_task(f"sweep {config.name}: cells", total=len(cells), completed=len(cells) - len(todo))
            reference = full_reference(model, tokens, bar)
            full = next((c for c in todo if c.kind == "full"), None)
            if full is not None:
                store.append([record(full, reference.result, config)])
                bar.advance(sweep_task)
            for budget in config.budgets:
                rows = [c for c in todo if c.budget == budget and c.kind in ("policy", "sinks")]
                if rows:
                    specs = list(dict.fromkeys(c.spec for c in rows))
                    results, _ = compare(
                        model, tokens, specs, budget, config.positions, reference=reference, progress=bar,
                        label=f"budget {budget}: {len(specs)} policies",
                    )
                    by_spec = {r.policy: r for r in results}
                    store.append([record(c, by_spec[c.spec], config) for c in rows])
                    bar.advance(sweep_task, len(rows))
                oracle = next((c for c in todo if c.budget == budget and c.kind == "oracle"), None)
                if oracle is not None:
                    result = recompute_oracle(model, tokens, budget, config.oracle_stride, reference, bar)
                    store.append([record(oracle, result, config)])
                    bar.advance(sweep_task)
    if extra_kinds:
        tokens, _ = load_tokens(config.text, tokenizer, config.tokens)
        with bars(progress) as bar:
            extras.run(config, model, tokenizer, tokens, store, extra_kinds, bar)
    records = store.records()
    wanted = {c.key for c in cells}
    return store, [r for r in records if r["key"] in wanted or r.get("kind") in extras.KINDS]

