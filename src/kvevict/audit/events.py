"""Where a deployment evicts along a generation, by the rule its engine declares (`RULES`):

* `context-shift`: llama-server's, from the context it declares (below);
* `declared-context`: another engine whose KV limit the user declares (`--context`): the one event the audit
  can place is where that context fills; what the engine does after it is its own;
* `none`: an engine that declares no eviction (vLLM refuses a sequence past `max_model_len` rather than
  evict): no event, and the whole stream is judged (`judge.py`).

llama-server (`tools/server/server-context.cpp`, `pre_decode`) shifts a generating slot when the tokens it
holds plus one reach `n_ctx`: it keeps `n_keep` (the whole prompt where `n_keep` is −1; one more where the
vocabulary adds BOS; at most `n_ctx − 4`), discards the next `n_discard = (held − n_keep) / 2` and moves the
rest down. The response's `truncated` says that it shifted at least once; the server's log names each shift
("slot context shift"). The audit places the events by this arithmetic from the context the server declares
(`/props`), and checks it against `truncated` where the server returns it.
"""

from __future__ import annotations

#: llama-server never keeps more than n_ctx − 4 tokens through a shift
RESERVED = 4


def effective_keep(n_keep: int, prompt: int, n_ctx: int, add_bos: bool) -> int:
    """The tokens llama-server keeps through a shift, for a request's `n_keep` (−1: the whole prompt)."""
    keep = prompt if n_keep < 0 else n_keep
    return min(n_ctx - RESERVED, keep + int(add_bos))


def shift_steps(prompt: int, n_predict: int, n_ctx: int, keep: int) -> list[int]:
    """Generated-token indices `j` whose distribution is the first computed after a shift (the tokens before the
    first such index form the A/A floor). `keep`: `effective_keep`'s count.

    The distribution of generated token j ≥ 1 comes from decoding token j − 1 on top of what the slot held;
    before that decode the slot shifts when it holds `n_ctx − 1`."""
    held, out = prompt, []
    for j in range(1, n_predict):
        if held + 1 >= n_ctx:
            left = held - keep
            held -= max(0, min(left // 2, left - 1))
            out.append(j)
        held += 1
    return out


def context_fills(prompt: int, n_predict: int, n_ctx: int, keep: int) -> list[int]:  # noqa: ARG001 (a rule's form)
    """The one event of a declared KV limit: the generated index where `n_ctx` fills, as llama-server's first."""
    first = n_ctx - prompt
    return [first] if 0 < first < n_predict else []


def no_events(prompt: int, n_predict: int, n_ctx: int, keep: int) -> list[int]:  # noqa: ARG001 (a rule's form)
    """An engine that declares no eviction: none placed."""
    return []


#: eviction rule -> the generated indices of its events, from (prompt, n_predict, n_ctx, keep)
RULES = {"context-shift": shift_steps, "declared-context": context_fills, "none": no_events}
