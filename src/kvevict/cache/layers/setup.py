"""What each layer of a model gets from the cache at construction: its class and its settings.

`LAYER_KINDS` maps each kind of attention layer a model declares (`config.layer_types`) to
the peer that serves it (`interface.CacheLayer`); `layer_classes` adjusts it to the
batch's policies. `position_modes` and `layer_settings` build the frozen `LayerSettings`
of every layer (the position mode with its kind's rotary module, the hand-off slot, the
storage form, the ring).
"""

from __future__ import annotations

from collections.abc import Sequence

from ...attention_stats import Workspace
from ...errors import KvevictError
from ...policies import Policy
from ...position_modes import DEFAULT_POSITIONS, ModeName
from ..attention import handoffs
from ..observers import Observer
from ..positions.modes import PositionMode, for_name
from ..positions.rotary import Rotary
from ..replay.paths import MEASURED_ELSEWHERE, unmeasured
from ..rows import RowLayout
from ..storage.quantized import storage_form_of
from ..storage.working import WorkingBuffer
from .interface import CacheLayer
from .per_head import PER_HEAD_KINDS
from .settings import LayerSettings
from .sliding import SlidingLayer
from .uniform import EvictingLayer

#: the layer class for each kind of attention layer a model declares (`config.layer_types`);
#: a new kind is one class and one line here
LAYER_KINDS: dict[str, type[CacheLayer]] = {"full_attention": EvictingLayer, "sliding_attention": SlidingLayer}


def layer_classes(policies: Sequence[Policy]) -> dict[str, type[CacheLayer]]:
    """The class serving each kind of layer under these policies: `LAYER_KINDS`, with per-head layers for a
    policy that shares a layer's entries among its heads (`Policy.varies_by_head`; sliding-window layers run
    no policy: they stay as they are), and the uniform layer for sliding-window layers when the policy's
    budget holds every layer (`Policy.bounds_every_layer`: it runs there too, masked to the window's band)."""
    classes = dict(LAYER_KINDS)
    if any(p.varies_by_head for p in policies):
        classes.update(PER_HEAD_KINDS)
    if any(p.bounds_every_layer for p in policies):
        classes["sliding_attention"] = EvictingLayer
    return classes


def check_measures(policies: Sequence[Policy], classes: Sequence[type[CacheLayer]], per_token: bool) -> None:
    """Refuse, when the cache is built, a policy that declares a request (`Capabilities.requests`) a layer it
    runs in cannot measure: the layer's own forwards (`CacheLayer.measures`) and, in uniform layers, each step
    path that may take its rows (`step_paths`) and, where a chunk is replayed token by token (`per_token`),
    each replay path that may (`replay_paths.unmeasured`)."""
    for policy in policies:
        caps = policy.capabilities
        for cls in {c for c in classes if c.measures is not None}:
            gaps = [(kind, f"the {cls.__name__}", MEASURED_ELSEWHERE) for kind in caps.requests
                    if kind not in cls.measures]
            if cls is EvictingLayer:
                gaps += unmeasured(caps, per_token)
            if gaps:
                kind, where, fix = gaps[0]
                raise KvevictError(
                    f"'{policy.spec()}' asks for '{kind}' measurements, which {where} cannot make: {fix}"
                )


def head_dim(text) -> int:
    """The size of one key (`text`: the decoder's config)."""
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def position_modes(model, text, kinds: Sequence[str], mode: ModeName) -> dict[str, PositionMode]:
    """Per kind of layer, the position mode `mode` with that kind's rotary module: one for all kinds, or one per
    kind when the model's rotary module has a base per kind (Gemma 3). Refuses a mode that needs a rotation on
    a model with absolute positions."""
    rotary_emb = getattr(model.base_model, "rotary_emb", None)
    if rotary_emb is None and mode.needs_rotary:
        raise KvevictError(
            f"{type(model).__name__} has learned/absolute position embeddings, not rotary ones: there is no "
            f"rotation to shift, so positions='{mode.name}' cannot apply; use positions='{DEFAULT_POSITIONS}' "
            "(eviction is masking)"
        )
    per_kind = rotary_emb is not None and hasattr(rotary_emb, "layer_types")  # Gemma 3: a base per kind
    parameter = next(model.parameters())

    def rotary(kind: str | None) -> Rotary | None:
        if rotary_emb is None:
            return None
        return Rotary(rotary_emb, head_dim(text), parameter.dtype, parameter.device, kind if per_kind else None)

    shared = None if per_kind else for_name(mode, rotary(None))
    return {kind: shared or for_name(mode, rotary(kind)) for kind in set(kinds)}


def layer_settings(
    model,
    text,
    kinds: Sequence[str],
    modes: dict[str, PositionMode],
    layout: RowLayout,
    observers: Sequence[Observer],
    slack: int,
    per_token: bool,
    workspace: Workspace | None = None,
    working: WorkingBuffer | None = None,
) -> list[LayerSettings]:
    """Every layer's settings (`kinds[i]`: layer `i`'s kind). Marks the model's attention modules with their
    hand-off slots (`attention.handoffs`). `working`: the cache's buffer its storage-form layers decode into."""
    policies = layout.policies
    slots = handoffs(model)
    window = getattr(text, "sliding_window", None)
    storage_form = storage_form_of(policies, head_dim(text), working)  # quantized entries (`q4+...`) or as they are
    fifo = {p.fifo_after for p in policies}
    fifo_after = fifo.pop() if len(fifo) == 1 else None  # one ring for all rows, or none
    return [
        LayerSettings(
            mode=modes[kind],
            layout=layout,
            stat_names=tuple(sorted({name for p in policies for name in p.stats})),
            query_window=max(p.query_window for p in policies),
            slack=slack,
            last_layer=len(kinds) - 1,
            per_token=per_token,
            config=model.config,
            observers=tuple(observers),
            handoff=slots.get(index),
            window=int(window) if kind == "sliding_attention" else None,
            fifo_after=fifo_after,
            storage_form=storage_form,
            workspace=workspace,
        )
        for index, kind in enumerate(kinds)
    ]
