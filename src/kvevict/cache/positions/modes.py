"""Position modes: what position a kept key and a new query carry. Two strategies, one interface.

* `OriginalPositions` (`"original"`): each key keeps the RoPE rotation of its position
  in the stream, as H2O, SnapKV and kvpress do. Nothing is ever re-rotated (`fixed_keys`),
  so a decode step may fill the victim's slot in place (`step/paths.py`; slots then
  leave positional order, which attention does not care about: every kept entry is
  older than every new token).
* `ShiftedPositions` (`"cache"`): StreamingLLM's position shift. Kept entries are
  numbered `0..L-1` in order and a new token sits at `L`, so the model never sees a
  position beyond its budget. Keys are stored un-rotated as well and rotated from
  scratch to their slot after every eviction, so no error accumulates; eviction
  therefore always compacts (every later slot moves down one position).

The layers, their step paths and the chunk replay ask their mode (`new_storage`,
`store_keys`, `align_query`, `compact`, `fixed_keys`, `keeps_arrival`, `ring`) and hand
it a chunk to replay (`static_attention`, `replay_steps`): each mode's maths lives in its methods (the
position shift's closed form and stepping here; original positions' fixed-key algorithms
in `replay/chunk.py`, which never asks which mode it runs in). Nothing outside this module tests
which mode it holds; the names users write live in `kvevict.position_modes`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...attention_stats import Mask, attend, products, query_attention
from ...position_modes import ORIGINAL, SHIFTED, ModeName
from ..replay import chunk as replay
from ..replay.chunk import StaticPlan
from ..replay.stepping import Replayed, ReplayingLayer, Stepper, take_slots
from ..statistics.probabilities import bound
from ..step import selection
from ..step.outputs import StepOutputs
from ..storage.slots import SlotStorage
from .rotary import Rotary


class PositionMode:
    """What both modes share: the model's rotary module, to move vectors between positions,
    and eviction by compaction."""

    name: str
    #: the storage keeps un-rotated copies of the keys (to rotate them again after an eviction)
    raw_keys: bool
    #: a stored key keeps its rotation for good (no eviction moves what it is rotated for)
    fixed_keys: bool

    def __init__(self, rotary: Rotary) -> None:
        self.rotary = rotary

    def new_storage(
        self, batch: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
        stat_names: tuple[str, ...], capacity: int, form: Callable[..., SlotStorage] = SlotStorage,
    ) -> SlotStorage:
        """Slot buffers for one layer, with the un-rotated key copies this mode needs, of the storage
        form `form` (`SlotStorage`, or a quantized one: `LayerSettings.storage_form`)."""
        return form(batch, heads, head_dim, dtype, device, stat_names, self.raw_keys, capacity)

    def keeps_arrival(self, wanted: bool) -> bool:
        """Whether to store a number each key alone decides (`Policy.arrival_stat`) when it arrives,
        `wanted` by a policy: only where a stored key never changes."""
        raise NotImplementedError

    def ring(self, start: int | None) -> int | None:
        """The first slot of a first-in-first-out ring of slots starting at `start` (None: no ring), or None
        where this mode cannot turn one (a decode step's victim slot refilled in place by the newest entry)."""
        raise NotImplementedError

    def compact(self, storage: SlotStorage, keep: torch.Tensor, count: int) -> None:
        """Move the slots `keep` `[B, H, count]` to the front, in order, and rebuild what moving left stale."""
        storage.gather(keep, keys=not self.raw_keys)
        self.after_compaction(storage, count)

    def after_compaction(self, storage: SlotStorage, count: int) -> None:
        """Rebuild what a compaction to `count` slots left stale."""
        raise NotImplementedError

    def align_query(
        self, query: torch.Tensor, used: Callable[[], torch.Tensor], n: int, remember: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The queries `[B, H_q, q, D]` rotated where the keys expect them, and those positions `[q]`
        (None when nothing needs them). `used()` gives the positions the model rotated them at;
        `remember`: a policy keeps recent queries, so their positions are needed."""
        raise NotImplementedError

    def move(self, x: torch.Tensor, used: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """`x` `[..., m, D]` rotated at `used` `[m]`, as it would be rotated at `target` `[m]`."""
        return x if torch.equal(used, target) else self.rotary.move(x, used, target)

    def static_attention(
        self, layer: ReplayingLayer, query: torch.Tensor, used: torch.Tensor, scaling: float, plan: StaticPlan
    ) -> torch.Tensor | None:
        """A closed-form replay's attention `[B, H_q, q, D]`: each query `[B, H_q, q, D]` (rotated at
        `used` `[q]`) over what was alive at its step (`plan.alive`), or None where this mode's
        shortcut does not apply (the chunk is then stepped)."""
        raise NotImplementedError

    def replay_steps(
        self, layer: ReplayingLayer, query: torch.Tensor, used: torch.Tensor, scaling: float
    ) -> Replayed:
        """Step through a chunk's queries `[B, H_q, q, D]` (rotated at `used` `[q]`) as one-token
        forwards would: attention, statistics, eviction (the reference replay). Returns the output
        `[B, H_q, q, D]` with the layer's new state."""
        raise NotImplementedError


class OriginalPositions(PositionMode):
    name = ORIGINAL.name
    raw_keys = False
    fixed_keys = True

    def seq_length(self, n: int, seen: int) -> int:
        """What the cache reports to transformers: where the next token's position starts."""
        return seen

    def continues(self, first: int, n: int, seen: int) -> bool:
        """Whether a forward whose first token sits at `first` continues this sequence."""
        return first == seen

    def keys_need_positions(self, layer: int) -> bool:
        """Whether `store_keys` needs the positions the model used (else: only layer 0 checks them)."""
        return False

    def store_keys(self, storage: SlotStorage, keys: torch.Tensor, used: torch.Tensor | None, n: int) -> None:
        storage.keys[:, :, n : n + keys.shape[2]] = keys

    def align_query(self, query, used, n, remember):
        return query, used() if remember else None  # keys sit where the model rotated the queries

    def static_attention(self, layer, query, used, scaling, plan):
        return replay.fixed_static_attention(layer, query, used, scaling, plan)

    def replay_steps(self, layer, query, used, scaling):
        return replay.steps_fixed_keys(layer, query, used, scaling)

    def keeps_arrival(self, wanted: bool) -> bool:
        return wanted

    def ring(self, start: int | None) -> int | None:
        return start

    def now(self, stream: torch.Tensor, seen: int, total: int) -> torch.Tensor:
        """Where tokens at stream positions `stream`, all still cached, sit now."""
        return stream

    def after_compaction(self, storage: SlotStorage, count: int) -> None:
        """Nothing to rebuild: a key keeps its rotation wherever its slot moves."""


class ShiftedPositions(PositionMode):
    name = SHIFTED.name
    raw_keys = True
    fixed_keys = False

    def seq_length(self, n: int, seen: int) -> int:
        return n

    def continues(self, first: int, n: int, seen: int) -> bool:
        return first in (n, seen)

    def keys_need_positions(self, layer: int) -> bool:
        return True

    def store_keys(self, storage: SlotStorage, keys: torch.Tensor, used: torch.Tensor | None, n: int) -> None:
        end = n + keys.shape[2]
        raw = self.rotary.unrotate(keys, *self.rotary.at(used))
        storage.raw[:, :, n:end] = raw
        cos, sin = self.rotary.table(end)
        storage.keys[:, :, n:end] = self.rotary.rotate(raw, cos[n:], sin[n:])

    def align_query(self, query, used, n, remember):
        target = torch.arange(n, n + query.shape[2], device=query.device)
        return self.move(query, used(), target), target

    def keeps_arrival(self, wanted: bool) -> bool:
        return False  # every eviction re-rotates the kept keys

    def ring(self, start: int | None) -> int | None:
        return None  # an eviction renumbers every later slot: it compacts

    def now(self, stream: torch.Tensor, seen: int, total: int) -> torch.Tensor:
        # Every such token is still cached, so its slot is fixed by how many came after it.
        return total - (seen - stream)

    def after_compaction(self, storage: SlotStorage, count: int) -> None:
        cos, sin = self.rotary.table(count)
        storage.keys[:, :, :count] = self.rotary.rotate(storage.raw[:, :, :count], cos, sin)

    def static_attention(self, layer, query, used, scaling, plan):
        """A chunk whose every step evicts the oldest unpinned entry (see `_shift_terms`): two
        rotations of the queries (for the sinks, and for the rest) and one of the keys give every
        logit exactly; the kernel attends a block of queries at a time (`attention_stats.attend`, its
        logits from both rotations). None when the chunk does not have that shape (then it is stepped)."""
        if plan.shift is None:
            plan.shift = self._shift_terms(layer, plan)
        if not plan.shift:
            return None
        pinned, width, seen_before, query_at, slot_rank = plan.shift
        storage, rotary = layer.storage, self.rotary
        total = layer.n + layer.new
        raw_query = rotary.unrotate(query, *rotary.at(used))
        keys = rotary.rotate(storage.raw[:, :, :total], *rotary.at(slot_rank))

        def products_at(start: int, stop: int) -> torch.Tensor:  # [B, H_kv, g, block, total], two rotations
            raw = raw_query[:, :, start:stop]
            logits = products(rotary.rotate(raw, *rotary.at(query_at[start:stop])), keys)
            if width:
                at_pinned = products(rotary.rotate(raw, *rotary.at(seen_before[start:stop])), keys[:, :, :width])
                logits[..., :width] = torch.where(pinned[:, :, None, None, :width], at_pinned, logits[..., :width])
            return logits

        return attend(raw_query, keys, scaling, bound(layer.settings.workspace), Mask(alive=plan.alive),
                      values=storage.values[:, :, :total], products=products_at).out

    @staticmethod
    def _shift_terms(layer: ReplayingLayer, plan: StaticPlan) -> tuple:
        """The shortcut's terms for `plan`, or `()` when the chunk lacks its shape.

        Query `i` sits at `n_i` (the entries it sees, less itself) and a key at its rank
        among them, so ranks move as entries leave. When each step evicts the oldest entry
        outside a fixed set `S` of older, never-evicted ones (the sinks: `window`,
        `sinkN+window`), every other key's rank drops by one per eviction, so the relative
        distance `n_i - rank` equals `Q_i - P_j` with `Q_i = n_i + E(i)` (`E(i)`: evictions
        before step `i`) and `P_j` fixed per key. Returns
        `(pinned [B, H, total], width, n_i [q], Q_i [q], P_j [total])`.
        """
        n0, q, budget = layer.n, layer.new, layer.budget
        device = plan.pos.device
        never = selection.LATEST_LAST
        step_of = (torch.arange(n0 + q, device=device) - n0).clamp(min=-1)
        victims = replay.victims_of(plan)
        first_victim = victims.masked_fill(~plan.evicting, never).amin(dim=-1)  # [B, H]
        pinned = (step_of < 0) & (plan.pos < first_victim[..., None])  # S: held, older than every victim
        oldest = plan.pos[:, :, None, :].masked_fill(~plan.alive | pinned[:, :, None, :], never).amin(dim=-1)
        if not bool(((oldest == victims) | ~plan.evicting).all()):
            return ()
        steps = torch.arange(q, device=device)
        seen_before = (n0 + steps).clamp(max=budget)  # n_i
        evictions = (steps - max(0, budget - n0)).clamp(min=0)  # E(i)
        slot_rank = torch.cat([torch.arange(n0, device=device), seen_before + evictions])  # P_j, by slot
        # S is a few of the oldest held slots (the sinks): their logits need the other query rotation
        width = int(pinned.any(dim=(0, 1)).nonzero().max()) + 1 if bool(pinned.any()) else 0
        return pinned, width, seen_before, seen_before + evictions, slot_rank

    def replay_steps(self, layer, query, used, scaling):
        """The kept entries are renumbered `0..k-1` at every step, so each step rotates the
        un-rotated keys to their slots and its query to `k`, and attends on its own (the kernel's
        one-query path, `attention_stats.query_attention`). A step that evicts compacts the virtual
        slots (positional order is kept)."""
        storage, rotary = layer.storage, self.rotary
        q = query.shape[2]
        step = Stepper(layer, scaling)
        raw_query = rotary.unrotate(query, *rotary.at(used))
        window = layer.window_size()  # a sliding layer that runs an engine's schedule masks its band
        outs = StepOutputs(q)  # one tensor for every step's output (`step/outputs.py`: the heap's sake)
        for i in range(q):
            slots, positions, seen = step.begin(i)
            total, k = slots.shape[-1], step.k
            cos, sin = rotary.table(total)
            keys = rotary.rotate(take_slots(storage.raw, slots), cos, sin)
            q_i = rotary.rotate(raw_query[:, :, i : i + 1], cos[k : k + 1], sin[k : k + 1])
            band = None  # a sliding layer under an engine's schedule: its band, the oldest slots hidden
            if window is not None and total > window:
                band = torch.arange(total, device=layer.device) < total - window
            out, probs = query_attention(q_i, keys, take_slots(storage.values, slots), scaling, band)
            outs.put(i, out)
            victim = step.end(slots, positions, seen, keys, probs, q_i, torch.tensor([k], device=layer.device))
            if victim is not None:  # compaction keeps positional order
                keep = torch.arange(step.k, device=layer.device)
                step.vslot[:, :, : step.k] = slots.gather(-1, keep + (keep >= victim[..., None]).long())
        self.compact(storage, step.vslot[:, :, : step.k], step.k)
        return Replayed(outs.out, step.k, layer.ordered)


MODES: dict[str, type[PositionMode]] = {mode.name: mode for mode in (OriginalPositions, ShiftedPositions)}


def for_name(mode: ModeName, rotary: Rotary | None) -> PositionMode:
    """The mode `mode` (checked by `position_modes.check_positions`) with one layer kind's rotary module."""
    return MODES[mode.name](rotary)
