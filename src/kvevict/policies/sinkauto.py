"""`sinkauto+P`: pin the positions that act as attention sinks, found on a calibration prefix.

`sinkN+P` assumes the sinks are the first N tokens. They usually include token 0, but
other early tokens (the first newline, a period, a chat-template marker) can soak up
as much attention while token 1..3 get little. `sinkauto` measures instead: during the
first `calib` tokens it sums the attention every slot receives (all queries of those
forwards, summed over the query heads of each KV head), and when the prefix is done it
pins, per layer and KV head, the `n` slots that received the most. Policy P runs on
the remaining `budget - n` slots, exactly as in `sinkN+P`.

Nothing is evicted before the cache is full, so during calibration slot i holds position
i and the accumulator can be indexed by position. If an eviction comes before `calib`
tokens were seen (a budget below `calib`), calibration ends at that step with what it
has. The accumulator is the layer's state for this policy (`Calibration`), not a cache statistic: when P asks for
attention at a calibration step (H2O always does), the same measurement feeds both.

Spec: `sinkauto+P` (4 sinks) or `sinkautoN+P`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import KvevictError
from .base import AttentionRequest, QueryBatch, SlotView
from .capabilities import Capabilities, with_fields
from .sinks import SinkWrapper

STAT = "sinkauto_mass"


@dataclass
class Calibration:
    """One layer's calibration: the attention each position received so far, then the sinks it chose."""

    inner: object | None  # the inner policy's state
    mass: torch.Tensor | None = None  # [b, H_kv, calib] attention received by position, until it closes
    sinks: torch.Tensor | None = None  # [b, H_kv, n] pinned positions, once it closed
    closing: bool = False  # calibration ends after this step


@dataclass(eq=False)
class SinkAuto(SinkWrapper):
    calib: int = 64

    def __post_init__(self) -> None:
        if self.n_sinks < 1:
            raise KvevictError(f"sinkauto needs at least 1 sink to pin, got {self.n_sinks}")
        if self.calib < self.n_sinks:
            raise KvevictError(
                f"sinkauto's calibration prefix ({self.calib}) must be at least its {self.n_sinks} sinks"
            )
        super().__post_init__()

    def wrap(self, inner: Capabilities) -> Capabilities:
        """Attention decides which slots are pinned (so it needs attention and its scores are not static,
        with a statistic of its own). The pinned slots are not the first N positions, so `pinned` (the
        cache's "first N are held" check) stays what the inner policy pins itself."""
        return with_fields(super().wrap(inner), needs_attention=True, static_scores=False,
                           requests=tuple(dict.fromkeys((*inner.requests, "new"))),
                           stats=tuple(dict.fromkeys((*inner.stats, STAT))), pinned=inner.pinned)

    def prefix(self) -> str:
        return f"sinkauto{self.n_sinks}"

    def new_state(self, layer: int) -> Calibration:
        return Calibration(inner=self.inner.new_state(layer))

    def inner_view(self, view: SlotView) -> SlotView:
        return view.with_budget(view.budget - self.n_sinks).with_state(view.state.inner)

    # --- calibration -------------------------------------------------------------
    def request(self, view: SlotView, will_evict: bool) -> AttentionRequest | None:
        inner = super().request(view, will_evict)
        state = view.state
        if state.sinks is not None:
            return inner
        state.closing = will_evict or view.seen >= self.calib
        return inner if inner is not None else AttentionRequest(kind="new", stat=STAT, accumulate=True)

    def absorb(self, view: SlotView, request: AttentionRequest, mass: torch.Tensor | QueryBatch) -> torch.Tensor:
        # an inner policy that reads the queries (expected-attention) measures no attention to calibrate on:
        # the steps before its first eviction calibrate, or the first N tokens stand in (`pinned_mask`)
        if view.state.sinks is None and not isinstance(mass, QueryBatch):
            self._record(view, mass)
        if request.stat == STAT:
            return view.stats[STAT] + mass
        return super().absorb(view, request, mass)

    def _record(self, view: SlotView, mass: torch.Tensor) -> None:
        state = view.state
        if state.mass is None:
            state.mass = torch.zeros(*mass.shape[:2], self.calib, dtype=torch.float64, device=mass.device)
        # padded views of ragged per-head storage (adakv) mark empty slots with position -1
        inside = (view.positions >= 0) & (view.positions < self.calib)
        index = view.positions.clamp(0, self.calib - 1)
        state.mass.scatter_add_(2, index, torch.where(inside, mass.to(torch.float64), 0.0))
        if state.closing:
            self._close(state, min(self.calib, view.seen))

    def _close(self, state: Calibration, seen: int) -> None:
        acc = state.mass[..., :seen]
        state.mass = None
        count = min(self.n_sinks, seen)
        # ties (e.g. no attention measured) go to the earliest positions, as sinkN would pin
        order = torch.sort(acc, dim=-1, descending=True, stable=True).indices
        state.sinks = order[..., :count]

    # --- selection -----------------------------------------------------------------
    def pinned_mask(self, view: SlotView) -> torch.Tensor:
        sinks = view.state.sinks
        if sinks is None:
            # evicting before any attention was measured: fall back to the first N tokens
            return view.positions < self.n_sinks
        return (view.positions[..., :, None] == sinks[..., None, :].to(view.positions.device)).any(-1)

    def scores(self, view: SlotView) -> torch.Tensor:
        if view.state.sinks is None and view.state.mass is not None:
            self._close(view.state, min(self.calib, view.seen))
        return super().scores(view)
