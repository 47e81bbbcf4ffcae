"""The conversation workload: deterministic in its seed, shaped as chat messages, scored against hand-written replies.

No model, no tokenizer: the structure is checked by re-reading the text (each fact stated
once, early, the filler cut from the essays), the scorer against replies written by hand.
"""

from __future__ import annotations

import random
import re

import pytest

from kvevict.data import load_text
from kvevict.errors import KvevictError
from kvevict.eval.conversation import Conversation, Probe, build_conversation, messages, score


def test_the_same_seed_gives_the_same_conversation_and_leaves_the_global_generator_alone():
    random.seed(5)
    state = random.getstate()
    first = build_conversation(7)
    assert random.getstate() == state  # no draw from the global generator
    random.random()  # moving the global generator changes nothing either
    assert build_conversation(7) == first
    other = build_conversation(8)
    assert other != first
    assert {p.answer for p in other.probes} != {p.answer for p in first.probes}


@pytest.mark.parametrize("facts, turns, words", [(3, 12, 60), (1, 4, 10), (0, 2, 5), (5, 5, 20)])
def test_facts_come_first_once_each_then_filler_cut_from_the_essays(facts, turns, words):
    conversation = build_conversation(11, facts=facts, turns=turns, words_per_turn=words)
    assert isinstance(conversation, Conversation) and len(conversation.turns) == turns
    fact_probes = [p for p in conversation.probes if p.kind == "fact"]
    rules = [p for p in conversation.probes if p.kind == "instruction"]
    assert len(fact_probes) == facts and len(rules) == 1 and conversation.probes[-1] == rules[0]
    users = [user for user, _ in conversation.turns]
    for index, probe in enumerate(fact_probes):
        assert re.fullmatch(r"\d{7}", probe.answer)
        stated = [i for i, user in enumerate(users) if probe.answer in user]
        assert stated == [index]  # stated once, in the fact turns, in the probes' order
        subject = re.search(r"of (project \S+) that", probe.question).group(1)
        assert subject in users[index]
    essays = " ".join(load_text("pg-essays").split())
    for user in users[facts:]:
        passage = user.split("\n")[1]
        assert len(passage.split()) == words and passage in essays
    marker = rules[0].answer
    assert marker.isalpha() and marker.isupper() and marker in conversation.system
    # the scripted history follows the rule, as the assistant's own replies would
    assert all(score(rules[0], assistant) for _, assistant in conversation.turns)


def test_messages_are_system_then_alternating_turns_then_the_probe():
    conversation = build_conversation(3, facts=2, turns=6, words_per_turn=12)
    for probe in conversation.probes:
        chat = messages(conversation, probe)
        assert [m["role"] for m in chat] == ["system"] + ["user", "assistant"] * 6 + ["user"]
        assert all(set(m) == {"role", "content"} and isinstance(m["content"], str) for m in chat)
        assert chat[0]["content"] == conversation.system
        assert [(chat[i]["content"], chat[i + 1]["content"]) for i in range(1, 13, 2)] == list(conversation.turns)
        assert chat[-1]["content"] == probe.question


FACT = Probe("What is the parcel code of project quiet-harbor?", "8541208", "fact")
RULE = Probe("Which passage did you like?", "CITY", "instruction")


@pytest.mark.parametrize("reply, passes", [
    ("The parcel code is 8541208.", True),
    ("8541208", True),
    ("It was\n  8541208 CITY", True),
    ("It is 854 1208.", False),
    ("It is 8541209.", False),
    ("", False),
])
def test_a_fact_passes_when_the_reply_holds_its_value(reply, passes):
    assert score(FACT, reply) is passes


@pytest.mark.parametrize("reply, passes", [
    ("I liked the second one. CITY", True),
    ("I liked the second one.\n  city.  ", True),
    ('The one on painting, "CiTy"!', True),
    ("CITY: the one on painting.", False),  # the marker must be the last word
    ("I liked the second one. CITYSCAPE", False),
    ("I liked the second one.", False),
    ("", False),
])
def test_the_rule_passes_when_the_reply_ends_with_the_marker(reply, passes):
    assert score(RULE, reply) is passes


@pytest.mark.parametrize("facts, turns, words", [(4, 3, 10), (-1, 3, 10), (1, 3, 0), (0, 0, 10)])
def test_impossible_counts_are_refused_naming_the_fix(facts, turns, words):
    with pytest.raises(KvevictError, match="give"):
        build_conversation(1, facts=facts, turns=turns, words_per_turn=words)


def test_a_probe_of_another_kind_is_refused():
    with pytest.raises(KvevictError, match="'fact' or 'instruction'"):
        score(Probe("q", "a", "summary"), "a")
