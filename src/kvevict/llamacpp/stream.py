"""One token stream through llama.cpp, with llama-server's context shift.

llama-server (`tools/server/server-context.cpp`, llama.cpp as vendored in llama-cpp-python
0.3.36) shifts a generating slot when `tokens held + 1 >= n_ctx`: it keeps `n_keep` (+1 when
the vocabulary adds BOS, at most `n_ctx - 4`), removes the next `n_discard = (held - n_keep)
/ 2` cells (`llama_memory_seq_rm`) and moves every later cell down by `n_discard`
(`llama_memory_seq_add`); llama.cpp re-rotates the moved keys itself before the next decode.
This module does exactly those calls, so the shift under test is llama.cpp's own, not a
re-implementation of its arithmetic on kvevict's side.

Tokens are decoded in batches that never cross a shift point (a batch fills the cache up
to `n_ctx - 1`, the most llama-server holds), with logits for every token: the same
predictions as one token per decode, since attention inside a batch is causal.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import KvevictError
from . import require

#: llama-server clamps n_keep to n_ctx - 4
RESERVED = 4


@dataclass
class EngineStream:
    """What llama.cpp did with one stream of `T` tokens."""

    nll: np.ndarray  # [T-1] float64: -log p(token t+1 | what the cache held at t)
    shifts: list[int] = field(default_factory=list)  # tokens seen when each context shift happened
    add_bos: bool = False  # the vocabulary adds BOS (llama-server then keeps one more token)
    n_ctx: int = 0  # the context llama.cpp was given (0: large enough for the whole stream)

    @property
    def ppl(self) -> float:
        return float(np.exp(self.nll.mean()))


def _silence(bindings):
    """A log callback that drops llama.cpp's messages (kept alive by the caller)."""

    @bindings.llama_log_callback
    def quiet(level, text, data):  # noqa: ARG001
        return None

    bindings.llama_log_set(quiet, ctypes.c_void_p())
    return quiet


class LlamaCppModel:
    """A GGUF file loaded by llama.cpp, CPU only. Use as a context manager (frees the model)."""

    def __init__(self, gguf: Path, threads: int = 2) -> None:
        self.b = require()
        self._quiet = _silence(self.b)
        self.b.llama_backend_init()
        params = self.b.llama_model_default_params()
        params.n_gpu_layers = 0
        self.model = self.b.llama_model_load_from_file(str(gguf).encode(), params)
        if not self.model:
            raise KvevictError(f"llama.cpp could not load {gguf}: check the file is a GGUF it supports")
        self.vocab = self.b.llama_model_get_vocab(self.model)
        self.n_vocab = self.b.llama_vocab_n_tokens(self.vocab)
        self.add_bos = bool(self.b.llama_vocab_get_add_bos(self.vocab))
        self.threads = threads

    def __enter__(self) -> LlamaCppModel:
        return self

    def __exit__(self, *exc) -> None:
        self.b.llama_model_free(self.model)

    def stream(self, tokens: list[int], n_ctx: int | None, keep: int = 0) -> EngineStream:
        """NLL of tokens 1..T-1. `n_ctx` None: a context holding the whole stream (the full cache);
        otherwise llama-server's context shift with `--keep keep` at that context size."""
        total = len(tokens)
        size = total + 1 if n_ctx is None else n_ctx
        if n_ctx is not None and n_ctx < RESERVED + 2:
            raise KvevictError(f"n_ctx {n_ctx} is too small for a context shift: use at least {RESERVED + 2}")
        batch_max = min(size, 512)
        params = self.b.llama_context_default_params()
        params.n_ctx = size
        params.n_batch = batch_max
        params.n_ubatch = batch_max
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = self.threads
        params.swa_full = True  # llama.cpp shifts SWA models only with full-size SWA caches (--swa-full)
        params.no_perf = True
        ctx = self.b.llama_init_from_model(self.model, params)
        if not ctx:
            raise KvevictError(f"llama.cpp could not create a context of {size} tokens")
        batch = self.b.llama_batch_init(batch_max, 0, 1)
        try:
            if self.b.llama_n_ctx(ctx) < size:
                raise KvevictError(f"llama.cpp gave a context of {self.b.llama_n_ctx(ctx)} cells, asked for {size}")
            return self._run(ctx, batch, tokens, size, n_ctx, keep, batch_max)
        finally:
            self.b.llama_batch_free(batch)
            self.b.llama_free(ctx)

    def _run(self, ctx, batch, tokens, size, n_ctx, keep, batch_max) -> EngineStream:
        b = self.b
        memory = b.llama_get_memory(ctx)
        n_keep = min(keep + int(self.add_bos), size - RESERVED)
        nll = np.zeros(len(tokens) - 1)
        shifts: list[int] = []
        held = 0  # cells in use; positions are 0..held-1 (contiguous after every shift)
        seen = 0
        while seen < len(tokens):
            room = size - 1 - held  # llama-server shifts before a token that would fill the last cell
            if room == 0:
                left = held - n_keep
                discard = min(left // 2, max(0, left - 1))
                b.llama_memory_seq_rm(memory, 0, n_keep, n_keep + discard)
                b.llama_memory_seq_add(memory, 0, n_keep + discard, held, -discard)
                held -= discard
                shifts.append(seen)
                continue
            count = min(room, batch_max, len(tokens) - seen)
            batch.n_tokens = count
            for i in range(count):
                batch.token[i] = tokens[seen + i]
                batch.pos[i] = held + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1
            if b.llama_decode(ctx, batch) != 0:
                raise KvevictError(f"llama_decode failed at token {seen} (context {size}, {held} cells held)")
            logits = np.ctypeslib.as_array(b.llama_get_logits(ctx), shape=(count, self.n_vocab)).astype(np.float64)
            top = logits.max(axis=1, keepdims=True)
            log_z = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
            for i in range(count):
                t = seen + i
                if t + 1 < len(tokens):
                    nll[t] = log_z[i] - logits[i, tokens[t + 1]]
            held += count
            seen += count
        return EngineStream(nll=nll, shifts=shifts, add_bos=self.add_bos, n_ctx=n_ctx or 0)
