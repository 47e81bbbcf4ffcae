"""How a uniform layer evicts after a forward that does not replay: one reference step, and the fast paths
registered as its specialisations, each with the test that says where it applies.

The reference (`REFERENCE`) is the one eviction step (`step/stages.py`) over the held slots: the policies' views,
their requests measured and absorbed (`measured`, the layer's `Statistics.feed`, through `step.absorb`),
every row's scores merged (`step.scores`), and the `keep` best slots kept, compacted to the front in
positional order (`selection.keep_slots`, `PositionMode.compact`). The specialisations keep the same entries
with less work where they apply, and a differential test (tests/test_step_paths.py) runs each against the
reference on the architecture matrix:

* **ring** (`_ring`): every row's policy evicts first-in-first-out after its pinned tokens
  (`Policy.fifo_after`) and the position mode lets a ring of slots turn (`PositionMode.ring`: original
  positions). A decode step's victim is the oldest unpinned entry, the ring's next slot
  (`SlotLayer.fifo_victim`): nothing is measured or scored, and the newest entry moves into that slot
  (`SlotLayer.turn_ring`). It declines a step that evicts more than one entry, or whose ring it cannot trust
  (slots out of positional order that its own last step did not leave).
* **in place** (`_in_place`): a stored key keeps its rotation in any slot (`PositionMode.fixed_keys`:
  original positions), so a decode step measures and scores as the reference does, finds its one victim
  per row and head (`selection.victim`) and moves the newest entry into that slot
  (`SlotStorage.fill_hole`) instead of compacting every later one. It declines a step that evicts more
  than one entry.

Both leave the slots out of positional order, which attention ignores, and so does every score that a slot's
own entry decides: the kept set is the reference's. `random` draws one number per slot in slot order, so
after an in-place step it draws over another layout than the reference's compaction: as random, not the
same set (one-token forwards have always drawn over the in-place layout, and the chunk replay keeps it,
`stepping.Stepper`, so chunks agree with them).

`applies` reads the layer's settings alone, so a layer binds its paths once (`bind`, at its first forward,
once the cache has bound its rows) and each step only tries the bound ones in order (`take`): the first that
does not decline evicts, and the reference never declines. A path declares the request kinds it can measure
(`measures`) and which policies' rows it may take (`takes`); a cache refuses, when it is built, a policy
that declares a request some path that may take its rows cannot measure (`replay_paths.unmeasured`).
Adding a path is one `StepPath` here and its differential test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ...policies import SlotView
from ...policies.capabilities import Capabilities
from ..layers.settings import LayerSettings
from ..statistics.measure import Statistics
from ..storage.slots import SlotStorage
from . import selection
from . import stages as step

#: the step's measurement, called by a path that scores: the requests measured and absorbed, the views returned
Measured = Callable[[], list[SlotView]]


class SteppingLayer(Protocol):
    """What a step path reads and calls on the layer it runs in (an `EvictingLayer`)."""

    seen: int
    ordered: bool
    batch_size: int
    heads: int
    storage: SlotStorage
    settings: LayerSettings
    statistics: Statistics
    steps: tuple[StepPath, ...]

    def ring_start(self) -> int | None: ...

    def fifo_victim(self, total: int, keep_count: int) -> int | None: ...

    def turn_ring(self, slot: int, keep_count: int) -> torch.Tensor: ...

    @property
    def wants_victims(self) -> bool: ...

    def report_eviction(self, seen: int, kept: torch.Tensor | None, victims: torch.Tensor | None) -> None: ...


@dataclass(frozen=True)
class StepPath:
    """One way to evict after a forward: where it applies (from the layer's settings alone), how it runs, and
    the request kinds it can measure.

    `run(layer, measured, total, keep)` evicts from the `total` held slots down to `keep` and returns whether
    the slots are in positional order after, or None: it declines, nothing changed, the next path runs.
    """

    name: str
    applies: Callable[[SteppingLayer], bool]
    run: Callable[[SteppingLayer, Measured, int, int], bool | None]
    measures: frozenset[str]
    #: whether the rows of a policy with these capabilities may be taken by it (what `applies` reads of them)
    takes: Callable[[Capabilities], bool] = lambda capabilities: True
    #: what a policy it may take should do instead of declaring a request it cannot measure (the refusal's fix)
    fix: str = "run it in a layer kind that measures them"


def _reference(layer: SteppingLayer, measured: Measured, total: int, keep: int) -> bool:
    """Measure, score, keep the `keep` best slots compacted to the front in positional order; report what stayed."""
    storage = layer.storage
    scores = step.scores(layer.settings.layout, measured(), layer.batch_size, layer.heads, total)
    kept = selection.keep_slots(scores, storage.pos[:, :, :total], keep, layer.ordered)  # [B, H_kv, keep]
    layer.settings.mode.compact(storage, kept, keep)
    layer.report_eviction(layer.seen, storage.pos[:, :, :keep], None)
    return True


def _in_place(layer: SteppingLayer, measured: Measured, total: int, keep: int) -> bool | None:
    """One entry too many: measure and score as the reference, then the newest slot (`keep`) fills the victim's."""
    if total != keep + 1:
        return None
    storage = layer.storage
    scores = step.scores(layer.settings.layout, measured(), layer.batch_size, layer.heads, total)
    pos = storage.pos[:, :, :total]
    victim = selection.victim(scores, pos, layer.ordered)  # [B, H_kv] a slot each
    evicted = pos.gather(-1, victim[..., None])[..., 0] if layer.wants_victims else None  # [B, H_kv] positions
    storage.fill_hole(victim, keep)
    layer.report_eviction(layer.seen, storage.pos[:, :, :keep], evicted)
    return False


def _ring(layer: SteppingLayer, measured: Measured, total: int, keep: int) -> bool | None:
    """One entry too many, first in first out: the ring's next slot goes, found without a measurement or a score."""
    slot = layer.fifo_victim(total, keep)
    if slot is None:
        return None
    gone = layer.turn_ring(slot, keep)  # [B, H_kv] the positions that left
    layer.statistics.skip()
    layer.report_eviction(layer.seen, layer.storage.pos[:, :, :keep], gone if layer.wants_victims else None)
    return False


def _turns_ring(layer: SteppingLayer) -> bool:
    return layer.settings.mode.ring(layer.ring_start()) is not None


#: the reference: what a one-token forward's eviction measures and does, whatever the policies and mode
REFERENCE = StepPath("reference", lambda layer: True, _reference, frozenset({"new", "last", "window", "queries"}))

#: the specialisations, tried in this order before the reference
PATHS: tuple[StepPath, ...] = (
    StepPath("ring", _turns_ring, _ring, frozenset(), lambda c: c.fifo_after is not None,
             "a first-in-first-out policy (fifo_after) needs no scores and is measured by nothing: declare no "
             "requests, or fifo_after=None"),
    StepPath("in place", lambda layer: layer.settings.mode.fixed_keys, _in_place, REFERENCE.measures),
)


def bind(layer: SteppingLayer) -> tuple[StepPath, ...]:
    """The paths `layer`'s steps may take, in the order they are tried: the specialisations that apply to its
    settings, then the reference. Made once per layer, so a step reads no setting to choose."""
    return (*(path for path in PATHS if path.applies(layer)), REFERENCE)


def take(layer: SteppingLayer, measured: Measured, total: int, keep: int) -> bool:
    """Evict from `total` held slots down to `keep` by the first bound path (`layer.steps`) that does not decline
    (the last, the reference, never does); returns whether the slots are in positional order after."""
    for path in layer.steps:
        ordered = path.run(layer, measured, total, keep)
        if ordered is not None:
            break
    return ordered
