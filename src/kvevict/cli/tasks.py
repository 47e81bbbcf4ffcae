"""`kvevict needle`, `kvevict generation`, `kvevict sinks`: the protocols beyond perplexity.

Same rules as every command: validate what can be validated before the model is
loaded, `--json` prints one JSON object as the last line of stdout, progress on stderr.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ..errors import KvevictError
from ..report.columns import Table
from .common import (
    DEVICE_HELP,
    DOWNLOAD_HELP,
    DTYPE_HELP,
    MODEL_HELP,
    POSITIONS_HELP,
    PREFILL_CHUNK_HELP,
    check_device,
    check_dtype,
    err,
    one_line_errors,
    parse_numbers,
    parse_prefill_chunk,
    save_json,
    settle_specs,
    split_specs,
)
from .tables import show


def _numbers(text: str, option: str, kind: type) -> list:
    return parse_numbers(text, option, kind, f"{kind.__name__}s")


def _budgets(text: str) -> list:
    from ..policies.budget import parse_budget

    return [parse_budget(part) for part in split_specs(text)]


def _specs(text: str, positions: str | None = None, tokenizer=None) -> tuple[list[str], str]:
    """The `--policies` of a task and their position mode (`settle_specs`): parsed now; their budgets are
    checked against each prompt later."""
    specs = split_specs(text)
    if not specs:
        raise KvevictError("--policies is empty: give comma-separated specs such as full,streamingllm,h2o")
    return settle_specs(specs, None, positions, tokenizer)


def _note_plain_prompt(chat: bool, model: str) -> None:
    if not chat:
        err.print(f"note: '{model}' has no chat template; asking with a plain 'Question: ... Answer:' prompt instead")


@one_line_errors
def needle(
    model: str = typer.Option("smollm2-135m", help=MODEL_HELP),
    text: str = typer.Option("pg-essays", help="haystack text: embedded name, .txt file, folder or .jsonl"),
    lengths: str = typer.Option("1000,2000,4000", help="haystack lengths in tokens"),
    depths: str = typer.Option("0.1,0.5,0.9", help="needle depths in [0, 1]"),
    trials: int = typer.Option(3, help="seeded trials per length and depth"),
    policies: str = typer.Option("full,streamingllm,h2o,snapkv", help="comma-separated specs; full runs once"),
    budgets: str = typer.Option("50%,25%,10%", help="entries or percentages of the compressed context"),
    seed: int = typer.Option(0, help="seed of keys and haystack offsets"),
    positions: str | None = typer.Option(None, show_default=False, help=POSITIONS_HELP),
    question_after: bool = typer.Option(False, help="compress only the haystack; read the question after (kvpress)"),
    prefill_chunk: str | None = typer.Option(None, show_default=False, help=PREFILL_CHUNK_HELP),
    save: str = typer.Option("", help="also write every trial's record to this JSON file"),
    as_json: bool = typer.Option(False, "--json", help="print {'cells': [...]} as the last line"),
    allow_download: bool = typer.Option(False, "--allow-download", help=DOWNLOAD_HELP),
    device: str = typer.Option("cpu", help=DEVICE_HELP),
    dtype: str | None = typer.Option(None, help=DTYPE_HELP),
) -> None:
    """Pass-key retrieval: a 5-digit key hidden at a depth of an essay haystack, per policy and budget."""
    from ..eval.needle import check_grid, run_needle
    from ..loading import load_model
    from ..loading.dtypes import dtype_name
    from ..report.tables import needle_grid

    check_device(device)
    check_dtype(dtype)
    length_list = _numbers(lengths, "--lengths", int)
    depth_list = _numbers(depths, "--depths", float)
    check_grid(length_list, depth_list, trials)
    chunk = parse_prefill_chunk(prefill_chunk)
    _specs(policies, positions)
    budget_list = _budgets(budgets)
    lm, tokenizer = load_model(model, device=device, allow_download=allow_download, dtype=dtype)
    specs, positions = _specs(policies, positions, tokenizer)
    result = run_needle(
        lm, tokenizer, length_list, depth_list, trials, specs, budget_list, seed, text, positions, question_after,
        prefill_chunk=chunk,
    )
    _note_plain_prompt(result.chat_template, model)
    save_json(save, result.to_dict())
    cells = result.cells()
    if as_json:
        print(json.dumps({"model": model, "dtype": dtype_name(lm.dtype), "cells": cells}))
        return
    show(needle_grid(cells), f"pass-key retrieval, {model} ({dtype_name(lm.dtype)}), {trials} trials per cell")


@one_line_errors
def generation(
    model: str = typer.Option("smollm2-135m", help=MODEL_HELP),
    text: str = typer.Option("pg-essays", help="essay text between the fact and the question"),
    length: int = typer.Option(1000, help="tokens of text between the fact and the question"),
    trials: int = typer.Option(4, help="seeded prompts, the same for every policy"),
    policies: str = typer.Option("full,window,streamingllm,h2o,snapkv", help="comma-separated specs"),
    budgets: str = typer.Option("25%", help="entries or percentages of the prompt"),
    max_new_tokens: int = typer.Option(48, help="tokens generated per answer"),
    seed: int = typer.Option(0),
    positions: str | None = typer.Option(None, show_default=False, help=POSITIONS_HELP),
    chat: bool = typer.Option(True, help="ask through the chat template, stop at the end of the turn"),
    prefill_chunk: str | None = typer.Option(None, show_default=False, help=PREFILL_CHUNK_HELP),
    save: str = typer.Option("", help="also write every output's record to this JSON file"),
    as_json: bool = typer.Option(False, "--json", help="print {'rows': [...]} as the last line"),
    allow_download: bool = typer.Option(False, "--allow-download", help=DOWNLOAD_HELP),
    device: str = typer.Option("cpu", help=DEVICE_HELP),
    dtype: str | None = typer.Option(None, help=DTYPE_HELP),
) -> None:
    """Generation failure modes: repeated 4-grams and recall of a fact stated only at the start."""
    from ..eval.generation import run_generation
    from ..loading import load_model
    from ..loading.dtypes import dtype_name
    from ..report.tables import generation_table

    check_device(device)
    check_dtype(dtype)
    if trials < 1:
        raise KvevictError(f"--trials must be at least 1, got {trials}")
    chunk = parse_prefill_chunk(prefill_chunk)
    _specs(policies, positions)
    budget_list = _budgets(budgets)
    lm, tokenizer = load_model(model, device=device, allow_download=allow_download, dtype=dtype)
    specs, positions = _specs(policies, positions, tokenizer)
    result = run_generation(
        lm, tokenizer, specs, budget_list, length, trials, max_new_tokens, seed, text, positions, chat,
        prefill_chunk=chunk,
    )
    if chat:
        _note_plain_prompt(result.chat, model)
    save_json(save, result.to_dict())
    rows = result.summary()
    if as_json:
        print(json.dumps({"model": model, "dtype": dtype_name(lm.dtype), "rows": rows}))
        return
    show(generation_table(rows),
         f"generation failure modes, {model} ({dtype_name(lm.dtype)}), {length}-token prompts, {trials} trials")


@one_line_errors
def sinks(
    model: str = typer.Option("smollm2-135m", help=MODEL_HELP),
    text: str = typer.Option("pg-essays", help="embedded name, .txt file, folder or .jsonl"),
    tokens: int = typer.Option(1024, help="tokens of text to measure on"),
    k: int = typer.Option(8, help="leading positions in the map"),
    threshold: float = typer.Option(0.1, help="attention share in one head that counts towards a sink"),
    min_heads: float = typer.Option(0.05, help="share of (layer, head) pairs over --threshold that makes a sink"),
    png: str = typer.Option("", help="write the sink-map figure to this PNG file"),
    save: str = typer.Option("", help="also write the whole map to this JSON file"),
    as_json: bool = typer.Option(False, "--json", help="print the map as one JSON object on the last line"),
    allow_download: bool = typer.Option(False, "--allow-download", help=DOWNLOAD_HELP),
    device: str = typer.Option("cpu", help=DEVICE_HELP),
    dtype: str | None = typer.Option(None, help=DTYPE_HELP),
) -> None:
    """The attention-sink map: per layer and head, the attention share of the first k positions, and the sinks."""
    from ..data import load_tokens
    from ..eval.sinkmap import sink_map
    from ..loading import load_model, load_tokenizer
    from ..loading.dtypes import dtype_name

    check_device(device)
    check_dtype(dtype)
    if tokens < 64:
        raise KvevictError(f"--tokens must be at least 64 for a sink map, got {tokens}")
    if not 1 <= k <= tokens // 4:
        raise KvevictError(f"--k must be in [1, {tokens // 4}] (a quarter of --tokens), got {k}")
    if not 0.0 < threshold < 1.0:
        raise KvevictError(f"--threshold is a share of attention in (0, 1), got {threshold}")
    if not 0.0 < min_heads <= 1.0:
        raise KvevictError(f"--min-heads is a share of (layer, head) pairs in (0, 1], got {min_heads}")
    ids, _ = load_tokens(text, load_tokenizer(model, allow_download), tokens)
    lm, tokenizer = load_model(model, device=device, allow_download=allow_download, dtype=dtype)
    result = sink_map(lm, tokenizer, ids, k=k, threshold=threshold, min_heads=min_heads)
    data = result.to_dict()
    data.update(model=model, dtype=dtype_name(lm.dtype), text=text, text_tokens=tokens)
    save_json(save, data)
    if png:
        from ..report.plots import png as to_png
        from ..report.task_plots import sink_map_figure

        Path(png).parent.mkdir(parents=True, exist_ok=True)
        Path(png).write_bytes(to_png(sink_map_figure(data)))
    if as_json:
        print(json.dumps(data))
        return
    rows = [[str(r["layer"]), f"{r['pos0']:.3f}", f"{r['first_k']:.3f}", f"{r['min_head_first_k']:.3f}",
             f"{r['max_head_first_k']:.3f}"] for r in result.table()]
    headers = ["layer", "share on pos 0", f"share on first {k}", "least-sunk head", "most-sunk head"]
    show(Table(headers, rows, aligns=["right"] * len(headers)),
         f"attention sinks, {model} ({data['dtype']}) on {text} ({tokens} tokens; probes: last half)")
    listed = ", ".join(
        f"{s['position']} {s['token']!r} (mean {s['mean_share']:.3f}, {s['heads_over_threshold']} heads)"
        for s in result.sinks
    )
    rule = f">= {threshold:g} of the attention in >= {min_heads:.0%} of (layer, head) pairs"
    print(f"sinks ({rule}): {listed or 'none'}")
