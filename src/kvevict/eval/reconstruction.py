"""KVzip's reconstruction pass: the model asked to repeat a prefilled context, chunk by chunk, so that a
policy scored by reconstruction (`Policy.reconstructs`, `policies/kvzip.py`) has its scores.

Why a pass and not a policy hook: KVzip scores a context after it was read, with extra forwards.
Between a held-back prefill (`EvictingCache.defer`) and its eviction (`evict_deferred`), each chunk's
repeat forward runs inside `EvictingCache.reconstructing`, where the per-head layers measure the
window attention (`cache/layers/per_head/reconstruction.py`), and its tokens are taken back out afterwards
(`EvictingCache.crop`), so the pass writes nothing: every repeat forward starts at the context's end.
On a hybrid model (Gemma 3) a sliding-window layer keeps only the model's last window, which a repeat
forward would push the context's end out of: each repeat forward runs against a copy of those layers,
dropped afterwards, so they hold their window as before; only the full-attention layers are scored.
kvpress refuses such models instead (`KVzipPress.__call__`).

The framing is kvpress's (NVIDIA/kvpress 0.5.5, `kvpress/presses/kvzip_press.py`: `__call__` and
`prepare`): the chat template rendered around a dummy user turn gives the opening the context starts
with (`prefix` tokens, never reconstructed) and the text that closes the user turn and opens the
answer (`suffix`); a tokenizer without a template gives no prefix and a newline. The first chunk is
asked with "\\n\\nRepeat the previous context exactly.", each later one with "\\n\\nRepeat the part
of the previous context exactly, starting with" and the previous chunk's last 8 tokens.
"""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import KvevictError
from ..files import atomic_write
from ..policies import Policy
from .forward import body

if TYPE_CHECKING:  # what is handed in; this module builds no cache
    from ..cache import EvictingCache

FIRST = "\n\nRepeat the previous context exactly."
LATER = "\n\nRepeat the part of the previous context exactly, starting with"
#: tokens of the previous chunk quoted after `LATER`
OVERLAP = 8


@dataclass(frozen=True)
class RepeatFraming:
    """The token ids of a reconstruction request, from one tokenizer.

    prefix: leading context tokens that are the chat template's opening (not reconstructed);
    first / later: the request for the first chunk and for each later one; suffix: the end of the user
    turn and the start of the answer. All `[n]` int64.
    """

    prefix: int
    first: torch.Tensor
    later: torch.Tensor
    suffix: torch.Tensor


def _ids(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer.encode(text, add_special_tokens=False), dtype=torch.long)


def repeat_framing(tokenizer) -> RepeatFraming:
    """kvpress's framing for `tokenizer` (a `RepeatFraming` passes through)."""
    if isinstance(tokenizer, RepeatFraming):
        return tokenizer
    if getattr(tokenizer, "chat_template", None) is None:
        prefix_text, suffix_text = "", "\n"
    else:
        dummy = "dummy context"
        separator = "\n" + "#" * len(dummy)
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}],
                                                 add_generation_prompt=True, tokenize=False, enable_thinking=False)
        context, suffix_text = rendered.split(separator)
        prefix_text = context.split(dummy)[0]
    return RepeatFraming(len(_ids(tokenizer, prefix_text)), _ids(tokenizer, FIRST), _ids(tokenizer, LATER),
                         _ids(tokenizer, suffix_text))


def repeat_inputs(context: torch.Tensor, framing: RepeatFraming,
                  chunk_size: int) -> list[tuple[int, int, torch.Tensor]]:
    """Per chunk: its context span `(start, end)` and the repeat forward's ids `[q]` (request, suffix, chunk).
    `context` `[T]` starts with the template's opening (`framing.prefix` tokens)."""
    tail = context[framing.prefix :].long()
    chunks = [tail[a : a + chunk_size] for a in range(0, tail.numel(), chunk_size)]
    out, start = [], framing.prefix
    for i, chunk in enumerate(chunks):
        ask = framing.first if i == 0 else torch.cat([framing.later, chunks[i - 1][-OVERLAP:]])
        out.append((start, start + chunk.numel(), torch.cat([ask, framing.suffix, chunk])))
        start += chunk.numel()
    return out


def repeat_room(context: torch.Tensor, tokenizer, policy: Policy) -> int:
    """Tokens of the longest repeat forward `policy` (`reconstructing_policy`) runs over `context` `[T]`: what a
    prefill reserves beyond the context (`compress.prefill`'s `room`), since each repeat forward is held, then
    taken back out, before the eviction."""
    forwards = repeat_inputs(context, repeat_framing(tokenizer), policy.chunk_size)
    return max((ids.numel() for _, _, ids in forwards), default=0)  # none: a context of the template's opening


def reconstructing_policy(cache: EvictingCache) -> Policy | None:
    """The policy of the cache's rows that is scored by reconstruction, or None. Rows that reconstruct
    share one chunking (one repeat forward serves every row)."""
    found = {p.spec(): p for p in cache.policies if p.reconstructs}
    chunking = {p.chunk_size for p in found.values()}
    if len(chunking) > 1:
        raise KvevictError(f"{', '.join(found)} chunk the context differently: run each in a cache of its own")
    return next(iter(found.values()), None)


@dataclass(frozen=True)
class KeptScores:
    """A folder where reconstruction scores are kept, one file per context, rows and model, so that the same
    context compressed again (a search's next budget, a resumed run) skips its repeat forwards.

    Why: the repeat forwards cost several prefills (benchmarks.md, "KVzip: the reconstruction's cost"), and
    their scores depend on the context, the rows' specs, the positions and the model alone, not on the
    budget: a prefill read again and given the kept scores is compressed exactly as the pass would leave it
    (`EvictingCache.restore_reconstruction`, which refuses scores that do not fit the state read). The digest
    names the model by its config and dtype, not its weights: a folder serves one model, as a run folder does.
    """

    folder: Path

    def path(self, model, cache: EvictingCache, context: torch.Tensor, framing: RepeatFraming) -> Path:
        """The file for this context `[T]`, rows, framing and model: a digest of all that decides the scores."""
        config = getattr(model, "config", None)
        described = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else ""
        named = [getattr(config, "_name_or_path", ""), described, str(getattr(model, "dtype", "")), cache.positions,
                 *(p.spec() for p in cache.policies)]
        digest = hashlib.sha256("\n".join(named).encode())
        for ids in (context.reshape(-1), framing.first, framing.later, framing.suffix, torch.tensor([framing.prefix])):
            digest.update(ids.to(torch.int64).cpu().numpy().tobytes())
            digest.update(b"|")
        return Path(self.folder) / f"{digest.hexdigest()[:32]}.pt"

    @staticmethod
    def restore(path: Path, cache: EvictingCache) -> bool:
        """Score the held-back prefill from `path` (`path()`); False where nothing fitting is kept there."""
        if not path.exists():
            return False
        try:
            scores = torch.load(path, weights_only=True)
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError):
            return False  # a file cut short: score again, and keep it anew
        return isinstance(scores, list) and cache.restore_reconstruction(scores)

    @staticmethod
    def keep(path: Path, cache: EvictingCache) -> None:
        """Write the pass's scores to `path` (`path()`) whole or not at all, so an interrupted run leaves no half
        file."""
        scores = [{k: v.cpu() for k, v in layer.items()} for layer in cache.reconstruction_scores()]
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda handle: torch.save(scores, handle))


def reconstruct(model, cache: EvictingCache, context: torch.Tensor, tokenizer, kept: KeptScores | None = None) -> int:
    """Score the context `[T]` a held-back prefill (`cache.defer()`) just read: one repeat forward per chunk,
    each taken back out. Returns the tokens the repeat forwards fed (the pass's extra work; 0 where `kept`
    held this context's scores, which are then the cache's, and the pass did not run)."""
    policy = reconstructing_policy(cache)
    if policy is None:
        return 0
    if tokenizer is None:
        raise KvevictError(
            f"'{policy.spec()}' asks the model to repeat the context in its own chat template: pass the model's "
            "tokenizer (kvevict.compress(..., tokenizer=tokenizer); kvevict.load_model returns it)"
        )
    if cache.tokens_seen != context.numel():
        raise KvevictError(f"the cache holds {cache.tokens_seen} tokens, not the {context.numel()} of the context "
                           "to reconstruct: reconstruct right after its prefill")
    framing = repeat_framing(tokenizer)
    path = kept.path(model, cache, context, framing) if kept is not None else None
    if path is not None and kept.restore(path, cache):
        return 0
    fed = 0
    with torch.inference_mode():
        for start, end, ids in repeat_inputs(context, framing, policy.chunk_size):
            with cache.reconstructing(start, end):  # taken back out afterwards: the pass writes nothing
                body(model, ids[None], cache)
            fed += ids.numel()
    if path is not None:
        kept.keep(path, cache)
    return fed
