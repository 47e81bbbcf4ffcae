"""Bad input around the engine presets and the llama.cpp check: one line naming the fix, exit 2."""

from __future__ import annotations

import sys

import pytest

from kvevict import KvevictError
from kvevict.policies import check_policy, parse_policy

from support import cli_error


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--policy", "llamacpp:kep=1", "--positions", "cache"], ["unknown option 'kep=1'", "keep, bos"]),
        (["--policy", "mlc:sink=2", "--positions", "cache"], ["unknown option 'sink=2'", "valid options are sinks"]),
        (["--policy", "vllm-swa:window=8"], ["unknown option", "none"]),
        (["--policy", "llamacpp:keep=256", "--positions", "cache", "--budget", "256"], ["at most n_ctx - 4 = 252"]),
        (["--policy", "llamacpp:keep=250,bos=1", "--positions", "cache", "--budget", "254"], ["keeps 251"]),
        (["--policy", "llamacpp:bos=2", "--positions", "cache"], ["bos is 0 or 1"]),
        (["--policy", "mlc:sinks=8", "--positions", "cache", "--budget", "9"], ["raise --budget above 9"]),
        (["--policy", "trtllm:sink=-1"], ["trtllm:sink must be", ">= 0"]),
        (["--policy", "llamacpp", "--positions", "original"], ["renumbered within the cache", "--positions cache"]),
        (["--policy", "ollama", "--positions", "original"], ["--positions cache"]),
        (["--policy", "vllm-swa", "--positions", "cache"], ["--positions original"]),
        (["--policy", "trtllm:sink=4,streamingllm=1", "--positions", "original"], ["--positions cache"]),
        (["--policy", "sink4+llamacpp", "--positions", "cache"], ["wraps an engine preset", "llamacpp:keep=N"]),
        (["--policy", "adakv:mlc", "--positions", "original"], ["wraps an engine preset"]),
        (["--policy", "h2o:page=0"], ["page must be a number of tokens >= 1"]),
        (["--policy", "h2o:page=x"], ["page needs a whole number"]),
        (["--policy", "h2o:page=40", "--budget", "64"], ["no whole page to evict", "a page of at most 33"]),
        (["--policy", "h2o:page=300", "--budget", "256"], ["no whole page to evict"]),
        (["--policy", "sink4+h2o:page=32", "--budget", "64"], ["1 sink page", "at least 94"]),
        (["--policy", "h2o:pagescore=max"], ["pagescore without page"]),
        (["--policy", "h2o:page=16,pagescore=median"], ["pagescore must be mean or max"]),
        (["--policy", "llamacpp:page=4", "--positions", "cache"], ["engine preset", "without page="]),
        (["--policy", "full:page=4"], ["scores entries"]),
    ],
)
def test_preset_bad_input_is_one_line(args, needles):
    cli_error("ppl", *args, needles=tuple(needles))


def test_preset_errors_from_the_library():
    with pytest.raises(KvevictError, match="at most n_ctx - 4"):
        check_policy("llamacpp:keep=8", 10, "cache")
    check_policy("llamacpp:keep=6", 10, "cache")  # 6 = n_ctx - 4: llama.cpp's own limit, allowed
    with pytest.raises(KvevictError, match="engine decides positions"):
        check_policy("hf-sinkcache", 10, "original")
    with pytest.raises(KvevictError, match="wraps an engine preset"):
        parse_policy("sinkauto2+ollama")


def test_engine_check_without_the_extra_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp now raises ImportError
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_cpp", None)
    cli_error("engine-check", needles=("pip install 'kvevict[llamacpp]'", "make test-llamacpp"))


def test_engine_check_refuses_a_model_llama_cpp_cannot_read(monkeypatch):
    pytest.importorskip("llama_cpp")
    cli_error("engine-check", "--models", "some/hf-model", needles=("GGUF file",))
