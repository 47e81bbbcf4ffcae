"""`kvevict audit`'s tasks through the endpoint, on `audit_fake.FakeServer`: RULER and the generation failure
modes scored on both sides, prompts past the context reported as refused or cut, the conversation as chat turns."""

from __future__ import annotations

import pytest

from audit_fake import FakeConfig, FakeServer
from kvevict.audit.run import run_audit
from kvevict.loading import load_tokenizer
from test_audit import _spec


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


# --- the tasks workload: prompts beyond the context are reported, not scored --------------------------------


@pytest.mark.parametrize("truncate,what", [(False, "refused"), (True, "cut")])
def test_a_prompt_beyond_the_context_is_reported_as_refused_or_cut(tokenizer, tmp_path, truncate, what):
    with FakeServer(FakeConfig(n_ctx=128, truncate=truncate), tokenizer) as dep, \
            FakeServer(FakeConfig(n_ctx=1024), tokenizer) as ref:
        spec = _spec(dep.url, tmp_path, ref.url, tasks=("niah_single_1",), samples=2, task_length=400, sinks=0)
        result = run_audit(spec)
    row = result.tasks[0]
    assert (row.refused if what == "refused" else row.truncated) == [0, 1] and not row.scores
    from kvevict.audit.text import task_line

    assert f"the deployment {what} every prompt" in task_line(row)


def test_tasks_inside_the_context_are_scored_on_both_sides(tokenizer, tmp_path):
    with FakeServer(FakeConfig(n_ctx=512), tokenizer) as dep, FakeServer(FakeConfig(n_ctx=1024), tokenizer) as ref:
        spec = _spec(dep.url, tmp_path, ref.url, new_tokens=600, tasks=("niah_single_1",), samples=3,
                     generation_trials=2, sinks=0)
        result = run_audit(spec)
    by_task = {r.task: r for r in result.tasks}
    assert len(by_task["niah_single_1"].scores) == 3 and len(by_task["generation"].scores) == 2
    assert by_task["generation"].judgement is not None and len(by_task["generation"].repetition) == 2


def test_the_conversation_goes_through_the_chat_route(tokenizer, tmp_path):
    """Chat turns sent as messages; each probe scored by eval/conversation.score on both sides and judged paired."""
    from kvevict.eval.conversation import build_conversation

    with FakeServer(FakeConfig(n_ctx=128), tokenizer) as dep, FakeServer(FakeConfig(n_ctx=1024), tokenizer) as ref:
        result = run_audit(_spec(dep.url, tmp_path, ref.url, route="chat", conversations=2, sinks=0))
        sent = [b for p, b, _ in dep.cfg.requests if p == "/v1/chat/completions"]
    assert result.deployed is None
    rows = {r.task: r for r in result.tasks}
    probes = [p for seed in range(2) for p in build_conversation(seed).probes]
    facts = [p for p in probes if p.kind == "fact"]
    assert len(sent) == len(probes) and sent[0]["messages"][0]["role"] == "system"
    # the fake answers with the first 7-digit number stated: the first fact of each conversation, no other
    assert sum(rows["conversation-fact"].scores) == 2 and len(rows["conversation-fact"].scores) == len(facts)
    assert rows["conversation-instruction"].scores == [0.0, 0.0]
