"""`--dtype` and `load_model(..., dtype=)`: checked before anything loads, the weights and the KV cache held
in it, named in every record and pinned by the run folder.

The exactness of the engine in bf16 against a reference in bf16 is in `test_bf16_exact.py`.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvevict import EvictingCache, compare
from kvevict.errors import KvevictError

from conftest import make_tiny, random_tokens
from support import cli, cli_error, one_line_error

MODEL_COMMANDS = ["ppl", "compare", "ab", "demo", "needle", "generation", "sinks", "ruler", "envelope", "engine-check"]


def _out(command: str, tmp_path) -> list[str]:
    return ["--out", str(tmp_path)] if command in ("ab", "demo", "ruler", "envelope") else []


@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_an_unknown_dtype_is_one_line_before_anything_loads(command, tmp_path, monkeypatch):
    import kvevict.loading

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before --dtype was checked")

    import kvevict.ab.run
    import kvevict.ab.worker

    # the harness binds the loaders at import: patch them there too, so this test neither misses a load
    # through them nor leaves its fake bound in a module first imported while the patch is up
    for module in (kvevict.loading, kvevict.ab.run, kvevict.ab.worker):
        for name in ("load_model", "load_tokenizer"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, no_load)
    cli_error(command, "--dtype", "float8", *_out(command, tmp_path),
              needles=("--dtype must be one of float32, bfloat16, float16", "'float8'"))
    assert not (tmp_path / "ab").exists() and not (tmp_path / "demo").exists()


@pytest.mark.parametrize("command", ["ppl", "compare", "needle", "generation", "sinks", "ruler"])
def test_the_dtype_reaches_load_model(command, tmp_path, monkeypatch):
    import kvevict.data
    import kvevict.loading

    asked = []

    def record(name, device=None, allow_download=False, dtype="not passed"):
        asked.append(dtype)
        raise KvevictError("stop here")

    monkeypatch.setattr(kvevict.loading, "load_model", record)
    monkeypatch.setattr(kvevict.loading, "load_tokenizer", lambda *a, **k: None)
    monkeypatch.setattr(kvevict.data, "load_tokens", lambda *a, **k: (torch.arange(3000), False))
    result = cli(command, "--dtype", "bfloat16", *_out(command, tmp_path))
    assert asked == ["bfloat16"], result.stderr
    assert "stop here" in result.stderr


def test_load_model_casts_the_weights_and_keeps_rope_in_float32(tiny_dir):
    """The weights as `from_pretrained(dtype=bf16)` gives them; `inv_freq` stays float32 (`model.to(bf16)`
    would round it, and move every rotation angle)."""
    from transformers import AutoModelForCausalLM

    from kvevict import load_model

    default, _ = load_model(str(tiny_dir))
    assert default.dtype == torch.float32  # the CPU default
    model, _ = load_model(str(tiny_dir), dtype="bfloat16")
    expected = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16)
    for (name, got), want in zip(model.named_parameters(), expected.parameters()):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), name
    for (name, got), want in zip(model.named_buffers(), expected.buffers()):
        assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want), name


def test_the_default_on_a_gpu_is_the_checkpoints_own(tiny_dir, tmp_path):
    """`model_dtype` (what a run folder pins before loading): float32 on the CPU whatever the checkpoint,
    the checkpoint's config dtype on cuda, float32 for a GGUF model (dequantised to float32)."""
    from transformers import AutoModelForCausalLM

    from kvevict.loading.models import model_dtype

    half = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16).save_pretrained(half)
    assert model_dtype(str(half), None, "cpu") == "float32"
    assert model_dtype(str(half), None, "cuda") == "bfloat16"
    assert model_dtype(str(tiny_dir), None, "cuda") == "float32"
    assert model_dtype(str(half), "float16", "cuda") == "float16"
    assert model_dtype("smollm2-135m", None, "cuda") == "float32"


def test_the_cache_holds_the_models_dtype_and_counts_its_bytes():
    """Keys and values in bf16, `kv_bytes` half of float32's for the same entries; the statistics
    a policy accumulates stay float32 (see `test_bf16_exact.py` for why that matters)."""
    tokens = random_tokens(40)
    held = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = make_tiny()
        for param in model.parameters():
            param.data = param.data.to(dtype)
        cache = EvictingCache(model, policy="h2o", budget=16)
        with torch.inference_mode():
            model(tokens[None], past_key_values=cache, use_cache=True)
        layer = cache.layers[0]
        assert layer.storage.kv.dtype == dtype
        assert all(stat.dtype == torch.float32 for stat in layer.storage.stats.values()) and layer.storage.stats
        held[dtype] = cache.memory()
    entries = 2 * 2 * 16 * 16  # layers x KV heads x budget x head_dim
    assert held[torch.float32].kv_bytes == 2 * entries * 4  # keys and values, 4 bytes each
    assert held[torch.bfloat16].kv_bytes == 2 * entries * 2


def test_float16_runs_on_the_cpu_and_agrees_with_float32():
    """torch 2.13 runs float16 matmuls on the CPU (slowly), so float16 is not refused there: the NLL of a
    bounded stream in fp16 is within fp16's rounding of float32's (10 mantissa bits: relative eps 2^-11
    per op; a 2-layer model's NLL moves by far less than 0.05 nats)."""
    tokens = random_tokens(40)
    rows = {}
    for dtype in (torch.float32, torch.float16):
        model = make_tiny()
        for param in model.parameters():
            param.data = param.data.to(dtype)
        found, _ = compare(model, tokens, ["sink4+window"], 16, reference=False, progress=False)
        rows[dtype] = found[0].nll
    assert rows[torch.float16].isfinite().all()
    assert (rows[torch.float16] - rows[torch.float32]).abs().max() < 0.05


# --- records and run folders ------------------------------------------------------------------------------------


def test_a_record_without_a_dtype_reads_as_float32_and_round_trips():
    from kvevict.records.schema import PplRecord, RulerRecord

    old = {"key": "policy|h2o|64", "kind": "policy", "policy": "h2o", "budget": 64, "ppl": 20.0,
           "positions": "original", "n_predictions": 10, "curve": []}
    record = PplRecord.from_dict(old)
    assert record.measured_dtype == "float32" and record.to_dict() == old
    new = PplRecord.from_dict({**old, "dtype": "bfloat16"})
    assert new.measured_dtype == "bfloat16" and new.to_dict()["dtype"] == "bfloat16"
    answer = {"key": "k", "task": "vt", "protocol": "agnostic", "length": 500, "sample": 0, "policy": "h2o",
              "budget": "64", "score": 1.0, "question": 0, "metric": "all", "answers": [], "output": "",
              "depths": [], "kind": "ruler"}
    assert RulerRecord.from_dict(answer).to_dict() == answer
    assert RulerRecord.from_dict({**answer, "dtype": "float16"}).to_dict()["dtype"] == "float16"


def _sweep(tmp_path, dtype: str, name: str = "d"):
    from kvevict.ab import SweepConfig

    return SweepConfig(dtype=dtype, tokens=40, budgets=[16], policies=["h2o"], oracle_stride=0,
                       out=str(tmp_path), name=name)


def _tiny_in(dtype: torch.dtype):
    from kvevict.loading import load_tokenizer

    model = make_tiny()
    model.resize_token_embeddings(len(load_tokenizer("smollm2-135m")))
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model, load_tokenizer("smollm2-135m")


def test_records_name_the_dtype_and_count_its_bytes(tmp_path):
    from kvevict.ab import run_sweep
    from kvevict.records.schema import ppl_records

    kv = {}
    for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        model, tokenizer = _tiny_in(dtype)
        _, records = run_sweep(_sweep(tmp_path, name, name), model=model, tokenizer=tokenizer, progress=False)
        rows = ppl_records(records)
        assert rows and all(r.dtype == name for r in rows)
        assert json.loads((tmp_path / name / "run.json").read_text())["identity"]["dtype"] == name
        policy = next(r for r in rows if r.kind == "policy")
        kv[name] = (policy.kv_bytes, policy.full_kv_bytes)
    assert kv["bfloat16"][0] * 2 == kv["float32"][0]  # the same entries, half the bytes
    assert kv["bfloat16"][1] * 2 == kv["float32"][1]


def test_a_rerun_in_another_dtype_is_refused_and_an_old_folder_reads_as_float32(tmp_path):
    from kvevict.ab.run import prepare_folder

    config = _sweep(tmp_path, "float32")
    prepare_folder(config)
    meta = config.folder / "run.json"
    data = json.loads(meta.read_text())
    del data["identity"]["dtype"]  # a folder written before the dtype was pinned
    meta.write_text(json.dumps(data))
    prepare_folder(config)  # float32: the same experiment
    with pytest.raises(KvevictError, match="use another --name to start fresh"):
        prepare_folder(_sweep(tmp_path, "bfloat16"))


def test_a_model_in_another_dtype_than_the_sweep_says_is_refused(tmp_path):
    from kvevict.ab import run_sweep

    model, tokenizer = _tiny_in(torch.bfloat16)
    with pytest.raises(KvevictError, match="pass SweepConfig\\(dtype='bfloat16'\\)"):
        run_sweep(_sweep(tmp_path, "float32"), model=model, tokenizer=tokenizer, progress=False)


def test_lm_eval_model_args_take_the_dtype():
    from kvevict.integrations.lmeval_args import Settings

    assert Settings.parse({"dtype": "bfloat16"}).dtype == "bfloat16"
    assert Settings.parse({"dtype": "auto"}).dtype is None
    with pytest.raises(KvevictError, match="model_args dtype must be one of float32, bfloat16, float16"):
        Settings.parse({"dtype": "fp8"})


def test_lm_eval_cli_refuses_a_bad_dtype_in_one_line():
    result = cli("lm-eval", "--tasks", "copa", "--model-args", "dtype=int8")
    one_line_error(result.exit_code, result.stderr, "model_args dtype must be one of")
