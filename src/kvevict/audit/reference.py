"""The reference: the same model with nothing evicted, teacher-forced on the deployment's own tokens.

Two ways to get it, each giving one `TopK` per generated token:

* `local_reference`: kvevict's full cache on the same weights (the embedded name, a folder or the same
  `.gguf`), one forward over prompt + generation; exact, so every id the KL needs is known;
* `endpoint_reference`: a second server whose context never evicts, one request per position (the prefix
  so far, one token asked, its top-k): with `cache_prompt` llama-server evaluates only the new token.
  Each request is keyed in the records, so an interrupted audit resumes without resending any.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .api import Ask, Step, generate
from .client import Client
from .fidelity import TopK


def local_reference(model, prompt: Sequence[int], steps: Sequence[Step], k: int) -> list[TopK]:
    """`[G]` exact distributions of kvevict's full cache at every generated position, its top-k and the
    log-probabilities of the deployment's top-k ids and token (`extra`)."""
    import torch

    from ..eval.streaming import full_reference

    tokens = torch.tensor(list(prompt) + [s.token for s in steps], dtype=torch.long)
    reference = full_reference(model, tokens, progress=False)
    start = len(prompt) - 1  # prediction i is of token i + 1: generated token j is prediction start + j
    out = []
    for j, step in enumerate(steps):
        logprobs = reference.log_probs(start + j, start + j + 1)[0].double()
        top = torch.topk(logprobs, k)
        wanted = sorted(set(step.ids) | {step.token})
        out.append(TopK(tuple(top.indices.tolist()), tuple(top.values.tolist()),
                        tuple((i, float(logprobs[i])) for i in wanted)))
    return out


def endpoint_reference(client: Client, route: str, model: str | None, prompt: Sequence[int],
                       steps: Sequence[Step], k: int, cached: Callable[[str, Ask], Step | None] | None = None,
                       keep: Callable[[str, Ask, Step], None] | None = None) -> list[TopK]:
    """`[G]` top-k distributions of the reference server at every generated position, one request each.
    `cached(key, ask)` answers a request already in the records; `keep(key, ask, step)` records a new answer."""
    from .records import request_key

    tokens = list(prompt) + [s.token for s in steps]
    asks = [Ask(n_predict=1, k=k, ids=tuple(tokens[: len(prompt) + j]), cache_prompt=True) for j in range(len(steps))]

    def one(ask: Ask) -> TopK:
        key = request_key(client.endpoint.base, route, model, ask)
        found = cached(key, ask) if cached else None
        if found is None:
            found = generate(client, route, ask, model).steps[0]
            if keep:
                keep(key, ask, found)
        return TopK.of(found)

    return client.map(one, asks)
