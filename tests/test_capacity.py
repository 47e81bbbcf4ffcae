"""Capacity arithmetic against hand computations; `kvevict envelope --config-only` on a Llama-3-8B-shaped config."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoConfig

from kvevict import KvevictError
from kvevict.capacity import capacity_rows, concurrent, kv_tokens, parse_size, read_config, shape_of

from support import cli, cli_error

LLAMA3_8B = str(Path(__file__).parent / "fixtures" / "llama3-8b-config.json")


def test_llama3_8b_by_hand():
    """32 layers x 8 KV heads x 128 head_dim x 2 (K, V) x 2 bytes (bf16) = 128 KiB a token; 32768 tokens: 4 GiB."""
    shape = read_config(LLAMA3_8B)
    assert (shape.full_layers, shape.sliding_layers, shape.kv_heads, shape.head_dim, shape.element_bytes) == (
        32, 0, 8, 128, 2)
    assert shape.sequence_bytes(32768) == 4 * 2**30
    assert shape.sequence_bytes(32768, 4096) == 2**29  # 4096 entries: an eighth
    assert shape.sequence_bytes(1000, 4096) == 1000 * 128 * 2**10  # a budget above the context bounds nothing
    # 80 GB less 16 GB of weights: 64e9 / 4 GiB = 14.9 -> 14 sequences; 64e9 / 512 MiB = 119.2 -> 119
    assert concurrent(80 * 10**9, 16 * 10**9, shape.sequence_bytes(32768)) == 14
    assert concurrent(80 * 10**9, 16 * 10**9, shape.sequence_bytes(32768, 4096)) == 119
    assert concurrent(10 * 10**9, 16 * 10**9, 1) == 0
    assert read_config(LLAMA3_8B, "float32").sequence_bytes(32768) == 8 * 2**30


def test_llamacpp_block_types_are_ggml_row_sizes():
    """llama.cpp's q8_0 / q4_0 KV: per layer a key row of 8 KV heads x 128 = 1024 values is 32 blocks of gguf's
    block size (34 or 18 bytes), a value row the same; 32 layers x 32768 tokens."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    for name, kind in (("q8_0", GGMLQuantizationType.Q8_0), ("q4_0", GGMLQuantizationType.Q4_0)):
        values, size = GGML_QUANT_SIZES[kind]
        row = 8 * 128 // values * size
        shape = read_config(LLAMA3_8B, name)
        assert shape.token_layer_bytes == 2 * row
        assert shape.sequence_bytes(32768) == 32 * 32768 * 2 * row
    assert read_config(LLAMA3_8B, "q8_0").sequence_bytes(32768) == 2.125 * 2**30  # 34/32 of bf16's 4 GiB / 2


def test_sliding_layers_are_bounded_by_their_window():
    """Gemma 3's pattern (5 sliding, 1 full), window 512: one KV head of 256 dims in bf16 is 1024 bytes a token;
    at 32768 tokens the full layer holds 32768, each sliding one 511 (window - 1): 35323 tokens x 1024 bytes."""
    config = AutoConfig.for_model(
        "gemma3_text", num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        hidden_size=640, sliding_window=512, layer_types=["sliding_attention"] * 5 + ["full_attention"])
    shape = shape_of(config, 2)
    assert (shape.full_layers, shape.sliding_layers, shape.window) == (1, 5, 512)
    assert shape.sequence_bytes(32768) == (32768 + 5 * 511) * 1024
    assert shape.sequence_bytes(32768, 1024) == (1024 + 5 * 511) * 1024
    assert shape.sequence_bytes(300) == 6 * 300 * 1024  # a context inside the window: every layer holds it all


def test_a_quantized_configuration_provisions_the_bytes_it_held():
    """The arithmetic counts 4096 bytes an entry and layer (bf16); a 4-bit cache of 1024 entries measured at
    4096 tokens held, say, 32 layers x 1024 x 1280 bytes (codes, scales, zero points). A bounded cache holds
    the same entries at any length, so at 32768 tokens it provisions exactly what it held: 40 MiB, and
    (80 - 16) GB / 40 MiB = 1525 sequences; the unquantized row keeps the arithmetic (1024 x 32 x 4096 bytes
    = 128 MiB: 476 sequences). At a
    512-token deployment, under the budget, it holds half the entries, so half the bytes."""
    shape = read_config(LLAMA3_8B)
    measured = 32 * 1024 * 1280
    configs = [("h2o", 1024), ("q4+h2o", 1024)]
    rows = capacity_rows(shape, configs, 32768, 80 * 10**9, 16 * 10**9, {"q4+h2o": (measured, 4096)})
    by_name = {r.name: r for r in rows}
    assert by_name["q4+h2o"].sequence_bytes == 40 * 2**20 and by_name["q4+h2o"].sequences == 1525
    assert by_name["h2o"].sequence_bytes == 2**27 and by_name["h2o"].sequences == 476
    short = capacity_rows(shape, configs, 512, 80 * 10**9, 16 * 10**9, {"q4+h2o": (measured, 4096)})
    assert {r.name: r.sequence_bytes for r in short}["q4+h2o"] == measured // 2


def smollm2_config():
    """SmolLM2-135M's shape: 30 layers, 9 heads of 64 dims, 3 KV heads."""
    return AutoConfig.for_model("llama", num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                hidden_size=576)


def smollm2_shape(element_bytes: int):
    return shape_of(smollm2_config(), element_bytes)


def test_kv_tokens_in_pages_by_hand():
    """vLLM's count, worked by hand: a SmolLM2 token is 30 x 3 x 64 x 2 x 4 = 46,080 bytes in float32, so a page
    of 128 is 5,898,240 and 1 GiB holds 182 whole pages (182.04): 23,296 tokens, 22.75 sequences of 1,024
    (what vLLM's CPU build logs at VLLM_CPU_KVCACHE_SPACE=1); at 1 byte (fp8) 728 pages: 93,184. Unpaged,
    1 GiB / 46,080 = 23,301 tokens."""
    assert kv_tokens(smollm2_shape(4), 2**30, 128) == 23_296
    assert kv_tokens(smollm2_shape(1), 2**30, 128) == 93_184
    assert kv_tokens(smollm2_shape(4), 2**30) == 23_301
    with pytest.raises(KvevictError, match="at least one token"):
        kv_tokens(smollm2_shape(4), 2**30, 0)


def test_config_only_states_the_tokens_that_fit(tmp_path):
    """The same count from the command line, for the dtype and page a vLLM deployment runs."""
    config = tmp_path / "config.json"
    config.write_text(smollm2_config().to_json_string())
    for dtype, tokens, sequences in (("float32", "23,296", "22.75"), ("fp8", "93,184", "91.00")):
        result = cli("envelope", "--config-only", str(config), "--deploy-context", "1024", "--accelerator-memory",
                     "1GiB", "--kv-dtype", dtype, "--kv-page", "128")
        assert result.exit_code == 0, result.stderr
        assert f"{tokens} KV tokens fit in whole pages of 128: {sequences} sequences of 1,024 tokens" in result.stdout


def test_sizes():
    assert parse_size("80GB", "--x") == 80 * 10**9
    assert parse_size("1.5GiB", "--x") == 3 * 2**29
    assert parse_size("123", "--x") == 123
    with pytest.raises(KvevictError, match="takes a size"):
        parse_size("eighty", "--x")


def test_config_only_prints_the_arithmetic():
    result = cli("envelope", "--config-only", LLAMA3_8B, "--deploy-context", "32768", "--accelerator-memory", "80GB",
                 "--weight-bytes", "16GB", "--configs", "full,window@4096,h2o@25%")
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert "8 KV heads x 128 head_dim x 2 (K, V) x 2 bytes = 4096 bytes" in out
    rows = [[c.strip() for c in line.strip("│ ").split("│")] for line in out.splitlines() if line.startswith("│")]
    sequences = {row[0]: row[-1] for row in rows}
    assert sequences == {"full cache": "14", "window@4096": "119",
                         "h2o@25%": str((64 * 10**9) // 2**30)}  # 25% of 32768 = 8192 entries: 1 GiB a sequence


@pytest.mark.parametrize("args,needles", [
    (["--tokens", "128", "--floor", "128"], ["--floor 128 is not below", "lower --floor"]),
    (["--max-ppl-ratio", "0.9"], ["must be above 1"]),
    (["--max-ppl-ratio", ""], ["give --max-ppl-ratio"]),
    (["--max-kl", "-1"], ["--max-kl", "above 0"]),
    (["--resolution", "1"], ["--resolution must be a ratio above 1"]),
    (["--policies", "full"], ["never evicts"]),
    (["--policies", "snapkv:window=32", "--floor", "16"], ["[1, 15]"]),
    (["--deploy-context", "32768"], ["needs both"]),
    (["--deploy-context", "32768", "--accelerator-memory", "eighty"], ["takes a size"]),
    (["--config-only", LLAMA3_8B, "--deploy-context", "32768", "--accelerator-memory", "80GB", "--configs",
      "lru@4096"], ["unknown policy 'lru'"]),
    (["--config-only", LLAMA3_8B, "--deploy-context", "32768", "--accelerator-memory", "80GB", "--configs",
      "window"], ["bounds nothing", "POLICY@BUDGET"]),
    (["--config-only", LLAMA3_8B], ["needs --deploy-context"]),
    (["--config-only", "missing.json", "--deploy-context", "8", "--accelerator-memory", "1GB"], ["cannot read"]),
    (["--config-only", LLAMA3_8B, "--deploy-context", "8", "--accelerator-memory", "1GB", "--kv-dtype", "int3"],
     ["--kv-dtype must be one of"]),
    (["--config-only", LLAMA3_8B, "--deploy-context", "8", "--accelerator-memory", "1GB", "--kv-page", "0"],
     ["--kv-page must be at least 1"]),
])
def test_bad_input_is_one_line(args, needles):
    cli_error("envelope", *args, needles=tuple(needles))
