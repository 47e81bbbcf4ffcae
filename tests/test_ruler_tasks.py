"""The RULER generator against the task definitions, the scorer against hand-scored answers, the QA loader.

No model: the prompts are made in the embedded tokenizer (SmolLM2's, with its chat
template) and checked by re-reading the text: each needle present once, where its
depth says, every answer recoverable from the prompt by an independent solver, the
prompt as long as the target allows and no longer.
"""

from __future__ import annotations

import collections
import re

import pytest

from kvevict.errors import KvevictError
from kvevict.eval.ruler.framing import framing
from kvevict.eval.ruler.niah import Niah
from kvevict.eval.ruler.qa import QaFile, load_qa
from kvevict.eval.ruler.registry import TASKS, parse_tasks
from kvevict.eval.ruler.sample import encode, fit, seeded
from kvevict.eval.ruler.scoring import match_all, match_part
from kvevict.eval.ruler.words import Material, sentences, spread_depths, van_der_corput
from kvevict.stats.uncertainty import wilson

LENGTH = 1000


@pytest.fixture(scope="module")
def shape():
    from kvevict.loading import load_tokenizer

    return framing(load_tokenizer("smollm2-135m"))


@pytest.fixture(scope="module")
def material():
    return Material()


def test_every_ruler_task_is_registered():
    assert sorted(TASKS) == sorted([
        "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
        "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe"])
    # RULER's answer lengths (scripts/data/synthetic/constants.py)
    assert {n: t.tokens_to_generate for n, t in TASKS.items() if not n.startswith("niah")} == {
        "vt": 30, "cwe": 120, "fwe": 50}
    assert all(t.tokens_to_generate == 128 for n, t in TASKS.items() if n.startswith("niah"))
    assert parse_tasks("niah,vt")[-1] == "vt" and len(parse_tasks("all")) == 11


@pytest.mark.parametrize("name", list(TASKS))
def test_prompt_fills_the_target_length_and_no_more(name, shape, material):
    task = TASKS[name]
    prompt = fit(task, LENGTH, 0, 0, shape, material)
    assert prompt.tokens + task.tokens_to_generate <= LENGTH
    # one more haystack unit would not fit (RULER's binary search finds the largest)
    bigger = task.build(prompt.sample.units + 1, 0, LENGTH, seeded(0, name, LENGTH, 0), material)
    assert encode(bigger, LENGTH, shape, task.tokens_to_generate).tokens + task.tokens_to_generate > LENGTH
    # the ids are the chat template around the text: the text decodes back from them
    text = shape.tokenizer.decode(prompt.ids)
    assert text.startswith("<|im_start|>") and "<|im_start|>assistant" in text
    assert prompt.sample.question.answer_prefix.strip() in text.split("<|im_start|>assistant")[1]


@pytest.mark.parametrize("name", list(TASKS))
def test_prompts_are_deterministic_per_seed(name, shape, material):
    a = fit(TASKS[name], LENGTH, 3, 0, shape, material)
    b = fit(TASKS[name], LENGTH, 3, 0, shape, material)
    c = fit(TASKS[name], LENGTH, 3, 1, shape, material)
    assert a.ids.tolist() == b.ids.tolist()
    assert a.ids.tolist() != c.ids.tolist()


NIAH = [n for n in TASKS if n.startswith("niah")]


@pytest.mark.parametrize("name", NIAH)
@pytest.mark.parametrize("index", [0, 1, 2])
def test_needles_are_present_once_at_their_depth(name, index, shape, material):
    task: Niah = TASKS[name]
    sample = fit(task, LENGTH, index, 0, shape, material).sample
    context = sample.head.split("\n", 1)[1]  # the instruction is the first line
    assert len(sample.needles) == max(task.keys, task.queries) * task.values == len(sample.depths)
    for needle, depth in zip(sample.needles, sample.depths, strict=True):
        assert context.count(needle) == 1
        others = context
        for other in sample.needles:
            if other != needle:
                others = others.replace(other, "")
        # depth in the haystack's own units: sentences of the essays, lines of noise or distractors
        pattern = r"[.?!](?=\s)" if task.haystack == "essay" else "\n"
        before = others[: others.index(needle)]
        if task.haystack == "essay":
            before = before.rstrip() + " "  # the sentence that ends right before the needle counts
        at = len(re.findall(pattern, before)) / max(1, len(re.findall(pattern, others.replace(needle, ""))))
        slack = 1.5 / max(1, len(re.findall(pattern, others)))
        assert depth - slack <= at <= depth + slack, (needle, depth, at)


@pytest.mark.parametrize("name", NIAH)
def test_niah_answers_are_the_values_of_the_asked_keys(name, shape, material):
    sample = fit(TASKS[name], LENGTH, 1, 0, shape, material).sample
    text = sample.head
    question = sample.question.text
    keys = re.findall(r"for (.+?) mentioned", question)[0].replace(", and ", ", ").split(", ")
    found = [v for k in keys for v in re.findall(r"for " + re.escape(k) + r" is: ([0-9a-f-]+)\.", text)]
    assert sorted(found) == sorted(sample.question.answers)
    for q in sample.per_key:  # the multi protocol's questions are answerable the same way
        key = re.findall(r"for (.+?) mentioned", q.text)[0]
        assert re.findall(r"for " + re.escape(key) + r" is: ([0-9a-f-]+)\.", text) == q.answers


def test_niah_haystacks_follow_ruler(shape, material):
    noise = fit(TASKS["niah_single_1"], LENGTH, 0, 0, shape, material).sample.head
    assert noise.count("The grass is green. The sky is blue.") >= 20
    needles = fit(TASKS["niah_multikey_2"], LENGTH, 0, 0, shape, material).sample.head
    assert needles.count("One of the special magic numbers for") >= 20  # distractor needles
    essay = fit(TASKS["niah_single_2"], LENGTH, 0, 0, shape, material).sample.head
    assert "The grass is green" not in essay and "One of the special magic numbers" in essay
    uuids = fit(TASKS["niah_multikey_3"], LENGTH, 0, 0, shape, material).sample
    uuid4 = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
    assert re.fullmatch(uuid4, uuids.question.answers[0])
    # one value asked: RULER's singular wording; several: plural
    assert "What is the special magic number for" in fit(TASKS["niah_single_1"], LENGTH, 0, 0, shape,
                                                         material).sample.question.text
    assert "What are all the special magic numbers for" in fit(TASKS["niah_multivalue"], LENGTH, 0, 0, shape,
                                                               material).sample.question.text


def test_vt_answer_is_the_chain_of_the_value(shape, material):
    sample = fit(TASKS["vt"], LENGTH, 2, 0, shape, material).sample
    value = re.findall(r"assigned the value (\d+) in the text above", sample.question.text)[0]
    context = sample.head.split("Memorize and track")[-1]  # after the solved example
    assigned = dict(re.findall(r"VAR ([A-Z]+) = (\d+|VAR [A-Z]+)", context))
    holders = {v for v, rhs in assigned.items() if rhs == value}
    grown = True
    while grown:
        new = {v for v, rhs in assigned.items() if rhs.startswith("VAR ") and rhs[4:] in holders}
        grown = not new <= holders
        holders |= new
    assert holders == set(sample.question.answers) and len(holders) == 5


def test_cwe_answer_is_the_ten_most_common_words(shape, material):
    sample = fit(TASKS["cwe"], LENGTH, 0, 0, shape, material).sample
    listed = sample.head.rsplit("Memorize the ones that appear most often.\n", 1)[1]
    counts = collections.Counter(re.findall(r"\d+\. (\S+)", listed))
    top = [w for w, _ in counts.most_common(10)]
    assert sorted(top) == sorted(sample.question.answers)
    assert counts.most_common(11)[10][1] < counts.most_common(10)[9][1]  # no tie at the cut


def test_fwe_answer_is_the_three_most_frequent_coded_words(shape, material):
    sample = fit(TASKS["fwe"], LENGTH, 0, 0, shape, material).sample
    words = sample.head.split("coded words. ", 1)[1].split()
    counts = collections.Counter(w for w in words if w != "...")
    assert [w for w, _ in counts.most_common(3)] == sample.question.answers
    assert collections.Counter(words).most_common(1)[0][0] == "..."  # the top rank is the noise


def test_depths_spread_evenly():
    assert [van_der_corput(i) for i in range(5)] == [0.0, 0.5, 0.25, 0.75, 0.125]
    firsts = sorted(spread_depths(i, 1)[0] for i in range(16))
    assert firsts == [i / 16 for i in range(16)]
    assert spread_depths(1, 4) == [0.125, 0.375, 0.625, 0.875]


def test_sentence_splitter():
    assert sentences("One. Two?  Three! Four") == ["One.", "Two?", "Three!", "Four"]
    assert sentences("3.14 is pi. Yes") == ["3.14 is pi.", "Yes"]


def test_scores_against_hand_scored_answers():
    # string_match_all: the share of references found, case-insensitively
    assert match_all("The numbers are 123 and 456.", ["123", "456"]) == 1.0
    assert match_all("The numbers are 123.", ["123", "456"]) == 0.5
    assert match_all("ABC-def", ["abc-DEF"]) == 1.0
    assert match_all("nothing", ["1", "2", "3", "4"]) == 0.0
    # string_match_part: any reference found
    assert match_part("Paris, France", ["paris", "Lyon"]) == 1.0
    assert match_part("London", ["paris", "Lyon"]) == 0.0
    # Wilson 95% interval of 5/10 (hand-computed: 0.2366, 0.7634) and of 0/10 (0, 0.2775)
    lo, hi = wilson(5, 10).low, wilson(5, 10).high
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)
    lo, hi = wilson(0, 10).low, wilson(0, 10).high
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)


def test_qa_file_loads_and_prompts(tmp_path, shape):
    path = tmp_path / "qa.jsonl"
    path.write_text(
        '{"context": "Doc 1: The capital of Freedonia is Fredville.", "question": "What is the capital of Freedonia?",'
        ' "answers": ["Fredville"]}\n\n'
        '{"context": "Doc 2: Mars has two moons.", "question": "How many moons?", "answers": ["two", "2"],'
        ' "answer_prefix": " The answer is"}\n'
    )
    rows = load_qa(path)
    assert [r.answers for r in rows] == [["Fredville"], ["two", "2"]]
    task = QaFile(tuple(rows))
    sample = task.build(0, 1, 0, seeded(0, "qa", 0, 1))
    prompt = encode(sample, 0, shape, task.tokens_to_generate)
    text = shape.tokenizer.decode(prompt.ids)
    assert "Mars has two moons." in text and "Question: How many moons?" in text
    assert text.endswith("The answer is")
    assert task.metric == "part"


def test_the_example_qa_file_is_answerable_from_its_own_excerpts():
    """examples/qa-pg-essays.jsonl (the QA findings in docs/leading-policies.md): every context is an excerpt of
    the embedded pg-essays text, every reference answer is in its own context and not in its question (else the
    question would give it away), and no line repeats another's excerpt."""
    from pathlib import Path

    from kvevict.data import load_text

    rows = load_qa(Path(__file__).resolve().parents[1] / "examples" / "qa-pg-essays.jsonl")
    essays = load_text("pg-essays")
    assert len(rows) == 24 and len({r.context for r in rows}) == 24
    for number, row in enumerate(rows, 1):
        assert row.context in essays, f"line {number}: not an excerpt of pg-essays"
        assert all(a in row.context and a not in row.question for a in row.answers), f"line {number}"


@pytest.mark.parametrize("line, says", [
    ('{"question": "q", "answers": ["a"]}', "lacks 'context'"),
    ('{"context": "c", "question": "q", "answers": []}', "empty answer list"),
    ('{"context": "c", "question": "q"}', "lacks 'answers'"),
    ("not json", "is not JSON"),
])
def test_bad_qa_lines_name_the_line_and_the_fix(tmp_path, line, says):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"context": "c", "question": "q", "answers": ["a"]}\n' + line + "\n")
    with pytest.raises(KvevictError, match=says) as info:
        load_qa(path)
    assert "bad.jsonl:2" in str(info.value)
