"""The conversation workload as tasks of the grid: the chat template's own rendering, every protocol, the report.

The prompts are checked against the tokenizer's own `apply_chat_template(..., tokenize=True)`
on the generator's messages (an independent rendering and tokenization), the scores
against `conversation.score` re-applied to each stored answer, the report's cells against
a Wilson interval computed here from the hits.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from scipy.stats import binomtest

from kvevict.errors import KvevictError
from kvevict.eval.conversation import Probe, messages, score
from kvevict.eval.ruler.framing import framing
from kvevict.eval.ruler.grid import RulerGrid, run_grid
from kvevict.eval.ruler.registry import get_task, parse_tasks
from kvevict.eval.ruler.sample import fit, seeded
from kvevict.eval.ruler.words import Material
from kvevict.loading import load_tokenizer
from kvevict.records.schema import RulerRecord
from kvevict.report.ruler import cells

LENGTH = 900


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


def _own(tokenizer, chat):
    return tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_dict=False)


@pytest.mark.parametrize("name, probes", [("conversation_fact", 3), ("conversation_instruction", 1)])
def test_context_and_question_are_the_chat_templates_own_rendering(tokenizer, name, probes):
    task = get_task(name)
    prompt = fit(task, LENGTH, 2, 0, framing(tokenizer), Material())
    conversation = prompt.sample.conversation
    asked = [prompt.sample.question, *prompt.sample.per_key] if probes == 1 else prompt.sample.per_key
    assert len(asked) == probes and len(conversation.turns) == 3 + prompt.sample.units
    ids = [prompt.question, *prompt.per_key] if probes == 1 else prompt.per_key
    for question, question_ids in zip(asked, ids, strict=True):
        probe = next(p for p in conversation.probes if p.question == question.text)
        assert probe.kind == task.probe and question.answers == [probe.answer]
        whole = _own(tokenizer, messages(conversation, probe))
        assert torch.cat([prompt.context, question_ids]).tolist() == whole
    # as long as the length allows: one filler turn more would not leave room for the answer
    assert prompt.tokens + task.tokens_to_generate <= LENGTH
    bigger = task.build(prompt.sample.units + 1, 2, LENGTH, seeded(0, name, LENGTH, 2), None)
    assert task.prompt(bigger, LENGTH, framing(tokenizer)).tokens + task.tokens_to_generate > LENGTH


def test_facts_are_stated_early_and_asked_late(tokenizer):
    prompt = fit(get_task("conversation_fact"), LENGTH, 0, 0, framing(tokenizer), Material())
    text = tokenizer.decode(prompt.context)
    values = [q.answers[0] for q in prompt.sample.per_key]
    positions = [text.index(v) for v in values]
    assert positions == sorted(positions) and max(positions) < len(text) / 3  # in the first turns
    assert all(text.count(v) == 2 for v in values)  # the user's statement and the scripted acknowledgement
    assert prompt.question.tolist() == prompt.per_key[0].tolist()  # one question: the earliest fact
    assert len(prompt.follow_ups) == 3  # `multi --form turns` asks them as later turns


def test_the_rule_is_read_to_the_end_of_the_turn_and_judged_by_its_last_word(tokenizer):
    task = get_task("conversation_instruction")
    prompt = fit(task, LENGTH, 0, 0, framing(tokenizer), Material())
    marker = prompt.sample.question.answers[0]
    assert prompt.sample.question.reads_whole and marker in prompt.sample.conversation.system
    assert task.score(f"The second one, about painting.\n\nIt was vivid. {marker}", [marker]) == 1.0
    assert task.score(f"{marker}\nThe second one, about painting.", [marker]) == 0.0
    fact = get_task("conversation_fact")
    assert fact.score("It is 4360363.", ["4360363"]) == 1.0 and fact.score("It is 436036.", ["4360363"]) == 0.0


def test_conversation_is_a_family_and_all_stays_rulers(tokenizer):
    assert parse_tasks("conversation") == ["conversation_fact", "conversation_instruction"]
    assert "conversation_fact" not in parse_tasks("all") and len(parse_tasks("all")) == 11
    RulerGrid(tasks=["conversation_fact"], protocol="multi").check()
    with pytest.raises(KvevictError, match="conversation_instruction does not hide"):
        RulerGrid(tasks=["conversation_instruction"], protocol="multi").check()


def test_a_model_without_a_chat_template_is_refused(tokenizer):
    plain = load_tokenizer("smollm2-135m")
    plain.chat_template = None
    with pytest.raises(KvevictError, match="conversation_fact is a chat conversation and this tokenizer has no chat"):
        fit(get_task("conversation_fact"), LENGTH, 0, 0, framing(plain), Material())


def test_a_template_that_rewrites_the_history_is_refused():
    counting = load_tokenizer("smollm2-135m")
    counting.chat_template = ("{{ messages | length }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                              "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(KvevictError, match="renders the history of a conversation differently"):
        fit(get_task("conversation_instruction"), LENGTH, 0, 0, framing(counting), Material())


def test_a_model_without_a_chat_template_is_refused_in_one_line(tiny_dir, tmp_path):
    from support import cli, one_line_error

    plain = tmp_path / "plain"
    shutil.copytree(tiny_dir, plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    result = cli("ruler", "--model", str(plain), "--tasks", "conversation", "--lengths", str(LENGTH),
                 "--samples", "1", "--policies", "window", "--budgets", "50%", "--out", str(tmp_path / "runs"))
    one_line_error(result.exit_code, result.stderr, "has no chat template", "use a chat model")


@pytest.mark.parametrize("protocol, form", [("stream", "requests"), ("multi", "requests"), ("agnostic", "requests")])
def test_every_protocol_answers_it_and_the_report_pairs_it_with_the_full_cache(tiny, tokenizer, protocol, form):
    tiny.resize_token_embeddings(len(tokenizer))
    tasks = ["conversation_fact"] if protocol == "multi" else ["conversation_fact", "conversation_instruction"]
    grid = RulerGrid(tasks=tasks, lengths=[LENGTH], samples=2, policies=["streamingllm", "h2o"], budgets=[128],
                     protocol=protocol, form=form, max_new_tokens=6)
    records = run_grid(tiny, tokenizer, grid)
    questions = 3 if protocol == "multi" else 1
    for task in tasks:
        mine = [r for r in records if r["task"] == task]
        assert len(mine) == 2 * 3 * questions  # samples x (full, two policies) x questions
        for r in mine:  # each stored score is the probe's, re-applied to the stored answer
            assert r["score"] == float(score(Probe("", r["answers"][0], get_task(task).probe), r["output"]))
    found = cells([RulerRecord.from_dict(r) for r in records])
    assert {c.policy for c in found} == {"full", "streamingllm", "h2o"}
    for c in found:
        hits = [r["score"] for r in records if r["task"] == c.task and r["policy"] == c.policy]
        interval = binomtest(int(sum(hits)), len(hits)).proportion_ci(method="wilson")
        assert c.n == len(hits) and c.accuracy == pytest.approx(sum(hits) / len(hits))
        assert (c.low, c.high) == pytest.approx((interval.low, interval.high))
