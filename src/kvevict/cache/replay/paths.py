"""How a chunk that evicts token by token inside itself is replayed: one reference, and the fast paths
registered as its specialisations, each with the test that says where it applies.

The reference is stepping (`chunk.replay_steps`, `stepping.Stepper`): each of the chunk's steps builds
its policies' views of the slots a token-by-token run would hold (`stepping.step_view`), measures what they
asked for and lets them absorb it (`step.absorb`), scores (`step.scores`) and selects one victim: the one
eviction step (`step/stages.py`) that a one-token forward's reference (`step_paths.REFERENCE`) runs over the held
slots. Every other path computes the same kept sets and outputs with less work where its `applies` holds,
and a differential test (tests/test_replay_paths.py) runs each against the reference on the architecture
matrix:

* **closed form** (`chunk.replay_static`): every row's policy has static scores, so the kept set after any
  step is the top-budget of all tokens seen; one masked attention for the chunk. In position-shift mode the
  keys' rotations move as entries leave, and the mode's shortcut (`ShiftedPositions.static_attention`)
  covers only a chunk whose every step evicts the oldest unpinned entry: it declines (None) otherwise.
* **by slot** (`by_slot.steps_by_slot`): static or slot-local policies in original positions, one entry
  evicted per step that evicts; every slot of the chunk scored at once, the not-yet-arrived masked.

A path declares what it can measure (`measures`: the request kinds it serves, `AttentionRequest.kind`).
The first registered path that applies and answers replays the chunk and returns the layer's new state
(`stepping.Replayed`); the reference always applies. Adding a path is one `ReplayPath` here and its
differential test. `unmeasured` answers for these paths and for a one-token forward's (`step/paths.py`):
what a cache refuses when it is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...policies.capabilities import Capabilities
from ..step import paths as step_paths
from . import by_slot
from .chunk import replay_static, replay_steps
from .stepping import Replayed, ReplayingLayer


@dataclass(frozen=True)
class ReplayPath:
    """One way to replay a chunk: where it applies, how it runs (None: it declines, the next path runs),
    and the request kinds it can measure."""

    name: str
    applies: Callable[[ReplayingLayer], bool]
    run: Callable[[ReplayingLayer, torch.Tensor, torch.Tensor, float], Replayed | None]
    measures: frozenset[str]
    #: whether the rows of a policy with these capabilities may be replayed by it (what `applies` reads of them)
    takes: Callable[[Capabilities], bool] = lambda capabilities: True


def _all_static(layer: ReplayingLayer) -> bool:
    return all(g.policy.static_scores for g in layer.settings.layout.groups)


def _by_slot(layer: ReplayingLayer) -> bool:
    return layer.settings.mode.fixed_keys and by_slot.applies(layer)


#: what a policy refused for a request some layer or chunk replay path cannot measure should do instead
MEASURED_ELSEWHERE = "run it where they are measured (one-token steps, --chunk 1, or a layer kind that measures them)"

#: the reference: what a one-token forward measures, step by step
REFERENCE = ReplayPath("reference", lambda layer: True, replay_steps, frozenset({"new", "last", "window", "queries"}))

#: the specialisations, tried in this order before the reference
PATHS: tuple[ReplayPath, ...] = (
    ReplayPath("closed form", _all_static, replay_static, frozenset(), lambda c: c.static_scores),
    ReplayPath("by slot", _by_slot, by_slot.steps_by_slot, frozenset({"new", "last", "window"}),
               lambda c: c.static_scores or c.slot_local),
)


def unmeasured(capabilities: Capabilities, per_token: bool = True) -> list[tuple[str, str, str]]:
    """`(kind, where, fix)` for each request kind these capabilities declare that a path which may take their
    rows cannot measure: a uniform layer's eviction step path (`step_paths`, with its own fix) and, where a
    chunk is replayed token by token (`per_token`), a replay path here (empty: every one is served)."""
    gaps = [(kind, f"the eviction step's {path.name} path", path.fix)
            for path in (*step_paths.PATHS, step_paths.REFERENCE)
            if path.takes(capabilities) for kind in capabilities.requests if kind not in path.measures]
    if per_token:
        gaps += [(kind, f"the chunk replay's {path.name} path", MEASURED_ELSEWHERE) for path in (*PATHS, REFERENCE)
                 if path.takes(capabilities) for kind in capabilities.requests if kind not in path.measures]
    return gaps


def replay_chunk(layer: ReplayingLayer, query: torch.Tensor, used: torch.Tensor, scaling: float) -> Replayed:
    """Replay the chunk in flight (query `[B, H_q, q, D]` as the model rotated it, at `used` `[q]`) by the
    first path that applies and answers; returns the output `[B, H_q, q, D]` and the layer's new state."""
    for path in PATHS:
        if path.applies(layer):
            done = path.run(layer, query, used, scaling)
            if done is not None:
                return done
    return REFERENCE.run(layer, query, used, scaling)
