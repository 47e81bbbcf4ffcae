"""`kvevict engine-check`: kvevict's `llamacpp` preset against llama.cpp itself (the `llamacpp` extra)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ..defaults import DEFAULT_CHUNK
from ..errors import KvevictError
from ..report.columns import Column, Table
from .common import CHUNK_HELP, check_dtype, one_line_errors, parse_chunk, parse_ints
from .tables import show

#: one row per (model, keep): both sides' PPL against their own full cache, and the three checks
CHECK: list[Column[dict]] = [
    Column("model", lambda r: r["model"], align="left"),
    Column("n_ctx", lambda r: str(r["budget"])),
    Column("keep", lambda r: f"{r['keep']}+{r['bos']} BOS" if r["bos"] else str(r["keep"])),
    Column("llama.cpp ppl", lambda r: f"{r['engine_ppl']:.2f} / {r['engine_full_ppl']:.2f}"),
    Column("kvevict ppl", lambda r: f"{r['kvevict_ppl']:.2f} / {r['kvevict_full_ppl']:.2f}"),
    Column("ratio gap", lambda r: f"{r['ratio_gap']:.4f} <= {r['tolerance']:.4f}" if r["ratio_gap"] <= r["tolerance"]
           else f"{r['ratio_gap']:.4f} > {r['tolerance']:.4f}"),
    Column("corr", lambda r: f"{r['correlation']:.4f}"),
    Column("shifts", lambda r: f"{r['shifts']} same" if r["same_shifts"] else f"{r['shifts']} DIFFER"),
    Column("ok", lambda r: "yes" if r["passed"] else "NO"),
]


#: `--llamacpp-only`: llama.cpp's PPL per --keep against its own full cache
ENGINE: list[Column[dict]] = [
    Column("model", lambda r: r["model"], align="left"),
    Column("n_ctx", lambda r: str(r["budget"])),
    Column("keep", lambda r: f"{r['keep']}+{r['bos']} BOS" if r["bos"] else str(r["keep"])),
    Column("keeps token 0", lambda r: "yes" if r["keeps_token0"] else "no"),
    Column("ppl", lambda r: f"{r['engine_ppl']:.2f}"),
    Column("full ppl", lambda r: f"{r['engine_full_ppl']:.2f}"),
    Column("ratio", lambda r: f"{r['engine_ratio']:.3f}"),
    Column("shifts", lambda r: str(r["shifts"])),
]


@one_line_errors
def engine_check(
    models: str = typer.Option("smollm2-135m,gemma3-270m", help="comma-separated: embedded names or .gguf files"),
    text: str = typer.Option("pg-essays", help="embedded name, .txt file, folder or .jsonl"),
    tokens: int = typer.Option(2048, help="stream length"),
    budget: int = typer.Option(512, help="llama.cpp's n_ctx, and the preset's budget"),
    keep: str = typer.Option("0,4", help="comma-separated --keep values of llama-server (n_keep)"),
    chunk: str = typer.Option(str(DEFAULT_CHUNK), help=CHUNK_HELP),
    threads: int = typer.Option(2, help="llama.cpp's CPU threads"),
    llamacpp_only: bool = typer.Option(
        False, "--llamacpp-only", help="only llama.cpp's side: its PPL per --keep against its own full cache"
    ),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object as the last line"),
    dtype: str | None = typer.Option(None, help="what kvevict's side holds the weights and KV cache in: float32, "
                                     "bfloat16 or float16 (default float32; llama.cpp's side runs as llama.cpp does)"),
) -> None:
    """Stream the same tokens through llama.cpp (context shift as llama-server does it) and kvevict's
    llamacpp preset; check the same shift points, PPL ratio and per-token NLL (exit 1 if any fails)."""
    from ..llamacpp import require

    check_dtype(dtype)  # bad input first, then the extra: a missing install is named before any model loads
    require()
    from ..llamacpp.check import engine_check as run_check
    from ..llamacpp.check import engine_side
    from ..loading import load_model

    keeps = parse_ints(keep, "--keep")
    chunk_size = parse_chunk(chunk)
    rows = []
    for name in _gguf_names(models):
        gguf, ids = _stream(name, text, tokens, budget)
        if llamacpp_only:
            rows += engine_side(name, gguf, ids, budget, keeps, threads)
            continue
        lm, _ = load_model(name, dtype=dtype)
        rows += [r.summary() for r in run_check(name, gguf, lm, ids, budget, keeps, chunk_size, threads)]
    _show_rows(rows, llamacpp_only, as_json, f"{tokens} tokens of {text}")
    if not llamacpp_only and not all(r["passed"] for r in rows):
        raise typer.Exit(1)


def _gguf_names(models: str) -> list[str]:
    """The comma-separated `--models`, each an embedded name or a .gguf file: llama.cpp reads nothing else,
    and every name is checked before the first model loads."""
    from ..loading.gguf import EMBEDDED

    names = [m.strip() for m in models.split(",") if m.strip()]
    for name in names:
        if name not in EMBEDDED and not name.lower().endswith(".gguf"):
            raise KvevictError(
                f"engine-check needs the model as a GGUF file, the form llama.cpp reads: '{name}' is neither an "
                f"embedded model ({', '.join(EMBEDDED)}) nor a .gguf file"
            )
    return names


def _stream(name: str, text: str, tokens: int, budget: int):
    """(the GGUF file of model `name`, its tokens of `text` `[T]`); refused when `budget` holds the whole
    stream, since then neither side ever shifts and the check would compare two full caches."""
    from ..data import load_tokens
    from ..loading import load_tokenizer
    from ..loading.gguf import EMBEDDED, embedded_gguf

    gguf = embedded_gguf(name) if name in EMBEDDED else Path(name).expanduser()
    ids, _ = load_tokens(text, load_tokenizer(name), tokens)
    if budget >= len(ids):
        raise KvevictError(f"--budget {budget} holds the whole {len(ids)}-token stream: nothing would shift")
    return gguf, ids


def _show_rows(rows: list[dict], llamacpp_only: bool, as_json: bool, what: str) -> None:
    """The rows as one JSON line, or as the table of the side that ran with each failed check on a line of
    its own (`--llamacpp-only` rows have no checks: llama.cpp is measured alone)."""
    if as_json:
        print(json.dumps({"rows": rows}))
    elif llamacpp_only:
        show(Table.of(ENGINE, rows), f"llama.cpp's context shift alone, {what}")
    else:
        show(Table.of(CHECK, rows), f"llama.cpp against kvevict's llamacpp preset, {what}")
        for row in rows:
            for failure in row.get("failures", []):
                print(f"  {row['model']} keep={row['keep']}: {failure}")
