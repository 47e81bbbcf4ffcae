"""kvevict as an lm-eval model, on small local tasks generated here (YAML + JSONL, no download).

Under `full` every request type equals plain transformers on the same requests (one full forward per request,
a hand-written greedy loop); under a tight sinkless `window` the embedded model scores worse, and pinning sinks
wins most of it back. Skipped, saying why, when the lm-eval extra is absent (`make test` installs it).
"""

from __future__ import annotations

import json
import math
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from kvevict.errors import KvevictError

from support import attn, cli, cli_error

pytestmark = pytest.mark.skipif(find_spec("lm_eval") is None,
                                reason="the lm-eval extra is not installed: pip install kvevict[lm-eval]")

CONTEXTS = [
    "The lighthouse keeper walked up the stairs every night and lit the lamp before the ships came",
    "Paul wrote that the best way to get startup ideas is not to try to think of startup ideas at all",
    "A cache that forgets the first token of the prompt loses the place where attention rests",
    "The river ran past the mill and the miller counted the sacks of flour twice",
]
CHOICES = [[" in.", " out."], [" but to notice them.", " in a meeting."], [" most of the time.", " never."],
           [" before dawn.", " purple."]]


def _cut(text: str, until) -> str:
    """What lm-eval keeps of a generation: the text before the first stop string."""
    for stop in until:
        text = text.split(stop)[0]
    return text


def write_tasks(folder, contexts=CONTEXTS, choices=CHOICES) -> str:
    """Three tasks, one per request type: multiple choice, rolling perplexity, generation."""
    docs = folder / "docs.jsonl"
    docs.write_text("".join(json.dumps({"context": c, "choices": ch, "gold": 0, "text": c + ch[0], "answer": ch[0]})
                            + "\n" for c, ch in zip(contexts, choices)))
    data = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {docs}\ntest_split: test\n"
    (folder / "kv_mc.yaml").write_text(
        "task: kv_mc\n" + data + "output_type: multiple_choice\ndoc_to_text: '{{context}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{gold}}'\ntarget_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n")
    (folder / "kv_roll.yaml").write_text(
        "task: kv_roll\n" + data + "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n")
    (folder / "kv_gen.yaml").write_text(
        "task: kv_gen\n" + data + "output_type: generate_until\ndoc_to_text: '{{context}}'\n"
        "doc_to_target: '{{answer}}'\ngeneration_kwargs:\n  until: ['\\n', '.']\n  max_gen_toks: 6\n"
        "metric_list:\n  - metric: exact_match\n")
    return str(folder)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    return write_tasks(tmp_path_factory.mktemp("lmeval-tasks"))


def evaluate(model_args: str, tasks: str, names=("kv_mc", "kv_roll", "kv_gen")) -> dict:
    from kvevict.integrations.lmeval import evaluate as run

    return run(model_args, list(names), include_path=tasks, log_samples=True)


def responses(results: dict, task: str) -> list:
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [[r[0] for r in s["resps"]] for s in samples], [s["arguments"] for s in samples]


# --- independent references: plain transformers, no kvevict ---------------------------------------------------


def hf_loglikelihood(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """lm-eval's split (whole text encoded, context's tokens cut off), scored by one full forward."""
    whole = tokenizer(context + continuation)["input_ids"]
    n = len(tokenizer(context)["input_ids"])
    ids = torch.tensor([whole])
    with torch.inference_mode():
        lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    target = ids[0, n:]
    picked = lp[n - 1 : -1]
    return float(picked.gather(-1, target[:, None]).sum()), bool((picked.argmax(-1) == target).all())


def hf_rolling(model, tokenizer, text: str) -> float:
    ids = torch.tensor([[tokenizer.eos_token_id] + tokenizer(text)["input_ids"]])
    with torch.inference_mode():
        lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    return float(lp[:-1].gather(-1, ids[0, 1:, None]).sum())


def hf_greedy(model, tokenizer, context: str, steps: int, until: list[str]) -> str:
    ids = tokenizer(context)["input_ids"]
    out = []
    with torch.inference_mode():
        for _ in range(steps):
            token = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
            if token == tokenizer.eos_token_id:
                break
            out.append(token)
    return _cut(tokenizer.decode(out, skip_special_tokens=True), until)


@pytest.fixture(scope="module")
def full_results(tasks, tiny_dir) -> dict:
    """Every task under the full cache (batches of 4), shared by the tests that compare with it."""
    return evaluate(f"pretrained={tiny_dir},policy=full,batch_size=4", tasks)


def test_full_equals_plain_transformers_on_every_request_type(full_results, tiny_dir):
    from kvevict.loading import load_model

    results = full_results
    model, tokenizer = load_model(str(tiny_dir))
    got, args = responses(results, "kv_mc")
    assert len(got) == 4 and all(len(r) == 2 for r in got)
    for resps, arguments in zip(got, args):
        for (ll, greedy), (context, continuation) in zip(resps, arguments):
            want, want_greedy = hf_loglikelihood(model, tokenizer, context, continuation)
            assert math.isclose(ll, want, rel_tol=1e-4, abs_tol=1e-4) and greedy == want_greedy
    got, args = responses(results, "kv_roll")
    for resps, (text,) in zip(got, [a[0] for a in args]):
        assert math.isclose(resps[0], hf_rolling(model, tokenizer, text), rel_tol=1e-4)
    got, args = responses(results, "kv_gen")
    for resps, arguments in zip(got, args):
        context, kwargs = arguments[0]
        assert resps[0] == hf_greedy(model, tokenizer, context, 6, ["\n", "."])


def test_a_tight_window_changes_the_scores_and_a_roomy_one_does_not(tasks, tiny_dir, full_results):
    """On the tiny model the window does not score `worse` (random weights); it must differ from full, and a
    budget of the whole context evicts nothing, so it equals full, as does the stream protocol's full cache."""
    full = responses(full_results, "kv_mc")[0]
    tight = responses(evaluate(f"pretrained={tiny_dir},policy=window,budget=4", tasks, ["kv_mc"]), "kv_mc")[0]
    roomy = responses(evaluate(f"pretrained={tiny_dir},policy=window,budget=100%", tasks, ["kv_mc"]), "kv_mc")[0]
    streamed = responses(evaluate(f"pretrained={tiny_dir},policy=full,protocol=stream", tasks, ["kv_mc"]),
                         "kv_mc")[0]
    assert tight != full

    def values(resps):
        return torch.tensor([[ll for ll, _ in r] for r in resps])

    assert torch.allclose(values(roomy), values(full), atol=1e-4)
    assert torch.allclose(values(streamed), values(full), atol=1e-4)
    assert [[g for _, g in r] for r in streamed] == [[g for _, g in r] for r in full]  # is_greedy, both protocols


def masked_greedy(model, tokenizer, context: str, steps: int, budget: int, until: list[str]) -> str:
    """Greedy decoding by full forwards under a mask: the prompt but its last token is one causal prefill (what
    compression reads); from the last prompt token on, each query sees itself and the `budget` tokens before it
    (a window evicting at every step)."""
    ids = tokenizer(context)["input_ids"]
    compressed = len(ids) - 1
    out = []
    with torch.inference_mode():
        for _ in range(steps):
            seq = torch.tensor([ids + out])
            n = seq.shape[1]
            i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
            visible = (j <= i) & ((i < compressed) | (i - j <= budget))
            token = int(model(seq, attention_mask=visible[None, None]).logits[0, -1].argmax())
            if token == tokenizer.eos_token_id:
                break
            out.append(token)
    return _cut(tokenizer.decode(out, skip_special_tokens=True), until)


def test_generation_keeps_evicting_after_the_prompt(tasks, tiny_dir):
    from kvevict.loading import load_model

    results = evaluate(f"pretrained={tiny_dir},policy=window,budget=6", tasks, ["kv_gen"])
    model, tokenizer = load_model(str(tiny_dir))
    got, args = responses(results, "kv_gen")
    with attn(model, "sdpa"):
        for resps, arguments in zip(got, args):
            assert resps[0] == masked_greedy(model, tokenizer, arguments[0][0], 6, 6, ["\n", "."])


@pytest.mark.model
def test_sinkless_window_scores_worse_on_the_embedded_model(tmp_path):
    from kvevict.data import load_text

    essays = load_text("pg-essays")
    contexts = [essays[i * 4000 : i * 4000 + 600].rsplit(" ", 1)[0] for i in range(1, 3)]
    choices = [[essays[i * 4000 + 600 : i * 4000 + 700].split(" ", 1)[1].rsplit(" ", 1)[0], " purple"]
               for i in range(1, 3)]
    choices = [[" " + a.strip(), b] for a, b in choices]
    tasks = write_tasks(tmp_path, contexts, choices)
    total = {}
    for policy in ("policy=full", "policy=window,budget=20%", "policy=sink4+window,budget=20%"):
        results = evaluate(f"pretrained=smollm2-135m,{policy}", tasks, ["kv_mc", "kv_roll"])
        gold = sum(r[0][0] for r in responses(results, "kv_mc")[0])
        total[policy.split(",")[0]] = (gold, results["results"]["kv_roll"]["word_perplexity,none"])
    full, window, sinks = total["policy=full"], total["policy=window"], total["policy=sink4+window"]
    assert window[0] < full[0] - 1.0  # log-likelihood of the gold continuations
    assert window[1] > 1.2 * full[1]  # word perplexity of the rolling documents
    assert sinks[1] < window[1]


# --- the command and its bad input ---------------------------------------------------------------------------------


def test_kvevict_lm_eval_prints_the_metrics_and_saves_them(tasks, tiny_dir, tmp_path):
    out = tmp_path / "lm.json"
    result = cli("lm-eval", "--tasks", "kv_mc,kv_roll", "--include-path", tasks, "--model-args",
                 f"pretrained={tiny_dir},policy=sink2+h2o,budget=50%", "--save", str(out))
    assert result.exit_code == 0, result.stderr
    saved = json.loads(out.read_text())["results"]
    assert set(saved) == {"kv_mc", "kv_roll"}
    assert f"{saved['kv_mc']['acc,none']:.4f}" in result.stdout


@pytest.mark.parametrize("args, needles", [
    ("pretrained=x,policy=lru,budget=20%", ("unknown policy 'lru'",)),
    ("pretrained=x,policy=h2o,budget=abc", ("budget 'abc'", "percentage")),
    ("pretrained=x,policy=h2o,budget=150%", ("budget '150%'", "(0, 100]")),
    ("pretrained=x,policy=sink4+window,budget=4", ("budget 4 must be larger than the 4 pinned sinks",)),
    ("pretrained=x,policy=h2o,budget=20%,protocol=magic", ("protocol must be one of compress, stream",)),
    ("pretrained=x,policy=h2o,budget=20%,size=3", ("unknown model_args size",)),
    ("pretrained=x,policy=snapkv:window=8,kernel=3,budget=50%", ("unknown model_args kernel",
                                                                 "separate the policy's own options with ';'")),
    ("pretrained=x,policy=adakv:h2o,budget=50%,positions=cache", ("positions='cache'", "--positions original")),
])
def test_bad_model_args_are_one_line_before_any_loading(args, needles):
    cli_error("lm-eval", "--tasks", "copa", "--model-args", args, needles=needles)


def test_policy_options_inside_model_args_are_separated_by_semicolons():
    from kvevict.integrations.lmeval_args import Settings, split_model_args
    from kvevict.policies import parse_policy

    settings = Settings.parse(split_model_args("pretrained=x,policy=sink2+snapkv:window=8;kernel=3,budget=50%"))
    policy = parse_policy(settings.policy)
    assert (policy.n_sinks, policy.inner.window, policy.inner.kernel) == (2, 8, 3)


def test_an_engine_preset_gets_its_budget_in_the_positions_its_engine_decides():
    # llama.cpp's preset runs in cache positions only: the budget's entries were once checked in the default mode
    from kvevict.integrations.lmeval_args import Settings, split_model_args

    settings = Settings.parse(split_model_args("pretrained=x,policy=llamacpp:keep=4,budget=25%"))
    assert settings.positions == "cache"  # the preset's engine decides, as in `kvevict ab`
    assert settings.settled(False).entries(1000) == 250
    # a vocabulary that adds BOS: llama-server keeps one more leading token (n_keep += add_bos_token)
    assert settings.settled(True).policy == "llamacpp:keep=4,bos=1"
    assert Settings.parse(split_model_args("pretrained=x,policy=h2o,budget=25%")).positions == "original"


def test_unknown_task_is_one_line(tasks, tiny_dir):
    cli_error("lm-eval", "--tasks", "no_such_task", "--include-path", tasks, "--model-args",
              f"pretrained={tiny_dir},policy=full", needles=("unknown lm-eval task no_such_task",))


def test_a_task_no_file_names_is_refused_before_the_index_is_built(tmp_path):
    """lm-eval's index is built from its task files, so a name none of them contains is unknown without it;
    a name some file contains goes to the index, which decides. Checked on lm-eval's own folder too."""
    import lm_eval.tasks

    from kvevict.integrations.lmeval_tasks import task_manager, unmentioned

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "one.yaml").write_text("task: kv_one\ntag: [kv_tagged]\n")
    (tmp_path / "two.py").write_text("NAME = 'kv_two'\n")
    (tmp_path / "kv_three.txt").write_text("kv_three\n")  # neither YAML nor Python: not a task file
    assert unmentioned(tmp_path, ["kv_one", "kv_tagged", "kv_two", "kv_three", "kv_none"]) == ["kv_three", "kv_none"]
    built = []

    class Index:
        def __init__(self, include_path=None, include_defaults=True):
            built.append(include_defaults)
            self.all_tasks = ["kv_one"]

    with pytest.raises(KvevictError, match="unknown lm-eval task kv_none: check --tasks"):
        task_manager(Index, ["kv_one", "kv_none"], None, tmp_path)
    assert built == []  # refused before any index
    assert task_manager(Index, ["kv_two"], None, tmp_path).all_tasks == ["kv_one"] and built == [True]
    assert unmentioned(Path(lm_eval.tasks.__file__).parent, ["no_such_task", "arc_easy", "hellaswag"]) == \
        ["no_such_task"]


# --- this machine only: datasets offline unless allowed, nothing sent elsewhere -----------------------------------


def test_a_dataset_not_on_this_machine_is_one_line_before_the_model_loads(tmp_path):
    """A task whose dataset is on the Hub and not in the local cache: one line naming the dataset and both fixes,
    before the model loads (the model folder here does not exist, so loading it first would be another error), and
    no lookup of the Hub on the way (the socket guard fails the test on one)."""
    (tmp_path / "kv_absent.yaml").write_text(
        "task: kv_absent\ndataset_path: kvevict-tests/no-such-dataset\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{gold}}'\nmetric_list:\n  - metric: acc\n")
    cli_error("lm-eval", "--tasks", "kv_absent", "--include-path", str(tmp_path), "--model-args",
              f"pretrained={tmp_path / 'no-model'},policy=full",
              needles=("lm-eval task kv_absent needs the dataset 'kvevict-tests/no-such-dataset'",
                       "not in the local Hugging Face cache", "--allow-download", "--include-path"))


def test_an_lm_eval_run_sends_nothing_off_this_machine_and_puts_the_switches_back(tasks, tiny_dir):
    """A whole run under the socket guard: datasets' load counting (a request to S3 for every load, local JSON
    included) and the Hub stay switched off during it, and the libraries' switches are what they were after it."""
    import datasets
    import huggingface_hub

    from netguard import GUARD

    before = (huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE,
              datasets.config.HF_UPDATE_DOWNLOAD_COUNTS, huggingface_hub.constants.HF_HUB_DISABLE_TELEMETRY)
    assert GUARD.installed
    GUARD.take()
    results = evaluate(f"pretrained={tiny_dir},policy=full", tasks, ["kv_mc"])
    assert GUARD.take() == [] and len(results["samples"]["kv_mc"]) == len(CONTEXTS)
    assert (huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE,
            datasets.config.HF_UPDATE_DOWNLOAD_COUNTS, huggingface_hub.constants.HF_HUB_DISABLE_TELEMETRY) == before


@pytest.mark.parametrize("allow_download, environ, offline, telemetry_off, counts_off", [
    (False, {}, True, True, True),
    (True, {}, False, True, True),  # downloading allowed: the user's own HF_HUB_OFFLINE stands
    (False, {"DO_NOT_TRACK": "0", "HF_UPDATE_DOWNLOAD_COUNTS": "1"}, True, False, False),  # the user chose
])
def test_what_kvevict_switches_off_and_what_it_leaves_to_the_user(allow_download, environ, offline, telemetry_off,
                                                                  counts_off):
    from kvevict.integrations.hub import switches

    names = {variable: value for variable, value, _ in switches(allow_download, environ)}
    assert (names.get("HF_HUB_OFFLINE") == "1" and names.get("HF_DATASETS_OFFLINE") == "1") == offline
    assert (names.get("HF_HUB_DISABLE_TELEMETRY") == "1") == telemetry_off
    assert (names.get("HF_UPDATE_DOWNLOAD_COUNTS") == "0") == counts_off
