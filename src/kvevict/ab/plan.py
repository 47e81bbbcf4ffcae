"""A sweep's settings and its cells, validated before any model work.

A sweep is a set of cells (policy x budget, plus the full cache, the recompute oracle
and the sink-count sweep). `plan` lists them and raises `KvevictError` for anything
that cannot run, so a mistake costs a second, not a model load.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..defaults import DEFAULT_CHUNK, DEFAULT_ORACLE_STRIDE
from ..errors import KvevictError
from ..eval.ruler.grid import RulerGrid
from ..policies import check_policy, is_full_cache, parse_policy
from ..policies.engine_defaults import run_positions, with_stream_start
from ..records.schema import cell_key


@dataclass
class SweepConfig:
    model: str = "smollm2-135m"
    dtype: str = "float32"  # what the model and its KV cache are held in (`loading.dtypes`)
    text: str = "pg-essays"
    tokens: int = 2000
    budgets: list[int] = field(default_factory=lambda: [64, 128, 256])
    policies: list[str] = field(default_factory=lambda: ["window", "streamingllm", "h2o", "snapkv"])
    sinks: list[int] = field(default_factory=list)
    #: the recompute oracle's stride; None: DEFAULT_ORACLE_STRIDE where the oracle is defined, and left out
    #: (the report says why, `oracle_left_out`) where it is not; a number given on a hybrid model is refused
    oracle_stride: int | None = None
    #: None: the position mode of the engine presets among the policies, else `DEFAULT_POSITIONS` (`run_positions`)
    positions: str | None = None
    chunk: int = DEFAULT_CHUNK  # tokens per forward; results do not depend on it (exact replay)
    seed: int = 0
    name: str = "ab"
    out: str = "runs"
    needle: list[int] = field(default_factory=list)  # haystack lengths; empty: no needle test
    needle_depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    needle_trials: int = 2
    generation: bool = False
    generation_length: int = 1000
    sink_map: bool = False
    ruler: list[str] = field(default_factory=list)  # RULER tasks; empty: none
    ruler_length: int = 1000
    ruler_samples: int = 5
    ruler_protocol: str = "agnostic"
    #: why a default oracle was left out on this model ("" when it runs or was not asked for); set by `settle`
    oracle_left_out: str = ""

    @property
    def folder(self) -> Path:
        """OUT/NAME, refused unless NAME is one folder name that stays inside OUT."""
        return run_folder(self.out, self.name)

    def identity(self) -> dict:
        """What the results depend on: a rerun must match it to reuse finished cells."""
        return {"model": self.model, "dtype": self.dtype, "text": self.text, "tokens": self.tokens,
                "positions": self.positions}


def settle(config: SweepConfig, adds_bos: bool | None = None, oracle_undefined: str | None = None) -> SweepConfig:
    """`config` with every default that depends on the model made concrete: the position mode the engine
    presets bring (`run_positions`), preset options read from the tokenizer (`adds_bos`, None: not known
    yet) and the oracle's stride. `oracle_undefined` is why the oracle is not defined on the model (None:
    it is): a default oracle is then left out and the reason kept for the report; a stride the user gave
    is refused. Idempotent: a settled config settles to itself."""
    policies = list(config.policies) if adds_bos is None else with_stream_start(list(config.policies), adds_bos)
    positions = run_positions(policies, config.positions)
    stride, left_out = config.oracle_stride, config.oracle_left_out
    if stride is None:
        stride, left_out = (0, f"recompute oracle left out: {oracle_undefined}") if oracle_undefined else (
            DEFAULT_ORACLE_STRIDE, "")
    elif stride and oracle_undefined:
        raise KvevictError(f"--oracle-stride {stride} asks for the recompute oracle, which is {oracle_undefined}; "
                           "leave --oracle-stride out (the run goes on without it, and its report says why) or give 0")
    return replace(config, policies=policies, positions=positions, oracle_stride=stride, oracle_left_out=left_out)


def ruler_grid(config: SweepConfig) -> RulerGrid:
    """The sweep's RULER tasks at its policies and budgets (entries, as its perplexity cells)."""
    return RulerGrid(tasks=list(config.ruler), lengths=[config.ruler_length], samples=config.ruler_samples,
                     policies=[p for p in config.policies if not is_full_cache(p)],
                     budgets=list(config.budgets), protocol=config.ruler_protocol, seed=config.seed,
                     positions=config.positions, text=config.text)


def run_folder(out: str, name: str) -> Path:
    """The run folder OUT/NAME. A run name is one path component: `--name ../../x` would
    write outside `--out`, and a name with separators scatters runs across folders."""
    separators = {"/", "\\", os.sep, os.altsep} - {None}
    if not name or name in (".", "..") or any(s in name for s in separators):
        raise KvevictError(
            f"run name '{name}' must be one folder name (no '/', '\\' or '..'): "
            "pass e.g. --name mine, and choose where runs go with --out"
        )
    folder = Path(out) / name
    root = Path(out).resolve()
    if not folder.resolve().is_relative_to(root):  # a symlinked OUT/NAME may still point elsewhere
        raise KvevictError(
            f"run folder '{folder}' resolves to '{folder.resolve()}', outside --out '{out}': "
            "remove the link or choose another --name"
        )
    return folder


@dataclass
class Cell:
    kind: str  # full | oracle | policy | sinks
    spec: str  # canonical policy spec
    label: str  # what the user wrote
    budget: int | None

    @property
    def key(self) -> str:
        return cell_key(self.kind, self.spec, self.budget)


def canonical(spec: str, seed: int) -> str:
    """The spec a cell runs: the sweep's seed goes to a seeded policy unless the user wrote `seed=`."""
    policy = parse_policy(spec)
    if "seed=" not in spec:
        policy = policy.with_seed(seed)
    return policy.spec()


def plan(config: SweepConfig) -> list[Cell]:
    """All cells of the sweep, validated (raises KvevictError before any model work). Defaults that
    depend on the model (`settle`) are taken as if it were a plain one until the sweep settles them."""
    config = settle(config)
    _check_settings(config)
    cells = [Cell("full", "full", "full", None)]
    for budget in config.budgets:
        cells += _budget_cells(config, budget)
    _check_tasks(config)
    return cells


def _check_settings(config: SweepConfig) -> None:
    """The settings that hold for the whole sweep, checked first, so an empty list or a bad run name is
    named before any budget's policies are parsed."""
    if not config.budgets:
        raise KvevictError("--budgets is empty: give comma-separated budgets such as 64,128,256")
    if not config.policies and not config.sinks:
        raise KvevictError("--policies is empty: give comma-separated specs such as window,streamingllm,h2o")
    if config.tokens < 2:
        raise KvevictError(f"need at least 2 tokens to score a prediction, got --tokens {config.tokens}")
    if config.oracle_stride < 0:
        raise KvevictError(f"--oracle-stride must be >= 1 (0: no oracle), got {config.oracle_stride}")
    run_folder(config.out, config.name)  # the run name is checked with the rest, before any work


def _budget_cells(config: SweepConfig, budget: int) -> list[Cell]:
    """The cells at one budget: the oracle, each distinct policy, then the sink-count sweep. Each policy is
    checked at this budget, since whether it fits (its pins, its window) depends on the budget."""
    if budget < 1:  # the oracle runs at every budget, whatever the policies
        raise KvevictError(f"budgets must be positive, got {budget}")
    if budget >= config.tokens:
        raise KvevictError(
            f"budget {budget} is not smaller than the {config.tokens} tokens of the stream: nothing would be "
            "evicted; lower the budget or raise --tokens"
        )
    cells = [Cell("oracle", "oracle", "oracle", budget)] if config.oracle_stride else []
    seen = set()
    for label in config.policies:
        checked = check_policy(label, budget, config.positions)
        if checked.reconstructs:
            raise KvevictError(
                f"'{label}' scores a context by reconstructing it after its prefill, and kvevict ab evicts a "
                "perplexity stream as it reads: run it with kvevict ruler (or kvevict.compress)"
            )
        if checked.capabilities.is_full_cache:
            continue  # the full cache is always a row of the table; a quantized one (`q4+full`) is a row of its own
        spec = canonical(label, config.seed)
        if spec not in seen:
            seen.add(spec)
            cells.append(Cell("policy", spec, label, budget))
    for count in config.sinks:
        if count < 0:
            raise KvevictError(f"--sinks takes counts >= 0, got {count}")
        label = "window" if count == 0 else f"sink{count}+window"
        check_policy(label, budget, config.positions)
        cells.append(Cell("sinks", canonical(label, config.seed), label, budget))
    return cells


def _check_tasks(config: SweepConfig) -> None:
    """The needle, RULER and generation settings against the budgets, after every cell is known: each task
    compresses a prompt, so every budget must be shorter than the prompt it runs on."""
    if config.needle:
        from ..eval.needle import check_grid

        check_grid(config.needle, config.needle_depths, config.needle_trials)
        if max(config.budgets) >= min(config.needle):
            raise KvevictError(
                f"--needle length {min(config.needle)} must exceed every budget (largest {max(config.budgets)}): "
                "a budget at least as long as the haystack compresses nothing"
            )
    if config.ruler:
        ruler_grid(config).check()
    if config.generation and max(config.budgets) >= config.generation_length:
        raise KvevictError(
            f"the generation prompt ({config.generation_length} tokens) must exceed every budget "
            f"(largest {max(config.budgets)})"
        )
