"""The position modes by name, importable without torch: what the CLI, the policies and the
cache agree on before any model is loaded.

A mode's maths (what position a kept key and a new query carry) lives in
`cache/positions/modes.py`, one class per mode; this module holds only what is known from the
name alone: the words it is written with, its one validator, and the two declarations a
check needs before there is a cache (whether the model must rotate its keys, whether a
head may hold its own number of entries).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import KvevictError


@dataclass(frozen=True)
class ModeName:
    """One position mode as a user names it."""

    name: str  # as written: `--positions NAME`, `positions='NAME'`
    words: str  # what its positions are, for error messages
    needs_rotary: bool  # renumbers keys by re-rotating them: a model with absolute positions cannot
    per_head: bool  # a KV head may hold its own entries (queries need only the stream's positions)


ORIGINAL = ModeName("original", "the stream's own (original)", needs_rotary=False, per_head=True)
SHIFTED = ModeName("cache", "renumbered within the cache (cache)", needs_rotary=True, per_head=False)
BY_NAME = {mode.name: mode for mode in (ORIGINAL, SHIFTED)}
POSITION_MODES = tuple(BY_NAME)
#: the mode every entry point uses unless told otherwise
DEFAULT_POSITIONS = ORIGINAL.name


def check_positions(name: str, option: str = "positions") -> ModeName:
    """The mode named `name`, or one line naming the choices (`option`: how the caller's user wrote it)."""
    mode = BY_NAME.get(name)
    if mode is None:
        raise KvevictError(f"{option} must be one of {', '.join(POSITION_MODES)}, got '{name}'")
    return mode
