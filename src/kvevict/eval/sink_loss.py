"""Sink loss, defined once: the share of (bounded layer, KV head) pairs that no longer hold token 0.

A *bounded* layer is one the budget bounds (every full-attention layer). A model's own
sliding-window layers (Gemma 3's local layers) keep their window whatever the policy,
so they lose token 0 by design once the stream passes the window and say nothing about
the policy: they are left out of the share and described on their own.

Everything that shows a sink loss (the A/B summary, the side-by-side table, the verdict,
the JSON rows of `kvevict ppl`) computes it here, from the grid a run records:
`sink_lost_at` `[layers][kv_heads]`, the tokens seen when token 0 left that (layer, KV
head), -1 if it never did, and `None` for a layer the budget does not bound. Pure
Python: the report imports it without torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SinkLoss:
    """`lost` of `bounded` (layer, KV head) pairs no longer hold token 0; `unbounded_layers` were left out."""

    lost: int
    bounded: int
    unbounded_layers: int = 0

    @property
    def share(self) -> float | None:
        """lost / bounded; None when no layer is bounded (nothing to lose)."""
        return self.lost / self.bounded if self.bounded else None


def sink_loss(grid: Sequence[Sequence[int] | None] | None) -> SinkLoss | None:
    """The sink loss of a recorded grid (None for a record without one)."""
    if not grid:
        return None
    lost = bounded = unbounded = 0
    for layer in grid:
        if layer is None:
            unbounded += 1
            continue
        bounded += len(layer)
        lost += sum(1 for at in layer if at >= 0)
    return SinkLoss(lost, bounded, unbounded)


def unbounded_note(loss: SinkLoss | None, window: int | None) -> str | None:
    """What happened to token 0 in the layers left out, in one clause (None when there are none)."""
    if loss is None or not loss.unbounded_layers:
        return None
    size = f"window {window}" if window else "their own window"
    return (f"sliding layers ({loss.unbounded_layers}): the model's {size}, not the budget; "
            "they lose token 0 by design once the stream passes it and are not counted")
