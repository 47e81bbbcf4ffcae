"""llama.cpp itself against kvevict's `llamacpp` preset (the `llamacpp` extra; `make test-llamacpp`).

The small form of `kvevict engine-check`: both embedded models (SmolLM2 has no BOS, Gemma 3
has one), llama-server's `--keep` 0 and 4, a 640-token stream at n_ctx 160 (a few shifts).
"""

from __future__ import annotations

import pytest

from kvevict.data import load_tokens
from kvevict.loading import load_model
from kvevict.loading.gguf import embedded_gguf

pytestmark = [pytest.mark.llamacpp, pytest.mark.model]

TOKENS = 640
N_CTX = 160


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_preset_matches_llama_cpp(name):
    pytest.importorskip("llama_cpp", reason="the llamacpp extra: pip install 'kvevict[llamacpp]'")
    from kvevict.llamacpp.check import engine_check

    model, tokenizer = load_model(name)
    ids, _ = load_tokens("pg-essays", tokenizer, TOKENS)
    results = engine_check(name, embedded_gguf(name), model, ids, N_CTX, [0, 4], chunk=32)
    for result in results:
        assert result.engine_shifts, "the stream must shift at least once"
        assert not result.failures(), (name, result.keep, result.failures())
        # the full caches agree closely enough for the tolerance to mean something
        assert result.full_correlation > 0.99 and result.tolerance < 0.1, result.summary()
