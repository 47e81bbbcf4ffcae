"""Protocols and sweep tasks as registered objects: nothing asks for one by name, and a new one is one registration.

The protocols' answers themselves are checked against independent computations in
test_ruler_protocols.py and test_deferred_eviction.py; here: the registries, the
refusals they own, and a protocol and a sweep task added by registration alone.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvevict.errors import KvevictError
from kvevict.eval.ruler.framing import framing
from kvevict.eval.ruler.grid import RulerGrid, preflight, run_grid
from kvevict.eval.ruler.protocol_kinds import registry
from kvevict.eval.ruler.protocol_kinds.agnostic import Agnostic
from kvevict.loading import load_tokenizer

SRC = Path(__file__).resolve().parents[1] / "src" / "kvevict"


def test_no_caller_asks_which_protocol_or_task_it_holds():
    """Only the registries match names: in the packages that run protocols and tasks, a comparison of a
    protocol, form or task kind with a literal is a decision that belongs to the object. (The record schema,
    `records/schema.py`, reads a line's kind to type it.)"""
    tested = re.compile(r"""\b(protocol|form|kind)\s*[!=]=\s*["'](agnostic|aware|stream|multi|requests|turns|"""
                        r"""aware-requests|needle|generation|ruler|sinkmap)["']""")
    files = [path for package in ("eval", "ab", "cli") for path in (SRC / package).rglob("*.py")]
    assert len(files) > 40
    found = [f"{path.relative_to(SRC)}:{n}" for path in files
             for n, line in enumerate(path.read_text().splitlines(), 1) if tested.search(line)]
    assert found == []


def test_the_registry_names_every_protocol_once():
    labels = [p.label for p in registry.PROTOCOLS]
    assert labels == ["agnostic", "aware", "stream", "multi-requests", "multi-turns", "multi-aware-requests"]
    assert registry.names() == ["agnostic", "aware", "stream", "multi"]
    assert registry.forms() == ["requests", "turns", "aware-requests"]
    for p in registry.PROTOCOLS:
        assert registry.get_protocol(p.name, p.form or "turns") is p  # a protocol without forms ignores --form
    with pytest.raises(KvevictError, match="unknown protocol 'sideways': use one of agnostic, aware, stream, multi"):
        registry.get_protocol("sideways")


class Again(Agnostic):
    """A protocol defined outside the package: agnostic's reading under another name."""

    name = "again"


def test_a_protocol_added_by_one_registration_runs_through_the_grid(tiny, monkeypatch):
    """Registered, `again` is accepted by the grid and recorded under its own label, and answers exactly as
    `agnostic`, whose reading it inherits."""
    tokenizer = load_tokenizer("smollm2-135m")
    tiny.resize_token_embeddings(len(tokenizer))
    monkeypatch.setattr(registry, "PROTOCOLS", (*registry.PROTOCOLS, Again()))
    grids = {name: RulerGrid(tasks=["niah_single_1"], lengths=[300], samples=1, policies=["h2o", "window"],
                             budgets=[40], protocol=name, max_new_tokens=4) for name in ("again", "agnostic")}
    got = {name: run_grid(tiny, tokenizer, grid) for name, grid in grids.items()}
    assert {r["key"].split("|")[1] for r in got["again"]} == {"again"}
    assert [(r["policy"], r["budget"], r["output"], r["kept"]) for r in got["again"]] == \
        [(r["policy"], r["budget"], r["output"], r["kept"]) for r in got["agnostic"]]
    monkeypatch.undo()
    with pytest.raises(KvevictError, match="unknown protocol 'again'"):
        RulerGrid(protocol="again").check()


NO_DIALOGUE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ raise_exception('no assistant turns') }}"
               "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_renders_no_dialogue_refuses_turns_and_serves_the_rest():
    tokenizer = load_tokenizer("smollm2-135m")
    assert framing(tokenizer).turn == "<|im_end|>\n<|im_start|>user\n"
    tokenizer.chat_template = NO_DIALOGUE
    assert framing(tokenizer).turn is None
    turns = RulerGrid(tasks=["niah_multikey_1"], lengths=[300], samples=1, policies=["h2o"], budgets=[40],
                      protocol="multi", form="turns")
    with pytest.raises(KvevictError, match="cannot render one .* use --form requests or aware-requests"):
        preflight(turns, tokenizer, None)
    for form in ("requests", "aware-requests"):  # they never ask a later turn
        assert preflight(RulerGrid(**{**vars(turns), "form": form}), tokenizer, None) == 2


class Refusing:
    """A chat tokenizer whose template fails on a dialogue with an error that is not the template's own."""

    chat_template = "{{ x }}"

    def __init__(self):
        self.inner = load_tokenizer("smollm2-135m")

    def apply_chat_template(self, chat, **kw):
        if any(m["role"] == "assistant" for m in chat):
            raise RuntimeError("a bug, not a template")
        return self.inner.apply_chat_template(chat, **kw)

    def __call__(self, *args, **kw):
        return self.inner(*args, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_an_error_other_than_the_templates_is_not_hidden():
    with pytest.raises(RuntimeError, match="a bug"):
        framing(Refusing())


def test_every_sweep_task_declares_its_record_and_its_section():
    from kvevict.ab.sweep_tasks.registry import SWEEP_TASKS
    from kvevict.ab.tasks import kinds
    from kvevict.records import schema as records
    from kvevict.report import sections

    assert kinds() == ("needle", "generation", "ruler", "sinkmap")
    for task in SWEEP_TASKS:
        assert getattr(sections, task.section) in sections.SECTIONS, task.kind
        assert task.record in (records.TaskRecord, records.RulerRecord, records.SinkMapRecord)
        if task.record is not records.TaskRecord:  # a typed record names its kind itself
            assert task.record.__dataclass_fields__["kind"].default == task.kind


def test_a_sweep_task_added_by_one_registration_runs_closes_and_is_skipped_on_a_rerun(tiny, tmp_path, monkeypatch):
    """A task registered in `sweep_tasks.registry` (its record kind known to the schema) runs after the cells,
    writes its records and its done marker, and a rerun with the same settings runs nothing."""
    from kvevict.ab import SweepConfig, run_sweep
    from kvevict.ab.sweep_tasks import registry as sweep_registry
    from kvevict.records import schema as records
    from test_sweep_task_kinds import Tally  # the toy task: one trial per policy with the stream's length

    monkeypatch.setattr(sweep_registry, "SWEEP_TASKS", (*sweep_registry.SWEEP_TASKS, Tally()))
    monkeypatch.setattr(records, "TASK_KINDS", (*records.TASK_KINDS, "tally"))
    tokenizer = load_tokenizer("smollm2-135m")
    tiny.resize_token_embeddings(len(tokenizer))
    config = SweepConfig(tokens=120, budgets=[32], policies=["window"], oracle_stride=0, out=str(tmp_path), name="c")
    _, found = run_sweep(config, model=tiny, tokenizer=tokenizer, progress=False)
    counted = [(r.fields["policy"], r.fields["tokens"]) for r in found if r.kind == "tally"]
    assert counted == [("full", 120), ("window", 120)]
    lines = (tmp_path / "c" / "results.jsonl").read_text()
    assert '"kind": "tally-done"' in lines and '"key": "tally-done|120"' in lines
    run_sweep(config, model=tiny, tokenizer=tokenizer, progress=False)
    assert (tmp_path / "c" / "results.jsonl").read_text() == lines
