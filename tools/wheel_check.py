"""What a user gets from the wheel alone: `kvevict --help`, and `kvevict ppl` on a model folder of their own.

Run with the Python of an environment that holds the installed wheel and torch, and none
of the embedded data packages (`make test-wheel` builds one). It saves a tiny randomly
initialised Llama and a word-level tokenizer built here (no download, no embedded
package), writes a short text, and runs the installed `kvevict` command on them; it
exits non-zero, naming the step, when one fails.

    .venv-wheel/bin/python tools/wheel_check.py
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

WORDS = ("the a of to and in is was it that he she they we you this with for on as at by from one two "
         "sea ship wind sail long night day light old man boy river stone").split()


def save_tiny_model(folder: Path) -> None:
    """A 2-layer Llama (hidden size 32) and a word-level tokenizer over WORDS, saved as a model folder."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def run(step: str, args: list[str]) -> str:
    result = subprocess.run(args, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"wheel check failed at {step}: {' '.join(args)}\n{result.stdout}\n{result.stderr}")
    return result.stdout


def main() -> None:
    kvevict = shutil.which("kvevict", path=str(Path(sys.executable).parent))
    if kvevict is None:
        sys.exit(f"no kvevict command beside {sys.executable}: install the wheel into this environment first")
    help_text = run("kvevict --help", [kvevict, "--help"])
    for command in ("ppl", "ab", "ruler", "report"):
        if command not in help_text:
            sys.exit(f"wheel check failed: `kvevict --help` does not list {command}")
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "tiny-llama"
        save_tiny_model(folder)
        text = Path(scratch) / "text.txt"
        text.write_text(" ".join(WORDS[(i * 7) % len(WORDS)] for i in range(400)))
        out = run("kvevict ppl", [kvevict, "ppl", "--model", str(folder), "--text", str(text), "--tokens", "120",
                                  "--budget", "32", "--policy", "streamingllm", "--json"])
        summary = json.loads(out.strip().splitlines()[-1])
        if not (summary["policy"] == "sink4+window" and summary["ppl"] > 1 and summary["max_kept"] <= 32):
            sys.exit(f"wheel check failed: unexpected ppl summary {summary}")
    print(f"wheel check passed: kvevict --help, and ppl {summary['ppl']:.1f} on a tiny local model "
          f"(kept at most {summary['max_kept']} of 120 tokens)")


if __name__ == "__main__":
    main()
