"""Fidelity of a deployment's stream to the reference, token by token: top-1 agreement, the reference's
log-probability of the deployment's token, and top-k KL(reference ‖ deployment).

Both sides are read at the same prefix: the deployment's own generated tokens, the reference teacher-forced
on them. A server gives only its top-k log-probabilities, so the KL is taken over a coarse-grained
vocabulary, stated here once (docs/audit.md):

* the cells are the ids in the union U of both sides' top-k, one cell each, and one *rest* cell for every
  other id;
* a side that reported an id of U gives its own probability; for an id of U outside a side's top-k, that
  side's unreported mass (1 − the sum of its top-k) is shared evenly over those missing ids and its rest
  cell, each missing id capped at the side's k-th probability (it ranked below it);
* the rest cell holds what is left. A reference computed locally (kvevict's full cache) knows every id
  exactly, so only the deployment's side is ever shared out.

Merging cells never raises a KL (the log-sum inequality), so with the sharing exact this is a lower bound
of the full-vocabulary KL; `tail` records the reference's mass outside U, the part the bound cannot see.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .api import Step

#: probabilities below this are held at it inside a log (a cell a side gives nothing)
FLOOR = 1e-12


@dataclass(frozen=True)
class TopK:
    """One side's distribution at one position: its top-k ids and natural-log probabilities, most likely first,
    and `extra`: log-probabilities it knows for other ids (an exact local reference fills it for every id the
    KL needs)."""

    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    extra: tuple[tuple[int, float], ...] = ()

    @classmethod
    def of(cls, step: Step) -> TopK:
        return cls(step.ids, step.logprobs)

    def known(self) -> dict[int, float]:
        found = dict(self.extra)
        found.update(zip(self.ids, self.logprobs, strict=True))
        return found


@dataclass(frozen=True)
class Point:
    """The fidelity of one generated token. `agree`: the reference's top-1 is the deployment's token; `ref_nll`:
    −log p_ref(deployment's token) (its k-th where outside the reference's top-k: a bound, `bounded`);
    `best_nll`: −log p_ref(the reference's own top-1); `kl`: top-k KL(ref ‖ deployment) (module docstring);
    `tail`: the reference's mass outside both top-k."""

    agree: bool
    ref_nll: float
    best_nll: float
    kl: float
    tail: float
    bounded: bool = False


def _shared(known: dict[int, float], cells: list[int], ranked: tuple[float, ...]) -> list[float]:
    """One side's probabilities over `cells` (module docstring): its own where it knows them, else an even share
    of its unreported mass, capped at its k-th probability."""
    probs = {i: math.exp(v) for i, v in known.items()}
    missing = [i for i in cells if i not in probs]
    if missing:
        unreported = max(0.0, 1.0 - sum(math.exp(v) for v in ranked))
        cap = math.exp(min(ranked)) if ranked else 1.0
        share = min(cap, unreported / (len(missing) + 1))
        probs.update({i: share for i in missing})
    return [probs[i] for i in cells]


def kl_topk(ref: TopK, dep: TopK) -> tuple[float, float]:
    """(KL(ref ‖ dep) over the coarse-grained cells, the reference's mass outside the union of the top-k)."""
    cells = list(dict.fromkeys(ref.ids + dep.ids))
    p = _shared(ref.known(), cells, ref.logprobs)
    q = _shared(dep.known(), cells, dep.logprobs)
    p_rest, q_rest = max(0.0, 1.0 - sum(p)), max(0.0, 1.0 - sum(q))
    kl = sum(a * math.log(a / max(b, FLOOR)) for a, b in zip(p + [p_rest], q + [q_rest], strict=True) if a > 0)
    return max(0.0, kl), p_rest


#: the end-of-generation tokens' texts: a deployment told to ignore the end of sequence never chooses them
END_TEXTS = frozenset({"</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>",
                       "<end_of_turn>", "<|end|>", "<|return|>"})


def end_ids(tokenizer) -> frozenset[int]:
    """The ids a greedy request with `ignore_eos` cannot choose: the end of sequence and the special tokens that
    end a turn (llama-server biases every end-of-generation token away; vLLM ignores the end of sequence)."""
    found = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    found |= {i for t, i in zip(tokenizer.all_special_tokens, tokenizer.all_special_ids, strict=False)
              if t in END_TEXTS}
    return frozenset(found)


def point(ref: TopK, step: Step, ended: frozenset[int] = frozenset()) -> Point:
    """The fidelity of `step` (the deployment's token and top-k) against `ref` at the same prefix. The reference's
    own choice is its most likely id outside `ended` (the ids the deployment was told never to choose): a
    reference whose top-1 is the end of sequence is not disagreed with by a deployment that may not stop."""
    known = ref.known()
    kl, tail = kl_topk(ref, TopK.of(step))
    inside = step.token in known
    ref_lp = known[step.token] if inside else min(ref.logprobs)
    best = next(((i, lp) for i, lp in zip(ref.ids, ref.logprobs, strict=True) if i not in ended),
                (ref.ids[0], ref.logprobs[0]))
    return Point(agree=best[0] == step.token, ref_nll=-ref_lp, best_nll=-best[1], kl=kl, tail=tail,
                 bounded=not inside)


def columns(points: list[Point]) -> dict[str, np.ndarray]:
    """The per-token series `[G]` each: kl, disagree (0/1), ref_nll, best_nll, tail."""
    return {
        "kl": np.array([p.kl for p in points]),
        "disagree": np.array([0.0 if p.agree else 1.0 for p in points]),
        "ref_nll": np.array([p.ref_nll for p in points]),
        "best_nll": np.array([p.best_nll for p in points]),
        "tail": np.array([p.tail for p in points]),
    }
