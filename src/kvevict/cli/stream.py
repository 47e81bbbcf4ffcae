"""`kvevict ppl` and `kvevict compare`: streaming perplexity of one policy, or several side by side."""

from __future__ import annotations

import typer

from ..defaults import DEFAULT_CHUNK
from ..errors import KvevictError
from ..report.columns import KV_BF16, KV_HELD, MEAN_KEPT, Column, Table, mean_kept
from .common import (
    CHUNK_HELP,
    DEVICE_HELP,
    DOWNLOAD_HELP,
    DTYPE_HELP,
    MODEL_HELP,
    POSITIONS_HELP,
    check_device,
    check_dtype,
    err,
    one_line_errors,
    parse_chunk,
    print_json,
    settle_specs,
    split_specs,
)
from .tables import show

#: the `ppl` / `compare` table over `RowResult.summary()` rows; narrow terminals drop s, positions, kept, top1,
#: sink_loss, kl_to_full, the KV bytes per sequence in that order (mean kept goes with kept)
PPL: list[Column[dict]] = [
    Column("policy", lambda r: r["policy"], align="left"),
    Column("budget", lambda r: str(r["budget"] if r["budget"] is not None else "-")),
    Column("positions", lambda r: r["positions"], align="left", drop=2),
    Column("ppl", lambda r: f"{r['ppl']:.2f}"),
    Column("kl_to_full", lambda r: f"{r['kl_to_full']:.3f}" if "kl_to_full" in r else "-", drop=6),
    Column("top1", lambda r: f"{r['top1_agreement']:.3f}" if "top1_agreement" in r else "-", drop=4),
    Column("sink_loss", lambda r: f"{r.get('sink_loss', 0.0):.2f}", drop=5),
    Column("kept", lambda r: str(r["max_kept"]), drop=3),
    Column(MEAN_KEPT, lambda r: mean_kept(r.get("mean_kept")), drop=3),
    Column(KV_HELD, lambda r: r["kv_held"], drop=7),
    Column(KV_BF16, lambda r: r["kv_bf16"], drop=8),
    Column("s", lambda r: f"{r['seconds']:.1f}", drop=1),
]


def _with_bytes(summaries: list[dict]) -> list[dict]:
    """The rows with their KV bytes per sequence (`report.kv_bytes.summary_bytes`: the full row's from the others),
    as numbers (`kv`) and as the table prints them."""
    from ..report.kv_bytes import mib, summary_bytes

    return [{**s, "kv": b, "kv_held": mib(b.held), "kv_bf16": mib(b.bf16)}
            for s, b in zip(summaries, summary_bytes(summaries))]


def note_unreached(budget: int, tokens: int) -> None:
    """Say when a budget is never reached: such a row is the full cache, not a test of the policy."""
    if budget >= tokens:
        err.print(f"note: budget {budget} ≥ {tokens} tokens: nothing was evicted; this row is the full cache",
                  markup=False, highlight=False)


@one_line_errors
def ppl(
    model: str = typer.Option("smollm2-135m", help=MODEL_HELP),
    text: str = typer.Option("pg-essays", help="embedded name, .txt file, folder or .jsonl"),
    tokens: int = typer.Option(2000, help="stream length N: tokens 2..N are scored"),
    policy: str = typer.Option("streamingllm", help="policy spec, e.g. sink4+h2o:recent=0.5"),
    budget: int = typer.Option(256, help="entries kept per layer and KV head"),
    positions: str | None = typer.Option(None, show_default=False, help=POSITIONS_HELP),
    repeat: bool = typer.Option(False, help="cycle the text if it is shorter than --tokens"),
    window: int = typer.Option(0, help="also report PPL per window of this many predictions"),
    chunk: str = typer.Option(str(DEFAULT_CHUNK), help=CHUNK_HELP),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object as the last line"),
    allow_download: bool = typer.Option(False, "--allow-download", help=DOWNLOAD_HELP),
    device: str = typer.Option("cpu", help=DEVICE_HELP),
    dtype: str | None = typer.Option(None, help=DTYPE_HELP),
) -> None:
    """Streaming perplexity of one policy at one budget."""
    from ..data import load_tokens
    from ..loading import load_model, load_tokenizer
    from ..loading.dtypes import dtype_name

    check_device(device)
    check_dtype(dtype)
    settle_specs([policy], budget, positions)
    chunk_size = parse_chunk(chunk)
    if tokens < 2:
        raise KvevictError(f"need at least 2 tokens to score a prediction, got --tokens {tokens}")
    tokenizer = load_tokenizer(model, allow_download)
    (policy,), positions = settle_specs([policy], budget, positions, tokenizer)
    ids, repeated = load_tokens(text, tokenizer, tokens, repeat=repeat)
    lm, _ = load_model(model, device=device, allow_download=allow_download, dtype=dtype)
    if repeated:
        err.print(f"note: '{text}' is shorter than {tokens} tokens; it was repeated to fill the stream")
    from ..eval.streaming import streaming_ppl  # transformers' cache module, which the load has imported

    result = streaming_ppl(lm, ids, policy=policy, budget=budget, positions=positions, chunk=chunk_size)
    note_unreached(budget, ids.numel())
    summary = result.summary()
    held = dtype_name(lm.dtype)
    summary.update(model=model, dtype=held, text=text, tokens=tokens, text_repeated=repeated,
                   sink_lost_at=result.sink_lost_at)
    if window:
        summary["ppl_windows"] = result.ppl_windows(window)
    if as_json:
        print_json(summary)
        return
    show(Table.of(PPL, _with_bytes([summary])), f"streaming perplexity, {model} ({held}) on {text}, {tokens} tokens")
    for w in summary.get("ppl_windows", []):
        print(f"  predictions {w['start']}-{w['end']}: ppl {w['ppl']:.2f}")


@one_line_errors
def compare(
    model: str = typer.Option("smollm2-135m", help=MODEL_HELP),
    text: str = typer.Option("pg-essays"),
    tokens: int = typer.Option(2000),
    policies: str = typer.Option("window,streamingllm", help="comma-separated specs, run as rows of one batch"),
    budget: int = typer.Option(256),
    positions: str | None = typer.Option(None, show_default=False, help=POSITIONS_HELP),
    chunk: str = typer.Option(str(DEFAULT_CHUNK), help=CHUNK_HELP),
    as_json: bool = typer.Option(False, "--json"),
    allow_download: bool = typer.Option(False, "--allow-download", help=DOWNLOAD_HELP),
    device: str = typer.Option("cpu", help=DEVICE_HELP),
    dtype: str | None = typer.Option(None, help=DTYPE_HELP),
) -> None:
    """Streaming perplexity of several policies side by side, with the full cache as reference."""
    from ..data import load_tokens
    from ..loading import load_model, load_tokenizer
    from ..loading.dtypes import dtype_name

    check_device(device)
    check_dtype(dtype)
    specs = split_specs(policies)
    if not specs:
        raise KvevictError("--policies is empty: give comma-separated specs such as window,streamingllm")
    settle_specs(specs, budget, positions)
    chunk_size = parse_chunk(chunk)
    tokenizer = load_tokenizer(model, allow_download)
    specs, positions = settle_specs(specs, budget, positions, tokenizer)
    ids, _ = load_tokens(text, tokenizer, tokens)
    lm, _ = load_model(model, device=device, allow_download=allow_download, dtype=dtype)
    rows, full = _compare_in_batches(lm, ids, specs, budget, positions, chunk_size)
    note_unreached(budget, ids.numel())
    summaries = [full.summary()] + [r.summary() for r in rows]
    held = dtype_name(lm.dtype)
    if as_json:
        print_json({"model": model, "dtype": held, "rows": summaries})
        return
    show(Table.of(PPL, _with_bytes(summaries)),
         f"streaming perplexity, {model} ({held}) on {text}, {tokens} tokens, budget {budget}")


def _compare_in_batches(lm, ids, specs: list[str], budget: int, positions: str, chunk: int):
    """`compare` over the batches `specs` can share (`shared_batches`: a policy with its own per-layer
    budgets, per-head budgets or eviction schedule runs alone), against one full-cache reference."""
    from ..eval.streaming import compare as run_compare
    from ..eval.streaming import full_reference
    from ..policies import shared_batches

    batches = shared_batches(specs)
    if len(batches) == 1:
        return run_compare(lm, ids, specs, budget, positions, chunk=chunk)
    reference = full_reference(lm, ids)
    by_spec = {}
    for batch in batches:
        rows, _ = run_compare(lm, ids, batch, budget, positions, reference=reference, chunk=chunk)
        by_spec.update(zip(batch, rows))
    return [by_spec[spec] for spec in specs], reference.result
