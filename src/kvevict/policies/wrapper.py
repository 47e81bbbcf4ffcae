"""`Wrapper`: the base of policies that wrap another (`sinkN+P`, `sinkauto+P`, `adakv:P`, `qB+P`, `P:page=N`).

A wrapper holds its inner policy and changes one thing about it (it pins sinks, shares the budget across
heads, evicts whole pages, or holds the kept entries as codes), so it is the inner policy for everything
else, by two rules written once here and never by hand (kvpress's wrapper presses hold the inner press
and delegate the same way):

* its `capabilities` are the inner policy's (`wrap`), but for the fields of the inner policy's own rule
  (`RULE`), which a wrapper that changes the rule declares itself;
* every hook of `Policy` it does not define itself is the inner policy's (the loop at the end): a hook that
  returns a policy (`with_seed`, `with_stream_start`) returns this wrapper around the inner policy's answer,
  every other one returns the inner policy's answer. So a hook added to `Policy` reaches every inner policy
  through every wrapper without a line here.

Not a dataclass itself: each wrapper owns its fields, `inner` among them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

from .base import Policy
from .capabilities import FIELDS, Capabilities, read, with_fields

#: what a wrapper does not take from its inner policy unless it says so (`Wrapper.wrap`): the defaults
RULE = {name: getattr(Capabilities(), name) for name in (
    "pinned", "unbounded", "slot_local", "preset", "bounds_every_layer", "fifo_after", "reconstructs", "ranks_layers"
)}

#: `Policy`'s methods a wrapper never takes from its inner policy: its spec names the wrapper too
OWN = frozenset({"spec"})


class Wrapper(Policy):
    """Derives its capabilities from `self.inner`'s (`wrap`) and answers every hook it does not define as
    `self.inner` does (the module's rule), the per-layer state included."""

    @functools.cached_property
    def capabilities(self) -> Capabilities:
        return self.wrap(self.inner.capabilities)

    def wrap(self, inner: Capabilities) -> Capabilities:
        """This wrapper's capabilities from its inner policy's: all of them, but those that belong to the
        inner policy's own rule (`RULE`: what it pins, whether it never evicts, its slot-local scores, an
        engine's rule and its schedule of layers, its first-in-first-out ring, a reconstruction). A wrapper
        subclass changes what it changes here, and nowhere else."""
        return with_fields(inner, **RULE)


def _forwarded(name: str):
    """`Policy.<name>` answered by `self.inner`: rewrapped when the hook returns a policy (`-> Policy`), the
    wrapper itself when the inner policy returns itself unchanged (so a spec stays as written)."""
    if inspect.signature(getattr(Policy, name)).return_annotation not in ("Policy", Policy):
        def hook(self, *args, **kwargs):
            return getattr(self.inner, name)(*args, **kwargs)
    else:
        def hook(self, *args, **kwargs):
            inner = getattr(self.inner, name)(*args, **kwargs)
            return self if inner is self.inner else dataclasses.replace(self, inner=inner)
    hook.__name__ = hook.__qualname__ = name
    hook.__doc__ = f"The inner policy's `{name}` (the wrapper's forwarding rule)."
    return hook


# the one rule by which a wrapper forwards: every public hook of `Policy` but its spec is the inner policy's,
# and every capability field reads as an attribute from the wrapper's capabilities; nothing is forwarded by hand
for _name, _value in list(vars(Policy).items()):
    if inspect.isfunction(_value) and not _name.startswith("_") and _name not in OWN:
        setattr(Wrapper, _name, _forwarded(_name))
for _name in FIELDS:
    setattr(Wrapper, _name, property(lambda self, name=_name: read(self.capabilities, name)))
del _name, _value
