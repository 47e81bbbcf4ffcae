"""The `kvevict` command. It only wires: parse, validate, call the library, print.

Every user mistake is caught before any model work where possible, and printed as one
line naming the fix, with exit code 2.
"""

from __future__ import annotations

import json
import sys

import typer
from rich.console import Console
from rich.table import Table

from .errors import KvevictError

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="KV-cache eviction policies: measure before you ship."
)
out = Console()
err = Console(stderr=True)


def fail(message: str) -> None:
    err.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def check_policies(specs: list[str], budget: int | None) -> None:
    from .policies import parse_policy

    for spec in specs:
        policy = parse_policy(spec)
        if budget is not None and not getattr(policy, "unbounded", False):
            if budget < 1:
                raise KvevictError(f"budget must be a positive number of entries, got {budget}")
            policy.check_budget(budget)


def check_positions(positions: str) -> None:
    from .cache import POSITION_MODES

    if positions not in POSITION_MODES:
        raise KvevictError(f"--positions must be one of {', '.join(POSITION_MODES)}, got '{positions}'")


def ppl_table(rows: list[dict], title: str) -> Table:
    table = Table(title=title)
    for column in ("policy", "budget", "positions", "ppl", "kl_to_full", "top1", "sink_loss", "kept", "s"):
        table.add_column(column, justify="right" if column not in ("policy", "positions") else "left")
    for r in rows:
        table.add_row(
            r["policy"],
            str(r["budget"] if r["budget"] is not None else "-"),
            r["positions"],
            f"{r['ppl']:.2f}",
            f"{r['kl_to_full']:.3f}" if "kl_to_full" in r else "-",
            f"{r['top1_agreement']:.3f}" if "top1_agreement" in r else "-",
            f"{r.get('sink_loss', 0.0):.2f}",
            str(r["max_kept"]),
            f"{r['seconds']:.1f}",
        )
    return table


@app.command()
def ppl(
    model: str = typer.Option("smollm2-135m", help="embedded name, local directory or HF id"),
    text: str = typer.Option("pg-essays", help="embedded name, .txt file, folder or .jsonl"),
    tokens: int = typer.Option(2000, help="stream length N: tokens 2..N are scored"),
    policy: str = typer.Option("streamingllm", help="policy spec, e.g. sink4+h2o:recent=0.5"),
    budget: int = typer.Option(256, help="entries kept per layer and KV head"),
    positions: str = typer.Option("original", help="original | cache (StreamingLLM position shift)"),
    repeat: bool = typer.Option(False, help="cycle the text if it is shorter than --tokens"),
    window: int = typer.Option(0, help="also report PPL per window of this many predictions"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object as the last line"),
) -> None:
    """Streaming perplexity of one policy at one budget."""
    try:
        check_positions(positions)
        check_policies([policy], budget)
        if tokens < 2:
            raise KvevictError(f"need at least 2 tokens to score a prediction, got --tokens {tokens}")
        from .data import load_tokens
        from .eval.streaming import streaming_ppl
        from .models import load_model, load_tokenizer

        ids, repeated = load_tokens(text, load_tokenizer(model), tokens, repeat=repeat)
        lm, _ = load_model(model)
        if repeated:
            err.print(f"note: '{text}' is shorter than {tokens} tokens; it was repeated to fill the stream")
        result = streaming_ppl(lm, ids, policy=policy, budget=budget, positions=positions)
    except KvevictError as exc:
        fail(str(exc))
    summary = result.summary()
    summary.update(model=model, text=text, tokens=tokens, text_repeated=repeated, sink_lost_at=result.sink_lost_at)
    if window:
        summary["ppl_windows"] = result.ppl_windows(window)
    if as_json:
        print(json.dumps(summary))
    else:
        out.print(ppl_table([summary], f"streaming perplexity, {model} on {text}, {tokens} tokens"))
        for w in summary.get("ppl_windows", []):
            out.print(f"  predictions {w['start']}-{w['end']}: ppl {w['ppl']:.2f}")


@app.command()
def compare(
    model: str = typer.Option("smollm2-135m"),
    text: str = typer.Option("pg-essays"),
    tokens: int = typer.Option(2000),
    policies: str = typer.Option("window,streamingllm", help="comma-separated specs, run as rows of one batch"),
    budget: int = typer.Option(256),
    positions: str = typer.Option("original"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Streaming perplexity of several policies side by side, with the full cache as reference."""
    specs = [s.strip() for s in policies.split(",") if s.strip()]
    try:
        check_positions(positions)
        if not specs:
            raise KvevictError("--policies is empty: give comma-separated specs such as window,streamingllm")
        check_policies(specs, budget)
        from .data import load_tokens
        from .eval.streaming import compare as run_compare
        from .models import load_model, load_tokenizer

        ids, _ = load_tokens(text, load_tokenizer(model), tokens)
        lm, _ = load_model(model)
        rows, full = run_compare(lm, ids, specs, budget, positions)
    except KvevictError as exc:
        fail(str(exc))
    summaries = [full.summary()] + [r.summary() for r in rows]
    if as_json:
        print(json.dumps({"rows": summaries}))
    else:
        out.print(ppl_table(summaries, f"streaming perplexity, {model} on {text}, {tokens} tokens, budget {budget}"))


def parse_numbers(text: str, option: str, kind: type, noun: str) -> list:
    """Comma-separated numbers of one kind; a bad item is a one-line error naming the option."""
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise KvevictError(f"{option} takes comma-separated {noun}, got '{text}'") from None


def parse_ints(text: str, option: str) -> list[int]:
    return parse_numbers(text, option, int, "integers")


def parse_floats(text: str, option: str) -> list[float]:
    return parse_numbers(text, option, float, "numbers")


def run_ab(config) -> None:
    """Plan, validate, run and report one sweep; prints the summary and the report path."""
    from .report.html import render
    from .report.tables import COLUMNS, summary_rows
    from .sweep import plan, prepare_folder, run_sweep

    check_positions(config.positions)
    plan(config)  # every spec and budget is checked before the model is loaded
    prepare_folder(config)
    store, records = run_sweep(config)
    if store.skipped_lines:
        err.print(f"note: skipped {store.skipped_lines} unreadable line(s) in {store.path}")
    from dataclasses import asdict

    report = render(records, asdict(config), config.folder / "report.html")
    table = Table(title=f"kvevict A/B: {config.model} on {config.text}, {config.tokens} tokens, {config.positions}")
    for column in COLUMNS:
        if column == "policy":
            table.add_column(column, justify="left", no_wrap=True, min_width=12)
        else:
            table.add_column(column, justify="right")
    for row in summary_rows(records):
        table.add_row(*row)
    out.print(table)
    print(report.resolve())


@app.command()
def ab(
    model: str = typer.Option("smollm2-135m", help="embedded name, local directory or HF id"),
    text: str = typer.Option("pg-essays", help="embedded name, .txt file, folder or .jsonl"),
    tokens: int = typer.Option(2000, help="stream length"),
    budgets: str = typer.Option("64,128,256", help="comma-separated budgets"),
    policies: str = typer.Option("window,streamingllm,h2o,snapkv", help="comma-separated policy specs"),
    sinks: str = typer.Option("", help="sink counts K: adds sinkK+window at each budget, e.g. 0,1,2,4,8"),
    oracle_stride: int = typer.Option(8, help="the recompute oracle scores every K-th token"),
    positions: str = typer.Option("original", help="original | cache"),
    seed: int = typer.Option(0, help="seed of random policies (recorded in every result)"),
    name: str = typer.Option("ab", help="run name: results go to OUT/NAME"),
    out_dir: str = typer.Option("runs", "--out", help="output folder"),
    needle: str = typer.Option("", help="also run pass-key retrieval at these haystack lengths, e.g. 1000,2000"),
    needle_depths: str = typer.Option("0.1,0.5,0.9", help="needle depths in [0, 1]"),
    needle_trials: int = typer.Option(2, help="seeded needle trials per length and depth"),
    generation: bool = typer.Option(False, help="also measure repetition and recall of greedy generation"),
    sink_map: bool = typer.Option(False, "--sink-map", help="also draw the model's attention-sink map"),
) -> None:
    """A/B test policies side by side: resumable results.jsonl, a summary table and an HTML report."""
    from .sweep import SweepConfig

    try:
        config = SweepConfig(
            model=model, text=text, tokens=tokens, budgets=parse_ints(budgets, "--budgets"),
            policies=[p.strip() for p in policies.split(",") if p.strip()], sinks=parse_ints(sinks, "--sinks"),
            oracle_stride=oracle_stride, positions=positions, seed=seed, name=name, out=out_dir,
            needle=parse_ints(needle, "--needle"), needle_depths=parse_floats(needle_depths, "--needle-depths"),
            needle_trials=needle_trials, generation=generation, sink_map=sink_map,
        )
        run_ab(config)
    except KvevictError as exc:
        fail(str(exc))


@app.command()
def report(
    run: str = typer.Argument(..., help="a run folder OUT/NAME written by `kvevict ab`"),
    markdown: bool = typer.Option(False, "--markdown", help="print the tables as Markdown"),
) -> None:
    """Redraw a run's HTML report from its results.jsonl (no model needed)."""
    from pathlib import Path

    from .report.html import render
    from .report.store import ResultStore
    from .report.tables import COLUMNS, sinks_table, summary_rows
    from .report.tables import markdown as to_markdown

    folder = Path(run)
    try:
        if not (folder / "results.jsonl").exists():
            raise KvevictError(f"no results.jsonl in '{run}': give the OUT/NAME folder of a `kvevict ab` run")
        records = ResultStore(folder / "results.jsonl").records()
        config = json.loads((folder / "run.json").read_text())["config"] if (folder / "run.json").exists() else {}
    except KvevictError as exc:
        fail(str(exc))
    path = render(records, config, folder / "report.html")
    if markdown:
        print(to_markdown(COLUMNS, summary_rows(records)))
        sinks = sinks_table(records)
        if sinks:
            print()
            print(to_markdown(*sinks))
    print(path.resolve())


#: The default A/B that `make demo` runs: sized to finish in under 10 minutes on 2 cores.
DEMO = dict(tokens=800, budgets=[64, 128, 256], policies=["window", "streamingllm", "h2o", "snapkv"],
            sinks=[0, 1, 2, 4, 8], oracle_stride=16, name="demo")


@app.command()
def demo(out_dir: str = typer.Option("runs", "--out", help="where results go")) -> None:
    """The main job: a default A/B on the embedded model and text."""
    from .sweep import SweepConfig

    try:
        run_ab(SweepConfig(out=out_dir, **DEMO))
    except KvevictError as exc:
        fail(str(exc))


from . import cli_tasks  # noqa: E402,F401  (registers needle / sinks / generation on `app`)


def main(argv: list[str] | None = None) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # config warnings are not the user's business here
    try:
        app(args=argv, standalone_mode=True)
    except KvevictError as exc:  # errors raised outside a command's own handler
        err.print(f"error: {exc}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
