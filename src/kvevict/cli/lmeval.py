"""`kvevict lm-eval`: lm-evaluation-harness tasks on a model whose KV cache a policy evicts.

It wraps `lm_eval.simple_evaluate` with `--model kvevict` (see `kvevict.integrations.lmeval`); the
model_args are checked before lm-eval or the model is loaded, the tasks and their data
before the model. Datasets and the model resolve offline unless `--allow-download`.
lm-eval is an optional extra, imported inside the command.
"""

from __future__ import annotations

import json

import typer

from .common import one_line_errors, save_json, split_specs
from .tables import show

MODEL_ARGS_HELP = ("pretrained=MODEL,policy=SPEC,budget=N|P%[,positions=original|cache][,protocol=compress|stream]"
                   "[,batch_size=N][,max_gen_toks=N]")


@one_line_errors
def lm_eval(
    tasks: str = typer.Option(..., help="comma-separated lm-eval task names, e.g. copa,piqa,winogrande"),
    model_args: str = typer.Option("pretrained=smollm2-135m,policy=full", help=MODEL_ARGS_HELP),
    num_fewshot: int = typer.Option(None, help="few-shot examples per prompt (lm-eval's --num_fewshot)"),
    limit: int = typer.Option(None, help="at most this many documents per task"),
    include_path: str = typer.Option(None, help="a folder of extra task YAML files (lm-eval's --include_path)"),
    seed: int = typer.Option(0, help="seed of few-shot sampling and everything lm-eval draws"),
    save: str = typer.Option(None, help="write lm-eval's results (JSON) to this file"),
    allow_download: bool = typer.Option(False, "--allow-download",
                                        help="let lm-eval download the tasks' datasets, and the model an HF id "
                                             "names (adds allow_download=true to --model-args); offline otherwise"),
) -> None:
    """Run lm-evaluation-harness tasks with kvevict's eviction (lm_eval --model kvevict)."""
    from ..integrations.lmeval_args import Settings, split_model_args
    from ..report.columns import Table

    if allow_download and "allow_download" not in split_model_args(model_args):
        model_args = f"{model_args},allow_download=true"
    Settings.parse(split_model_args(model_args))  # before lm-eval (seconds to import) or the model loads
    from ..integrations.lmeval import evaluate

    results = evaluate(model_args, split_specs(tasks), num_fewshot, limit, include_path, seed=seed,
                       allow_download=allow_download)
    rows = []
    for task, metrics in results["results"].items():
        for name, value in metrics.items():
            if isinstance(value, float) and "_stderr" not in name:
                stderr = metrics.get(name.replace(",", "_stderr,", 1))
                rows.append([task, name.split(",")[0], f"{value:.4f}",
                             f"{stderr:.4f}" if isinstance(stderr, float) else "-"])
    show(Table(["task", "metric", "value", "stderr"], rows), f"lm-eval, --model kvevict {model_args}")
    save_json(save, json.loads(json.dumps({k: results[k] for k in ("results", "configs", "n-shot") if k in results},
                                          default=str)))
