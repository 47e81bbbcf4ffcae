"""The reference: the same model with nothing evicted, teacher-forced on the deployment's own tokens.

Two ways to get it, each giving one `TopK` per generated token:

* `local_reference`: kvevict's full cache on the same weights (the embedded name, a folder or the same
  `.gguf`), one forward over prompt + generation; exact, so every id the KL needs is known;
* `endpoint_reference`: a second server whose context never evicts, one request per position (the prefix
  so far, one token asked, its top-k): with `cache_prompt` llama-server evaluates only the new token.
  Each request is keyed in the records, so an interrupted audit resumes without resending any.
* `prompt_logprobs_reference`: a server that scores a prompt (vLLM's `prompt_logprobs`): one request for
  the whole stream, its top-k and the deployment's token at every position.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .api import Ask, Step, generate
from .client import Client
from .fidelity import TopK

if TYPE_CHECKING:
    from .stream import Side

#: generated positions whose full-vocabulary log-probabilities are held at once (`local_reference`)
BLOCK = 64


def local_reference(model, prompt: Sequence[int], steps: Sequence[Step], k: int) -> list[TopK]:
    """`[G]` exact distributions of kvevict's full cache at every generated position, its top-k and the
    log-probabilities of the deployment's top-k ids and token (`extra`)."""
    import torch

    from ..eval.streaming import full_reference

    tokens = torch.tensor(list(prompt) + [s.token for s in steps], dtype=torch.long)
    reference = full_reference(model, tokens, progress=False)
    start = len(prompt) - 1  # prediction i is of token i + 1: generated token j is prediction start + j
    out = []
    with torch.inference_mode():
        for lo in range(0, len(steps), BLOCK):
            rows = reference.log_probs(start + lo, start + min(len(steps), lo + BLOCK)).double()  # [b, vocab]
            top = torch.topk(rows, k)
            for i, step in enumerate(steps[lo:lo + BLOCK]):
                wanted = sorted(set(step.ids) | {step.token})
                out.append(TopK(tuple(top.indices[i].tolist()), tuple(top.values[i].tolist()),
                                tuple((t, float(rows[i, t])) for t in wanted)))
    return out


def endpoint_reference(side: Side, prompt: Sequence[int], steps: Sequence[Step], k: int,
                       cached: Callable[[str, Ask], Step | None] | None = None,
                       keep: Callable[[str, Ask, Step], None] | None = None) -> list[TopK]:
    """`[G]` top-k distributions of the reference server (`side`) at every generated position, one request each.
    `cached(key, ask)` answers a request already in the records; `keep(key, ask, step)` records a new answer."""
    tokens = list(prompt) + [s.token for s in steps]
    asks = [Ask(n_predict=1, k=k, ids=tuple(tokens[: len(prompt) + j]), cache_prompt=True) for j in range(len(steps))]

    def one(ask: Ask) -> TopK:
        key = side.key(ask)
        found = cached(key, ask) if cached else None
        if found is None:
            found = generate(side.client, side.route, ask, side.model).steps[0]
            if keep:
                keep(key, ask, found)
        return TopK.of(found)

    return side.client.map(one, asks)


def prompt_logprobs_reference(client: Client, model: str | None, prompt: Sequence[int], steps: Sequence[Step],
                              k: int) -> list[TopK]:
    """`[G]` top-k distributions from one `/v1/completions` request with vLLM's `prompt_logprobs: k`: at each
    prompt position a map {token id: {logprob, rank}} of the top-k and the token actually there."""
    from ..errors import KvevictError

    tokens = list(prompt) + [s.token for s in steps]
    body = {"prompt": tokens, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": k}
    if model:
        body["model"] = model
    answer = client.post("/v1/completions", body)
    found = ((answer.get("choices") or [{}])[0]).get("prompt_logprobs") or answer.get("prompt_logprobs")
    if not found or len(found) != len(tokens):
        raise KvevictError(f"{client.endpoint.base}/v1/completions returned no prompt_logprobs for the stream: use "
                           "--reference-mode positions (one request per position)")
    out = []
    for j in range(len(steps)):
        entries = {int(t): v for t, v in found[len(prompt) + j].items()}
        ranked = sorted((v.get("rank", 0), t, float(v["logprob"])) for t, v in entries.items())
        top = [(t, lp) for rank, t, lp in ranked if rank <= k][:k]
        out.append(TopK(tuple(t for t, _ in top), tuple(lp for _, lp in top),
                        tuple((t, float(v["logprob"])) for t, v in entries.items())))
    return out
