"""`kvevict envelope --tasks`: per configuration, the smallest budget whose task accuracy holds.

The perplexity envelope (`envelope.py`) bisects budgets on a stream; this one bisects
them on a RULER task, where a probe is a (configuration, budget) cell answered on the
same seeded samples as the full cache, and judged paired against it by the tolerance rule
(`stats.tolerance.judge_accuracy`: Bonett and Price's paired interval of the accuracy drop, or
with `min_accuracy_ratio` their paired interval of the accuracy ratio). Both count every prompt, so
"inside" takes many agreeing answers: at the default looks (20, 40, 60, 80) a 5-point drop is
shown at 69 answers that all agree with the full cache, and never at 30.

**Sequential sampling.** A cell starts with `start` samples and adds `start` more at a time
until its interval decides, inside or outside the tolerance, or until `cap` samples,
where an undecided cell counts as not inside (the report names it). Looking at a cell
several times and stopping when it decides would make a 95% interval too optimistic, so
each look is judged at confidence `1 - 0.05 / looks` (Bonferroni over the planned looks):
the chance that any look of a cell is wrong stays within 5%.

Every answer is a `RulerRecord` line of `results.jsonl` (the same records `kvevict ruler`
writes; the full cache's answers are shared by every cell of a sample). The grid runner
(`eval.ruler.grid.run_grid`) reads each sample's context once for all of a batch's rows and
the full cache, and skips every answer already stored: a rerun replays the searches from the
records and answers only what is missing.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace

from ..defaults import DEFAULT_SAMPLES_MAX, DEFAULT_SAMPLES_START
from ..errors import KvevictError
from ..eval.ruler.grid import RulerGrid, compressed_length, preflight, prompts, run_grid
from ..eval.ruler.registry import get_task
from ..loading.dtypes import dtype_name
from ..policies import check_policy
from ..position_modes import DEFAULT_POSITIONS
from ..records.schema import load
from ..records.store import ResultStore
from ..report.task_envelope import cells_of
from ..stats.tolerance import Tolerance, judge_accuracy
from .bisection import Bracket, step
from .folder import cap_identity, open_run_folder
from .grid_shards import GridSpec, run_shards, shard
from .plan import canonical, run_folder
from .ruler import keeper, max_positions


@dataclass
class TaskEnvelopeConfig:
    """One task envelope: the task and its length, the configurations, the bracket, the tolerance and the
    sampling schedule (`start` samples, `start` more per look, at most `cap`)."""

    model: str = "smollm2-135m"
    dtype: str = "float32"
    task: str = "niah_single_1"
    length: int = 2048
    protocol: str = "agnostic"
    policies: list[str] = field(default_factory=lambda: ["streamingllm", "h2o", "snapkv"])
    floor: int = 64
    resolution: float = 1.25
    max_accuracy_drop: float = 0.05
    min_accuracy_ratio: float | None = None  # set: accuracy / full accuracy at least this, instead of the drop
    start: int = DEFAULT_SAMPLES_START
    cap: int = DEFAULT_SAMPLES_MAX
    seed: int = 0
    positions: str = DEFAULT_POSITIONS
    text: str = "pg-essays"
    name: str = "task-envelope"
    out: str = "runs"
    max_new_tokens: int | None = None  # None: RULER's answer length of the task

    def looks(self) -> list[int]:
        """The sample counts a cell is judged at: start, 2 x start, ... up to and including cap."""
        return sorted({*range(self.start, self.cap, self.start), self.cap})

    def tolerance(self) -> Tolerance:
        """The rule's tolerance at each look, Bonferroni-corrected over the planned looks (module docstring)."""
        return Tolerance(max_accuracy_drop=self.max_accuracy_drop, confidence=1 - 0.05 / len(self.looks()),
                         min_accuracy_ratio=self.min_accuracy_ratio)

    def grid(self, policies: list[str], budgets: list[int], samples: int) -> RulerGrid:
        return RulerGrid(tasks=[self.task], lengths=[self.length], samples=samples, policies=policies,
                         budgets=list(budgets), protocol=self.protocol, seed=self.seed, positions=self.positions,
                         text=self.text, max_new_tokens=self.max_new_tokens,
                         scores=str(run_folder(self.out, self.name) / "reconstruction"))

    def identity(self) -> dict:
        return {"model": self.model, "dtype": self.dtype, "seed": self.seed, "positions": self.positions,
                "text": self.text, "task": self.task, "length": self.length, "protocol": self.protocol,
                "search": "task-envelope", **cap_identity(self.max_new_tokens)}

    def check(self) -> list[str]:
        """Everything refused before a model loads; the configurations' canonical specs."""
        get_task(self.task)
        if not self.policies:
            raise KvevictError("--policies is empty: give comma-separated specs such as streamingllm,h2o")
        if self.start < 1 or self.cap < self.start:
            raise KvevictError(f"--samples-start {self.start} and --samples-max {self.cap}: give 1 <= start <= max, "
                               "e.g. 20 and 80")
        self.tolerance()
        self.check_reach()
        self.grid(list(self.policies), [self.floor], self.start).check()
        run_folder(self.out, self.name)
        specs = []
        for label in self.policies:
            if check_policy(label, self.floor, self.positions).unbounded:
                raise KvevictError(f"'{label}' never evicts: the full cache is the reference every cell is judged "
                                   "against; leave it out of --policies")
            specs.append(canonical(label, self.seed))
        return list(dict.fromkeys(specs))


    def perfect_cell_inside(self) -> bool:
        """Whether a cell that answers all `cap` samples as the full cache does, every one right, is inside: both
        rules' intervals count every prompt (`stats.tolerance`), so agreeing answers bound a loss only so
        tightly."""
        n = self.cap
        return judge_accuracy([1.0] * n, [1.0] * n, self.tolerance()).outcome == "inside"

    def check_reach(self) -> None:
        """Refuse a tolerance no cell can be shown to hold at the cap, naming the cap that would do: 30 answers
        all agreeing bound the drop at 98.3% from about 11 points and the ratio from about 0.88, so 5 points or
        0.95 need more samples."""
        if self.perfect_cell_inside():
            return
        ratio = self.min_accuracy_ratio
        reachable = ratio < 1 if ratio is not None else self.max_accuracy_drop > 0
        least = next((cap for cap in range(self.cap + 1, 10_000) if replace(self, cap=cap).perfect_cell_inside()),
                     None) if reachable else None  # a ratio of 1 or a drop of 0: only a better policy is inside
        rule = (f"--min-accuracy-ratio {ratio:g}" if ratio is not None
                else f"--max-accuracy-drop {self.max_accuracy_drop:g}")
        fix = f"raise --samples-max to at least {least}" if least else "loosen the tolerance"
        raise KvevictError(f"{rule} cannot be shown with --samples-max {self.cap}: even {self.cap} answers all "
                           f"agreeing with a full cache that got every one right leave the interval past it; {fix}")


def next_requests(config: TaskEnvelopeConfig, specs: list[str], records: list, top: int) -> dict[tuple[int, int],
                                                                                                 list[str]]:
    """(budget, samples) -> the configurations that need those answers next: an unfinished cell's next look,
    else the next budget of the bisection (its first look)."""
    bracket = Bracket(config.floor, top, config.resolution).check()
    wanted: dict[tuple[int, int], list[str]] = defaultdict(list)
    for spec in specs:
        cells = cells_of(config.looks(), config.tolerance(), spec, records)
        pending = [c for c in cells.values() if c.need is not None]
        if pending:
            wanted[pending[0].budget, pending[0].need].append(spec)
            continue
        budget = step(bracket, {b: c.inside for b, c in cells.items()}).next
        if budget is not None:
            wanted[budget, config.looks()[0]].append(spec)
    return wanted


def context_top(config: TaskEnvelopeConfig, tokenizer, limit: int | None) -> int:
    """The bracket's top: the shortest context among the samples a cell may use (a budget at or above a
    sample's context would keep all of it)."""
    grid = config.grid(["full"], [], config.cap)
    preflight(grid, tokenizer, limit)
    return min(compressed_length(p, config.protocol) for p in prompts(grid, tokenizer, limit))


def run_task_envelope(config: TaskEnvelopeConfig, model, tokenizer,
                      on_step: Callable[[dict], None] | None = None, executor=None,
                      allow_download: bool = False, device: str = "cpu") -> tuple[ResultStore, list]:
    """Search every configuration to its resolution on the task; returns the store and its records.
    `on_step` is told of each step's requests, (budget, samples) -> configurations, before they run. With an
    `executor` (Ray's), each step's requests run as one-sample shards on its workers (`grid_shards`): the search
    is sequential in its steps (each waits for the judgements before it), the samples and configurations of a
    step are not. A shard the executor gave up on stops the search (KvevictError); a rerun continues it."""
    specs = config.check()
    if model is not None and hasattr(model, "dtype") and dtype_name(model.dtype) != config.dtype:
        raise KvevictError(f"the model given is held in {model.dtype}, the search says dtype '{config.dtype}': "
                           f"pass TaskEnvelopeConfig(dtype='{dtype_name(model.dtype)}') so its records name what ran")
    store = open_run_folder(run_folder(config.out, config.name), config.identity(), asdict(config), "answers")
    limit = max_positions(model)
    top = context_top(config, tokenizer, limit)
    if top <= config.floor:
        raise KvevictError(f"--floor {config.floor} is not below the task's context of {top} tokens: lower it")
    with executor.opened() if executor is not None else nullcontext():
        return _search(config, specs, model, tokenizer, store, top, on_step, executor,
                       GridSpec(config.model, config.dtype, allow_download, device, model, tokenizer))


def _search(config, specs, model, tokenizer, store, top, on_step, executor, spec) -> tuple[ResultStore, list]:
    """Step after step until every configuration's search is done (`run_task_envelope`)."""
    limit = max_positions(model)
    while True:
        records = load(store.records())
        wanted = next_requests(config, specs, records, top)
        if not wanted:
            return store, records
        if on_step is not None:
            on_step(dict(wanted))
        if executor is not None:
            _step_on(executor, config, wanted, store, spec)
            continue
        for (budget, samples), group in sorted(wanted.items()):
            done = store.done()
            run_grid(model, tokenizer, config.grid(group, [budget], samples), done, keeper(store, done, config.dtype),
                     limit)


def _step_on(executor, config: TaskEnvelopeConfig, wanted: dict, store: ResultStore, spec) -> None:
    """One step of the search as shards on `executor`; a shard given up on stops the search in one line."""
    done = store.done()
    todo = [item for (budget, samples), group in sorted(wanted.items())
            for item in shard(config.grid(group, [budget], samples), done)]
    failed = run_shards(executor, spec, todo, keeper(store, done, config.dtype), progress=False)
    if failed:
        item, reason = failed[0]
        raise KvevictError(f"{len(failed)} shard(s) failed ({item.name}: {reason}): rerun the same command to "
                           "continue the search")
