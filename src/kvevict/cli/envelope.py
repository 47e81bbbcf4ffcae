"""`kvevict envelope`: the cheapest cache that holds quality, and what it buys at deployment.

Two modes. With a model, a search (`ab.envelope`) per configuration for the smallest
budget inside the tolerance, then the table, the verdict and the HTML page. With
`--config-only CONFIG.json`, no model and no search: the KV arithmetic of the named
configurations at the deployment's context (`kvevict.capacity`).
"""

from __future__ import annotations

import typer

from ..defaults import DEFAULT_CHUNK, DEFAULT_SAMPLES_MAX, DEFAULT_SAMPLES_START
from ..errors import KvevictError
from .common import (
    CHUNK_HELP,
    DEVICE_HELP,
    DOWNLOAD_HELP,
    DTYPE_HELP,
    MODEL_HELP,
    POSITIONS_HELP,
    address_option,
    answer_cap,
    check_device,
    check_dtype,
    check_positions,
    executor_option,
    max_accuracy_drop_option,
    max_new_tokens_option,
    min_accuracy_ratio_option,
    one_line_errors,
    parse_chunk,
    print_json,
    remote_executor,
    retries_option,
    split_specs,
    tolerance_from,
    workers_option,
)
from .tables import show


def _optional_float(text: str, option: str) -> float | None:
    if not text.strip():
        return None
    try:
        return float(text)
    except ValueError:
        raise KvevictError(f"{option} takes a number, got '{text}'") from None


def _deployment(deploy_context: int, memory: str, weights: str) -> tuple[int, int, int] | None:
    """(context, accelerator bytes, weight bytes), or None when no deployment is described."""
    from ..capacity import parse_size

    if not deploy_context and not memory:
        return None
    if deploy_context < 1 or not memory:
        raise KvevictError("capacity needs both --deploy-context (tokens, e.g. 32768) and --accelerator-memory "
                           "(e.g. 80GB)")
    return deploy_context, parse_size(memory, "--accelerator-memory"), parse_size(weights or "0", "--weight-bytes")


def _capacity(shape, configs, deployment, weights_given: bool, held: dict | None = None, page: int = 1):
    from ..capacity import arithmetic, capacity_rows, gib, kv_tokens

    context, memory, weights = deployment
    rows = capacity_rows(shape, configs, context, memory, weights, held)
    note = arithmetic(shape, context) + f"; {memory / 1e9:g} GB ({gib(memory)}) of accelerator memory"
    note += (f" less {weights / 1e9:g} GB of weights" if weights_given
             else " (weights not subtracted: pass --weight-bytes)")
    tokens = kv_tokens(shape, max(0, memory - weights), page)
    note += (f"; {tokens:,} KV tokens fit" + (f" in whole pages of {page}" if page > 1 else "")
             + f": {tokens / context:.2f} sequences of {context:,} tokens")
    return note, rows


def config_only(path: str, configs: str, deployment, weights_given: bool, dtype: str, as_json: bool = False,
                page: int = 1) -> None:
    """Print the KV arithmetic of named configurations for a model's config.json."""
    from ..capacity import named_configs, read_config
    from ..report.envelope_page import capacity_table

    if page < 1:
        raise KvevictError(f"--kv-page must be at least 1 token, got {page}")
    if deployment is None:
        raise KvevictError("--config-only needs --deploy-context and --accelerator-memory (e.g. 32768 and 80GB)")
    shape = read_config(path, dtype)
    named = named_configs(configs or "full", deployment[0])
    note, rows = _capacity(shape, named, deployment, weights_given, page=page)
    print(note)
    show(capacity_table(rows), f"capacity at {deployment[0]} tokens")
    if as_json:
        from ..report import as_json as to_json

        print_json({"config": path, "context": deployment[0], "capacity": to_json.capacity(note, rows)})


#: each option's help, by parameter name: the command's signature then reads as its options and defaults
HELP = {
    "model": MODEL_HELP,
    "text": "embedded name, .txt file, folder or .jsonl",
    "tokens": "stream length: budgets are searched below it",
    "lengths": "several stream lengths, e.g. 2K,4K,8K (K = 1024): one search per length, each in OUT/NAME-LENGTH; "
               "overrides --tokens",
    "policies": "comma-separated policy specs",
    "floor": "the smallest budget searched (entries; the default leaves room for SnapKV's window of 32)",
    "resolution": "stop when the passing and failing budgets are within this ratio",
    "max_ppl_ratio": "tolerance: PPL / full cache at most this ('' : none)",
    "max_kl": "tolerance: mean KL(full || policy) in nats at most this",
    "positions": POSITIONS_HELP,
    "dtype": DTYPE_HELP,
    "chunk": CHUNK_HELP,
    "seed": "seed of random policies",
    "name": "run name, one folder name: results go to OUT/NAME",
    "out_dir": "output folder",
    "deploy_context": "capacity: the deployment's context length in tokens",
    "accelerator_memory": "capacity: accelerator memory, e.g. 80GB or 79.6GiB",
    "weight_bytes": "capacity: memory the weights take (default: the loaded model's)",
    "config_only_path": "a model's config.json: capacity arithmetic only, no model, no search",
    "configs": "--config-only: configurations as POLICY@BUDGET, e.g. full,window@4096,h2o@25%",
    "kv_dtype": "--config-only: the cache's dtype, llama.cpp's q8_0 or q4_0, or fp8 (vLLM's --kv-cache-dtype fp8) "
                "(default: the config's)",
    "kv_page": "--config-only: tokens per KV page, as the engine allocates them (vLLM's --block-size: 16 on GPUs, "
               "128 on its CPU build)",
    "allow_download": DOWNLOAD_HELP,
    "device": DEVICE_HELP,
    "tasks": "RULER tasks, e.g. niah_single_1,niah_multikey_1: search task accuracy (at --lengths, default 2048) "
             "instead of perplexity",
    "protocol": "--tasks: the RULER protocol (agnostic, aware, stream, multi)",
    "samples_start": "--tasks: samples a cell is first judged on, and added per look",
    "samples_max": "--tasks: the most samples a cell takes; undecided there = not inside",
    "as_json": "print one JSON object as the last line",
}


@one_line_errors
def envelope(
    model: str = typer.Option("smollm2-135m", help=HELP["model"]),
    text: str = typer.Option("pg-essays", help=HELP["text"]),
    tokens: int = typer.Option(4096, help=HELP["tokens"]),
    lengths: str = typer.Option("", help=HELP["lengths"]),
    policies: str = typer.Option("window,streamingllm,h2o,snapkv", help=HELP["policies"]),
    floor: int = typer.Option(64, help=HELP["floor"]),
    resolution: float = typer.Option(1.1, help=HELP["resolution"]),
    max_ppl_ratio: str = typer.Option("1.05", help=HELP["max_ppl_ratio"]),
    max_kl: str = typer.Option("", help=HELP["max_kl"]),
    positions: str | None = typer.Option(None, show_default=False, help=HELP["positions"]),
    dtype: str | None = typer.Option(None, help=HELP["dtype"]),
    chunk: str = typer.Option(str(DEFAULT_CHUNK), help=HELP["chunk"]),
    seed: int = typer.Option(0, help=HELP["seed"]),
    name: str = typer.Option("envelope", help=HELP["name"]),
    out_dir: str = typer.Option("runs", "--out", help=HELP["out_dir"]),
    deploy_context: int = typer.Option(0, help=HELP["deploy_context"]),
    accelerator_memory: str = typer.Option("", help=HELP["accelerator_memory"]),
    weight_bytes: str = typer.Option("", help=HELP["weight_bytes"]),
    config_only_path: str = typer.Option("", "--config-only", help=HELP["config_only_path"]),
    configs: str = typer.Option("full", help=HELP["configs"]),
    kv_dtype: str = typer.Option("", help=HELP["kv_dtype"]),
    kv_page: int = typer.Option(1, help=HELP["kv_page"]),
    allow_download: bool = typer.Option(False, "--allow-download", help=HELP["allow_download"]),
    device: str = typer.Option("cpu", help=HELP["device"]),
    tasks: str = typer.Option("", help=HELP["tasks"]),
    protocol: str = typer.Option("agnostic", help=HELP["protocol"]),
    max_accuracy_drop: float | None = max_accuracy_drop_option(),
    min_accuracy_ratio: float | None = min_accuracy_ratio_option(),
    samples_start: int = typer.Option(DEFAULT_SAMPLES_START, help=HELP["samples_start"]),
    samples_max: int = typer.Option(DEFAULT_SAMPLES_MAX, help=HELP["samples_max"]),
    max_new_tokens: int = max_new_tokens_option("--tasks: "),
    executor: str = executor_option(),
    address: str = address_option(),
    workers: int = workers_option(),
    retries: int = retries_option(),
    as_json: bool = typer.Option(False, "--json", help=HELP["as_json"]),
) -> None:
    """Find, per policy, the smallest KV budget within a quality tolerance; bytes, capacity, a verdict."""
    deployment = _deployment(deploy_context, accelerator_memory, weight_bytes)
    if config_only_path:
        return config_only(config_only_path, configs, deployment, bool(weight_bytes), kv_dtype, as_json, kv_page)
    check_device(device)  # before the dtype: on cuda the default is read from the checkpoint
    runner = remote_executor(executor, address, workers, retries)
    if tasks.strip():
        accuracy = tolerance_from(None, max_accuracy_drop, None, min_accuracy_ratio=min_accuracy_ratio)
        return _tasks(model, dtype, tasks, lengths, protocol, policies, floor, resolution, accuracy, samples_start,
                      samples_max, seed, positions, text, name, out_dir, allow_download, device, runner,
                      answer_cap(max_new_tokens), as_json)
    per_length = _configs_per_length(model, text, tokens, lengths, policies, floor, resolution, max_ppl_ratio,
                                     max_kl, positions, dtype, chunk, seed, name, out_dir, allow_download, device)
    _search(per_length, runner, deployment, weight_bytes, allow_download, device, as_json)


def _configs_per_length(model: str, text: str, tokens: int, lengths: str, policies: str, floor: int,
                        resolution: float, max_ppl_ratio: str, max_kl: str, positions: str | None, dtype: str | None,
                        chunk: str, seed: int, name: str, out_dir: str, allow_download: bool, device: str) -> list:
    """One perplexity search (`ab.envelope.EnvelopeConfig`) per stream length, each in OUT/NAME-LENGTH when there
    are several: the options read once, so a bad one is refused before any search starts."""
    from ..ab.envelope import EnvelopeConfig
    from ..loading.models import model_dtype
    from ..policies.engine_defaults import run_positions

    if positions:
        check_positions(positions)
    positions = run_positions(split_specs(policies), positions)  # an engine preset brings its own mode
    dtype = model_dtype(model, check_dtype(dtype), device, allow_download)
    sizes = parse_lengths(lengths) if lengths.strip() else [tokens]
    return [EnvelopeConfig(
        model=model, dtype=dtype, text=text, tokens=size, policies=split_specs(policies), floor=floor,
        resolution=resolution,
        max_ppl_ratio=_optional_float(max_ppl_ratio, "--max-ppl-ratio"), max_kl=_optional_float(max_kl, "--max-kl"),
        positions=positions, chunk=parse_chunk(chunk), seed=seed, name=name if len(sizes) == 1 else f"{name}-{size}",
        out=out_dir,
    ) for size in sizes]


def _search(configs: list, runner, deployment, weight_bytes: str, allow_download: bool, device: str,
            as_json: bool) -> None:
    """Every length's search (each length's options checked before the first starts), its table, verdict and
    page; the lengths side by side; with `as_json` every envelope as one JSON object on the last line."""
    from ..ab.envelope import configurations, run_envelope

    for config in configs:  # every length's options checked before the first search starts
        configurations(config)
    per_length, found = {}, []
    for config in configs:
        _, records = run_envelope(config, allow_download=allow_download, device=device, executor=runner)
        per_length[config.tokens] = show_envelope(config, records, deployment, weight_bytes, found)
    if len(per_length) > 1:
        from ..report.envelope import lengths_table

        show(lengths_table(per_length), "smallest budget inside the tolerance, per context length")
    if as_json:
        first = configs[0]
        print_json({"model": first.model, "dtype": first.dtype, "text": first.text,
                    "tolerance": first.tolerance().as_dict(), "envelopes": found})


def _tasks(model, dtype, tasks, lengths, protocol, policies, floor, resolution, accuracy, start, cap, seed,
           positions, text, name, out_dir, allow_download, device, runner=None, max_new_tokens=None,
           as_json: bool = False) -> None:
    """The search of task accuracy; `device` and the `runner` were checked by the command before it."""
    from ..eval.ruler.registry import parse_tasks
    from ..loading.models import model_dtype
    from ..policies.engine_defaults import run_positions
    from .envelope_tasks import TaskOptions, run_tasks

    if positions:
        check_positions(positions)
    options = TaskOptions(
        model=model, dtype=model_dtype(model, check_dtype(dtype), device, allow_download), tasks=parse_tasks(tasks),
        lengths=parse_lengths(lengths) if lengths.strip() else [2048], protocol=protocol,
        policies=split_specs(policies), floor=floor, resolution=resolution,
        max_accuracy_drop=accuracy.max_accuracy_drop, min_accuracy_ratio=accuracy.min_accuracy_ratio, start=start,
        cap=cap,
        seed=seed, positions=run_positions(split_specs(policies), positions), text=text, name=name, out=out_dir,
        max_new_tokens=max_new_tokens)
    run_tasks(options, allow_download, device, runner, as_json)


def parse_lengths(text: str) -> list[int]:
    """`2K,4K,8K` (K = 1024) or plain token counts, ascending, each at least 2."""
    out = []
    for item in split_specs(text):
        raw = item.upper()
        try:
            value = int(raw[:-1]) * 1024 if raw.endswith("K") else int(raw)
        except ValueError:
            raise KvevictError(f"--lengths takes token counts such as 2K,4K,8K or 2048,4096, got '{item}'") from None
        if value < 2:
            raise KvevictError(f"--lengths: a stream needs at least 2 tokens, got '{item}'")
        out.append(value)
    return sorted(set(out))


def show_envelope(config, records, deployment, weight_bytes: str, found: list | None = None) -> list:
    """The envelope table, the verdict, the capacity of each configuration inside; the HTML page's path. `found`:
    where the same result goes as a JSON object (`report.as_json.envelope`) for `--json`."""
    from ..capacity import KvShape
    from ..report.envelope import envelope_rows, envelope_table, envelope_verdict
    from ..report.envelope_page import capacity_table, render_envelope

    tolerance = config.tolerance()
    full, rows = envelope_rows(records, tolerance)
    show(envelope_table(rows), f"kvevict envelope: {config.model} ({config.dtype}) on {config.text}, "
                              f"{config.tokens} tokens")
    sentence = envelope_verdict(full, rows, tolerance)
    print(sentence)
    capacity = None
    if deployment is not None and full is not None and "kv_shape" in full.extra:
        context, memory, weights = deployment
        if not weight_bytes:
            deployment = (context, memory, int(full.extra.get("weight_bytes", 0)))
        found = [r for r in rows if r.smallest is not None]
        named = [(r.name, r.smallest.budget) for r in found]
        held = {r.name: (r.smallest.record.kv_bytes, config.tokens) for r in found
                if r.smallest.record.kv_bytes is not None}  # what each cache held, not a nominal width
        capacity = _capacity(KvShape(**full.extra["kv_shape"]), named, deployment, True, held)
        print(capacity[0])
        show(capacity_table(capacity[1]), f"capacity at {context} tokens (budgets as found at {config.tokens})")
    path = render_envelope(vars(config), full, rows, tolerance, config.sweep().folder / "envelope.html", capacity)
    print(path.resolve())
    if found is not None:
        from ..report import as_json as to_json

        found.append({**to_json.envelope(config.tokens, full, rows, sentence), "report": str(path.resolve()),
                      "capacity": to_json.capacity(*capacity) if capacity else None})
    return rows
