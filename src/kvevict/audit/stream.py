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
from .events import effective_keep, shift_steps
from .fidelity import Point, TopK, columns, point
from .judge import BLOCK, StreamVerdict, judge_stream
from .records import Records, request_key

#: the A/A floor needs at least this many generated tokens before the first event (two bootstrap blocks)
MIN_FLOOR = 2 * BLOCK


@dataclass(frozen=True)
class Side:
    """A server and how to speak to it: its client, route and the model name to ask for (None: the server's)."""

    client: Client
    route: str
    model: str | None = None


@dataclass(frozen=True)
class StreamPlan:
    """One generation: the prompt ids, the tokens to generate, the top-k to read, the request's `n_keep` (None: the
    server's own), and the context the deployment declares (`n_ctx`) with what it keeps (`server_keep`)."""

    prompt: tuple[int, ...]
    n_predict: int
    k: int
    n_ctx: int
    n_keep: int | None = None
    server_keep: int = 0
    add_bos: bool = False
    ended: frozenset[int] = frozenset()  # end-of-generation ids the greedy request ignores (`fidelity.end_ids`)

    def ask(self) -> Ask:
        return Ask(n_predict=self.n_predict, k=self.k, ids=self.prompt, n_keep=self.n_keep)

    @property
    def keep(self) -> int:
        """The tokens kept through each shift (llama-server's arithmetic, `events.effective_keep`)."""
        wanted = self.server_keep if self.n_keep is None else self.n_keep
        return effective_keep(wanted, len(self.prompt), self.n_ctx, self.add_bos)

    def events(self) -> list[int]:
        return shift_steps(len(self.prompt), self.n_predict, self.n_ctx, self.keep)

    def check(self) -> None:
        """A workload that cannot show eviction against a floor is refused before any request."""
        room = self.n_ctx - 1 - len(self.prompt)
        if room < MIN_FLOOR:
            raise KvevictError(f"the deployment's context ({self.n_ctx} tokens) is too short for a "
                               f"{len(self.prompt)}-token prompt and the {MIN_FLOOR}-token floor before its first "
                               f"eviction: use --prompt-tokens {max(1, self.n_ctx - 1 - MIN_FLOOR)} or fewer")
        if len(self.prompt) + self.n_predict <= self.n_ctx:
            raise KvevictError(f"--new-tokens {self.n_predict} ends before the deployment's {self.n_ctx}-token context "
                               f"fills: nothing would be evicted; use --new-tokens "
                               f"{self.n_ctx - len(self.prompt) + 2 * MIN_FLOOR} or more")


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
    key = request_key(side.client.endpoint.base, side.route, side.model, ask)
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
               tol: Tolerance) -> StreamResult:
    """Generate on the deployment, read the reference at every position, judge (module docstring)."""
    generation = deployment_generation(side, plan, records)
    ref = references(plan.prompt, generation)
    points = [point(r, s, plan.ended) for r, s in zip(ref, generation.steps, strict=True)]
    series = columns(points)
    events = plan.events()
    verdict = judge_stream(series, events, tol)
    return StreamResult(label, plan, generation, points, verdict, series)
