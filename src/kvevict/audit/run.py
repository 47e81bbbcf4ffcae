"""One audit, start to end: learn the servers, check both sides see the same ids, run the fidelity stream as
deployed and once more with the sinks kept where the server takes `n_keep`, judge, write the record.

Everything the user can get wrong is refused before the first workload request (`probe.py`, `StreamPlan.check`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import KvevictError
from ..files import atomic_write
from ..stats.tolerance import Tolerance
from .client import Client, Endpoint
from .fidelity import end_ids
from .judge import audit_tolerance, rerun_effect
from .probe import Server, check_model, check_tokenizer, describe
from .records import Records
from .reference import endpoint_reference, local_reference, prompt_logprobs_reference
from .stream import References, Side, StreamPlan, StreamResult, run_stream


@dataclass(frozen=True)
class AuditSpec:
    """What to audit and how. `reference_url` None: kvevict's own full cache on `model` is the reference."""

    deployment: Endpoint
    route: str = "llama"
    served_model: str | None = None
    reference: Endpoint | None = None
    reference_route: str | None = None
    reference_mode: str = "positions"  # or "prompt-logprobs" (vLLM: the whole stream scored in one request)
    model: str = "smollm2-135m"
    text: str = "pg-essays"
    prompt_tokens: int = 32
    new_tokens: int = 736
    top_k: int = 20
    offset: int = 0
    n_keep: int | None = None
    sinks: int = 4
    context: int | None = None
    server_keep: int | None = None  # the deployment's own --keep where it does not tell (None: what /props says)
    out: Path = Path("runs/audit")
    tolerance: Tolerance = field(default_factory=Tolerance)
    tasks: tuple[str, ...] = ()  # RULER task names
    qa: str | None = None  # the user's QA file
    samples: int = 10  # prompts per task
    generation_trials: int = 0  # the generation failure modes' prompts
    task_length: int | None = None  # prompt + answer tokens (None: the deployment's context filled, `tasks.MARGIN`)
    conversations: int = 0  # `eval/conversation`'s conversations, each probe a prompt
    conversation_turns: int = 12


@dataclass
class AuditResult:
    server: Server
    deployed: StreamResult | None  # None: no fidelity stream (the chat route)
    rerun: StreamResult | None = None
    effect: str | None = None
    notes: list[str] = field(default_factory=list)
    tasks: list = field(default_factory=list)  # `tasks.TaskRow`s
    requests: dict = field(default_factory=dict)  # requests sent per server (retries counted), this run alone

    def summary(self) -> dict:
        return {"server": {"url": self.server.url, "n_ctx": self.server.n_ctx, "n_keep": self.server.n_keep,
                           "models": list(self.server.models)},
                "deployed": self.deployed and self.deployed.summary(), "rerun": self.rerun and self.rerun.summary(),
                "effect": self.effect, "notes": self.notes, "tasks": [t.as_dict() for t in self.tasks],
                "requests": self.requests}


def prompt_ids(tokenizer, text: str, count: int, offset: int) -> tuple[int, ...]:
    """`count` tokens of `text` from token `offset` on, after what the tokenizer puts first (Gemma's BOS)."""
    from ..data import load_text, stream_start, tokenize

    ids = tokenize(load_text(text), tokenizer).tolist()
    if offset < 0 or offset + count > len(ids):
        raise KvevictError(f"--offset {offset} with --prompt-tokens {count} runs past the {len(ids)} tokens of "
                           f"'{text}'")
    return tuple(stream_start(tokenizer) + ids[offset:offset + count])


class LocalModel:
    """kvevict's full cache on the audit's weights, loaded on first use (a resumed audit may need no forward)."""

    def __init__(self, name: str) -> None:
        self.name, self._model = name, None

    def get(self):
        if self._model is None:
            from ..loading import load_model

            self._model, _ = load_model(self.name)
        return self._model


def _references(spec: AuditSpec, client: Client | None, tokenizer, records: Records, local: LocalModel,
                need: int) -> References:
    if client is None:
        return lambda prompt, gen: local_reference(local.get(), prompt, gen.steps, spec.top_k)
    server = describe(client)
    check_model(server, spec.served_model)
    check_tokenizer(client, tokenizer, spec.served_model)
    if server.n_ctx is not None and server.n_ctx < need + 1:
        raise KvevictError(f"the reference's context ({server.n_ctx} tokens) is shorter than the workload's {need}: "
                           "it would evict too; start it with a context of at least "
                           f"{need + 1} (llama-server --ctx-size)")
    route = spec.reference_route or spec.route
    side = Side(client, "llama" if route == "chat" else route, spec.served_model)
    if spec.reference_mode == "prompt-logprobs":
        return lambda prompt, gen: prompt_logprobs_reference(client, spec.served_model, prompt, gen.steps, spec.top_k)
    return lambda prompt, gen: endpoint_reference(side.client, side.route, side.model, prompt, gen.steps, spec.top_k,
                                                  records.step, records.keep_step)


def run_audit(spec: AuditSpec, local: LocalModel | None = None) -> AuditResult:
    """Run the audit `spec` describes; its records and `audit.json` go to `spec.out`. On the chat route only the
    tasks run (chat answers carry no token ids to pair a stream by)."""
    from ..loading import load_tokenizer

    if spec.route == "chat" and not _has_tasks(spec):
        raise KvevictError("--api chat carries no token ids to pair a stream by: audit fidelity with --api llama or "
                           "--api completions, or give chat a workload (--conversations, --tasks)")
    if _has_tasks(spec) and spec.reference is None:
        raise KvevictError("the tasks workload compares answers with a reference server: give --reference-url (the "
                           "same model with a context that never evicts)")
    client = Client(spec.deployment)
    server = describe(client)
    check_model(server, spec.served_model)
    tokenizer = load_tokenizer(spec.model)
    notes = [] if check_tokenizer(client, tokenizer, spec.served_model) else [
        "the deployment has no /tokenize route: its tokenizer was not checked against the local one"]
    n_ctx = spec.context or server.n_ctx
    if n_ctx is None:
        raise KvevictError("the deployment does not declare its context: give it with --context N (its KV limit)")
    records = Records(spec.out)
    ref_client = Client(spec.reference) if spec.reference else None
    side = Side(client, spec.route, spec.served_model)
    result = AuditResult(server, None, notes=notes)
    if spec.route != "chat":
        _fidelity(spec, result, side, ref_client, tokenizer, records, local or LocalModel(spec.model), n_ctx)
    if _has_tasks(spec):
        result.tasks = _tasks(spec, side, ref_client, tokenizer, records, audit_tolerance(spec.tolerance), n_ctx)
    result.requests = {"deployment": client.sent, "reference": ref_client.sent if ref_client else 0}
    atomic_write(spec.out / "audit.json", json.dumps(result.summary(), indent=1))
    return result


def _fidelity(spec: AuditSpec, result: AuditResult, side: Side, ref_client: Client | None, tokenizer,
              records: Records, local: LocalModel, n_ctx: int) -> None:
    """The fidelity stream as deployed, then with the sinks kept where the server takes n_keep (`result` filled)."""
    from ..data import stream_start

    server, notes = result.server, result.notes
    prompt = prompt_ids(tokenizer, spec.text, spec.prompt_tokens, spec.offset)
    server_keep = spec.server_keep if spec.server_keep is not None else max(0, server.n_keep or 0)
    if spec.server_keep is None and spec.n_keep is None:
        notes.append(f"the deployment's own --keep is not visible from outside (llama-server's /props reports the "
                     f"request default): events after the first are placed for keep {server_keep}; give --server-keep")
    plan = StreamPlan(prompt, spec.new_tokens, spec.top_k, n_ctx, spec.n_keep, server_keep,
                      bool(stream_start(tokenizer)), end_ids(tokenizer))
    plan.check()
    references = _references(spec, ref_client, tokenizer, records, local, len(prompt) + spec.new_tokens)
    tol = audit_tolerance(spec.tolerance)
    result.deployed = deployed = run_stream("as deployed", side, plan, references, records, tol)
    if deployed.verdict.events and deployed.generation.truncated is False:
        notes.append("the server reports truncated=false although its declared context places an eviction event: "
                     "its context is larger than declared, or it evicts without saying")
    rerun_plan = replace(plan, n_keep=spec.sinks)
    if server.native and spec.sinks > 0 and rerun_plan.keep > plan.keep:
        result.rerun = run_stream(f"n_keep={spec.sinks}", side, rerun_plan, references, records, tol)
        result.effect = rerun_effect(deployed.verdict, result.rerun.verdict)
    elif not server.native:
        notes.append("the server takes no per-request n_keep the audit knows of: no rerun with the sinks kept")


def _tasks(spec: AuditSpec, side: Side, ref_client: Client | None, tokenizer, records: Records, tol: Tolerance,
           n_ctx: int) -> list:
    """The tasks workload (`tasks.py`) against the reference server."""
    from .tasks import MARGIN, conversation_items, generation_items, ruler_items, run_tasks

    reference = Side(ref_client, spec.reference_route or spec.route, spec.served_model)
    items = []
    if spec.tasks or spec.qa:
        from ..eval.ruler.registry import get_task

        answer = max([get_task(t).tokens_to_generate for t in spec.tasks] or [32])
        length = spec.task_length or n_ctx - MARGIN + answer
        items += ruler_items(tokenizer, spec.tasks, length, spec.samples, text=spec.text, qa=spec.qa)
    if spec.generation_trials:
        items += generation_items(tokenizer, spec.task_length or n_ctx - MARGIN, spec.generation_trials,
                                  text=spec.text)
    if spec.conversations:
        items += conversation_items(tokenizer, spec.conversations, spec.route == "chat",
                                    turns=spec.conversation_turns)
    return run_tasks(side, reference, items, records, tokenizer, tol)


def _has_tasks(spec: AuditSpec) -> bool:
    return bool(spec.tasks or spec.qa or spec.generation_trials or spec.conversations)
