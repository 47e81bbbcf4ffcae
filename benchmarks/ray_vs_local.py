"""One sweep run by the local executor and by Ray workers on this machine: time, and the same numbers.

The arms take turns in one process, each in a fresh run folder, on the same model, text
and cells; the ratio is printed and the two `results.jsonl` files are compared cell by
cell. `tests/test_ray.py` asserts bit-identical numbers with one torch thread per process
on both sides; here the local run uses every core and each Ray worker one, so matrix
multiplies sum in another order and PPL/KL may differ in the last float32 bits (the
script asserts at most 1e-5 relative and prints the largest difference).

What it shows on a laptop-sized machine: Ray's workers split the cores between them
(one torch thread per core each) where the local executor gives all cores to one batch
at a time, and Ray adds its start-up and a model load per worker. On a cluster the
workers are separate machines and the sweep's wall time divides by their number; this
benchmark measures the overhead a team pays for that on one box.

    unshare --net sh -c 'ip link set lo up && .venv/bin/python benchmarks/ray_vs_local.py --tokens 600 --budgets 64,128'
    unshare --net sh -c 'ip link set lo up && .venv/bin/python benchmarks/ray_vs_local.py --job ruler --samples 6'

`--job ruler` times a `kvevict ruler` grid instead (niah_single_1 at `--length` tokens, `--samples` prompts, h2o
and tova at 50% and 25%): one shard per sample on the workers, against the local grid runner, which reads each
sample's context once for every row of a batch. The answers must be the same record for record.

Run it in a network namespace that holds only loopback, as above (root): the local Ray
instance binds to 127.0.0.1, but Ray's dashboard probes cloud metadata addresses at every
start, and no switch stops that (docs/integrations.md).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvevict.ab import SweepConfig, run_sweep
from kvevict.integrations.executor_choice import make_executor

POLICIES = ["window", "streamingllm", "h2o", "snapkv"]


def numbers(path: Path) -> dict:
    """Cell key -> PPL, KL and sink loss as recorded (the fields that must not depend on the executor)."""
    out = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        out[record["key"]] = (record.get("ppl"), record.get("kl_to_full"), record.get("sink_lost_at"))
    return out


def show(title: str, included: str, unit: str, count: int, seconds: dict, workers: int) -> None:
    """The two arms' wall times and rates (`count` `unit`s each), as one table."""
    table = Table(title=title)
    for column in ("executor", f"seconds ({included} included)", f"{unit}/min"):
        table.add_column(column)
    for arm in ("local", "ray"):
        name = arm if arm == "local" else f"ray, {workers} workers"
        table.add_row(name, f"{seconds[arm]:.1f}", f"{60 * count / seconds[arm]:.1f}")
    Console().print(table)


def answers(path: Path) -> dict:
    """Cell key -> the recorded output and score (what must not depend on the executor; timings left out)."""
    out = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        out[record["key"]] = (record.get("output"), record.get("score"), record.get("kept"))
    return out


def ruler_arms(args) -> None:
    """The RULER grid local, then on Ray workers, in fresh folders; the model loaded once here for the local arm
    (each worker loads its own, counted in its arm's time)."""
    from kvevict.ab.ruler import RulerRun, run_ruler
    from kvevict.eval.ruler.grid import RulerGrid
    from kvevict.loading import load_model

    model, tokenizer = load_model(args.model)
    grid = RulerGrid(tasks=["niah_single_1"], lengths=[args.length], samples=args.samples, policies=["h2o", "tova"],
                     budgets=["50%", "25%"])
    seconds, results = {}, {}
    with tempfile.TemporaryDirectory() as out:
        for arm in ("local", "ray"):
            run = RulerRun(arm, out, args.model, grid)
            t0 = time.perf_counter()
            run_ruler(run, model, tokenizer, progress=False,
                      executor=None if arm == "local" else make_executor("ray", workers=args.workers))
            seconds[arm] = time.perf_counter() - t0
            results[arm] = answers(Path(out) / arm / "results.jsonl")
    assert results["local"] == results["ray"], "the Ray run's answers differ from the local run's"
    cells = len(results["local"])
    show(f"{cells} answers (niah_single_1 at {args.length} tokens, {args.samples} samples, full + h2o, tova at "
         f"50%, 25%), {args.model}", "worker start-up and model loads", "answers", cells, seconds, args.workers)
    print(f"ray / local wall time: {seconds['ray'] / seconds['local']:.2f}x; every answer identical")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", choices=("ab", "ruler"), default="ab")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=600)
    parser.add_argument("--budgets", default="64,128")
    parser.add_argument("--length", type=int, default=1024, help="ruler: the context length")
    parser.add_argument("--samples", type=int, default=6, help="ruler: prompts per cell")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    if args.job == "ruler":
        return ruler_arms(args)
    budgets = [int(b) for b in args.budgets.split(",")]
    seconds, results = {}, {}
    with tempfile.TemporaryDirectory() as out:
        for arm in ("local", "ray"):
            config = SweepConfig(model=args.model, tokens=args.tokens, budgets=budgets, policies=POLICIES,
                                 oracle_stride=args.tokens, out=out, name=arm)
            executor = make_executor(arm, workers=args.workers)
            t0 = time.perf_counter()
            run_sweep(config, progress=False, executor=executor)
            seconds[arm] = time.perf_counter() - t0
            results[arm] = numbers(Path(out) / arm / "results.jsonl")
    local, ray = results["local"], results["ray"]
    assert local.keys() == ray.keys(), "the Ray run finished other cells than the local run"
    assert all(local[k][2] == ray[k][2] for k in local), "sink loss differs between the runs"
    worst = max(abs(ray[k][i] - local[k][i]) / abs(local[k][i])
                for k in local for i in (0, 1) if local[k][i])  # PPL and KL
    assert worst <= 1e-5, f"the Ray run's numbers differ from the local run's by {worst:.1e} relative"
    cells = len(results["local"])
    show(f"{cells} cells ({len(POLICIES)} policies × budgets {args.budgets} + full + oracle), {args.tokens} tokens, "
         f"{args.model}", "model loads and start-up", "cells", cells, seconds, args.workers)
    same = "identical" if worst == 0 else f"within {worst:.1e} relative"
    print(f"ray / local wall time: {seconds['ray'] / seconds['local']:.2f}x; PPL and KL of every cell {same}, "
          "sink loss identical")


if __name__ == "__main__":
    main()
