"""What every command shares: the stderr console, the one error handler, option parsing.

Every user mistake is caught before any model work where possible, and printed as one
line naming the fix, with exit code 2 (`one_line_errors`). This module imports no
command, and the commands never import the package that registers them: no cycle.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, ParamSpec, TypeVar

import typer
from rich.console import Console

from ..errors import KvevictError
from ..files import atomic_write
from ..position_modes import DEFAULT_POSITIONS, POSITION_MODES, SHIFTED

err = Console(stderr=True)

P = ParamSpec("P")
R = TypeVar("R")

MODEL_HELP = "embedded name, local directory or HF id (resolved offline unless --allow-download)"
DOWNLOAD_HELP = "let an HF id that is not in the local cache be downloaded (off: fail at once, no network)"
DEVICE_HELP = "where the model runs: cpu, or cuda (cuda:N) where torch sees a CUDA device"
POSITIONS_HELP = (
    f"{' | '.join(POSITION_MODES)} ({SHIFTED.name}: StreamingLLM's position shift); "
    f"default: an engine preset's own, else {DEFAULT_POSITIONS}"
)
DTYPE_HELP = ("what the weights and the KV cache are held in: float32, bfloat16 or float16 "
              "(left out: float32 on cpu, the checkpoint's own dtype on cuda)")


def fail(message: str) -> NoReturn:
    """Print `error: message` as one line on stderr and exit with code 2."""
    err.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def one_line_errors(command: Callable[P, R]) -> Callable[P, R]:
    """Turn a `KvevictError` raised anywhere in `command` into one line on stderr and exit code 2.

    Every command wears it, so nobody reads a traceback to learn that a budget was
    smaller than a sink count, and no command repeats its own try/except.
    """

    @functools.wraps(command)
    def guarded(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except KvevictError as exc:
            fail(str(exc))

    return guarded


def check_device(device: str) -> str:
    """`--device` as given, once it names a device torch can use here: `cpu`, or `cuda` / `cuda:N` where
    torch sees that CUDA device. Checked before anything loads, so a machine without a GPU says so in one line."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise KvevictError(f"--device must be cpu, cuda or cuda:N, got '{device}'")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise KvevictError(
                f"--device {device}: torch sees no CUDA device on this machine (torch.cuda.is_available() is False); "
                "use --device cpu"
            )
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            raise KvevictError(f"--device {device}: torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return device


def check_dtype(dtype: str | None) -> str | None:
    """`--dtype` as given (None: the device's default), once it names a dtype `load_model` takes."""
    from ..loading.dtypes import check_dtype as check

    return check(dtype)


def split_specs(text: str) -> list[str]:
    """Comma-separated items, blanks dropped (`--policies "window, h2o,"`). A spec's own options are
    comma-separated too (`q4:group=64,residual=128+full`), so an item that starts `name=` continues the
    spec before it rather than starting one: no spec starts with an option."""
    items: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if items and re.match(r"[A-Za-z_]\w*=", part):
            items[-1] += "," + part
        elif part:
            items.append(part)
    return items


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


CHUNK_HELP = ("tokens per forward, evicting token by token inside it (1: one token per forward; the budget's first "
              "tokens, which nothing evicts, at least 256 per forward)")


PREFILL_CHUNK_HELP = (
    "read each prompt this many tokens per forward into the full cache, then compress it once: the same kept "
    "entries, one chunk's activations at a time (default: the prompt in one forward)"
)


def parse_prefill_chunk(text: str | None) -> int | None:
    """`--prefill-chunk` as a whole number >= 1, or None (one forward)."""
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise KvevictError(
            f"--prefill-chunk takes a whole number of tokens >= 1 (tokens per forward of a prompt), got '{text}'"
        )
    return value


def parse_chunk(text: str) -> int:
    """`--chunk` as a whole number >= 1 (parsed here, not by typer, so a bad value is one line)."""
    from ..eval.chunks import check_chunk

    try:
        value = int(text)
    except ValueError:
        raise KvevictError(f"--chunk takes a whole number of tokens >= 1 (1 = token by token), got '{text}'") from None
    return check_chunk(value)


def check_positions(positions: str) -> None:
    from ..position_modes import check_positions as check

    check(positions, "--positions")


def check_policies(specs: list[str], budget: int | None, positions: str = DEFAULT_POSITIONS) -> None:
    """Every spec parses and can run at `budget` (None: parse only) in the position mode `positions`."""
    from ..policies import check_policy

    for spec in specs:
        check_policy(spec, budget, positions)


def print_json(data: dict) -> None:
    """`--json`: the command's result as one JSON object on the last line of stdout (after its tables)."""
    print(json.dumps(data))


def save_json(path: str | None, data: dict) -> None:
    """Write `data` to `path` (a `--save` option) if one was given."""
    if path:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(target, json.dumps(data, indent=1))


def max_ppl_ratio_option():
    return typer.Option(None, "--max-ppl-ratio", help="verdict tolerance: policy PPL / full PPL a policy may reach "
                        "and ship (default 1.05: within 5%)")


def max_accuracy_drop_option():
    return typer.Option(None, "--max-accuracy-drop", help="verdict tolerance: task accuracy a policy may lose "
                        "against the full cache, absolute (default 0.05: 5 points)")


def min_accuracy_ratio_option():
    return typer.Option(None, "--min-accuracy-ratio", help="verdict tolerance: task accuracy a policy must keep, as "
                        "a share of the full cache's, in (0, 1] (e.g. 0.95; replaces --max-accuracy-drop)")


def max_new_tokens_option(scope: str = ""):
    return typer.Option(0, "--max-new-tokens", help=f"{scope}cap on answer tokens (0: RULER's answer length per task)")


def answer_cap(max_new_tokens: int) -> int | None:
    """`--max-new-tokens` as `RulerGrid.max_new_tokens`: 0 is RULER's own answer length (None); a negative
    value is passed on for the grid's check to refuse."""
    return max_new_tokens or None


def max_kl_option():
    return typer.Option(None, "--max-kl", help="verdict tolerance: mean KL(full ‖ policy) in nats per token "
                        "(default: KL not judged)")


def tolerance_from(max_ppl_ratio: float | None, max_accuracy_drop: float | None, max_kl: float | None,
                   recorded: dict | None = None, *, min_accuracy_ratio: float | None = None):
    """The verdict's `Tolerance`: the options given, else what the run recorded (`run.json`), else the default.
    An impossible one (a ratio at or below 1, a drop outside [0, 1)) is one line naming the option. The accuracy
    rule is one of two: a drop given replaces a recorded ratio, a ratio given replaces the drop; both given at once
    is refused."""
    from ..stats.tolerance import Tolerance

    if max_accuracy_drop is not None and min_accuracy_ratio is not None:
        raise KvevictError("--max-accuracy-drop and --min-accuracy-ratio are two accuracy rules, one at a time: give "
                           "either an absolute drop (0.05: 5 points) or a share of the full cache's accuracy (0.95)")
    base = Tolerance.from_dict(recorded)
    ratio = min_accuracy_ratio if min_accuracy_ratio is not None else (
        None if max_accuracy_drop is not None else base.min_accuracy_ratio)
    return Tolerance(base.max_ppl_ratio if max_ppl_ratio is None else max_ppl_ratio,
                     base.max_accuracy_drop if max_accuracy_drop is None else max_accuracy_drop,
                     base.max_kl if max_kl is None else max_kl, base.confidence, ratio)


def settle_specs(specs: list[str], budget: int | None, positions: str | None,
                 tokenizer=None) -> tuple[list[str], str]:
    """`specs` and the position mode they run in, each checked at `budget`: `positions` when the user gave
    it, else the engine presets' own (`policies.engine_defaults`); with the model's `tokenizer`, a preset
    option that reads the model (llama.cpp's add-BOS) written out. Called once before anything loads
    (no tokenizer: refuse early) and again once the tokenizer is read."""
    from ..data import stream_start
    from ..policies.engine_defaults import run_positions, with_stream_start

    if positions:
        check_positions(positions)
    if tokenizer is not None:
        specs = with_stream_start(list(specs), bool(stream_start(tokenizer)))
    mode = run_positions(list(specs), positions or None)
    check_policies(list(specs), budget, mode)
    return list(specs), mode


def executor_option():
    return typer.Option("local", "--executor", help="local (this process) | ray (Ray workers: "
                        "pip install kvevict[ray])")


def address_option():
    return typer.Option("", "--address", help="--executor ray: the cluster's HOST:PORT or ray://HOST:PORT "
                        "(default: start a local Ray instance for the run)")


def workers_option():
    return typer.Option(2, "--workers", help="--executor ray: Ray workers, each loads the model once")


def retries_option():
    return typer.Option(2, "--retries", help="--executor ray: times a batch whose worker died is run again")


def remote_executor(name: str, address: str, workers: int, retries: int):
    """The executor `--executor` names, checked before any work: None for `local` (everything runs in this
    process, as without the option), else Ray's (a RULER grid's samples or a search's budgets on its workers)."""
    from ..integrations.executor_choice import make_executor

    found = make_executor(name, address or None, workers, retries)
    return None if found.in_process else found
