"""What an engine preset brings to a run unless the user says otherwise: its position mode, and
what it reads from the model (llama.cpp's add-BOS).

A preset reproduces an engine, and the engine decides both: llama.cpp renumbers positions
within the cache and keeps one more token when the vocabulary adds BOS
(`n_keep += add_bos_token` in llama-server, see `llamacpp.py`). So a run of presets takes
their position mode by default, and only a `positions` the user gave that conflicts is
refused (`check_policy`); a preset option left at "the model's" is read from the tokenizer.
"""

from __future__ import annotations

from ..errors import KvevictError
from ..position_modes import DEFAULT_POSITIONS
from .registry import parse_policy

#: a run with no preset among its policies, and no --positions, keeps the stream's own positions
PLAIN_POSITIONS = DEFAULT_POSITIONS


def run_positions(specs: list[str], positions: str | None) -> str:
    """The position mode of a run of `specs`: `positions` when the user gave one (a preset that runs in
    the other mode is then refused by `check_policy`, naming the fix), else the one mode the engine
    presets among `specs` use, else `PLAIN_POSITIONS`. Presets of two modes cannot share a run."""
    if positions:
        return positions
    modes: dict[str, str] = {}
    for spec in specs:
        policy = parse_policy(spec)
        if policy.position_mode is not None:
            modes.setdefault(policy.position_mode, policy.spec())
    if len(modes) > 1:
        (first, a), (second, b) = modes.items()
        raise KvevictError(
            f"'{a}' reproduces an engine with {first} positions and '{b}' one with {second} positions, and a run "
            f"has one position mode: run them as two runs (another --name), or give --positions to choose"
        )
    return next(iter(modes), PLAIN_POSITIONS)


def with_stream_start(specs: list[str], adds_bos: bool) -> list[str]:
    """`specs` as they run on a model whose tokenizer does (`adds_bos`) or does not put BOS before a text
    (`data.stream_start`): a preset option left at "the model's" is written out (`llamacpp:keep=0` ->
    `llamacpp:keep=0,bos=1` on Gemma 3), so records name what ran; every other spec is left as written."""
    out = []
    for spec in specs:
        policy = parse_policy(spec)
        settled = policy.with_stream_start(adds_bos)
        out.append(spec if settled is policy else settled.spec())
    return out
