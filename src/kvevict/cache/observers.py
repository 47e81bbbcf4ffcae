"""Observers: metrics an evaluation attaches to a cache, kept off the cache's own logic.

A layer reports two things to whoever observes it: after every forward how many
entries it holds, and after every eviction what left. Sink tracking and the largest
cache size are built on those reports; the layers know nothing of them. The
`held_*` functions answer from what the cache holds now, with no observer at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Eviction:
    """What one layer evicted in one forward.

    `victims` `[B, H_kv]`: original positions of the single entry each (row, head) lost
    (a decode step, or one step of a chunk replayed token by token), when an observer
    asked for them; None after a compaction, where `kept` `[B, H_kv, budget]`
    (positions, ascending) tells what stayed.
    """

    layer: int
    seen: int
    kept: torch.Tensor | None
    victims: torch.Tensor | None


class Observer:
    """Base: override what you need. `wants_victims` asks the layer to report victims."""

    wants_victims = False

    def on_bind(self, pinned_per_row: list[int]) -> None:
        """The cache's rows were bound to policies that pin this many leading tokens each."""

    def on_forward(self, layer: int, held: int) -> None:
        """`layer` holds `held` entries per (row, KV head) after a forward."""

    def on_evict(self, event: Eviction) -> None:
        """`layer` just evicted down to its budget."""

    def on_evict_steps(self, layer: int, seen: torch.Tensor, victims: torch.Tensor) -> None:
        """`layer` evicted one entry per (row, KV head) at each of `k` steps of a chunk replayed
        in closed form: `seen` `[k]` tokens seen after each step, `victims` `[B, H_kv, k]`
        their positions. By default one `on_evict` per step; an observer may take them at once."""
        for i, at in enumerate(seen.tolist()):
            self.on_evict(Eviction(layer, at, None, victims[:, :, i]))

    def keep_rows(self, rows: list[int]) -> None:
        """Only the batch rows `rows` stay (`EvictingCache.batch_select_indices`): row `rows[i]` is row `i` from now on.
        An observer that keeps something per row must follow."""

    def reset(self) -> None:
        """The cache was reset for a new sequence."""


class KeptTracker(Observer):
    """The most entries any layer held after a forward (checks the budget was kept)."""

    def __init__(self) -> None:
        self.most = 0

    def reset(self) -> None:
        self.most = 0

    def on_forward(self, layer: int, held: int) -> None:
        if held > self.most:
            self.most = held


class SinkTracker(Observer):
    """When token 0 (the attention sink) left each layer's (row, KV head): tokens seen then, -1 never.

    Rows whose policy pins token 0 can never lose it; when every row does, eviction
    reports are not even looked at.

    A decode step's victims are not looked at one layer at a time: token 0 leaves a (row, head)
    once, so most steps evict something else and one look per forward at all its layers' victims
    (`_flush`, when a layer reports a second time or anyone reads `lost_at`) costs one comparison
    instead of one per layer. Events are looked at in the order they came, so the first loss wins.
    """

    def __init__(self) -> None:
        self.pinned_per_row: list[int] = []
        self.reset()

    def on_bind(self, pinned_per_row: list[int]) -> None:
        self.pinned_per_row = pinned_per_row
        self.wants_victims = any(p == 0 for p in pinned_per_row)

    def reset(self) -> None:
        self.lost: dict[int, torch.Tensor] = {}  # layer -> [B, H_kv]
        self.settled: set[int] = set()  # layers where token 0 left every (row, KV head): nothing left to note
        # one-entry evictions not looked at yet, oldest first: (layer, seen, victims [B, H_kv])
        self._pending: list[tuple[int, int, torch.Tensor]] = []
        self._pending_layers: set[int] = set()

    def keep_rows(self, rows: list[int]) -> None:
        self._flush()
        self.pinned_per_row = [self.pinned_per_row[r] for r in rows]
        self.wants_victims = any(p == 0 for p in self.pinned_per_row)
        index = torch.tensor(rows, dtype=torch.long)
        for layer, at in self.lost.items():
            self.lost[layer] = at[index.to(at.device)]
        self.settled = {layer for layer, at in self.lost.items() if bool((at >= 0).all())}

    def on_evict(self, event: Eviction) -> None:
        if not self.wants_victims or event.layer in self.settled:
            return
        if event.victims is not None:
            if event.layer in self._pending_layers:  # the next forward: look at the last one's first
                self._flush()
            self._pending.append((event.layer, event.seen, event.victims))
            self._pending_layers.add(event.layer)
            return
        self._flush()
        self._record(event.layer, event.kept[:, :, 0] != 0, event.seen)  # kept positions ascend: token 0 held iff first

    def _flush(self) -> None:
        """Look at the pending victims, all layers at once (see the class docstring)."""
        pending = self._pending
        if not pending:
            return
        self._pending, self._pending_layers = [], set()
        shapes = {victims.shape for _, _, victims in pending}
        lost = [victims == 0 for _, _, victims in pending] if len(shapes) > 1 else None
        if lost is None:
            stacked = torch.stack([victims for _, _, victims in pending]) == 0  # [k, B, H_kv]
            # token 0 leaves a (row, head) once: most forwards evict something else. On the CPU looking
            # costs less than the update; on a GPU it would wait for the device, so it updates blindly
            if not stacked.is_cuda and not bool(stacked.any()):
                return
            lost = stacked.unbind(0)
        for (layer, seen, _), gone in zip(pending, lost):
            if layer not in self.settled:
                self._record(layer, gone, seen)

    def on_evict_steps(self, layer: int, seen: torch.Tensor, victims: torch.Tensor) -> None:
        if not self.wants_victims or layer in self.settled:
            return
        self._flush()
        lost = victims == 0  # [B, H, k]; token 0 leaves a (row, head) at most once
        first = lost.to(torch.uint8).argmax(dim=-1)  # [B, H], the step it left at (0 when it stayed)
        self._record(layer, lost.any(dim=-1), seen.to(victims.device)[first])

    def _record(self, layer: int, lost: torch.Tensor, seen: int | torch.Tensor) -> None:
        """Note `seen` where token 0 left (`lost` `[B, H]`) and had not left before."""
        at = self.lost.get(layer)
        if at is None:
            at = self.lost[layer] = torch.full(lost.shape, -1, dtype=torch.long, device=lost.device)
        # a new tensor, not `copy_`: a look deferred to `lost_at` may run outside the inference mode
        # the forward ran in, where an inference tensor cannot be updated in place
        at = self.lost[layer] = torch.where(lost & (at < 0), seen, at)
        if not at.is_cuda and bool((at >= 0).all()):  # a token never comes back: nothing more to tell
            self.settled.add(layer)

    def lost_at(self, layers: int, heads: int) -> torch.Tensor:
        """`[layers, B, H_kv]`: tokens seen when token 0 was evicted, -1 if it never was."""
        self._flush()
        never = torch.full((len(self.pinned_per_row), heads), -1, dtype=torch.long)
        return torch.stack([self.lost[i].cpu() if i in self.lost else never for i in range(layers)])


def held_sink_loss(kept: list[torch.Tensor]) -> torch.Tensor:
    """Per row: the fraction of (layer, KV head) pairs that no longer hold token 0.

    `kept`: per layer, `[B, H_kv, n]` original positions held (any order).
    """
    held = torch.stack([(pos == 0).any(dim=-1) for pos in kept]).cpu()
    return 1.0 - held.float().mean(dim=(0, 2))


def held_pinned_lost(kept: list[torch.Tensor], pinned_per_row: list[int]) -> torch.Tensor:
    """`[B]` bool: whether a row no longer holds one of the leading tokens its policy pins.

    A token never comes back once evicted, so "not held now" is "evicted at some point":
    True would be a bug in the cache or the policy.
    """
    pinned = torch.tensor(pinned_per_row, dtype=torch.long)
    wrong = torch.zeros(len(pinned_per_row), dtype=torch.bool)
    most = int(pinned.max()) if len(pinned_per_row) else 0
    for pos in kept:
        # before the cache holds `most` entries nothing was evicted: check what it can hold
        for token in range(min(most, pos.shape[-1])):
            held = (pos == token).any(dim=-1).cpu()  # [B, H]
            wrong |= (~held).flatten(1).any(-1) & (token < pinned)
    return wrong
