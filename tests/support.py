"""Independent references used by the tests: plain transformers, no kvevict code."""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def attn(model, implementation: str):
    """Temporarily run `model` with another attention implementation."""
    before = model.config._attn_implementation
    model.set_attn_implementation(implementation)
    try:
        yield model
    finally:
        model.set_attn_implementation(before)


def logits_through(model, name: str, attention, chunks: list[torch.Tensor]) -> torch.Tensor:
    """Logits `[T, vocab]` of `chunks` fed in turn through a full `DynamicCache`, with
    `attention` (a reference attention function) registered as `name` and in use."""
    from transformers import AttentionInterface, DynamicCache

    AttentionInterface.register(name, attention)
    out = []
    with attn(model, name), torch.inference_mode():
        full = DynamicCache(config=model.config)
        for chunk in chunks:
            out.append(model(chunk[None], past_key_values=full, use_cache=True).logits[0])
    return torch.cat(out)


def logits_one_by_one(model, tokens: torch.Tensor, cache) -> torch.Tensor:
    """Logits `[T, vocab]` of `tokens` `[T]` fed one per forward into `cache` (any transformers cache)."""
    with torch.inference_mode():
        return torch.cat([model(t[None, None], cache=cache, use_cache=True).logits[0] for t in tokens])


def nll_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """NLL of tokens[1:] from logits[:-1] (one sequence)."""
    lp = torch.log_softmax(logits.float(), dim=-1)[:-1]
    return -lp.gather(-1, tokens[1:, None])[:, 0]


def plain_nll(model, tokens: torch.Tensor) -> torch.Tensor:
    with attn(model, "sdpa"), torch.inference_mode():
        return nll_from_logits(model(tokens[None]).logits[0], tokens)


def band_sink_nll(model, tokens: torch.Tensor, budget: int, sinks: int) -> torch.Tensor:
    """One full-sequence forward where query i sees key j iff j <= i and (j < sinks or i - j <= budget - sinks)."""
    n = tokens.numel()
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    visible = (j <= i) & ((j < sinks) | (i - j <= budget - sinks))
    with attn(model, "sdpa"), torch.inference_mode():
        logits = model(tokens[None], attention_mask=visible[None, None]).logits[0]
    return nll_from_logits(logits, tokens)


# --- CLI scaffolding: one-line errors, runs through Typer's runner ------------------------------


def one_line_error(code: int, text: str, *needles: str) -> None:
    """The CLI's contract for a user mistake: exit code 2, one line `error: ...` naming the fix, no traceback."""
    assert code == 2, text
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1, text
    assert lines[0].startswith("error: "), text
    assert "Traceback" not in text
    for needle in needles:
        assert needle in lines[0], lines[0]


def cli(*args: str, env: dict | None = None):
    """Run `kvevict ARGS` in-process; the result has .exit_code, .stdout and .stderr (kept apart)."""
    from typer.testing import CliRunner

    from kvevict.cli import app

    return CliRunner().invoke(app, list(args), env=env)


def cli_error(*args: str, needles: tuple[str, ...] = ()) -> None:
    """`kvevict ARGS` must fail as one line on stderr naming every needle."""
    result = cli(*args)
    one_line_error(result.exit_code, result.stderr, *needles)


# --- figures: what is drawn, read off the matplotlib objects -----------------------------------


def series(ax) -> dict[str, tuple[list, list]]:
    """The named lines of an axis (legend label -> x data, y data); unnamed lines (`_child...`) left out."""
    return {
        line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
        for line in ax.get_lines()
        if not line.get_label().startswith("_")
    }


def close(fig) -> None:
    import matplotlib.pyplot as plt

    plt.close(fig)


def count_repeat_forwards(monkeypatch) -> list[int]:
    """KVzip's repeat forwards run from now on, one entry each (its length); a prefill's forward is not counted."""
    from kvevict.eval import reconstruction
    from kvevict.eval.forward import body

    calls: list[int] = []

    def counted(model, ids, cache):
        calls.append(ids.shape[-1])
        return body(model, ids, cache)

    monkeypatch.setattr(reconstruction, "body", counted)
    return calls


def reference_nll_with(reference, model, rule, cache_mode: bool, prefill: int | None = None):
    """`test_architectures.reference_nll` with its `Reference` attention swapped for `reference` (called as
    `Reference` is: model, rule, cache mode, then the rest), for a storage form's images of the entries.
    `prefill`: tokens of the first forward (the budget by default; 1 for a stream read token by token)."""
    import test_architectures

    original = test_architectures.Reference
    test_architectures.Reference = reference
    try:
        return test_architectures.reference_nll(model, rule, cache_mode, prefill=prefill)
    finally:
        test_architectures.Reference = original


def counting(path, ran: list[str]):
    """A fast path's `run` (step or replay path) that notes its name in `ran` whenever it does not decline,
    so a differential test can assert the path it compares actually ran."""

    def run(*args):
        done = path.run(*args)
        if done is not None:
            ran.append(path.name)
        return done

    return run
