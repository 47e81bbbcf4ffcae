"""`PlainReader` parses a GGUF file exactly as `gguf.GGUFReader` does (a file written here with
gguf's own writer: a tokenizer's long arrays, scalars of each kind, strings, tensors)."""

from __future__ import annotations

import gguf
import numpy as np

from kvevict.loading.gguf_reader import PlainReader, plain_reader


def _file(path) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"tok{i}" + "é" * (i % 3) for i in range(3000)])
    writer.add_token_scores(rng.standard_normal(3000).astype(np.float32).tolist())
    writer.add_token_types([int(t) for t in rng.integers(1, 6, 3000)])
    writer.add_uint32("llama.block_count", 2)
    writer.add_float32("llama.rope.freq_base", 10000.5)
    writer.add_bool("kvevict.flag", True)
    writer.add_int64("kvevict.signed", -7)
    writer.add_string("general.name", "tiny test")
    writer.add_tensor("token_embd.weight", rng.standard_normal((16, 8)).astype(np.float32))
    writer.add_tensor("output.weight", rng.standard_normal((8, 16)).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_plain_parse_equals_gguf_s_reader(tmp_path):
    path = tmp_path / "t.gguf"
    _file(path)
    ours, theirs = PlainReader(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields) and len(ours.fields) > 10
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.name, mine.data, mine.types) == (field.offset, field.name, field.data, field.types)
        assert [p.dtype for p in mine.parts] == [p.dtype for p in field.parts], name
        assert all(np.array_equal(a, b) for a, b in zip(mine.parts, field.parts, strict=True)), name
    tokens = ours.fields["tokenizer.ggml.tokens"]
    assert bytes(tokens.parts[tokens.data[2999]]).decode() == "tok2999" + "é" * 2
    assert [t.name for t in ours.tensors] == ["token_embd.weight", "output.weight"]
    for mine, theirs_t in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == theirs_t.tensor_type and np.array_equal(mine.data, theirs_t.data)


def test_plain_reader_lends_one_parse_per_file_for_one_block_only(tmp_path):
    path = tmp_path / "t.gguf"
    _file(path)
    original = gguf.GGUFReader
    with plain_reader():
        first = gguf.GGUFReader(path)
        assert isinstance(first, PlainReader) and gguf.GGUFReader(str(path)) is first  # transformers' second read
        assert list(first.fields) == list(original(path).fields)
    assert gguf.GGUFReader is original
