"""`Capabilities`: everything the cache, the replay and the harness may ask about a policy, in one object.

A leaf policy declares what differs from the defaults as class attributes named like the fields
(`static_scores = True`), or as properties where an option decides (SnapKV's `query_window`);
`Policy.capabilities` gathers them once per policy object. A wrapper never forwards a
declaration by hand: its `capabilities` are its inner policy's, with what the wrapper changes
(`Wrapper.wrap`), so a new field is one line here and, where wrappers must not inherit it, one
line in `wrapper.RULE`.

Two questions the harness asks in many places are answered here once: `is_full_cache` (the
reference every policy is judged against: never evicts, entries held as they are; `q4+full`
never evicts but is a storage form, measured as a row of its own) and `may_share_batch` (whether
policies can be rows of one cache).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import KvevictError


@dataclass(frozen=True)
class Capabilities:
    """What a policy declares. Field by field:

    `stats`: per-slot float accumulators the cache carries (and gathers) for it.
    `pinned`: leading tokens it guarantees to keep (sink pinning).
    `query_window`: most recent queries the cache must remember for it (SnapKV).
    `unbounded`: never evicts; the cache treats the budget as unbounded (`full`).
    `needs_attention`: what it keeps depends on attention (so it asks for it); otherwise the kept set
    follows from positions and keys alone and can be computed ahead of attention.
    `static_scores`: a token's score is fixed when it arrives (its position or its key decides it) and no
    randomness is drawn, so the kept set after any step is the top-budget of all tokens seen: chunked
    evaluation computes it in closed form instead of stepping.
    `slot_local`: `scores` treats each slot on its own (its position, its statistics, the view's `seen` and
    `budget`), and so does `absorb` of the `"new"` requests it makes (a `"window"` request is absorbed on the
    alive slots only): a chunk replay in original positions scores every slot of the chunk at once.
    `reads_keys`: scores slots by their keys (`view.keys()`: knorm, keydiff), so like an attention-driven
    policy it can keep token 0 on some heads and lose it on others.
    `varies_by_layer`: gives each layer its own budget (`layer_budgets`, PyramidKV).
    `varies_by_head`: gives each KV head of a layer its own share of the layer's entries (`head_floor`,
    Ada-KV); the layer then stores ragged per-head segments and attends by hand.
    `own_schedule`: evicts on its own schedule (`evict_to`: many entries at once, or below the budget).
    `preset`: reproduces a serving engine's whole rule; wrappers refuse to wrap it.
    `bounds_every_layer`: on a hybrid model the budget bounds the sliding-window layers too (llama.cpp).
    `fifo_after`: evicts the oldest entry after its first `fifo_after` tokens (a window, or a window behind
    pinned sinks), None for any other rule: a decode step's victim is known without scores (a ring).
    `arrival_stat`: part of its score is a number each key alone decides (`Policy.arrival`), which the cache
    may compute once per key and keep per slot (`SlotView.arrival`).
    `kv_storage`: how the cache holds each kept entry: None (the model's dtype) or a `quantized.KvQuant`.
    `reconstructs`: scored by reconstructing the context after its prefill (KVzip).
    `ranks_layers`: ranks the entries of every layer together at a held-back eviction (KVzip's default).
    `position_mode`: the position mode of the engine it reproduces (a name in `position_modes`), or None
    when it runs in either.
    `requests`: the kinds of measurement it may ask for (`AttentionRequest.kind`), so that a cache whose
    layers cannot measure one refuses it when it is built, not mid-run; () declares none.
    """

    stats: tuple[str, ...] = ()
    pinned: int = 0
    query_window: int = 0
    unbounded: bool = False
    needs_attention: bool = False
    static_scores: bool = False
    slot_local: bool = False
    reads_keys: bool = False
    varies_by_layer: bool = False
    varies_by_head: bool = False
    own_schedule: bool = False
    preset: bool = False
    bounds_every_layer: bool = False
    fifo_after: int | None = None
    arrival_stat: bool = False
    kv_storage: object | None = None
    reconstructs: bool = False
    ranks_layers: bool = False
    position_mode: str | None = None
    requests: tuple[str, ...] = ()

    @property
    def own_batch(self) -> bool:
        """Whether this policy cannot share a batch with uniform-budget policies: a layer stores one
        budget for all its rows (`varies_by_layer`), one storage layout (`varies_by_head`) and one
        number of entries held (`own_schedule`)."""
        return self.varies_by_layer or self.varies_by_head or self.own_schedule

    @property
    def is_full_cache(self) -> bool:
        """The full cache, the reference: never evicts and holds its entries as they are (`full`; not
        `q4+full`, which never evicts but holds codes: a storage form measured as a row of its own)."""
        return self.unbounded and self.kv_storage is None

    def batch_key(self) -> tuple:
        """Policies with equal keys may be rows of one cache (`may_share_batch`): one storage form, and
        a cache that grows or one that does not."""
        return (self.kv_storage, self.unbounded)


#: the field names, in declaration order (what `Policy.capabilities` gathers)
FIELDS = tuple(f.name for f in dataclasses.fields(Capabilities))


@dataclass(frozen=True)
class Unknown:
    """A field its policy cannot answer yet (llama.cpp's pinned tokens before the model's add-BOS is known):
    the policy's own error, raised when the field is read through the policy (`read`)."""

    error: Exception


def gather(policy) -> Capabilities:
    """`policy`'s declarations (class attributes and properties named like the fields) as one object; a
    field whose declaration refuses to answer yet holds `Unknown`."""
    values = {}
    for name in FIELDS:
        try:
            values[name] = getattr(policy, name)
        except KvevictError as exc:
            values[name] = Unknown(exc)
    return Capabilities(**values)


def read(capabilities: Capabilities, name: str) -> object:
    """Field `name`, raising the policy's error where it could not answer (`Unknown`)."""
    value = getattr(capabilities, name)
    if isinstance(value, Unknown):
        raise value.error
    return value


def may_share_batch(capabilities: Sequence[Capabilities]) -> bool:
    """Whether policies with these capabilities can run as rows of one cache: none runs in a batch of its
    own (`own_batch`) unless it is alone, all hold entries in one storage form, and none grows beside
    rows that do not (a full cache's layers grow while a bounded one's stay at the budget)."""
    if len(capabilities) <= 1:
        return True
    if any(c.own_batch for c in capabilities):
        return False
    return len({c.batch_key() for c in capabilities}) == 1


def with_fields(capabilities: Capabilities, **changes) -> Capabilities:
    """`capabilities` with `changes` (a wrapper's: `Wrapper.wrap`)."""
    return dataclasses.replace(capabilities, **changes)
