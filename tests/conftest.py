"""Shared fixtures: a tiny randomly initialised GQA Llama, built in-process (no download); and the network
guard: every test fails that opens a socket to an address outside loopback (`netguard.py`)."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

# the network guard's hooks, run for every test (also loadable alone: `pytest -p netguard`)
from netguard import pytest_configure, pytest_runtest_makereport, pytest_unconfigure  # noqa: F401

VOCAB = 101
# `make test` runs the suite in as many pytest-xdist workers as there are cores: each worker then has one
# core, so a test on the embedded model gets one thread there (two threads per worker would oversubscribe
# the cores and slow both workers many times over)
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
DEFAULT_THREADS = max(1, torch.get_num_threads() // WORKERS)


@pytest.fixture(autouse=True)
def _threads(request):
    """Tiny models run on one thread: their ops are too small to gain from more, and
    oversubscribed threads on a busy 2-core machine are many times slower. Tests on the
    embedded model (marker `model`) get every core."""
    torch.set_num_threads(DEFAULT_THREADS if request.node.get_closest_marker("model") else 1)
    yield


def make_tiny(seed: int = 0, layers: int = 2, rope_scaling: dict | None = None, kv_heads: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=16,
        max_position_embeddings=8192,
        # a wide init makes attention peaky, so evicting the wrong entry changes the output
        initializer_range=0.3,
        rope_parameters=rope_scaling or {"rope_type": "default", "rope_theta": 10000.0},
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).eval()
    return model


@pytest.fixture(scope="module")
def tiny() -> LlamaForCausalLM:
    return make_tiny()


def random_tokens(n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny Llama with the embedded tokenizer, saved as a local model directory (for CLI runs)."""
    from kvevict.loading import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    model = make_tiny()
    model.resize_token_embeddings(len(tokenizer))
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
