"""`--device` on every command that loads a model: checked before anything loads, handed to `load_model`.

No test here needs a GPU: CUDA is made absent (so the refusal is tested the same way on a
machine that has one), and the pass-through is checked with `--device cpu`.
"""

from __future__ import annotations

import pytest
import torch

from kvevict.errors import KvevictError

from support import cli, cli_error

MODEL_COMMANDS = ["ppl", "compare", "ab", "demo", "needle", "generation", "sinks", "ruler"]


def _out(command: str, tmp_path) -> list[str]:
    return ["--out", str(tmp_path)] if command in ("ab", "demo", "ruler") else []


@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_cuda_without_a_cuda_device_is_one_line(command, tmp_path, monkeypatch):
    import kvevict.loading

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before --device was checked")

    monkeypatch.setattr(kvevict.loading, "load_model", no_load)
    monkeypatch.setattr(kvevict.loading, "load_tokenizer", no_load)
    cli_error(command, "--device", "cuda", *_out(command, tmp_path),
              needles=("--device cuda", "torch sees no CUDA device", "use --device cpu"))
    assert not (tmp_path / "ab").exists() and not (tmp_path / "demo").exists()


@pytest.mark.parametrize("device", ["tpu", "gpu", "cuda:x"])
def test_a_device_torch_does_not_know_is_one_line(device):
    cli_error("ppl", "--device", device, needles=("--device must be cpu, cuda or cuda:N", f"'{device}'"))


def test_a_cuda_index_beyond_the_devices_is_one_line(monkeypatch):
    from kvevict.cli.common import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert check_device("cuda:1") == "cuda:1"
    with pytest.raises(KvevictError, match=r"torch sees 2 CUDA device\(s\), cuda:0 to cuda:1"):
        check_device("cuda:2")


@pytest.mark.parametrize("command", ["ppl", "compare", "needle", "generation", "sinks", "ruler"])
def test_the_device_reaches_load_model(command, tmp_path, monkeypatch):
    import kvevict.data
    import kvevict.loading

    asked = []

    def record(name, device=None, allow_download=False, dtype=None):  # None: the command did not say
        asked.append(device)
        raise KvevictError("stop here")

    monkeypatch.setattr(kvevict.loading, "load_model", record)
    monkeypatch.setattr(kvevict.loading, "load_tokenizer", lambda *a, **k: None)
    monkeypatch.setattr(kvevict.data, "load_tokens", lambda *a, **k: (torch.arange(3000), False))
    result = cli(command, "--device", "cpu", *_out(command, tmp_path))
    assert asked == ["cpu"], result.stderr
    assert "stop here" in result.stderr
