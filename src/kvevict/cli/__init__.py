"""The `kvevict` command. It only wires: parse, validate, call the library, print.

* `common` — the stderr console, `one_line_errors` (a `KvevictError` becomes one line
  on stderr and exit code 2), option parsing;
* `tables` — result tables that fit the terminal without cutting a number;
* `stream` — `ppl`, `compare`; `ab` — `ab`, `report`, `demo`; `tasks` — `needle`,
  `generation`, `sinks`; `lmeval` — `lm-eval` (lm-evaluation-harness tasks); `ruler` — `ruler` (RULER's
  long-context tasks); `engine` — `engine-check` (the `llamacpp` preset against llama.cpp itself); `envelope` —
  `envelope` (the smallest budget within a tolerance, and its capacity); `audit` — `audit` (a running server
  against the same model with nothing evicted).

The commands are plain functions; `COMMANDS` registers them on `app`, in the order
`kvevict --help` lists them.
"""

from __future__ import annotations

import os

import typer

from . import ab, audit, engine, envelope, lmeval, ruler, stream, tasks

COMMANDS = [stream.ppl, stream.compare, ab.ab, ab.report, ab.demo, tasks.needle, tasks.generation, tasks.sinks,
            lmeval.lm_eval, ruler.ruler, engine.engine_check, envelope.envelope,
            audit.audit]

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="KV-cache eviction policies: measure before you ship."
)
for _command in COMMANDS:
    app.command()(_command)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `kvevict` script.

    Config warnings are not the user's business here: transformers reads its verbosity from the environment
    when a command first imports it, so `--help` never imports transformers (or torch) at all."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    app(args=argv, standalone_mode=True)


__all__ = ["COMMANDS", "app", "main"]
