"""The audit's verdict on one stream, by the rule `ab` ships by (`stats/tolerance.py`), and the sink-loss signature.

* Fidelity is judged against the stated tolerance with the verdict's own functions: the mean top-k
  KL(reference ‖ deployment) per token (`judge_kl`, a bootstrap over blocks of `BLOCK` tokens, against
  `--max-kl`; the audit judges KL by default, at ln of `--max-ppl-ratio`: `audit_tolerance`), and the
  reference's perplexity of the deployment's tokens over its perplexity of its own top-1 choices on the same
  prefixes (`judge_ppl`, paired blocks, against `--max-ppl-ratio`): 1 when the deployment chooses as the
  reference would. Inside: every metric's whole interval within its limit; outside: one wholly past it; else
  undecided.
* What is judged (`JUDGES`): `after-event`, the generated tokens from the first eviction event on, for a loss
  that starts at an eviction point (llama-server's context shift); or `whole`, every generated token, for a
  loss with no eviction point (a quantized KV cache touches every token from the first).
* The A/A floor: where the two sides differ only by their arithmetic. After an event, the tokens before the
  first event. A *twin* (a second server that never evicts and holds nothing lossy: the same engine
  unquantized, or a copy of the reference) gives it instead where one is given, and always in the whole
  mode: there the tokens before any event already carry the loss, so they are never a floor. No twin in the
  whole mode: no floor, and the verdict says so.
* The step: the judged window's KL and top-1 disagreement both lie beyond the floor (the window's whole
  bootstrap interval above the floor's). After an event the window is the first event to the next; in the
  whole mode, the whole stream.
* The sink-loss signature: a step at the first event whose window is judged outside the KL limit.
* A rerun with the sinks kept (llama-server's `n_keep`), run only where the first showed a step, is set beside
  it: the step is *gone* where the rerun shows no step beyond its floor, *smaller* where its window's KL lies
  wholly below the first run's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from ..stats.tolerance import Judgement, Tolerance, judge_kl, judge_ppl
from ..stats.uncertainty import Blocks, Interval, mean_interval

#: tokens per bootstrap block: neighbouring tokens are not independent, so they are resampled together
BLOCK = 16
#: what a stream's verdict covers (module docstring)
JUDGES = ("after-event", "whole")
#: where a verdict's A/A floor came from
FROM_PREFIX, FROM_TWIN = "before the first event", "twin"


def audit_tolerance(tol: Tolerance) -> Tolerance:
    """`tol` with a KL limit where none was stated: fidelity is what the audit judges. The limit is ln of
    `--max-ppl-ratio` (0.0488 nats at the default 1.05): KL(ref ‖ deployment) is the deployment's expected extra
    NLL per token on text the reference writes, and a PPL ratio R on a text is an extra NLL of ln R per token,
    so this is the KL limit that says what the PPL tolerance says."""
    return tol if tol.max_kl is not None else replace(tol, max_kl=math.log(tol.max_ppl_ratio))


def blocks_of(values: np.ndarray, start: int = 0) -> Blocks | None:
    """Consecutive blocks of `BLOCK` values (the last one shorter), `start` the first value's index; None with
    fewer than two blocks (no interval)."""
    cuts = list(range(0, len(values), BLOCK))
    if len(cuts) < 2:
        return None
    means = np.array([values[c:c + BLOCK].mean() for c in cuts])
    weights = np.array([float(len(values[c:c + BLOCK])) for c in cuts])
    return Blocks(tuple(start + c for c in cuts), means, weights)


@dataclass(frozen=True)
class Window:
    """Fidelity over generated tokens [start, stop): mean KL and top-1 disagreement with their intervals."""

    start: int
    stop: int
    kl: float
    kl_interval: Interval | None
    disagree: float
    disagree_interval: Interval | None

    def as_dict(self) -> dict:
        def pair(i: Interval | None) -> list[float] | None:
            return None if i is None else [i.low, i.high]

        return {"start": self.start, "stop": self.stop, "kl": self.kl, "kl_interval": pair(self.kl_interval),
                "disagree": self.disagree, "disagree_interval": pair(self.disagree_interval)}


def window(series: dict[str, np.ndarray], start: int, stop: int) -> Window:
    kl, dis = series["kl"][start:stop], series["disagree"][start:stop]
    kb, db = blocks_of(kl, start), blocks_of(dis, start)
    return Window(start, stop, float(kl.mean()) if len(kl) else float("nan"), kb and mean_interval(kb),
                  float(dis.mean()) if len(dis) else float("nan"), db and mean_interval(db))


def _above(a: Interval | None, b: Interval | None) -> bool:
    return a is not None and b is not None and a.low > b.high


@dataclass(frozen=True)
class StreamVerdict:
    """The verdict on one stream: `judgements` (label, Judgement), the floor and judged windows, the events;
    `judge` what was judged (`JUDGES`), `floor_source` where the floor came from (None: there is none)."""

    judgements: tuple[tuple[str, Judgement], ...]
    events: tuple[int, ...]
    floor: Window | None
    after: Window | None  # the first event to the next (`after-event`), or the whole stream (`whole`)
    tolerance: Tolerance
    segments: tuple[Window, ...] = ()  # the start to the first event, then each to the next (or the stream's end)
    judge: str = "after-event"
    floor_source: str | None = None

    @property
    def outcome(self) -> str:
        found = [j.outcome for _, j in self.judgements]
        if not found:
            return "undecided"
        return "outside" if "outside" in found else "inside" if all(o == "inside" for o in found) else "undecided"

    @property
    def step(self) -> bool:
        """KL and top-1 disagreement both lie beyond the A/A floor over the judged window."""
        return (self.floor is not None and self.after is not None and _above(self.after.kl_interval,
                self.floor.kl_interval) and _above(self.after.disagree_interval, self.floor.disagree_interval))

    @property
    def above_floor(self) -> bool:
        """The judged window's KL lies wholly above the floor's: a loss beyond the two sides' arithmetic (in the
        whole mode a quantized cache need not change a top-1, so KL alone says it)."""
        return self.floor is not None and self.after is not None and _above(self.after.kl_interval,
                                                                             self.floor.kl_interval)

    @property
    def signature(self) -> bool:
        """The sink-loss signature (module docstring): a step at the first event, its window outside the KL limit."""
        if self.judge != "after-event" or not self.events or not self.step or self.after.kl_interval is None:
            return False
        return self.after.kl_interval.low > self.tolerance.max_kl

    def as_dict(self) -> dict:
        return {"outcome": self.outcome, "judge": self.judge, "events": list(self.events), "step": self.step,
                "above_floor": self.above_floor, "signature": self.signature, "floor_source": self.floor_source,
                "floor": self.floor and self.floor.as_dict(), "after": self.after and self.after.as_dict(),
                "segments": [w.as_dict() for w in self.segments],
                "judgements": [{"label": label, "text": j.text(), "outcome": j.outcome, "estimate": j.estimate,
                                "low": j.low, "high": j.high, "limit": j.limit, "more": j.more_samples}
                               for label, j in self.judgements]}


def judge_stream(series: dict[str, np.ndarray], events: list[int], tol: Tolerance, judge: str = "after-event",
                 twin: Window | None = None) -> StreamVerdict:
    """Judge one stream's per-token `series` (`fidelity.columns`) against `tol` (`audit_tolerance` applied).
    `after-event`: over the generated tokens from the first eviction event on (the whole stream where there is
    none), the tokens before it the floor; `whole`: over every token. `twin`: the A/A floor measured on a twin
    (module docstring), which replaces the tokens before the first event."""
    tol = audit_tolerance(tol)
    total = len(series["kl"])
    first = events[0] if events and judge == "after-event" else None
    cut = first or 0
    found = []
    kl = judge_kl(blocks_of(series["kl"][cut:], cut), tol)
    if kl is not None:
        found.append(("KL", kl))
    ppl = judge_ppl(blocks_of(series["ref_nll"][cut:], cut), blocks_of(series["best_nll"][cut:], cut), tol)
    if ppl is not None:
        found.append(("the reference's PPL of the deployment's tokens over its own top-1", ppl))
    cuts = [0, *events, total]
    segments = tuple(window(series, a, b) for a, b in zip(cuts, cuts[1:], strict=False) if b > a)
    if judge == "whole":
        after = window(series, 0, total)
    else:
        after = segments[1] if first is not None and len(segments) > 1 else None
    if twin is not None:
        floor, source = twin, FROM_TWIN
    elif first is not None:
        floor, source = window(series, 0, first), FROM_PREFIX
    else:
        floor, source = None, None
    return StreamVerdict(tuple(found), tuple(events), floor, after, tol, segments, judge, source)


def rerun_effect(first: StreamVerdict, rerun: StreamVerdict) -> str:
    """What keeping the sinks did to the step at the first event: gone, smaller, or unchanged; `no-step` where the
    first run showed none to remove (no advice follows from it)."""
    if not first.step:
        return "no-step"
    if not rerun.step:
        return "gone"
    a, b = first.after and first.after.kl_interval, rerun.after and rerun.after.kl_interval
    if a is not None and b is not None and b.high < a.low:
        return "smaller"
    return "unchanged"
