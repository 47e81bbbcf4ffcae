"""`LayerSettings`: what every layer of one cache shares, set by the cache and read by its layers."""

from __future__ import annotations

from dataclasses import dataclass, field

from .observers import Observer
from .positions import PositionMode
from .rows import RowLayout


@dataclass
class LayerSettings:
    """What every layer of one cache shares; set by the cache, read by its layers."""

    mode: PositionMode
    layout: RowLayout
    stat_names: tuple[str, ...]
    query_window: int
    slack: int
    last_layer: int
    budgets: list[int | None]  # per layer; None never evicts
    per_token: bool  # a forward of many tokens evicts as that many one-token forwards would
    config: object  # the model's config: its attention implementation must be kvevict's
    observers: list[Observer] = field(default_factory=list)
    # the last chunk's closed-form replay plan, reused by the next layer when it ranks the
    # same tokens the same way (`replay.StaticPlan`); a memo, never read as state
    static_plan: object | None = None
