"""`kvevict audit`: a running server as the system under test, A/B'd against the same model with nothing evicted.

Wires only: parse, build the `AuditSpec`, run it (`kvevict.audit.run`), print the verdict, write the report.
Heavy imports stay inside the command (the CLI starts in under a second).
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from .common import (
    DEVICE_HELP,
    DTYPE_HELP,
    MODEL_HELP,
    err,
    max_accuracy_drop_option,
    max_kl_option,
    max_ppl_ratio_option,
    one_line_errors,
    tolerance_from,
)

API_HELP = ("how to speak to it: llama (llama-server's /completion: token ids, n_probs, n_keep), completions "
            "(/v1/completions), chat (/v1/chat/completions)")
#: --fail-on -> the verdicts that make the command exit `FAIL_EXIT`
FAIL_ON = {"never": (), "outside": ("outside",), "undecided": ("outside", "undecided")}
#: the exit status of an audit whose verdict `--fail-on` names (2 is bad input, 1 a crash)
FAIL_EXIT = 3
KEY_HELP = "the environment variable holding {whose} API key (sent as a bearer token to that server alone, never " \
           "written anywhere)"


#: each option's help, by parameter name: the command's signature then reads as its options and defaults
HELP = {
    "url": "the deployment's base URL, e.g. http://127.0.0.1:8080",
    "api": API_HELP,
    "served_model": "the model name the server serves (checked against its /v1/models; sent with /v1 requests)",
    "reference_url": "a second server with the same model and a context that never evicts (default: kvevict's own "
                     "full cache on --model)",
    "reference_api": "the reference's route (default: --api)",
    "reference_mode": "how the reference server scores the stream: positions (one request per generated token) or "
                      "prompt-logprobs (vLLM: one request)",
    "model": f"the weights the server serves, for the tokenizer check and the local reference: {MODEL_HELP}",
    "text": "embedded name, .txt file or folder: where the prompt comes from",
    "prompt_tokens": "prompt length in tokens",
    "new_tokens": "tokens the deployment generates (well past its KV limit)",
    "top_k": "top log-probabilities read per token (the KL's resolution)",
    "offset": "the prompt's first token in the text (another offset: another prompt)",
    "n_keep": "n_keep sent with the deployment's requests (default: the server's own --keep)",
    "sinks": "n_keep of the rerun with the sinks kept (llama-server; 0: no rerun)",
    "context": "the deployment's KV limit in tokens, where the server does not declare it (llama-server does, in "
               "/props)",
    "server_keep": "the deployment's own --keep (llama-server does not report it; it places the events after the "
                   "first)",
    "concurrency": "requests in flight at most, per server",
    "timeout": "seconds a request may take",
    "retries": "retries on 429, 503 or a dropped connection, with exponential backoff",
    "api_key_env": KEY_HELP.format(whose="the deployment's"),
    "reference_api_key_env": KEY_HELP.format(whose="the reference server's"),
    "floor_url": "a twin whose own stream gives the A/A floor: the same engine with nothing lossy (its KV "
                 "unquantized), or a second copy of the reference; a context that never evicts",
    "floor_api_key_env": KEY_HELP.format(whose="the twin's"),
    "allow_plain_http_key": "send a key over plain http:// to a host beyond loopback (off: refused; use https://)",
    "judge": "what the verdict covers: after-event (the tokens from the first eviction event on, those before it the "
             "A/A floor), whole (every token: a loss with no eviction point, e.g. a quantized KV cache), auto (whole "
             "where the server declares no eviction)",
    "fail_on": f"exit {FAIL_EXIT} when the audit's verdict is outside (outside), or outside or undecided "
               "(undecided); never: exit 0 whatever the verdict",
    "device": f"the local reference's device: {DEVICE_HELP}",
    "dtype": f"the local reference's dtype: {DTYPE_HELP}",
    "out": "folder for the records (results.jsonl), audit.json and report.html",
    "tasks": "RULER tasks sent to both servers, e.g. niah_single_1,vt (needs --reference-url)",
    "qa": "a QA .jsonl file of {context, question, answers} sent to both",
    "samples": "prompts per task",
    "generation_trials": "prompts of the generation failure modes (a fact stated first, asked last; repeated "
                         "n-grams)",
    "conversations": "conversations (a system rule and facts early, filler turns, questions late) sent as chat "
                     "turns (--api chat) or rendered with the chat template",
    "task_length": "task prompt + answer tokens (default: the deployment's context filled, so the answer crosses "
                   "its eviction point)",
    "reproduce": "also stream the deployment's tokens through a kvevict spec and set its fidelity beside the "
                 "audit's: llamacpp (llama-server's shift, its keep and BOS the deployment's), vllmfp8+full (vLLM's "
                 "fp8 KV), fp8+full, any spec",
    "as_json": "print one JSON object as the last line",
}


@one_line_errors
def audit(
    url: str = typer.Argument(..., help=HELP["url"]),
    api: str = typer.Option("llama", help=HELP["api"]),
    served_model: str | None = typer.Option(None, help=HELP["served_model"]),
    reference_url: str | None = typer.Option(None, help=HELP["reference_url"]),
    reference_api: str | None = typer.Option(None, help=HELP["reference_api"]),
    reference_mode: str = typer.Option("positions", help=HELP["reference_mode"]),
    model: str = typer.Option("smollm2-135m", help=HELP["model"]),
    text: str = typer.Option("pg-essays", help=HELP["text"]),
    prompt_tokens: int = typer.Option(32, help=HELP["prompt_tokens"]),
    new_tokens: int = typer.Option(736, help=HELP["new_tokens"]),
    top_k: int = typer.Option(20, help=HELP["top_k"]),
    offset: int = typer.Option(0, help=HELP["offset"]),
    n_keep: int | None = typer.Option(None, help=HELP["n_keep"]),
    sinks: int = typer.Option(4, help=HELP["sinks"]),
    context: int | None = typer.Option(None, help=HELP["context"]),
    server_keep: int | None = typer.Option(None, help=HELP["server_keep"]),
    concurrency: int = typer.Option(4, help=HELP["concurrency"]),
    timeout: float = typer.Option(120.0, help=HELP["timeout"]),
    retries: int = typer.Option(4, help=HELP["retries"]),
    api_key_env: str | None = typer.Option(None, help=HELP["api_key_env"]),
    reference_api_key_env: str | None = typer.Option(None, help=HELP["reference_api_key_env"]),
    floor_url: str | None = typer.Option(None, help=HELP["floor_url"]),
    floor_api_key_env: str | None = typer.Option(None, help=HELP["floor_api_key_env"]),
    allow_plain_http_key: bool = typer.Option(False, "--allow-plain-http-key", help=HELP["allow_plain_http_key"]),
    judge: str = typer.Option("auto", help=HELP["judge"]),
    fail_on: str = typer.Option("never", help=HELP["fail_on"]),
    device: str = typer.Option("cpu", help=HELP["device"]),
    dtype: str | None = typer.Option(None, help=HELP["dtype"]),
    out: str = typer.Option("runs/audit", help=HELP["out"]),
    max_ppl_ratio: float | None = max_ppl_ratio_option(),
    max_kl: float | None = max_kl_option(),
    tasks: str = typer.Option("", help=HELP["tasks"]),
    qa: str | None = typer.Option(None, help=HELP["qa"]),
    samples: int = typer.Option(10, help=HELP["samples"]),
    generation_trials: int = typer.Option(0, help=HELP["generation_trials"]),
    conversations: int = typer.Option(0, help=HELP["conversations"]),
    task_length: int | None = typer.Option(None, help=HELP["task_length"]),
    max_accuracy_drop: float | None = max_accuracy_drop_option(),
    reproduce: str | None = typer.Option(None, "--reproduce", metavar="SPEC", help=HELP["reproduce"]),
    as_json: bool = typer.Option(False, "--json", help=HELP["as_json"]),
) -> None:
    """Audit a running server: its fidelity along a long generation against the reference, the eviction events,
    the sink-loss signature, a rerun with the sinks kept; judged by the verdict's rule (docs/audit.md). Exits 0
    whatever the verdict unless --fail-on names it (then 3); bad input exits 2."""
    settings = {"timeout": timeout, "retries": retries, "concurrency": concurrency,
                "allow_plain_http_key": allow_plain_http_key}
    keys = {"--api-key-env": api_key_env, "--reference-api-key-env": reference_api_key_env,
            "--floor-api-key-env": floor_api_key_env}
    spec = _spec((url, reference_url, floor_url), keys, settings, (max_ppl_ratio, max_accuracy_drop, max_kl), tasks,
                 route=api, served_model=served_model, reference_route=reference_api, reference_mode=reference_mode,
                 judge=judge, model=model, device=device, dtype=dtype, text=text, prompt_tokens=prompt_tokens,
                 new_tokens=new_tokens, top_k=top_k, offset=offset, n_keep=n_keep, sinks=sinks, context=context,
                 server_keep=server_keep, out=Path(out), qa=qa, samples=samples, generation_trials=generation_trials,
                 task_length=task_length, conversations=conversations)
    _check_fail_on(fail_on)
    _run(spec, reproduce, as_json, fail_on)


def _spec(urls: tuple[str, str | None, str | None], keys: dict, settings: dict, tolerance: tuple, tasks: str, *,
          route: str, reference_route: str | None, reference_mode: str, judge: str, device: str, dtype: str | None,
          prompt_tokens: int, new_tokens: int, top_k: int, **fields):
    """The `AuditSpec` the options describe, every one checked before the first request goes out (`_check`).
    `urls`: the deployment's, the reference's and the twin's (None: not given); `keys`: each server's key option
    and the variable it names; `settings`: how every endpoint is spoken to; `tolerance`: `tolerance_from`'s three
    limits; `fields`: the spec's fields that the options give as they are."""
    from ..audit.client import Endpoint
    from ..audit.run import AuditSpec
    from ..eval.ruler.registry import parse_tasks
    from .common import check_device, check_dtype

    _check(route, reference_route, reference_mode, judge, prompt_tokens, new_tokens, top_k)
    deployment, reference, floor = (
        Endpoint(url, api_key_env=keys[option], key_option=option, **settings) if url else None
        for url, option in zip(urls, keys, strict=True))
    return AuditSpec(
        deployment=deployment, route=route, reference=reference, reference_route=reference_route,
        reference_mode=reference_mode, floor=floor, judge=judge, device=check_device(device), dtype=check_dtype(dtype),
        prompt_tokens=prompt_tokens, new_tokens=new_tokens, top_k=top_k, tolerance=tolerance_from(*tolerance),
        tasks=tuple(parse_tasks(tasks)) if tasks else (), **fields,
    )


def _check(route: str, reference_route: str | None, reference_mode: str, judge: str, prompt_tokens: int,
           new_tokens: int, top_k: int) -> None:
    """Routes, a reference mode and a judge the audit knows, and lengths of at least 1: each refused in one line
    naming its option before any request."""
    from ..audit.api import ROUTES
    from ..audit.judge import JUDGES
    from ..errors import KvevictError

    for name, value in (("--api", route), ("--reference-api", reference_route or route)):
        if value not in ROUTES:
            raise KvevictError(f"{name} must be one of {', '.join(ROUTES)}, got '{value}'")
    if reference_mode not in ("positions", "prompt-logprobs"):
        raise KvevictError(f"--reference-mode must be positions or prompt-logprobs, got '{reference_mode}'")
    if judge not in ("auto", *JUDGES):
        raise KvevictError(f"--judge must be one of auto, {', '.join(JUDGES)}, got '{judge}'")
    for name, value in (("--prompt-tokens", prompt_tokens), ("--new-tokens", new_tokens), ("--top-k", top_k)):
        if value < 1:
            raise KvevictError(f"{name} must be at least 1, got {value}")


def _check_fail_on(fail_on: str) -> None:
    from ..errors import KvevictError

    if fail_on not in FAIL_ON:
        raise KvevictError(f"--fail-on must be one of {', '.join(FAIL_ON)}, got '{fail_on}': outside exits "
                           f"{FAIL_EXIT} on an outside verdict, undecided on an outside or undecided one")


def _run(spec, reproduce: str | None, as_json: bool, fail_on: str) -> None:
    from ..audit.report import write_report
    from ..audit.run import LocalModel, run_audit
    from ..audit.text import lines

    local = LocalModel(spec.model, spec.device, spec.dtype)
    if reproduce is not None:  # a spec that cannot run is refused before any request
        from ..audit.reproduction import check_spec

        check_spec(reproduce, spec.context)
    result = run_audit(spec, local)
    found = result.summary()
    if reproduce:
        from ..audit.reproduction import reproduce as run_reproduction

        reproduced = [run_reproduction(local.get(), r, reproduce) for r in (result.deployed, result.rerun) if r]
        found["reproduction"] = [r.as_dict() for r in reproduced] or None
    page = write_report(result, spec.out / "report.html", found.get("reproduction"))
    for line in lines(result) + [r.line() for r in (reproduced if reproduce else [])]:
        print(line)
    print(f"report: {page}")
    if as_json:
        print(json.dumps(found))
    if result.outcome in FAIL_ON[fail_on]:
        err.print(f"verdict: {result.outcome}; --fail-on {fail_on}: exit {FAIL_EXIT}", markup=False, highlight=False)
        raise typer.Exit(FAIL_EXIT)
