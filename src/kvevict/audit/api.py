"""The three routes the audit speaks, and what it reads back: one greedy generation with its top-k log-probabilities.

* `llama`: llama-server's native `/completion`: the prompt as token ids, `n_probs` top log-probabilities
  of every generated token (softmax of the raw logits before any sampler, `post_sampling_probs` off),
  `n_keep` per request, and `truncated` (true once the slot shifted its context or cut the prompt).
* `completions`: the OpenAI-compatible `/v1/completions` (vLLM, SGLang, trtllm-serve, llama-server's `/v1`):
  the prompt as token ids, `logprobs: k`. Token ids are read from llama-server's `id` fields, or from
  vLLM's `token_id:N` strings (`return_tokens_as_token_ids`, which the request asks for).
* `chat`: `/v1/chat/completions` with `logprobs` and `top_logprobs`: messages in, text out (the tasks and the
  conversation; its prompt ids are the server's own template, so it carries no fidelity stream).

Every request is greedy (temperature 0) and ignores the end-of-sequence token where the server takes
`ignore_eos`, so a stream runs the length it was asked for.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import KvevictError
from .client import Client

ROUTES = ("llama", "completions", "chat")
PATHS = {"llama": "/completion", "completions": "/v1/completions", "chat": "/v1/chat/completions"}
_TOKEN_ID = re.compile(r"^token_id:(\d+)$")


@dataclass(frozen=True)
class Step:
    """One generated token: the deployment's choice and its top-k, most likely first (natural logs)."""

    token: int
    logprob: float
    ids: tuple[int, ...]
    logprobs: tuple[float, ...]


@dataclass(frozen=True)
class Generation:
    """What one request returned. `truncated`: the server said it shifted or cut the context (None: it does not
    say); `prompt_tokens`: the prompt tokens it evaluated (None: not reported)."""

    text: str
    steps: tuple[Step, ...]
    truncated: bool | None
    prompt_tokens: int | None

    @property
    def tokens(self) -> list[int]:
        return [s.token for s in self.steps]


@dataclass(frozen=True)
class Ask:
    """One request: a prompt as ids (`llama`, `completions`) or chat messages (`chat`), `n_predict` tokens, the top
    `k` log-probabilities (0: none asked), `n_keep` (None: the server's own; llama-server only)."""

    n_predict: int
    k: int = 0
    ids: tuple[int, ...] = ()
    messages: tuple[dict, ...] = ()
    n_keep: int | None = None
    cache_prompt: bool = False


def body(route: str, ask: Ask, model: str | None) -> dict:
    """The JSON body of `ask` on `route`."""
    if route == "llama":
        found = {"prompt": list(ask.ids), "n_predict": ask.n_predict, "temperature": 0.0, "ignore_eos": True,
                 "cache_prompt": ask.cache_prompt, "return_tokens": True}
        if ask.k:
            found["n_probs"] = ask.k
        if ask.n_keep is not None:
            found["n_keep"] = ask.n_keep
        return found
    # cache_prompt is llama-server's (a reused prefix would change the arithmetic of the first token); others ignore it
    found = {"max_tokens": ask.n_predict, "temperature": 0.0, "ignore_eos": True, "cache_prompt": ask.cache_prompt}
    if model:
        found["model"] = model
    if ask.n_keep is not None:
        found["n_keep"] = ask.n_keep  # llama-server's /v1 routes pass it through; others ignore it
    if route == "completions":
        found.update(prompt=list(ask.ids), return_tokens_as_token_ids=True)
        if ask.k:
            found["logprobs"] = ask.k
        return found
    found["messages"] = list(ask.messages)
    if ask.k:
        found.update(logprobs=True, top_logprobs=ask.k)
    return found


def generate(client: Client, route: str, ask: Ask, model: str | None = None) -> Generation:
    """Send `ask` and read back its tokens and log-probabilities (refused in one line where the server gave none
    while some were asked)."""
    answer = client.post(PATHS[route], body(route, ask, model))
    if route == "llama":
        entries = answer.get("completion_probabilities")
        text, truncated, prompt = answer.get("content", ""), answer.get("truncated"), answer.get("tokens_evaluated")
        tokens = answer.get("tokens")
    else:
        choice = (answer.get("choices") or [{}])[0]
        logprobs = choice.get("logprobs") or {}
        entries = logprobs.get("content") if isinstance(logprobs, dict) and "content" in logprobs else logprobs
        text = choice.get("text") if route == "completions" else (choice.get("message") or {}).get("content", "")
        truncated, prompt, tokens = answer.get("truncated"), (answer.get("usage") or {}).get("prompt_tokens"), None
    if not ask.k:
        return Generation(text or "", (), truncated, prompt)
    if not entries:
        raise KvevictError(f"{client.endpoint.base}{PATHS[route]} returned no log-probabilities: the audit needs a "
                           "server that gives top-k log-probabilities (vLLM: --max-logprobs; llama-server: n_probs)")
    steps = _steps(entries, ask.k) if isinstance(entries, list) else _legacy(entries)
    if tokens and [s.token for s in steps] != list(tokens)[: len(steps)]:
        raise KvevictError("the server's log-probabilities do not line up with the tokens it returned")
    return Generation(text or "", tuple(steps), truncated, prompt)


def _token_id(entry: dict) -> int:
    if "id" in entry:
        return int(entry["id"])
    match = _TOKEN_ID.match(str(entry.get("token", "")))
    if match:
        return int(match.group(1))
    raise KvevictError("the server gives log-probabilities by token text, not token id: the audit pairs tokens by id "
                       "(llama-server gives ids; vLLM does with return_tokens_as_token_ids, which the audit asks)")


def _steps(entries: list[dict], k: int) -> list[Step]:
    """llama.cpp's and OpenAI chat's form: one object per token with `top_logprobs` as a list."""
    out = []
    for entry in entries:
        top = entry.get("top_logprobs") or []
        ids = tuple(_token_id(t) for t in top[:k])
        logprobs = tuple(float(t["logprob"]) for t in top[:k])
        out.append(Step(_token_id(entry), float(entry["logprob"]), ids, logprobs))
    return out


def _legacy(found: dict) -> list[Step]:
    """OpenAI's legacy completions form: parallel lists, `top_logprobs` one dict {token: logprob} per token."""
    out = []
    for token, logprob, top in zip(found.get("tokens") or [], found.get("token_logprobs") or [],
                                   found.get("top_logprobs") or [], strict=False):
        ranked = sorted((top or {}).items(), key=lambda kv: -kv[1])
        out.append(Step(_token_id({"token": token}), float(logprob),
                        tuple(_token_id({"token": t}) for t, _ in ranked), tuple(float(v) for _, v in ranked)))
    return out
