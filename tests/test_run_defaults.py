"""Defaults that run: `kvevict ab` on a hybrid model goes on without the recompute oracle and says why;
an engine preset reads add-BOS from the model's tokenizer and brings its own position mode; `ruler --qa`
reads the whole file. Every check runs the CLI on a tiny model saved as a local folder."""

from __future__ import annotations

import html
import json

import pytest
import torch

from architectures import BUILDERS, GEMMA_WINDOW

from conftest import make_tiny
from support import cli, cli_error


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    """A tiny Gemma 3 (2 sliding layers of window 7, 2 full-attention layers) with SmolLM2's tokenizer."""
    from kvevict.loading import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    torch.manual_seed(0)
    model = BUILDERS["gemma3"]().eval()
    model.resize_token_embeddings(len(tokenizer))
    path = tmp_path_factory.mktemp("tiny-gemma3")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def bos_dir(tmp_path_factory):
    """A tiny Llama whose tokenizer puts BOS before a text (as Gemma's does): SmolLM2's, told to add it."""
    from kvevict.loading import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    tokenizer.add_bos_token = True
    model = make_tiny(seed=3)
    model.resize_token_embeddings(len(tokenizer))
    path = tmp_path_factory.mktemp("tiny-bos")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _json(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --- the recompute oracle on a hybrid model --------------------------------------------------------


def test_ab_on_a_hybrid_model_leaves_the_default_oracle_out_and_says_why(hybrid_dir, tiny_dir, tmp_path):
    runs = tmp_path / "runs"
    common = ["--tokens", "40", "--budgets", "12", "--policies", "window", "--out", str(runs)]
    out = cli("ab", "--model", str(hybrid_dir), *common, "--name", "hybrid")
    assert out.exit_code == 0, out.output
    run = runs / "hybrid"
    assert {r["kind"] for r in _lines(run / "results.jsonl")} == {"full", "policy"}
    # the reason, counted by hand from the tiny Gemma's config: layers 1 and 3 full, 0 and 2 sliding
    why = (f"eviction bounds its 2 full-attention layers while its 2 sliding layers keep their own window of "
           f"{GEMMA_WINDOW}")
    config = json.loads((run / "run.json").read_text())["config"]
    assert config["oracle_stride"] == 0 and why in config["oracle_left_out"]
    assert "recompute oracle left out" in out.stdout and why in " ".join(out.stdout.split())
    assert html.escape(why) in (run / "report.html").read_text()
    markdown = cli("report", str(run), "--markdown")
    assert markdown.exit_code == 0 and f"Note: recompute oracle left out: not defined on this hybrid model: {why}" \
        in markdown.stdout
    # a model without sliding layers keeps the oracle as a default row, and says nothing
    plain = cli("ab", "--model", str(tiny_dir), *common, "--name", "plain")
    assert plain.exit_code == 0, plain.output
    rows = _lines(runs / "plain" / "results.jsonl")
    assert {r["kind"] for r in rows} == {"full", "policy", "oracle"}
    gone = "recompute oracle left out"
    assert gone not in plain.stdout and gone not in (runs / "plain" / "report.html").read_text()


def test_an_explicit_oracle_stride_on_a_hybrid_model_is_refused(hybrid_dir, tmp_path):
    cli_error("ab", "--model", str(hybrid_dir), "--tokens", "40", "--budgets", "12", "--policies", "window",
              "--oracle-stride", "8", "--out", str(tmp_path), "--name", "x",
              needles=("--oracle-stride 8", "not defined on this hybrid model", "leave --oracle-stride out"))
    assert not (tmp_path / "x" / "results.jsonl").exists()


# --- engine presets: add-BOS from the tokenizer, positions from the engine ----------------------------


def test_llamacpp_reads_add_bos_from_the_tokenizer(bos_dir, tiny_dir):
    """llama-server keeps `keep + add_bos` tokens. Without `bos=`, a tokenizer that adds BOS runs as
    `bos=1` and one that does not as `bos=0`; an explicit `bos=` still overrides the tokenizer."""
    common = ["--tokens", "40", "--budget", "12", "--json"]

    def ppl(folder, spec, *extra):
        return _json(cli("ppl", "--model", str(folder), "--policy", spec, *common, *extra))

    read = ppl(bos_dir, "llamacpp:keep=0")
    assert read["policy"] == "llamacpp:keep=0,bos=1" and read["positions"] == "cache"
    assert read["ppl"] == ppl(bos_dir, "llamacpp:keep=0,bos=1", "--positions", "cache")["ppl"]
    override = ppl(bos_dir, "llamacpp:keep=0,bos=0")
    assert override["policy"] == "llamacpp:keep=0,bos=0" and override["ppl"] != read["ppl"]
    assert ppl(tiny_dir, "ollama")["policy"] == "ollama:keep=4,bos=0"


def test_a_preset_brings_its_position_mode_and_only_an_explicit_conflict_is_refused(tiny_dir, tmp_path):
    base = ["--model", str(tiny_dir), "--tokens", "40", "--budget", "12"]
    assert _json(cli("ppl", *base, "--policy", "vllm-swa", "--json"))["positions"] == "original"
    assert _json(cli("ppl", *base, "--policy", "window", "--json"))["positions"] == "original"
    rows = _json(cli("compare", *base, "--policies", "mlc,window", "--json"))["rows"]
    assert {r["positions"] for r in rows if r["policy"] != "full"} == {"cache"}
    cli_error("ppl", *base, "--policy", "mlc", "--positions", "original", needles=("--positions cache",))
    cli_error("compare", *base, "--policies", "mlc,vllm-swa",
              needles=("'mlc:sinks=4'", "'vllm-swa'", "one position mode", "--positions"))
    out = cli("ab", "--model", str(tiny_dir), "--tokens", "40", "--budgets", "12", "--policies", "llamacpp:keep=2",
              "--oracle-stride", "0", "--out", str(tmp_path), "--name", "preset")
    assert out.exit_code == 0, out.output
    assert json.loads((tmp_path / "preset" / "run.json").read_text())["identity"]["positions"] == "cache"
    assert {r["policy"] for r in _lines(tmp_path / "preset" / "results.jsonl")} == {"full", "llamacpp:keep=2,bos=0"}


# --- a user's QA file ------------------------------------------------------------------------------


def test_ruler_reads_the_whole_qa_file_unless_samples_says_fewer(tiny_dir, tmp_path):
    qa = tmp_path / "qa.jsonl"
    lines = 12  # more than the default of 10 samples per task
    qa.write_text("".join(json.dumps({"context": f"Note {i}: the word is lark{i}.", "question": "Which word?",
                                      "answers": [f"lark{i}"]}) + "\n" for i in range(lines)))
    common = ["ruler", "--model", str(tiny_dir), "--qa", str(qa), "--policies", "window", "--budgets", "50%",
              "--max-new-tokens", "1", "--out", str(tmp_path)]
    out = cli(*common, "--name", "whole")
    assert out.exit_code == 0, out.output
    answered = {tuple(r["answers"]) for r in _lines(tmp_path / "whole" / "results.jsonl")}
    assert answered == {(f"lark{i}",) for i in range(lines)}
    out = cli(*common, "--samples", "3", "--name", "three")
    assert out.exit_code == 0, out.output
    assert {tuple(r["answers"]) for r in _lines(tmp_path / "three" / "results.jsonl")} == {
        (f"lark{i}",) for i in range(3)}

