"""The fidelity workload: the deployment generates greedily well past its KV limit, and every generated token
is set against the reference at the same prefix.

One `StreamPlan` is one request to the deployment (keyed in the records: a rerun sends it only if it is not
there), then the reference's distributions at each of its positions (`reference.py`), then the per-token
fidelity (`fidelity.py`), the eviction events (`events.py`) and the verdict (`judge.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..errors import KvevictError
from ..stats.tolerance import Tolerance
from .api import Ask, Generation, generate
from .client import Client
from .events import RULES, effective_keep
from .fidelity import Point, TopK, columns, point
from .identity import ServerIdentity
from .judge import BLOCK, StreamVerdict, Window, judge_stream
from .records import Records, request_key

#: the A/A floor needs at least this many generated tokens before the first event (two bootstrap blocks)
MIN_FLOOR = 2 * BLOCK


@dataclass(frozen=True)
class Side:
    """A server and how to speak to it: its client, route and the model name to ask for (None: the server's), and
    what it says it is (`identity.py`), which keys every answer recorded from it."""

    client: Client
    route: str
    model: str | None = None
    identity: ServerIdentity = ServerIdentity("openai")

    def key(self, ask: Ask) -> str:
        """The records' key of `ask` sent to this server (`records.request_key`)."""
        return request_key(self.client.endpoint.base, self.route, self.model, ask, self.identity.as_dict())


@dataclass(frozen=True)
class StreamPlan:
    """One generation: the prompt ids, the tokens to generate, the top-k to read, the request's `n_keep` (None: the
    server's own), and the context the deployment declares (`n_ctx`) with what it keeps (`server_keep`); its
    engine's eviction `rule` (`events.RULES`) and what the verdict covers (`judge`: `judge.JUDGES`)."""

    prompt: tuple[int, ...]
    n_predict: int
    k: int
    n_ctx: int
    n_keep: int | None = None
    server_keep: int = 0
    add_bos: bool = False
    ended: frozenset[int] = frozenset()  # end-of-generation ids the greedy request ignores (`fidelity.end_ids`)
    rule: str = "context-shift"
    judge: str = "after-event"

    def ask(self) -> Ask:
        return Ask(n_predict=self.n_predict, k=self.k, ids=self.prompt, n_keep=self.n_keep)

    @property
    def keep(self) -> int:
        """The tokens kept through each shift (llama-server's arithmetic, `events.effective_keep`)."""
        wanted = self.server_keep if self.n_keep is None else self.n_keep
        return effective_keep(wanted, len(self.prompt), self.n_ctx, self.add_bos)

    def events(self) -> list[int]:
        return RULES[self.rule](len(self.prompt), self.n_predict, self.n_ctx, self.keep)

    def check(self) -> None:
        """A workload that cannot show its loss against a floor is refused before any request."""
        if self.judge == "whole":
            self._check_whole()
            return
        room = self.n_ctx - 1 - len(self.prompt)
        if room < MIN_FLOOR:
            raise KvevictError(f"the deployment's context ({self.n_ctx} tokens) is too short for a "
                               f"{len(self.prompt)}-token prompt and the {MIN_FLOOR}-token floor before its first "
                               f"eviction: use --prompt-tokens {max(1, self.n_ctx - 1 - MIN_FLOOR)} or fewer")
        if len(self.prompt) + self.n_predict <= self.n_ctx:
            raise KvevictError(f"--new-tokens {self.n_predict} ends before the deployment's {self.n_ctx}-token context "
                               f"fills: nothing would be evicted; use --new-tokens "
                               f"{self.n_ctx - len(self.prompt) + 2 * MIN_FLOOR} or more, or judge a loss with no "
                               "eviction point over the whole stream (--judge whole)")

    def _check_whole(self) -> None:
        """The whole stream judged: enough tokens for an interval, and within a context the server never evicts."""
        if self.n_predict < MIN_FLOOR:
            raise KvevictError(f"--new-tokens {self.n_predict} is too few to judge (two blocks of {BLOCK} tokens "
                               f"at least): use --new-tokens {MIN_FLOOR} or more")
        if self.rule == "none" and len(self.prompt) + self.n_predict > self.n_ctx:
            raise KvevictError(f"a {len(self.prompt)}-token prompt and --new-tokens {self.n_predict} run past the "
                               f"deployment's {self.n_ctx}-token context, which it does not evict from (it refuses "
                               f"the request): use --new-tokens {self.n_ctx - len(self.prompt)} or fewer")


@dataclass
class StreamResult:
    """One generation and its fidelity: `points` `[G]`, the `series` built from them, the events and verdict."""

    label: str
    plan: StreamPlan
    generation: Generation
    points: list[Point]
    verdict: StreamVerdict
    series: dict[str, np.ndarray] = field(repr=False, default_factory=dict)

    @property
    def tokens(self) -> list[int]:
        return self.generation.tokens

    def summary(self) -> dict:
        s = self.series
        return {"label": self.label, "n_keep": self.plan.n_keep, "kept": self.plan.keep, "n_ctx": self.plan.n_ctx,
                "prompt": len(self.plan.prompt), "generated": len(self.points),
                "truncated": self.generation.truncated, "kl": float(s["kl"].mean()),
                "disagree": float(s["disagree"].mean()), "tail": float(s["tail"].mean()),
                "bounded": int(sum(p.bounded for p in self.points)), **self.verdict.as_dict()}


References = Callable[[tuple[int, ...], Generation], list[TopK]]


def deployment_generation(side: Side, plan: StreamPlan, records: Records) -> Generation:
    """The deployment's generation for `plan`, from the records where it was sent before."""
    ask = plan.ask()
    key = side.key(ask)
    found = records.generation(key)
    if found is None:
        found = generate(side.client, side.route, ask, side.model)
        if len(found.steps) < plan.n_predict:
            raise KvevictError(f"the deployment stopped after {len(found.steps)} of {plan.n_predict} tokens: it does "
                               "not take ignore_eos, or its context ended without a shift (llama-server: "
                               "--context-shift)")
        records.keep_generation(key, "deployment-generation", found, n_keep=plan.n_keep)
    return found


def run_stream(label: str, side: Side, plan: StreamPlan, references: References, records: Records,
               tol: Tolerance, twin: Window | None = None) -> StreamResult:
    """Generate on `side`, read the reference at every position, judge (module docstring); `twin`: the A/A floor a
    twin's own stream gave (`judge.judge_stream`)."""
    generation = deployment_generation(side, plan, records)
    ref = references(plan.prompt, generation)
    points = [point(r, s, plan.ended) for r, s in zip(ref, generation.steps, strict=True)]
    series = columns(points)
    verdict = judge_stream(series, plan.events(), tol, plan.judge, twin)
    return StreamResult(label, plan, generation, points, verdict, series)
