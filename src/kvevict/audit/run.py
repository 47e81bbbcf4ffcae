"""One audit, start to end: learn the servers, check both sides see the same ids, run the fidelity stream as
deployed (and on a twin for its A/A floor, where one is given), once more with the sinks kept where llama-server
showed a step, judge, write the record.

Everything the user can get wrong is refused before the first workload request (`probe.py`, `StreamPlan.check`).
Every answer is keyed by what its server says it is (`identity.py`): a server restarted at the same URL with
another configuration is recorded apart, none of its old answers replayed, and the folder's last `audit.json`
says which configuration it saw, so the verdict's notes can name what changed.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import KvevictError
from ..files import atomic_write
from ..stats.tolerance import Tolerance
from .client import Client, Endpoint
from .fidelity import end_ids
from .identity import ENGINE_CONTEXT, differences
from .judge import audit_tolerance, rerun_effect, window
from .kv_capacity import Buys, what_it_buys
from .probe import Server, check_model, check_tokenizer, describe
from .records import Records
from .reference import endpoint_reference, local_reference, prompt_logprobs_reference
from .stream import References, Side, StreamPlan, StreamResult, run_stream


@dataclass(frozen=True)
class AuditSpec:
    """What to audit and how. `reference` None: kvevict's own full cache on `model` (on `device`, in `dtype`) is the
    reference. `floor`: a twin (module docstring of `judge.py`) whose own stream gives the A/A floor."""

    deployment: Endpoint
    route: str = "llama"
    served_model: str | None = None
    reference: Endpoint | None = None
    reference_route: str | None = None
    reference_mode: str = "positions"  # or "prompt-logprobs" (vLLM: the whole stream scored in one request)
    floor: Endpoint | None = None
    judge: str = "auto"  # or one of `judge.JUDGES`; auto: the whole stream where the engine declares no eviction
    model: str = "smollm2-135m"
    device: str = "cpu"
    dtype: str | None = None  # the local reference's (None: float32 on cpu, the checkpoint's own on cuda)
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
    floor: StreamResult | None = None  # the twin's own stream, whose whole is the A/A floor
    reference: dict = field(default_factory=dict)  # what the reference was (a server's identity, or the local model)
    servers: dict = field(default_factory=dict)  # role -> URL and identity, as keyed (the next run's `_changed`)
    buys: Buys | None = None  # the KV capacity the deployment declares beside the unquantized cache's

    @property
    def outcome(self) -> str:
        """The audit's verdict: outside if the stream or a task is, inside if every one is, else undecided (a task
        with nothing scored counts as undecided). The rerun is a what-if and never counts."""
        found = [self.deployed.verdict.outcome] if self.deployed else []
        found += [t.judgement.outcome if t.judgement else "undecided" for t in self.tasks]
        if "outside" in found:
            return "outside"
        return "inside" if found and all(o == "inside" for o in found) else "undecided"

    def summary(self) -> dict:
        return {"outcome": self.outcome,
                "server": {"url": self.server.url, "engine": self.server.identity.kind, "n_ctx": self.server.n_ctx,
                           "n_keep": self.server.n_keep, "models": list(self.server.models),
                           "identity": self.server.identity.as_dict()},
                "reference": self.reference, "deployed": self.deployed and self.deployed.summary(),
                "floor": self.floor and self.floor.summary(), "rerun": self.rerun and self.rerun.summary(),
                "effect": self.effect, "notes": self.notes, "tasks": [t.as_dict() for t in self.tasks],
                "requests": self.requests, "servers": self.servers, "buys": self.buys and self.buys.as_dict()}


def prompt_ids(tokenizer, text: str, count: int, offset: int) -> tuple[int, ...]:
    """`count` tokens of `text` from token `offset` on, after what the tokenizer puts first (Gemma's BOS)."""
    from ..data import load_text, stream_start, tokenize

    ids = tokenize(load_text(text), tokenizer).tolist()
    if offset < 0 or offset + count > len(ids):
        raise KvevictError(f"--offset {offset} with --prompt-tokens {count} runs past the {len(ids)} tokens of "
                           f"'{text}'")
    return tuple(stream_start(tokenizer) + ids[offset:offset + count])


class LocalModel:
    """kvevict's full cache on the audit's weights, on `device` in `dtype` (`loading.load_model`), loaded on first
    use (a resumed audit may need no forward)."""

    def __init__(self, name: str, device: str = "cpu", dtype: str | None = None) -> None:
        self.name, self.device, self.dtype, self._model = name, device, dtype, None

    def get(self):
        if self._model is None:
            from ..loading import load_model

            self._model, _ = load_model(self.name, device=self.device, dtype=self.dtype)
        return self._model

    def describe(self) -> dict:
        """What the reference is: the model and, once loaded, the dtype and device its weights are in."""
        if self._model is None:
            return {"kind": "local", "model": self.name, "device": self.device, "dtype": self.dtype}
        from ..loading.dtypes import dtype_name

        weight = next(self._model.parameters())
        return {"kind": "local", "model": self.name, "device": str(weight.device), "dtype": dtype_name(weight.dtype)}


def _never_evicting(client: Client, spec: AuditSpec, tokenizer, route: str, need: int | None, role: str) -> Side:
    """A reference or a twin: the model and tokenizer the deployment's, and a context that holds `need` tokens and
    one more (None: not checked), so it never evicts."""
    server = describe(client)
    check_model(server, spec.served_model)
    check_tokenizer(client, tokenizer, spec.served_model)
    if need is not None and server.n_ctx is not None and server.n_ctx < need + 1:
        raise KvevictError(f"the {role}'s context ({server.n_ctx} tokens) is shorter than the workload's {need}: "
                           f"it would evict too; start it with a context of at least {need + 1} "
                           f"({ENGINE_CONTEXT[server.identity.kind]})")
    return Side(client, route, spec.served_model, server.identity)


def _references(spec: AuditSpec, reference: Side | None, records: Records, local: LocalModel) -> References:
    if reference is None:
        return lambda prompt, gen: local_reference(local.get(), prompt, gen.steps, spec.top_k)
    if spec.reference_mode == "prompt-logprobs":
        return lambda prompt, gen: prompt_logprobs_reference(reference.client, spec.served_model, prompt, gen.steps,
                                                             spec.top_k)
    side = replace(reference, route="llama" if reference.route == "chat" else reference.route)
    return lambda prompt, gen: endpoint_reference(side, prompt, gen.steps, spec.top_k, records.step,
                                                  records.keep_step)


def run_audit(spec: AuditSpec, local: LocalModel | None = None) -> AuditResult:
    """Run the audit `spec` describes; its records and `audit.json` go to `spec.out`. On the chat route only the
    tasks run (chat answers carry no token ids to pair a stream by)."""
    from ..loading import load_tokenizer

    _check_workload(spec)
    local = local or LocalModel(spec.model, spec.device, spec.dtype)
    with ExitStack() as open_clients:
        client = open_clients.enter_context(Client(spec.deployment))
        server = describe(client)
        check_model(server, spec.served_model)
        tokenizer = load_tokenizer(spec.model)
        notes = [] if check_tokenizer(client, tokenizer, spec.served_model) else [
            "the deployment has no /tokenize route: its tokenizer was not checked against the local one"]
        n_ctx = spec.context or server.n_ctx
        if n_ctx is None:
            raise KvevictError("the deployment does not declare its context: give it with --context N (its KV limit)")
        keep = spec.server_keep if server.identity.kind == "llama-server" else None
        sides = {"deployment": Side(client, spec.route, spec.served_model,
                                    server.identity.declared(server_keep=keep, context=spec.context))}
        prompt = () if spec.route == "chat" else prompt_ids(tokenizer, spec.text, spec.prompt_tokens, spec.offset)
        need = len(prompt) + spec.new_tokens if prompt else None
        for role, endpoint, route in (("reference", spec.reference, spec.reference_route or spec.route),
                                      ("twin", spec.floor, spec.route)):
            if endpoint is not None:
                found = open_clients.enter_context(Client(endpoint))
                sides[role] = _never_evicting(found, spec, tokenizer, route, need, role)
        records = Records(spec.out)
        result = AuditResult(server, None, notes=notes)
        if prompt:
            _fidelity(spec, result, sides, records, local, n_ctx, prompt, tokenizer)
        if _has_tasks(spec):
            result.tasks = _tasks(spec, sides["deployment"], sides.get("reference"), tokenizer, records,
                                  audit_tolerance(spec.tolerance), n_ctx)
        if server.identity.kind == "vllm":  # the engine that declares its KV cache (`kv_capacity.py`)
            result.buys = what_it_buys(client, [sides[r].client for r in ("twin", "reference") if r in sides],
                                       spec.model)
        result.requests = {role: side.client.sent for role, side in sides.items()}
        result.servers = {role: {"url": side.client.endpoint.base, **side.identity.as_dict()}
                          for role, side in sides.items()}
        result.reference = result.servers.get("reference") or local.describe()
        result.notes += _changed(spec.out, result.servers)
    atomic_write(spec.out / "audit.json", json.dumps(result.summary(), indent=1))
    return result


def _check_workload(spec: AuditSpec) -> None:
    """Workloads the routes and servers given cannot run, refused before any request."""
    if spec.route == "chat" and not _has_tasks(spec):
        raise KvevictError("--api chat carries no token ids to pair a stream by: audit fidelity with --api llama or "
                           "--api completions, or give chat a workload (--conversations, --tasks)")
    if spec.route == "chat" and spec.floor is not None:
        raise KvevictError("--floor-url gives the fidelity stream's A/A floor, and --api chat runs no stream: audit "
                           "fidelity with --api llama or --api completions, or leave --floor-url out")
    if _has_tasks(spec) and spec.reference is None:
        raise KvevictError("the tasks workload compares answers with a reference server: give --reference-url (the "
                           "same model with a context that never evicts)")


def _judge(spec: AuditSpec, rule: str, server: Server) -> str:
    """What the verdict covers: `spec.judge`, or where it is auto, the whole stream for an engine that declares no
    eviction and the tokens from the first event on for one that does."""
    if spec.judge == "auto":
        return "whole" if rule == "none" else "after-event"
    if spec.judge == "after-event" and rule == "none":
        raise KvevictError(f"--judge after-event needs an eviction event, and {server.engine} declares none: give "
                           "--context N where its KV limit lies, or judge the whole stream (--judge whole)")
    return spec.judge


def _fidelity(spec: AuditSpec, result: AuditResult, sides: dict[str, Side], records: Records, local: LocalModel,
              n_ctx: int, prompt: tuple[int, ...], tokenizer) -> None:
    """The twin's stream for the floor (where one is given), the stream as deployed, then with the sinks kept
    where llama-server showed a step (`result` filled)."""
    from ..data import stream_start

    server, notes, side = result.server, result.notes, sides["deployment"]
    llama = server.identity.kind == "llama-server"
    rule = "context-shift" if llama else "declared-context" if spec.context else "none"
    judge = _judge(spec, rule, server)
    server_keep = spec.server_keep if spec.server_keep is not None else max(0, server.n_keep or 0)
    if llama and judge == "after-event" and spec.server_keep is None and spec.n_keep is None:
        notes.append(f"llama-server's own --keep is not visible from outside (its /props reports the request "
                     f"default): events after the first are placed for keep {server_keep}; give --server-keep")
    plan = StreamPlan(prompt, spec.new_tokens, spec.top_k, n_ctx, spec.n_keep, server_keep,
                      bool(stream_start(tokenizer)), end_ids(tokenizer), rule, judge)
    plan.check()
    references = _references(spec, sides.get("reference"), records, local)
    tol = audit_tolerance(spec.tolerance)
    twin = None
    if "twin" in sides:
        result.floor = run_stream("A/A floor (the twin)", sides["twin"], replace(plan, n_keep=None, rule="none",
                                  judge="whole"), references, records, tol)
        twin = window(result.floor.series, 0, len(result.floor.points))
    result.deployed = deployed = run_stream("as deployed", side, plan, references, records, tol, twin)
    if deployed.verdict.events and deployed.generation.truncated is False:
        notes.append("the server reports truncated=false although its declared context places an eviction event: "
                     "its context is larger than declared, or it evicts without saying")
    if not llama or judge == "whole":
        if deployed.verdict.step and judge == "after-event":
            notes.append(f"{server.engine} takes no per-request n_keep the audit knows of: no rerun with the sinks "
                         "kept")
        return
    rerun_plan = replace(plan, n_keep=spec.sinks)
    if spec.sinks > 0 and rerun_plan.keep > plan.keep:
        if not deployed.verdict.step:
            result.effect = "no-step"
            return
        result.rerun = run_stream(f"n_keep={spec.sinks}", side, rerun_plan, references, records, tol, twin)
        result.effect = rerun_effect(deployed.verdict, result.rerun.verdict)


def _changed(out: Path, servers: dict[str, dict]) -> list[str]:
    """A note for each server whose answers this folder held under another configuration at the same URL (they were
    keyed apart, none replayed), from the servers the folder's last `audit.json` names."""
    try:
        before = json.loads((out / "audit.json").read_text()).get("servers") or {}
    except (OSError, json.JSONDecodeError, AttributeError):
        before = {}
    changed = {role: differences(before[role], found) for role, found in servers.items()
               if isinstance(before.get(role), dict) and before[role].get("url") == found["url"]}
    return [f"the {role} at {servers[role]['url']} is not the server this folder's earlier answers came from "
            f"({'; '.join(found)}): they stay in results.jsonl, keyed apart, and none was replayed"
            for role, found in changed.items() if found]


def _tasks(spec: AuditSpec, side: Side, reference: Side, tokenizer, records: Records, tol: Tolerance,
           n_ctx: int) -> list:
    """The tasks workload (`tasks.py`) against the reference server."""
    from .tasks import MARGIN, conversation_items, generation_items, ruler_items, run_tasks

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
