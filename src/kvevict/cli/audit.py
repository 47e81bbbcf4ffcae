"""`kvevict audit`: a running server as the system under test, A/B'd against the same model with nothing evicted.

Wires only: parse, build the `AuditSpec`, run it (`kvevict.audit.run`), print the verdict, write the report.
Heavy imports stay inside the command (the CLI starts in under a second).
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from .common import (
    MODEL_HELP,
    max_accuracy_drop_option,
    max_kl_option,
    max_ppl_ratio_option,
    one_line_errors,
    tolerance_from,
)

API_HELP = ("how to speak to it: llama (llama-server's /completion: token ids, n_probs, n_keep), completions "
            "(/v1/completions), chat (/v1/chat/completions)")


@one_line_errors
def audit(
    url: str = typer.Argument(..., help="the deployment's base URL, e.g. http://127.0.0.1:8080"),
    api: str = typer.Option("llama", help=API_HELP),
    served_model: str | None = typer.Option(None, help="the model name the server serves (checked against its "
                                            "/v1/models; sent with /v1 requests)"),
    reference_url: str | None = typer.Option(None, help="a second server with the same model and a context that "
                                             "never evicts (default: kvevict's own full cache on --model)"),
    reference_api: str | None = typer.Option(None, help="the reference's route (default: --api)"),
    reference_mode: str = typer.Option("positions", help="how the reference server scores the stream: positions "
                                       "(one request per generated token) or prompt-logprobs (vLLM: one request)"),
    model: str = typer.Option("smollm2-135m", help=f"the weights the server serves, for the tokenizer check and the "
                              f"local reference: {MODEL_HELP}"),
    text: str = typer.Option("pg-essays", help="embedded name, .txt file or folder: where the prompt comes from"),
    prompt_tokens: int = typer.Option(32, help="prompt length in tokens"),
    new_tokens: int = typer.Option(736, help="tokens the deployment generates (well past its KV limit)"),
    top_k: int = typer.Option(20, help="top log-probabilities read per token (the KL's resolution)"),
    offset: int = typer.Option(0, help="the prompt's first token in the text (another offset: another prompt)"),
    n_keep: int | None = typer.Option(None, help="n_keep sent with the deployment's requests (default: the "
                                      "server's own --keep)"),
    sinks: int = typer.Option(4, help="n_keep of the rerun with the sinks kept (llama-server; 0: no rerun)"),
    context: int | None = typer.Option(None, help="the deployment's KV limit in tokens, where the server does not "
                                       "declare it (llama-server does, in /props)"),
    server_keep: int | None = typer.Option(None, help="the deployment's own --keep (llama-server does not report "
                                           "it; it places the events after the first)"),
    concurrency: int = typer.Option(4, help="requests in flight at most, per server"),
    timeout: float = typer.Option(120.0, help="seconds a request may take"),
    retries: int = typer.Option(4, help="retries on 429, 503 or a dropped connection, with exponential backoff"),
    api_key_env: str | None = typer.Option(None, help="the environment variable holding the API key (sent as a "
                                           "bearer token, never written anywhere)"),
    out: str = typer.Option("runs/audit", help="folder for the records (results.jsonl), audit.json and report.html"),
    max_ppl_ratio: float | None = max_ppl_ratio_option(),
    max_kl: float | None = max_kl_option(),
    tasks: str = typer.Option("", help="RULER tasks sent to both servers, e.g. niah_single_1,vt (needs "
                              "--reference-url)"),
    qa: str | None = typer.Option(None, help="a QA .jsonl file of {context, question, answers} sent to both"),
    samples: int = typer.Option(10, help="prompts per task"),
    generation_trials: int = typer.Option(0, help="prompts of the generation failure modes (a fact stated first, "
                                          "asked last; repeated n-grams)"),
    conversations: int = typer.Option(0, help="conversations (a system rule and facts early, filler turns, "
                                      "questions late) sent as chat turns (--api chat) or rendered with the chat "
                                      "template"),
    task_length: int | None = typer.Option(None, help="task prompt + answer tokens (default: the deployment's "
                                           "context filled, so the answer crosses its eviction point)"),
    max_accuracy_drop: float | None = max_accuracy_drop_option(),
    reproduce: bool = typer.Option(False, "--reproduce", help="also stream the deployment's tokens through kvevict's "
                                   "llamacpp preset and set its fidelity beside the audit's"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object as the last line"),
) -> None:
    """Audit a running server: its fidelity along a long generation against the reference, the eviction events,
    the sink-loss signature, a rerun with the sinks kept; judged by the verdict's rule (docs/audit.md)."""
    settings = {"api_key_env": api_key_env, "timeout": timeout, "retries": retries, "concurrency": concurrency}
    spec = _spec(url, reference_url, settings, (max_ppl_ratio, max_accuracy_drop, max_kl), tasks, route=api,
                 served_model=served_model, reference_route=reference_api, reference_mode=reference_mode, model=model,
                 text=text, prompt_tokens=prompt_tokens, new_tokens=new_tokens, top_k=top_k, offset=offset,
                 n_keep=n_keep, sinks=sinks, context=context, server_keep=server_keep, out=Path(out), qa=qa,
                 samples=samples, generation_trials=generation_trials, task_length=task_length,
                 conversations=conversations)
    _run(spec, reproduce, as_json)


def _spec(url: str, reference_url: str | None, settings: dict, tolerance: tuple, tasks: str, *, route: str,
          reference_route: str | None, reference_mode: str, prompt_tokens: int, new_tokens: int, top_k: int,
          **fields):
    """The `AuditSpec` the options describe, every one checked before the first request goes out (`_check`).
    `settings`: how both endpoints are spoken to; `tolerance`: `tolerance_from`'s three limits; `fields`: the
    spec's fields that the options give as they are."""
    from ..audit.client import Endpoint
    from ..audit.run import AuditSpec
    from ..eval.ruler.registry import parse_tasks

    _check(route, reference_route, reference_mode, prompt_tokens, new_tokens, top_k)
    return AuditSpec(
        deployment=Endpoint(url, **settings), route=route,
        reference=Endpoint(reference_url, **settings) if reference_url else None, reference_route=reference_route,
        reference_mode=reference_mode, prompt_tokens=prompt_tokens, new_tokens=new_tokens, top_k=top_k,
        tolerance=tolerance_from(*tolerance), tasks=tuple(parse_tasks(tasks)) if tasks else (), **fields,
    )


def _check(route: str, reference_route: str | None, reference_mode: str, prompt_tokens: int, new_tokens: int,
           top_k: int) -> None:
    """Routes and a reference mode the client speaks, and lengths of at least 1: each refused in one line naming
    its option before any request."""
    from ..audit.api import ROUTES
    from ..errors import KvevictError

    for name, value in (("--api", route), ("--reference-api", reference_route or route)):
        if value not in ROUTES:
            raise KvevictError(f"{name} must be one of {', '.join(ROUTES)}, got '{value}'")
    if reference_mode not in ("positions", "prompt-logprobs"):
        raise KvevictError(f"--reference-mode must be positions or prompt-logprobs, got '{reference_mode}'")
    for name, value in (("--prompt-tokens", prompt_tokens), ("--new-tokens", new_tokens), ("--top-k", top_k)):
        if value < 1:
            raise KvevictError(f"{name} must be at least 1, got {value}")


def _run(spec, reproduce: bool, as_json: bool) -> None:
    from ..audit.report import write_report
    from ..audit.run import LocalModel, run_audit
    from ..audit.text import lines

    local = LocalModel(spec.model)
    result = run_audit(spec, local)
    found = result.summary()
    if reproduce:
        from ..audit.reproduction import reproduce as run_reproduction

        found["reproduction"] = [run_reproduction(local.get(), r).as_dict()
                                 for r in (result.deployed, result.rerun) if r is not None] or None
    page = write_report(result, spec.out / "report.html", found.get("reproduction"))
    for line in lines(result):
        print(line)
    print(f"report: {page}")
    if as_json:
        print(json.dumps(found))
